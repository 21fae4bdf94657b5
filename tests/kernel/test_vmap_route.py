"""`jax.vmap(diffeqsolve)`'s kernel route (`_kernel/_vmap.py`) against the loop, in
float64 and Pallas' interpreter: the same program run with the route off and on
(`_vmap.ENABLED`), whose values and every derivative must agree to the tolerance's
order (rtol 1e-10: within ~1e-6 of their scale), or the route must have declined
(`solverkit.kernel_routes()` says so, with a reason).

`test_route_matches_loop` is a matrix of cells `(field, option, solver,
transformation)` chosen so that every value of every axis appears (not their
product: each cell compiles two programs in the interpreter); `_QUICK` keep the
quick loop's, the rest are slow. Then the cases that each once gave a wrong
gradient without an error.
"""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
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


# --- The matrix -------------------------------------------------------------------


def _elem(theta):
    def field(t, y, args):
        return -theta["a"] * y + args * jnp.sin(t)

    return field


def _mlp(theta):
    def field(t, y, args):
        h = jnp.tanh(theta["w1"] @ y + theta["b1"])
        return theta["w2"] @ h - args * y

    return field


def _tree(theta):
    def field(t, y, args):
        return {"p": y["q"], "q": -theta["a"][0] * y["p"] - args * y["q"]}

    return field


def _mixed(theta):
    """Closes over an int, a bool and a PRNG key besides a float."""
    k, flag, key = jnp.asarray(2), jnp.asarray(True), jax.random.PRNGKey(3)

    def field(t, y, args):
        noise = jax.random.uniform(key, y.shape)
        damp = jnp.where(flag, 1.0 + 0.1 * k.astype(y.dtype), 1.0)
        return -theta["a"] * damp * y + args * noise

    return field


FIELDS = dict(elem=_elem, mlp=_mlp, tree=_tree, mixed=_mixed)


def _theta(field):
    if field == "mlp":
        return _mlp_params()
    return dict(a=jnp.array([0.7, 1.3]))


def _inputs(field):
    """`(theta, y0s, args)`: shared parameters, a batch of `N` states and args."""
    y0s = _y0s()
    if field == "tree":
        y0s = {"p": y0s[:, :1], "q": y0s[:, 1:]}
    return _theta(field), y0s, jnp.linspace(0.1, 0.3, N)


SOLVERS = dict(
    tsit5=lambda: (sk.Tsit5(), sk.PIDController(TOL, TOL)),
    dopri5=lambda: (sk.Dopri5(), sk.PIDController(TOL, TOL)),
    fixed=lambda: (sk.Tsit5(), sk.ConstantStepSize()),
    heun=lambda: (sk.Heun(), sk.ConstantStepSize()),
    rodas5p=lambda: (sk.Rodas5P(), sk.PIDController(1e-8, 1e-8)),
    kvaerno5=lambda: (sk.Kvaerno5(), sk.PIDController(1e-8, 1e-8)),
)


def _options(option):
    """`diffeqsolve` keyword arguments, and whether the loss may meet a NaN."""
    ts = jnp.array([0.3, 0.6, 1.0])
    out = dict(t0=0.0, t1=1.0, dt0=0.05, saveat=sk.SaveAt(t1=True), throw=True)
    if option == "ts":
        out.update(saveat=sk.SaveAt(t0=True, ts=ts, t1=True))
    elif option == "steps":
        out.update(saveat=sk.SaveAt(steps=True))
    elif option == "dense":
        out.update(saveat=sk.SaveAt(t1=True, dense=True))
    elif option == "throw":  # every lane runs out of steps, reported not raised
        out.update(t1=50.0, throw=False, max_steps=8)
    elif option == "event":
        out.update(event=sk.Event(lambda t, y, args, **kw: t - 0.5))
    elif option == "reverse":
        out.update(t0=1.0, t1=0.0, dt0=-0.05, saveat=sk.SaveAt(ts=ts[::-1]))
    elif option == "dt0none":
        out.update(dt0=None)
    return out


