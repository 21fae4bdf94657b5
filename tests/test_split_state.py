"""A small 1-D state carried through the loop as its components (`_split.py`): taken
where nothing reads the state's layout, and the same solve as with the array, under
`jit`, `vmap` and every adjoint, with closed-over values of several dtypes.

The reference is the same solve with the split turned off (`MAX_COMPONENTS = 0`).
Both do the same element-wise arithmetic per component; only the RMS norm's sum of
squares may round differently (leaf by leaf against one reduction), so in float64
the steps are the same and the values agree to round-off (rtol 1e-12: a few
hundred float64 spacings, for errors amplified by Lorenz over t <= 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk
from solverkit import _split


def _lorenz(rho, k, mask):
    table = jnp.asarray([0.0, 0.5, 1.0])

    def field(t, y, args):
        beta = args
        damp = jnp.where(mask, 1.0 + table[k], 1.0)
        return jnp.stack(
            [10.0 * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1] * damp,
             y[0] * y[1] - beta * y[2]]
        )  # fmt: skip

    return field


def _solve(rho, y0, beta, *, adjoint=sk.RecursiveCheckpointAdjoint(), **kwargs):
    kwargs.setdefault("saveat", sk.SaveAt(ts=jnp.linspace(0.0, 1.0, 5), t1=True))
    kwargs.setdefault("stepsize_controller", sk.PIDController(rtol=1e-8, atol=1e-8))
    field = _lorenz(rho, jnp.asarray(1, jnp.int32), jnp.asarray(True))
    return sk.diffeqsolve(
        sk.ODETerm(field), kwargs.pop("solver", sk.Tsit5()), 0.0, 1.0, 1e-3, y0,
        beta, adjoint=adjoint, **kwargs
    )  # fmt: skip


def _carries(fn, *args) -> list[tuple]:
    """The shapes of every `while` loop's carry in `fn`'s jaxpr."""
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                shapes.extend(v.aval.shape for v in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else [param]:
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


def _without_split(monkeypatch):
    monkeypatch.setattr(_split, "MAX_COMPONENTS", 0)


CONSTANT = sk.ConstantStepSize()
OWN_NORM = sk.PIDController(rtol=1e-8, atol=1e-8, norm=jnp.linalg.norm)


@pytest.mark.quick_cases("ts", "dense")
@pytest.mark.parametrize(
    "options, split",
    [
        (dict(), True),
        (dict(saveat=sk.SaveAt(steps=True, fn=lambda t, y, a: y[0] * y[1])), True),
        (dict(stepsize_controller=CONSTANT, saveat=sk.SaveAt(t1=True)), True),
        (dict(saveat=sk.SaveAt(dense=True)), False),
        (dict(solver=sk.Kvaerno5()), False),
        (dict(event=sk.Event(lambda t, y, a, **kw: y[0] > 100.0)), False),
        (dict(stepsize_controller=OWN_NORM), False),
    ],
    ids=["ts", "steps-fn", "constant", "dense", "implicit", "event", "norm"],
)  # fmt: skip
def test_taken_where_nothing_reads_the_layout(options, split):
    """Under `vmap` over N = 7 the loop carries `(7,)` components (split) or the
    `(7, 3)` state."""
    y0 = jnp.asarray([1.0, 0.0, 0.0])
    fn = jax.vmap(lambda r: _solve(r, y0, 8 / 3, **options).ys)
    shapes = _carries(fn, jnp.linspace(20.0, 30.0, 7))
    assert ((7, 3) not in shapes) == split, shapes
    assert ((7,) in shapes) or not split


def _values_and_grads(adjoint, rho, y0, beta):
    def loss(rho, y0, beta):
        sol = _solve(rho, y0, beta, adjoint=adjoint)
        return jnp.sum(sol.ys**2), sol.stats["num_steps"]

    value_grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(jax.vmap(value_grad, in_axes=(0, None, None)))(rho, y0, beta)


@pytest.mark.quick_cases("checkpoint")
@pytest.mark.parametrize(
    "adjoint",
    [sk.RecursiveCheckpointAdjoint(), sk.BacksolveAdjoint(), sk.DirectAdjoint()],
    ids=["checkpoint", "backsolve", "direct"],
)
def test_values_and_gradients_are_the_arrays(adjoint, monkeypatch, x64):
    """`jit(vmap(value_and_grad))` with respect to a closed-over float (beside a
    closed-over int index and bool), `y0` and `args`: the split solve's values,
    step counts and gradients are the array solve's."""
    rho = jnp.asarray([22.0, 28.0])
    y0, beta = jnp.asarray([1.0, 0.5, 0.0]), jnp.asarray(8 / 3)
    got = _values_and_grads(adjoint, rho, y0, beta)
    _without_split(monkeypatch)
    want = _values_and_grads(adjoint, rho, y0, beta)
    (value, steps), grads = got
    (value_ref, steps_ref), grads_ref = want
    np.testing.assert_array_equal(steps, steps_ref)
    np.testing.assert_allclose(value, value_ref, rtol=1e-12)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(
            g, g_ref, rtol=1e-12, atol=1e-12 * np.abs(g_ref).max()
        )


# Quick loop: the split solve under jit, vmap and grad:
# test_values_and_gradients_are_the_arrays[checkpoint].
@pytest.mark.slow
def test_forward_mode_and_float32(monkeypatch):
    """`jax.jvp` through `ForwardMode`, float32, 1000 fixed steps: the array
    solve's values and tangents, to float32 round-off accumulated over the steps
    (XLA may fuse and contract the two programs differently: ~1000 x 6e-8) times
    Lorenz's growth over t <= 1 (< 10)."""

    def tangent(rho):
        def ys(r):
            return _solve(
                r, jnp.asarray([1.0, 0.0, 0.0], jnp.float32), jnp.float32(8 / 3),
                adjoint=sk.ForwardMode(), stepsize_controller=sk.ConstantStepSize(),
            ).ys  # fmt: skip

        return jax.jit(jax.jvp, static_argnums=0)(ys, (rho,), (jnp.ones_like(rho),))

    rho = jnp.float32(28.0)
    got = tangent(rho)
    _without_split(monkeypatch)
    want = tangent(rho)
    assert got[0].dtype == jnp.float32 and got[0].shape == (6, 3)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=6e-4 * np.abs(b).max())
