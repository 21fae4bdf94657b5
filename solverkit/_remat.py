"""Values that a recomputation takes from the forward pass instead of deciding again.

`DirectAdjoint` checkpoints blocks of steps with `jax.checkpoint`: its backward pass
recomputes them, in another compiled program, which may round an error estimate to
the other side of the tolerance or a step's end to another float, and take other
steps from there (a float32 gradient 1e-2 off for a 1e-4 solve:
tests/kernel/test_replayed_decisions.py). The step-size decisions and each step's end
are marked `replayed`, and `POLICY` saves them: the recomputation reads them back.
(`RecursiveCheckpointAdjoint` records them itself, more compactly:
`_adjoint/_replay.py`.)
"""

import jax
from jax.ad_checkpoint import checkpoint_name


_NAME = "solverkit_replayed"

# The `jax.checkpoint` policy that keeps every value marked `replayed`.
POLICY = jax.checkpoint_policies.save_only_these_names(_NAME)


def replayed(x):
    """`x`, which a recomputation under `POLICY` takes from the forward pass."""
    return checkpoint_name(x, _NAME)
