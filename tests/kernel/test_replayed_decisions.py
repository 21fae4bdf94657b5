"""A checkpointed backward pass pulls each step back as the forward pass took it,
and recomputes the forward pass's steps from a checkpoint.

The pullback recompiles the step; a float32 error estimate within round-off of the
tolerance can land on the other side of 1 there. It then replays the decision the
carries record (`_checkpoint._vjp_step`): pulled back through the branch not taken,
float32 Lorenz gradients of `ensemble_solve`'s backward pass came out 1.6-2.2x off
for 3 of 128 trajectories (against the float64 gradient, which the whole-solve
kernel's forward sensitivities matched), with XLA's CPU loop emitters
(`--xla_cpu_use_fusion_emitters=false`), which round differently. The flips depend
on the compilation, so the checks need that flag (where this jaxlib knows it). The
suite compiles with it by default (tests/conftest.py): then the float32 comparison is
test_kernel_tangent.py's own, and the recomputation check runs in this process; a
run that compiles otherwise starts a second process with the flag for each.
"""

import os
import subprocess
import sys
from typing import NamedTuple

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64

import solverkit as sk


_FLAG = "--xla_cpu_use_fusion_emitters=false"
_TEST = "tests/kernel/test_kernel_tangent.py::test_tangent_backward_vmap_float32"


