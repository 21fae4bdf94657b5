"""`jax.vmap(diffeqsolve)`'s kernel route (`_kernel/_vmap.py`) against the loop, in
float64 and Pallas' interpreter: the same program run with the route off and on
(`_vmap.ENABLED`), whose values and every derivative must agree to the tolerance's
order (rtol 1e-10: forward `ys` within ~1e-7 of their scale), or the route must
have declined (`solverkit.kernel_routes()` says so, with a reason).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk
from solverkit._kernel import _vmap


pytestmark = pytest.mark.usefixtures("x64")

N = 3
TOL = 1e-10


def _fresh(fn):
    """`fn` under a new identity: JAX caches traces by function, and the cache does
    not know `ENABLED`."""
    return lambda *args: fn(*args)


def _both(fn, *args, monkeypatch):
    """`jit(fn)(*args)` with the route off, then on, and the routes it took."""
    monkeypatch.setattr(_vmap, "ENABLED", False)
    loop = jax.jit(_fresh(fn))(*args)
    monkeypatch.setattr(_vmap, "ENABLED", True)
    with sk.kernel_routes() as routes:
        route = jax.jit(_fresh(fn))(*args)
    return loop, route, list(routes)


def _close(a, b, rel=1e-6):
    """Equal to `rel` of the largest magnitude among `b`'s leaves (a gradient's
    components that are round-off in both agree to that scale only)."""
    a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    finite = [np.abs(np.asarray(y))[np.isfinite(y)] for y in b]
    scale = max([float(np.max(y, initial=0.0)) for y in finite] + [1e-300])
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=rel * scale)


def _mlp_params():
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    return dict(
        w1=0.5 * jax.random.normal(key1, (4, 2)),
        b1=jnp.array([0.1, -0.2, 0.0, 0.3]),
        w2=0.5 * jax.random.normal(key2, (2, 4)),
    )


def _mlp_solve(params, y0, saveat=None, dt0=1e-2, fixed=False, solver=None):
    """A 2-4-2 neural ODE closing over `params`."""

    def field(t, y, args):
        h = jnp.tanh(params["w1"] @ y + params["b1"])
        return params["w2"] @ h - 0.1 * y

    controller = sk.ConstantStepSize() if fixed else sk.PIDController(TOL, TOL)
    return sk.diffeqsolve(
        sk.ODETerm(field), solver or sk.Tsit5(), 0.0, 1.0, dt0, y0,
        saveat=saveat or sk.SaveAt(t1=True), stepsize_controller=controller,
    )  # fmt: skip


def _y0s():
    return jnp.array([[1.0, 0.5], [-0.3, 0.8], [0.2, -1.0]])


def _route(routes, stage):
    return [r for r in routes if r.stage == stage]


def test_per_example_gradients_of_shared_inputs(monkeypatch):
    """vmap(grad) with shared weights: each lane's own gradient, not their sum."""
    loss = lambda p, y: jnp.sum(_mlp_solve(p, y).ys ** 2)  # noqa: E731
    fn = jax.vmap(jax.grad(loss), in_axes=(None, 0))
    loop, route, routes = _both(fn, _mlp_params(), _y0s(), monkeypatch=monkeypatch)
    _close(route, loop)
    assert any(r.kernel for r in _route(routes, "backward"))


def test_shared_save_times_and_dt0_gradients(monkeypatch):
    """The gradient of a shared `SaveAt(ts)` and of `dt0` (fixed steps)."""
    ts = jnp.array([0.25, 0.5, 1.0])
    saveat = lambda ts: sk.SaveAt(ts=ts)  # noqa: E731

    def loss(ts, dt0):
        run = jax.vmap(lambda y: _mlp_solve(_mlp_params(), y, saveat(ts), dt0, True).ys)
        return jnp.sum(run(_y0s()) ** 2)

    fn = jax.grad(loss, (0, 1))
    loop, route, routes = _both(fn, ts, jnp.asarray(0.15), monkeypatch=monkeypatch)
    assert np.all(loop[0] != 0) and loop[1] != 0
    _close(route, loop)
    backward = _route(routes, "backward")
    assert backward and not any(r.kernel for r in backward)


def test_custom_jvp_in_the_field_is_honoured(monkeypatch):
    """A surrogate gradient (a `custom_jvp` whose rule is not its primal's
    derivative) reaches the route's gradient as it reaches the loop's."""

    @jax.custom_jvp
    def clipped(x):
        return jnp.tanh(x)

    @clipped.defjvp
    def _(primals, tangents):
        (x,), (dx,) = primals, tangents
        return jnp.tanh(x), 0.5 * dx  # not the derivative of tanh

    def loss(a, y0):
        def field(t, y, args):
            return -a * clipped(y)

        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 1e-2, y0,
            stepsize_controller=sk.PIDController(TOL, TOL),
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    fn = jax.grad(lambda a, y: jnp.sum(jax.vmap(loss, (None, 0))(a, y)), (0, 1))
    loop, route, routes = _both(fn, 0.7, _y0s(), monkeypatch=monkeypatch)
    _close(route, loop)


def test_ensemble_kernel_save_times_gradient(monkeypatch):
    """`ensemble_solve(kernel=True)`: the gradient of shared save times (through
    `ys` and `sol.ts`) is the lane loop's; that of `y0` alone stays on the kernel's
    forward sensitivities."""
    y0s = _y0s()

    def loss(ts, y0s, kernel):
        sol = sk.ensemble_solve(
            sk.ODETerm(lambda t, y, a: a * jnp.stack([y[1], -y[0]])), sk.Tsit5(),
            0.0, 1.0, 0.01, y0s, jnp.ones(N), saveat=sk.SaveAt(ts=ts),
            stepsize_controller=sk.PIDController(TOL, TOL), kernel=kernel,
        )  # fmt: skip
        return jnp.sum(sol.ys[..., 1] ** 2) + jnp.sum(sol.ts)

    ts = jnp.array([0.25, 0.5, 1.0])
    grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
    loop = grad(ts, y0s, False)
    with sk.kernel_routes() as routes:
        out = grad(ts, y0s, True)
    assert np.all(loop[0] != 0)
    _close(out, loop)
    assert [r.kernel for r in _route(routes, "backward")] == [False]
    with sk.kernel_routes() as routes:
        out = jax.jit(jax.grad(loss, 1), static_argnums=2)(ts, y0s, True)
    _close(out, loop[1])
    assert [r.kernel for r in _route(routes, "backward")] == [True]
