"""`BacksolveAdjoint` with many parameters: the backward solve integrates their
cotangents as a quadrature over the stages of the state and its adjoint
(`_adjoint/_quadrature.py`). It must give what the stage-by-stage step of the whole
adjoint system gives (the same sums, in another order), for FSAL and other
tableaus, under `jit`, `vmap` and `grad`, with closed-over values of several
dtypes, and match RecursiveCheckpointAdjoint to the tolerance."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import solverkit as sk
from solverkit._adjoint import _quadrature


pytestmark = pytest.mark.usefixtures("x64")


def _model():
    # 2-16-16-2: 338 parameters, above the size where the stages run in a loop.
    return eqx.nn.MLP(2, 2, 16, 2, activation=jnp.tanh, key=jax.random.key(0))


def _loss(model, solver, adjoint, y0s, ts, tol=1e-8):
    table = jnp.array([0.5, -0.25, 1.0])  # float64, indexed by an int32 per lane
    keys = jnp.arange(y0s.shape[0], dtype=jnp.int32) % 3
    flip = jnp.array(True)  # a closed-over bool

    def one(y0, k):
        def field(t, y, args):
            out = model(y) + table[k] * jnp.sin(t)
            return jnp.where(flip, out, -out)

        sol = sk.diffeqsolve(
            sk.ODETerm(field), solver, 0.0, 1.5, None, y0,
            saveat=sk.SaveAt(ts=ts),
            stepsize_controller=sk.PIDController(rtol=tol, atol=tol),
            adjoint=adjoint,
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    return jnp.sum(jax.vmap(one)(y0s, keys))


@pytest.mark.parametrize(
    "solver",
    [sk.Tsit5(), pytest.param(sk.Heun(), marks=pytest.mark.slow)],
    ids=["tsit5", "heun"],
)
def test_quadrature_equals_the_stage_by_stage_step(solver, monkeypatch):
    """Tsit5 (FSAL: its last stage is the next step's first) and Heun (not FSAL:
    the step ends with an evaluation that is no stage)."""
    model = _model()
    y0s = jnp.array([[0.3, -0.2], [1.0, 0.5], [-0.4, 0.8]])
    ts = jnp.array([0.0, 0.7, 1.5])
    heun = isinstance(solver, sk.Heun)  # second order: a looser tolerance
    if heun:
        ts = jnp.array([0.7, 1.5])

    def grad(*args):  # traced anew each call
        return eqx.filter_jit(eqx.filter_grad(lambda *a: _loss(*a)))(*args)

    used = []
    real = _quadrature.applies
    monkeypatch.setattr(
        _quadrature, "applies", lambda *a: used.append(real(*a)) or used[-1]
    )
    tol = 1e-5 if heun else 1e-8
    fast = grad(model, solver, sk.BacksolveAdjoint(), y0s, ts, tol)
    assert used and all(used)
    monkeypatch.setattr(_quadrature, "applies", lambda *a: False)
    slow = grad(model, solver, sk.BacksolveAdjoint(), y0s, ts, tol)
    assert_tree_allclose(fast, slow, rtol=1e-9, atol=1e-12)
    if not heun:
        ref = grad(model, solver, sk.RecursiveCheckpointAdjoint(), y0s, ts)
        assert_tree_allclose(
            fast, ref, rtol=1e-5, atol=1e-6
        )  # (the continuous adjoint)


@pytest.mark.slow
def test_quadrature_per_example_gradients():
    """`vmap(grad)` with the model shared: each trajectory's own gradient (the
    quadrature's parameter cotangents are per trajectory until summed)."""
    model = _model()
    y0s = jnp.array([[0.3, -0.2], [1.0, 0.5]])
    ts = jnp.array([0.5, 1.5])

    def loss(model, y0):
        return _loss(model, sk.Tsit5(), sk.BacksolveAdjoint(), y0[None], ts)

    each = jax.vmap(eqx.filter_grad(loss), in_axes=(None, 0))(model, y0s)
    for i in range(2):
        one = eqx.filter_grad(loss)(model, y0s[i])
        assert_tree_allclose(jax.tree.map(lambda x: x[i], each), one, rtol=1e-10)
    assert not np.allclose(jax.tree.leaves(each)[0][0], jax.tree.leaves(each)[0][1])