def _solver(field, option, solver):
    """`solve(theta, y0, args) -> Solution` for one trajectory."""
    method, controller = SOLVERS[solver]()
    kwargs = _options(option)
    if solver in ("fixed", "heun") and kwargs["dt0"] is None:
        kwargs["dt0"] = 0.05

    def solve(theta, y0, args):
        return sk.diffeqsolve(
            sk.ODETerm(FIELDS[field](theta)), method, y0=y0, args=args,
            stepsize_controller=controller, **kwargs,
        )  # fmt: skip

    return solve


def _out(sol, option):
    """The outputs compared: saved states and times, the result, and the step
    counts for "stats"; for "dense", the interpolation at one time."""
    out = dict(ys=sol.ys, ts=sol.ts, result=sol.result._value)
    if option == "stats":
        out["steps"] = sol.stats["num_steps"]
    if option == "dense":
        out["dense"] = sol.evaluate(0.45)
    return out


def _loss(sol):
    ys = jtu.tree_leaves(sol.ys)
    return sum(jnp.sum(jnp.where(jnp.isfinite(y), y, 0) ** 2) for y in ys)


def _program(field, option, solver, transform):
    """`(fn, inputs)`: the cell's program and its inputs."""
    solve = _solver(field, option, solver)
    theta, y0s, args = _inputs(field)
    one = lambda th, y, a: _out(solve(th, y, a), option)  # noqa: E731
    loss = lambda th, y, a: _loss(solve(th, y, a))  # noqa: E731
    batch = lambda th, y, a: jnp.sum(jax.vmap(loss, (None, 0, 0))(th, y, a))  # noqa: E731
    if transform == "vmap":
        return jax.vmap(one, (None, 0, 0)), (theta, y0s, args)
    if transform == "grad_vmap":
        return jax.grad(batch, (0, 1, 2)), (theta, y0s, args)
    if transform == "vmap_grad":
        return jax.vmap(jax.grad(loss, (0, 1, 2)), (None, 0, 0)), (theta, y0s, args)
    if transform == "shared_args":  # args shared by the batch, per-lane gradients
        fn = jax.vmap(jax.grad(loss, (0, 2)), (None, 0, None))
        return fn, (theta, y0s, args[0])
    if transform == "jacrev":
        return jax.jacrev(lambda th: jax.vmap(loss, (None, 0, 0))(th, y0s, args)), (
            theta,
        )
    if transform == "jacfwd":
        return jax.jacfwd(lambda a: jax.vmap(loss, (None, 0, 0))(theta, y0s, a)), (
            args,
        )
    if transform == "nested":  # a vmap of a vmap, 2 x 2
        y4 = jnp.concatenate([y0s, y0s[:1] * 0.5]).reshape(2, 2, -1)
        a4 = jnp.linspace(0.1, 0.3, 4).reshape(2, 2)
        inner = jax.vmap(one, (None, 0, 0))
        return jax.vmap(inner, (None, 0, 0)), (theta, y4, a4)
    if transform == "axes":  # y0 batched along axis 1, outputs along axis 1
        fn = jax.vmap(lambda th, y, a: one(th, y, a)["ys"], (None, 1, 0), 1)
        return fn, (theta, y0s.T, args)
    raise ValueError(transform)


