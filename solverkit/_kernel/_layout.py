"""The kernel's lane layout: a batch of `N` trajectories as `(m, R, 128)` tiles
(one `(R, 128)` tile per component, trajectories along rows and lanes), and back."""

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._pallas import LANES


def to_lanes(x, batch: int, rows: int):
    """`(N, *s)` to `(m, R, 128)`, `m = prod(s)`, padded with trajectory 0."""
    block = rows * LANES
    size = -(-batch // block) * block
    flat = jnp.reshape(x, (batch, -1))
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.int32)
    pad = jnp.broadcast_to(flat[:1], (size - batch, flat.shape[1]))
    flat = jnp.concatenate([flat, pad]) if size > batch else flat
    # One component per trajectory: a reshape, not a transpose.
    flat = flat.reshape(1, size) if flat.shape[1] == 1 else flat.T
    return flat.reshape(flat.shape[0], size // LANES, LANES)


def from_lanes(x, batch: int):
    """`(..., m, R, 128)` to `(N, ..., m)`."""
    lead = x.shape[:-2]
    flat = x.reshape(lead + (-1,))[..., :batch]
    return jnp.moveaxis(flat, -1, 0)


def per_trajectory(tile, batch: int):
    """`(R, 128)` to `(N,)`: a reshape, no transpose (a `(N, k)` array with a small
    `k` is padded to 128 lanes on a TPU, and its strided slices overflowed scoped
    VMEM at N = 2^20)."""
    return tile.reshape(-1)[:batch]


def state_of(flat, y0_example: PyTree, batch: int) -> PyTree:
    """`(N, ..., n)` components back into the pytree of `y0` (leading `N, ...`)."""
    leaves, tree = jtu.tree_flatten(y0_example)
    lead = flat.shape[:-1]
    out, start = [], 0
    for leaf in leaves:
        shape = leaf.shape[1:]
        size = int(jnp.size(leaf)) // batch
        out.append(flat[..., start : start + size].reshape(lead + shape))
        start += size
    return jtu.tree_unflatten(tree, out)
