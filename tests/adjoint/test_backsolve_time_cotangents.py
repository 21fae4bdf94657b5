"""`BacksolveAdjoint` and the cotangents of `sol.ts`: the saved times are the
inputs' own (`t0`, `SaveAt(ts=...)`, `t1`), so a loss that reads them has their
derivative, as through the other adjoints (it was dropped: d sum(sol.ts) / dt1 came
out 0 instead of 1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import skip_unless_full_matrix

import solverkit as sk


def _loss(t0, t1, ts, adjoint, kind):
    saveat = {
        "t1": sk.SaveAt(t1=True),
        "t0t1": sk.SaveAt(t0=True, t1=True),
        "ts": sk.SaveAt(t0=True, ts=ts, t1=True),
    }[kind]
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, a: -0.5 * y + jnp.sin(t)), sk.Tsit5(), t0, t1,
        0.1 * jnp.sign(t1 - t0), jnp.array(1.0), saveat=saveat,
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint,
    )  # fmt: skip
    return jnp.sum(sol.ts**2) + jnp.sum(sol.ys)


# Quick loop: save-time gradients:
# ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep];
# BacksolveAdjoint: closure/test_closure_matrix.py's backsolve cells.
@pytest.mark.slow
@pytest.mark.parametrize("direction", ["forwards", "backwards"])
@pytest.mark.parametrize("kind", ["t1", "t0t1", "ts"])
def test_backsolve_time_cotangents_match_the_checkpointed_adjoint(x64, kind, direction):
    """d/d(t0, t1, ts) of a loss of `sol.ts` and `sol.ys` through BacksolveAdjoint
    equals RecursiveCheckpointAdjoint's, forwards and backwards in time, and under
    `vmap` over `t1` (the continuous adjoint at tolerance 1e-10: its error ~1e-9
    relative, so 1e-7)."""
    if kind == "t0t1" or (kind, direction) == ("t1", "backwards"):
        skip_unless_full_matrix(
            f"[ts-{direction}] (t0, ts and t1 saved: each time's cotangent) and "
            "[t1-forwards] (the final state alone)"
        )
    t0, t1 = (0.2, 2.0) if direction == "forwards" else (2.0, 0.2)
    ts = jnp.array([0.5, 1.0]) if direction == "forwards" else jnp.array([1.0, 0.5])
    # Each gradient one jitted program (the adjoint and the saves static).
    grad = jax.grad(_loss, argnums=(0, 1, 2))
    jitted = jax.jit(grad, static_argnums=(3, 4))
    back = jitted(t0, t1, ts, sk.BacksolveAdjoint(), kind)
    ref = jitted(t0, t1, ts, sk.RecursiveCheckpointAdjoint(), kind)
    for b, r in zip(back, ref):
        np.testing.assert_allclose(b, r, rtol=1e-7, atol=1e-9)
    t1s = jnp.array([t1, t1 + 0.3 * np.sign(t1 - t0)])
    vmapped = jax.jit(
        jax.vmap(grad, in_axes=(None, 0, None, None, None)), static_argnums=(3, 4)
    )
    back = vmapped(t0, t1s, ts, sk.BacksolveAdjoint(), kind)
    # The reference at each `t1` alone (the program above: one gradient program
    # fewer than a vmapped reference).
    for i, t in enumerate(t1s):
        ref = jitted(t0, float(t), ts, sk.RecursiveCheckpointAdjoint(), kind)
        for b, r in zip(back, ref):
            np.testing.assert_allclose(b[i], r, rtol=1e-7, atol=1e-9)


def test_backsolve_through_save_times_at_the_ends_and_repeated(x64):
    """The backward solve passes every saved time in one loop, adding each saved
    state's cotangent where it was saved: with save times at `t0` and `t1`, a
    time saved twice, and a time within a step of the forward solve, the
    parameter's gradient is the analytic one, under `jit` and `vmap`
    (per-trajectory save times) alike."""

    def loss(theta, ts, adjoint):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -theta * y), sk.Tsit5(), 0.0, 1.0, None,
            jnp.array([1.0, 2.0]), saveat=sk.SaveAt(ts=ts),
            stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
            adjoint=adjoint,
        )  # fmt: skip
        w = jnp.arange(1.0, ts.shape[0] + 1)
        return jnp.sum(w * sol.ys[:, 0]) + jnp.sum(sol.ys[:, 1] ** 2)

    def exact(theta, ts):  # y = (1, 2) exp(-theta t)
        w = jnp.arange(1.0, ts.shape[0] + 1)
        e = jnp.exp(-theta * ts)
        return jnp.sum(-w * ts * e) + jnp.sum(-8 * ts * e**2)

    grad = jax.jit(jax.grad(loss), static_argnums=2)
    ts = jnp.array([0.0, 0.3, 0.3, 0.7, 1.0])  # at t0 and t1, and one twice
    back = grad(0.7, ts, sk.BacksolveAdjoint())
    np.testing.assert_allclose(back, exact(0.7, ts), rtol=1e-7)
    many = jnp.array([[0.25, 0.5, 1.0], [0.0, 0.2, 0.2]])  # within a step; at t0
    back = jax.vmap(grad, in_axes=(None, 0, None))(0.7, many, sk.BacksolveAdjoint())
    want = jax.vmap(exact, in_axes=(None, 0))(0.7, many)
    np.testing.assert_allclose(back, want, rtol=1e-7)