# `(field, option, solver, transformation, the backward expected on the kernel)`:
# every value of each axis at least once.
CELLS = [
    ("elem", "t1", "tsit5", "vmap", None),
    ("elem", "t1", "tsit5", "vmap_grad", True),
    ("elem", "ts", "tsit5", "grad_vmap", True),
    ("elem", "t1", "dopri5", "grad_vmap", True),
    ("mlp", "ts", "fixed", "vmap", None),
    ("tree", "ts", "tsit5", "vmap_grad", True),
    ("mixed", "t1", "tsit5", "grad_vmap", None),
    ("elem", "t1", "fixed", "jacrev", True),
    ("elem", "t1", "tsit5", "jacfwd", None),
    ("elem", "t1", "tsit5", "nested", None),
    ("elem", "ts", "tsit5", "axes", None),
    ("elem", "t1", "tsit5", "shared_args", True),
    ("elem", "steps", "tsit5", "vmap", None),
    ("elem", "dense", "tsit5", "vmap", None),
    ("elem", "stats", "fixed", "vmap", None),
    ("elem", "throw", "tsit5", "vmap", None),
    ("elem", "event", "tsit5", "vmap", None),
    ("elem", "reverse", "tsit5", "grad_vmap", None),
    ("elem", "dt0none", "tsit5", "grad_vmap", True),
    ("elem", "t1", "rodas5p", "grad_vmap", False),
    ("elem", "t1", "kvaerno5", "vmap", None),
    ("elem", "t1", "heun", "vmap", None),
]
_QUICK = {("elem", "t1", "tsit5", "vmap"), ("elem", "t1", "tsit5", "vmap_grad")}


def _cell_params():
    out = []
    for cell in CELLS:
        marks = [] if cell[:4] in _QUICK else [pytest.mark.slow]
        out.append(pytest.param(*cell, id="-".join(cell[:4]), marks=marks))
    return out


def _outcome(fn, args):
    """`fn(*args)` jitted, or the type of what it raised."""
    try:
        return jax.block_until_ready(jax.jit(_fresh(fn))(*args))
    except Exception as e:  # noqa: BLE001 - compared between the two paths
        return type(e)


@pytest.mark.parametrize("field, option, solver, transform, tangents", _cell_params())
def test_route_matches_loop(field, option, solver, transform, tangents, monkeypatch):
    fn, args = _program(field, option, solver, transform)
    monkeypatch.setattr(_vmap, "ENABLED", False)
    loop = _outcome(fn, args)
    monkeypatch.setattr(_vmap, "ENABLED", True)
    with sk.kernel_routes() as routes:
        route = _outcome(fn, args)
    assert routes, "the route made no decision"
    assert all(r.kernel or r.reason for r in routes), routes
    if isinstance(loop, type):  # both raise alike (forward mode of a custom_vjp)
        assert route is loop
        return
    assert not isinstance(route, type), route
    assert jtu.tree_structure(route) == jtu.tree_structure(loop)
    _close(route, loop)
    for a, b in zip(jtu.tree_leaves(route), jtu.tree_leaves(loop)):
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
    if tangents is not None:
        backward = _route(routes, "backward")
        assert [r.kernel for r in backward] == [tangents], routes


@pytest.mark.slow
def test_per_example_gradients_of_shared_inputs(monkeypatch):
    """vmap(grad) with shared weights: each lane's own gradient, not their sum."""
    loss = lambda p, y: jnp.sum(_mlp_solve(p, y).ys ** 2)  # noqa: E731
    fn = jax.vmap(jax.grad(loss), in_axes=(None, 0))
    loop, route, routes = _both(fn, _mlp_params(), _y0s(), monkeypatch=monkeypatch)
    _close(route, loop)
    # On the kernel's forward sensitivities, or declined by the resource model (the
    # MLP's tangents exceed the interpreter's bound on lane operations).
    backward = _route(routes, "backward")
    assert backward and all(r.kernel or "lane operations" in r.reason for r in backward)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("case", ["where_sqrt", "masked_lane"])
