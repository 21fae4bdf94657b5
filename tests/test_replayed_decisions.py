"""A checkpointed backward pass pulls each step back as the forward pass took it.

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
import pytest


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