def _repository_root() -> str:
    """The repository's root, where this jaxlib's XLA knows `_FLAG` (else skip)."""
    if not conftest._accepted_xla_flags((_FLAG,)):
        pytest.skip(f"this jaxlib's XLA does not know {_FLAG}")
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compiled_here_with_the_flag() -> bool:
    """Whether this process compiles as the checks need: with `_FLAG` (conftest's
    default, which XLA read from `XLA_FLAGS` when JAX made its backend) and most
    optimizations off. Then they run here, not in a second process."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return _FLAG in flags and bool(jax.config.read("jax_disable_most_optimizations"))


@pytest.mark.slow
def test_pullback_replays_the_step_taken():
    if _compiled_here_with_the_flag():
        pytest.skip(f"this run compiles with {_FLAG}: {_TEST} checks it here")
    root = _repository_root()
    env = {**os.environ, "SOLVERKIT_TEST_XLA_FLAGS": _FLAG, "JAX_PLATFORMS": "cpu"}
    env["SOLVERKIT_FULL_MATRIX"] = "1"  # `_TEST` runs only there by default
    env.pop("XLA_FLAGS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow",
         "-p", "no:randomly", _TEST],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


# Recomputations (a chunk from a checkpoint, more steps than slots; DirectAdjoint's
# checkpointed blocks) against the forward pass's own gradient (every step stored:
# `checkpoints=max_steps`, nothing recomputed), under `vmap`:
# - the float32 Lorenz of test_kernel_tangent.py, 4 slots for 27-60 steps. Deciding
#   its steps again, the recomputation took others on 3 of 128 trajectories: 13-21%
#   off (trajectory 81 alone: -259.4 against -269.8, which float64 gives too).
# - the float32 oscillator of test_float32_steps.py on [199, 200], where times are
#   1.5e-5 apart beside steps of ~2e-3: with the same decisions, the recomputed step
#   ends drifted a spacing a step from the forward pass's, and the gradient was
#   1e-2 off (DirectAdjoint 1.8e-2) for a 1e-5 solve; it is 5e-4 from the exact one.
def _lorenz_grads(adjoint, idx) -> np.ndarray:
    """`vmap` of the gradient of test_kernel_tangent.py's float32 Lorenz loss over
    the trajectories `idx`, through `adjoint`."""
    import test_kernel_tangent as T

    y0, rho, k = T._inputs(jnp.float32)

    def loss(a, r, kk):
        sol = sk.diffeqsolve(
            sk.ODETerm(T._field(jnp.float32(9.0), 8 / 3)), sk.Tsit5(), 0.0, 1.0, None,
            a, (r, kk), saveat=T._saveat(), stepsize_controller=T._controller(1e-5),
            adjoint=adjoint,
        )  # fmt: skip
        return jnp.sum(sol.ys**2) + jnp.sum(jnp.sin(sol.ys[1:, 0]))

    idx = np.asarray(idx)
    return np.asarray(jax.jit(jax.vmap(jax.grad(loss)))(y0[idx], rho[idx], k[idx]))


def _oscillator_grads(adjoint, omegas) -> np.ndarray:
    """`vmap` over `omegas` of d u(T1) / d omega for test_float32_steps.py's float32
    oscillator on [T0, T1], through `adjoint`."""
    import test_float32_steps as F

    def u(omega):
        field = lambda t, y, args: jnp.stack([2 * omega * y[1], -2 * omega * y[0]])  # noqa: E731
        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), jnp.float32(F.T0), jnp.float32(F.T1),
            jnp.float32(1e-3), jnp.asarray([0.0, 1.0], jnp.float32),
            stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5),
            adjoint=adjoint,
        )  # fmt: skip
        return sol.ys[-1, 0]

    return np.asarray(jax.jit(jax.vmap(jax.grad(u)))(omegas))


def _check_recomputation() -> None:
    """The recomputed gradients against the stored ones (see above); run in a
    process that compiles with `_FLAG`."""
    stored = sk.RecursiveCheckpointAdjoint(checkpoints=4096)  # = max_steps
    recomputed = (
        sk.RecursiveCheckpointAdjoint(checkpoints=4),
        sk.RecursiveCheckpointAdjoint(),
        sk.DirectAdjoint(),
    )
    # Every step stored, nothing is recomputed and the lanes of `vmap` are
    # independent: trajectory 81's stored gradient alone is its row of the batch's
    # (float32 round-off apart, far below the bound), one program fewer.
    stored_grads = _lorenz_grads(stored, np.arange(128))
    for idx in (np.arange(128), [81]):
        want = stored_grads[np.asarray(idx)]
        # Both differentiate the forward pass's steps, in two programs: float32
        # round-off (6e-8) of 27-60 steps, grown by the Lorenz flow over t <= 1 (up
        # to e^8 on these trajectories): 1e-3 of each gradient's largest component.
        # A gradient of other steps is 0.1-0.2 off.
        bound = 1e-3 * np.abs(want).max(axis=1, keepdims=True)
        bound = np.broadcast_to(bound, want.shape)
        for adjoint in recomputed[::2]:
            got = _lorenz_grads(adjoint, idx)
            np.testing.assert_array_less(np.abs(got - want), bound)
    omegas = jnp.linspace(15, 60, 8, dtype=jnp.float32)
    want = _oscillator_grads(stored, omegas)
    # d u(T1) / d omega = 2 cos(2 omega) for s = T1 - T0 = 1: the stored gradient is
    # within the solve's error (rtol per radian, phase <= 120: 2.4e-3) of it.
    exact = 2 * np.cos(2 * np.asarray(omegas, np.float64))
    np.testing.assert_allclose(want, exact, atol=2.4e-3)
    for adjoint in recomputed:
        # The same steps, two programs: float32 round-off of the sensitivity (its
        # size, 2, times ~250 steps of 6e-8 relative, grown by the phase: 1e-3).
        got = _oscillator_grads(adjoint, omegas)
        np.testing.assert_allclose(got, want, atol=1e-3)


def _check_round_off_step_sizes() -> None:
    """The oscillator from `dt0 = 1e-3` over omega in [10, 70]: the first step's
    error (~1e-10) is float32 round-off, so the next step's size is too, and the
    recomputation's differed from the forward pass's by 66 floats of `t` (0.01009
    against 0.00911), which 6 recorded low bits of the end could not recover: the
    recomputed chunk took other steps, and the gradient was 0.0143 off (0.0318 at 32
    trajectories). `vmap`: the longest trajectory (272 steps) fills the 128 slots,
    so every trajectory's chunks are recomputed; alone they are stored."""
    omegas = jnp.linspace(10, 70, 16, dtype=jnp.float32)
    got = _oscillator_grads(sk.RecursiveCheckpointAdjoint(), omegas)
    # d u(T1) / d omega = 2 cos(2 omega), within the solve's error (rtol per radian,
    # twice: phase <= 140: 2.8e-3; it is 1.2e-3 at omega = 70).
    exact = 2 * np.cos(2 * np.asarray(omegas, np.float64))
    np.testing.assert_allclose(got, exact, atol=2 * 1e-5 * 140)


# In a second process only where this one compiles otherwise (`SOLVERKIT_TEST_XLA_FLAGS`
# or `SOLVERKIT_TEST_OPTIMIZE` set): there the flag and the settings come first.
_RECOMPUTED = """
import sys
import jax
jax.config.update("jax_disable_most_optimizations", True)
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/kernel")
import test_replayed_decisions
test_replayed_decisions.{check}()
print("ok")
"""