def test_nan_gradients_are_reverse_modes(case, monkeypatch):
    """The route's gradient has JAX's reverse-mode semantics, as the loop's: a
    `where` whose unselected branch has a NaN derivative (`sqrt` of a negative
    state) gives NaN, and so does a lane that blew up, masked out of the loss (0 ·
    NaN); the documented remedy is the "double where"."""
    y0s = jnp.array([[0.5], [0.2], [0.9]])
    if case == "where_sqrt":

        def field(a):
            return lambda t, y, args: jnp.where(y > 0, jnp.sqrt(y), 0.0) - a

        keep, controller = jnp.ones(N, bool), sk.PIDController(1e-8, 1e-8)
    else:

        def field(a):
            return lambda t, y, args: a * y**2

        y0s = jnp.array([[0.5], [0.2], [30.0]])  # the last overflows to inf
        keep, controller = jnp.array([True, True, False]), sk.ConstantStepSize()

    def loss(a, y0s):
        def one(y0):
            sol = sk.diffeqsolve(
                sk.ODETerm(field(a)), sk.Tsit5(), 0.0, 1.0, 0.05, y0,
                stepsize_controller=controller, throw=False,
            )  # fmt: skip
            return jnp.sum(sol.ys)

        return jnp.sum(jnp.where(keep, jax.vmap(one)(y0s), 0.0))

    fn = jax.grad(loss)
    loop, route, routes = _both(fn, jnp.asarray(1.0), y0s, monkeypatch=monkeypatch)
    assert np.isnan(loop)
    assert np.isnan(route), routes


@pytest.mark.parametrize("route", [False, True])
def test_traced_invalid_save_times_are_reported(route, monkeypatch):
    """Save times out of order or outside `[t0, t1]`, traced (so not checked before
    the solve): a failed `result` with `throw=False`, an error with `throw=True`, on
    the loop and on the kernel alike."""
    monkeypatch.setattr(_vmap, "ENABLED", route)

    def solve(ts, throw):
        def one(y):
            return sk.diffeqsolve(
                sk.ODETerm(_elem(_theta("elem"))), sk.Tsit5(), 0.0, 1.0, 0.05, y,
                0.2, saveat=sk.SaveAt(ts=ts), throw=throw,
                stepsize_controller=sk.PIDController(1e-6, 1e-6),
            )  # fmt: skip

        return jax.vmap(one)(_y0s())

    good, unsorted, outside = [0.2, 0.5, 0.9], [0.5, 0.2, 0.9], [0.2, 0.5, 1.5]
    run = jax.jit(_fresh(lambda ts: solve(ts, False).result._value))
    invalid = sk.RESULTS.invalid_save_times._value
    assert np.all(run(jnp.array(good)) == sk.RESULTS.successful._value)
    assert np.all(run(jnp.array(unsorted)) == invalid)
    assert np.all(run(jnp.array(outside)) == invalid)
    raising = jax.jit(_fresh(lambda ts: solve(ts, True).ys))
    with pytest.raises(Exception, match="saveat.ts"):
        jax.block_until_ready(raising(jnp.array(unsorted)))


def test_kernel_routes_records_and_logs(monkeypatch, caplog):
    """Traced only (`make_jaxpr`): a vmap over a tolerance is declined with its
    reason, in the record and in the log; with the route off, a batched solve says
    so."""

    def solve(y, rtol):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -y), sk.Tsit5(), 0.0, 1.0, 0.1, y,
            stepsize_controller=sk.PIDController(rtol, 1e-6),
        ).ys  # fmt: skip

    monkeypatch.setattr(_vmap, "ENABLED", True)
    rtols = jnp.linspace(1e-6, 1e-5, N)
    with caplog.at_level("DEBUG", logger="solverkit"), sk.kernel_routes() as routes:
        jax.make_jaxpr(jax.vmap(_fresh(solve)))(_y0s(), rtols)
    assert [(r.stage, r.kernel) for r in routes] == [("forward", False)]
    assert "rtol" in routes[0].reason
    assert routes[0].reason in caplog.text
    monkeypatch.setattr(_vmap, "ENABLED", False)
    with sk.kernel_routes() as routes:
        jax.make_jaxpr(jax.vmap(_fresh(solve), (0, None)))(_y0s(), 1e-6)
    assert [(r.stage, r.kernel) for r in routes] == [("forward", False)]
    assert "off" in routes[0].reason
