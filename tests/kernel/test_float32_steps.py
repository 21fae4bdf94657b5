"""Adaptive steps where float32 times are coarse: a solve never spins to `max_steps`.

Two ways it did: (1) a rejected step near `t1` was retried on `t1` again whenever
the controller's shorter retry fell inside the landing window (100 spacings of `t1`,
~2e-3 at `t1 = 200` in float32), forever; (2) a step shorter than the spacing of
`t` rounded to no step at all, and a zero-length step is accepted with zero error,
so the step size stayed zero.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk


T0, T1 = 199.0, 200.0  # float32 spacing 1.5e-5 there; the landing window ~2.4e-3


def _oscillator(solver, omega, k, rtol):
    """`u' = k ω v, v' = -k ω u` on `[T0, T1]` from `(0, 1)`: exact `(sin, cos)(kω)`."""

    def field(t, y, args):
        w = omega * k.astype(omega.dtype)
        return jnp.stack([w * y[1], -w * y[0]])

    sol = sk.diffeqsolve(
        sk.ODETerm(field),
        solver,
        jnp.float32(T0),
        jnp.float32(T1),
        jnp.float32(1e-3),
        jnp.asarray([0.0, 1.0], jnp.float32),
        stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
        max_steps=4096,
        throw=False,
    )
    assert sol.ys is not None and sol.stats is not None
    return sol.ys[-1], sol.result == sk.RESULTS.successful, sol.stats["num_steps"]


@pytest.mark.parametrize("solver", [sk.Tsit5(), sk.Rodas5P()], ids=["tsit5", "rodas5p"])
@pytest.mark.quick_cases("tsit5")
def test_rejected_step_near_t1_is_not_retried_on_t1(solver):
    # Steps of ~0.2/ω ≈ 1e-3 to 7e-3 for ω in [30, 300]: comparable to the window, so
    # some last steps are rejected into it. Before the fix 90 of 256 Tsit5 solves
    # (rtol 1e-4) ended with max_steps; now every one succeeds in a few hundred steps.
    omegas = jnp.linspace(15, 150, 48, dtype=jnp.float32)
    k = jnp.asarray(2, jnp.int32)  # a closed-over integer, as a harmonic
    rtol = 1e-4
    solve = jax.jit(jax.vmap(lambda w: _oscillator(solver, w, k, rtol)))
    y, ok, steps = solve(omegas)
    assert bool(ok.all()), np.asarray(omegas)[~np.asarray(ok)]
    # Far from max_steps: at most a few hundred steps per unit time at these ω.
    assert int(steps.max()) < 1024
    phase = 2 * np.asarray(omegas, np.float64) * (T1 - T0)
    exact = np.stack([np.sin(phase), np.cos(phase)], axis=1)
    # The global error of a PID solve grows like rtol per unit phase: the phase is
    # at most 300 here, and float32 rounding of ~300 steps adds ~1e-4.
    bound = rtol * phase[:, None] + 1e-3
    assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= bound)


# With XLA's CPU loop emitters (`--xla_cpu_use_fusion_emitters=false`, on in the
# suite where the jaxlib knows it) this gradient was wrong, not imprecise: a solve of
# more steps than checkpoint slots (128 by default; 60-233 steps here) recomputes
# chunks from checkpoints in the backward pass, and the recomputation (another
# compilation) drifted a float a step from the forward pass's step ends (1.5e-5
# apart at t = 200). Errors of up to 1.3e-2 (RecursiveCheckpointAdjoint, vmapped)
# and 1.8e-2 (DirectAdjoint), where forward mode and `checkpoints=4096` (no
# recomputation) are within 4.8e-4 of the exact derivative. Both recomputations now
# replay the forward pass's steps (tests/kernel/test_replayed_decisions.py).


# The full suite; the quick loop's near-t1 rejection:
# test_rejected_step_near_t1_is_not_retried_on_t1.
@pytest.mark.slow
def test_rejected_step_near_t1_gradient():
    # The retry changes only where steps end; the derivative of the solution in ω
    # is still that of the exact one, s·(cos, -sin)(ωs) with s = T1 - T0 = 1.
    k = jnp.asarray(2, jnp.int32)

    def u(omega):
        y, _, _ = _oscillator(sk.Tsit5(), omega, k, 1e-5)
        return y[0]

    omegas = jnp.linspace(15, 60, 8, dtype=jnp.float32)
    grads = jax.jit(jax.vmap(jax.grad(u)))(omegas)
    exact = 2 * np.cos(2 * np.asarray(omegas, np.float64))
    # The bound, from the problem:
    # - the discrete solution's error grows like rtol per radian of phase φ = 2ωs
    #   (<= 120 here), so its derivative in ω is at most rtol · φ · dφ/dω
    #   = 1e-5 · 120 · 2 = 2.4e-3 (steps that move with ω add O(rtol) more);
    # - float32 round-off: the sensitivity |∂y/∂ω| = 2s = 2 picks up a relative
    #   error of about (stages + 1) · ε = 8 · 6e-8 in each of <= 256 steps, forward
    #   and back: 2 · 2 · 256 · 8 · 6e-8 ≈ 5e-4.
    # Measured where the gradient is right: <= 4.8e-4 (JAX 0.10.2, both emitters).
    bound = 2 * 120 * 1e-5 + 2 * 2 * 256 * 8 * 6e-8
    assert np.allclose(np.asarray(grads), exact, rtol=0, atol=bound)


def _far_from_zero(rtol, lam):
    """`y' = -λy` on `[2^20, 2^20 + 64]`, where float32 times are 0.125 apart."""
    t0 = jnp.float32(2.0**20)
    lam = jnp.asarray(lam, jnp.float32)
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -args * y),
        sk.Tsit5(),
        t0,
        t0 + jnp.float32(64),
        jnp.float32(1e-3),
        jnp.ones((2,), jnp.float32),
        lam,
        stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
        max_steps=1000,
        throw=False,
    )
    assert sol.ys is not None and sol.stats is not None
    return sol


def test_step_below_time_spacing_advances():
    # `dt0 = 1e-3` is below the spacing 0.125 of `t0`: `t0 + dt0 == t0`. It used to
    # give zero-length steps (accepted, zero error, the next step zero again) until
    # max_steps; the first step is now one spacing long and grows from there.
    sol = jax.jit(lambda: _far_from_zero(1e-4, 0.05))()
    assert bool(sol.result == sk.RESULTS.successful)
    assert sol.ys is not None and sol.stats is not None
    assert int(sol.stats["num_steps"]) < 100
    # Each step keeps its error under rtol|y| + atol (both 1e-4); over 3.2 time
    # constants the global error is a few of those: 10 (rtol|y| + atol). At y(T) =
    # 0.04 the atol term dominates (a relative 1e-3 bound was 11% short once XLA's
    # optimizations were off in the test session: float32 rounding, not the method).
    exact = np.exp(-0.05 * 64)
    np.testing.assert_allclose(
        np.asarray(sol.ys[-1]), exact, rtol=0, atol=10 * (1e-4 * exact + 1e-4)
    )


def test_rejected_smallest_step_ends_the_solve():
    # λ = 5 wants steps of ~1e-2 at rtol 1e-6, below the spacing 0.125 of t: even a
    # step of one spacing is rejected (Tsit5's error ~ (λh)^5 / 1e3 ~ 1e-4). That
    # ends the solve with `dt_min_reached` at once (it spun to max_steps, making no
    # progress), and `throw=True` raises it.
    sol = jax.jit(lambda: _far_from_zero(1e-6, 5.0))()
    assert bool(sol.result == sk.RESULTS.dt_min_reached)
    assert sol.stats is not None and int(sol.stats["num_steps"]) < 100
    with pytest.raises(Exception, match="spacing"):
        sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -5 * y),
            sk.Tsit5(),
            jnp.float32(2.0**20),
            jnp.float32(2.0**20 + 64),
            jnp.float32(1e-3),
            jnp.ones((2,), jnp.float32),
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
            max_steps=1000,
        )