def _check_here_or_with_the_flag(check) -> None:
    """Run `check` in this process where it compiles with `_FLAG` (and most
    optimizations off), else in a second process that does."""
    if _compiled_here_with_the_flag():
        with jax.enable_x64(False):
            check()
        return
    root = _repository_root()
    env = {**os.environ, "XLA_FLAGS": _FLAG, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _RECOMPUTED.format(check=check.__name__)], cwd=root,
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_recomputation_replays_the_steps_taken():
    _check_here_or_with_the_flag(_check_recomputation)


def test_recomputation_takes_the_forward_step_sizes_at_round_off():
    _check_here_or_with_the_flag(_check_round_off_step_sizes)


def test_controller_sizes_the_next_step_after_the_replayed_decision():
    """`keep` replaces the PID controller's decision, and the next step is sized as
    after that decision: as the controller itself sizes it for an error on that side
    of the tolerance (here 1 -/+ 1e-3: the factors differ by that error's power)."""
    controller = sk.PIDController(rtol=1e-3, atol=1e-3)

    def adapt(err, keep=None):
        t0, t1, y0 = jnp.float64(0.0), jnp.float64(0.1), jnp.ones(2)
        state = controller.init(None, t0, 1.0, y0, 0.1, None, None, 5)[1]
        y_error = jnp.full(2, err * 2e-3)  # scaled error `err` (RMS norm)
        args = (t0, t1, y0, y0, None, y_error, 5, state)
        if keep is None:
            return controller.loop_adapt_step_size(*args)
        return controller.loop_adapt_step_size(*args, keep=keep)

    adapt = jax.jit(adapt)  # (op by op: ~45 compiles)
    with float64():
        for err, other in ((0.999, 1.001), (1.001, 0.999)):
            want = adapt(other)
            got = adapt(err, keep=want[0])
            assert bool(got[0]) == bool(want[0]) != bool(adapt(err)[0])
            assert got[1] == want[1]  # the next step starts where that decision puts it
            # float64 next ends: the power 1/5 of errors 2e-3 apart (relative 4e-4).
            np.testing.assert_allclose(got[2], want[2], rtol=1e-3)
            np.testing.assert_allclose(got[4].prev, want[4].prev, rtol=3e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_recorded_step_end_is_recovered_bit_for_bit(dtype):
    """A recomputed step end moves onto the recorded one however far from it, for
    ends of either sign, at zero, and whatever their exponent (6 low bits of the end
    recovered it only within 32 floats: the oscillator test below)."""
    from solverkit._adjoint import _replay
    from solverkit._problem import StepOut

    with float64():
        ends = jnp.asarray([0.0, -0.0, 1e-30, -3.5, 199.99, 2.0**20, -1e10], dtype)
        shifts = jnp.asarray([-1000, -40, -31, -1, 0, 1, 32, 40, 66, 5000])

        def moved(t, n):  # `t` moved `n` floats up (or down)
            toward = jnp.where(n >= 0, jnp.inf, -jnp.inf).astype(dtype)
            return jax.lax.fori_loop(
                0, jnp.abs(n), lambda _, x: jnp.nextafter(x, toward), t
            )

        def recovered(t, n):
            out = StepOut(jnp.asarray(True), t, t, None, None, lands=jnp.asarray(False))
            empty = _replay.Record(jnp.zeros(4, jnp.uint8), jnp.zeros(4, dtype))
            record = _replay.write(empty, 2, _End(t), out)
            replay = _replay.decisions(record, 2)
            assert replay is not None
            return _replay.step_end(record, 2, moved(t, n)), replay

        # Each batch one jitted program (op by op: ~40-70 compiles).
        got, replay = jax.jit(
            jax.vmap(lambda t: jax.vmap(lambda n: recovered(t, n))(shifts))
        )(ends)
        assert bool(jnp.all(replay.accepted)) and not bool(jnp.any(replay.lands))
        bits = lambda x: jax.lax.bitcast_convert_type(x, _INT[dtype])  # noqa: E731
        want = jnp.broadcast_to(ends[:, None], got.shape)
        assert bool(jnp.all(bits(got) == bits(want)))  # bit for bit (-0 too)


_INT = {jnp.float32: jnp.int32, jnp.float64: jnp.int64}


class _End(NamedTuple):
    tnext: jax.Array
