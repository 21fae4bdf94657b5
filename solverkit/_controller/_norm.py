"""`rms_norm`, the default norm of error estimates: used by the step-size controllers,
the steady-state event and the backsolve adjoint's seminorm."""

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._reduce import sum_all


def rms_norm(x: PyTree) -> Array:
    """Root mean square of every element of every leaf (complex: of the modulus)."""
    leaves = [jnp.abs(leaf) for leaf in jtu.tree_leaves(x) if jnp.size(leaf)]
    if not leaves:  # nothing to measure (an empty state): no error
        return jnp.asarray(0.0)
    size = sum(leaf.size for leaf in leaves)
    total = sum(
        sum_all(leaf.astype(jnp.result_type(float, leaf)) ** 2) for leaf in leaves
    )
    return jnp.sqrt(total / size)
