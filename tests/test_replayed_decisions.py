"""A checkpointed backward pass pulls each step back as the forward pass took it,
and recomputes the forward pass's steps from a checkpoint.

The pullback recompiles the step; a float32 error estimate within round-off of the
tolerance can land on the other side of 1 there. It then replays the decision the
carries record (`_checkpoint._vjp_step`): pulled back through the branch not taken,
float32 Lorenz gradients of `ensemble_solve`'s backward pass came out 1.6-2.2x off
for 3 of 128 trajectories (against the float64 gradient, which the whole-solve
kernel's forward sensitivities matched), with XLA's CPU loop emitters
(`--xla_cpu_use_fusion_emitters=false`), which round differently. The flips depend
on the compilation, so the check runs the float32 comparison of
test_kernel_tangent.py in a process with that flag (where this jaxlib knows it).
"""

import os
import subprocess
import sys

import conftest
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64

import solverkit as sk


_FLAG = "--xla_cpu_use_fusion_emitters=false"
_TEST = "tests/test_kernel_tangent.py::test_tangent_backward_vmap_float32"


@pytest.mark.slow
def test_pullback_replays_the_step_taken():
    if not conftest._accepted_xla_flags((_FLAG,)):
        pytest.skip(f"this jaxlib's XLA does not know {_FLAG}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "SOLVERKIT_TEST_XLA_FLAGS": _FLAG, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow",
         "-p", "no:randomly", _TEST],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


# The recomputation from a checkpoint (more steps than slots): the same float32
# Lorenz, 4 slots for 27-60 steps, `vmap` over all 128 trajectories and over a batch
# of one, against DirectAdjoint (which differentiates the forward pass itself).
# Deciding its steps again, the recomputation took others on 3 of 128 trajectories:
# 13-21% off (trajectory 81 alone: -259.4 against -269.8, which float64 gives too);
# replaying the decision alone (the controller sizing the next step from its own)
# sent trajectory 75 from -160.0 to +302.6. Now within 2e-4 of DirectAdjoint.
_RECOMPUTED = """
import sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_disable_most_optimizations", True)
sys.path.insert(0, "tests")
import solverkit as sk
import test_kernel_tangent as T
y0, rho, k = T._inputs(jnp.float32)
def grads(adjoint, idx):
    def loss(a, r, kk):
        sol = sk.diffeqsolve(
            sk.ODETerm(T._field(jnp.float32(9.0), 8 / 3)), sk.Tsit5(), 0.0, 1.0, None,
            a, (r, kk), saveat=T._saveat(), stepsize_controller=T._controller(1e-5),
            adjoint=adjoint)
        return jnp.sum(sol.ys**2) + jnp.sum(jnp.sin(sol.ys[1:, 0]))
    idx = np.asarray(idx)
    return np.asarray(jax.jit(jax.vmap(jax.grad(loss)))(y0[idx], rho[idx], k[idx]))
for idx in (np.arange(len(y0)), [81]):
    got = grads(sk.RecursiveCheckpointAdjoint(checkpoints=4), idx)
    want = grads(sk.DirectAdjoint(), idx)
    # Both differentiate the forward pass's steps, in two programs: float32
    # round-off (6e-8) of 27-60 steps, grown by the Lorenz flow over t <= 1 (up to
    # e^8 on these trajectories): 1e-3 of each gradient's largest component. A
    # gradient of other steps is 0.1-0.2 off.
    scale = np.abs(want).max(axis=1, keepdims=True)
    bound = np.broadcast_to(1e-3 * scale, want.shape)
    np.testing.assert_array_less(np.abs(got - want), bound)
print("ok")
"""


@pytest.mark.slow
def test_recomputation_replays_the_steps_taken():
    if not conftest._accepted_xla_flags((_FLAG,)):
        pytest.skip(f"this jaxlib's XLA does not know {_FLAG}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": _FLAG, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _RECOMPUTED], cwd=root, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


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

    with float64():
        for err, other in ((0.999, 1.001), (1.001, 0.999)):
            want = adapt(other)
            got = adapt(err, keep=want[0])
            assert bool(got[0]) == bool(want[0]) != bool(adapt(err)[0])
            assert got[1] == want[1]  # the next step starts where that decision puts it
            # float64 next ends: the power 1/5 of errors 2e-3 apart (relative 4e-4).
            np.testing.assert_allclose(got[2], want[2], rtol=1e-3)
            np.testing.assert_allclose(got[4].prev, want[4].prev, rtol=3e-3)
