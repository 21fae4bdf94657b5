"""The kernel's lane layout: a batch of `N` trajectories as `(m, R, 128)` tiles
(one `(R, 128)` tile per component, trajectories along rows and lanes), and back."""

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._problem import Problem
from .._select import where
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


def saved_rows(problem: Problem, settings, y0, ys_ts, t_end, y_end):
    """The saved rows in the vmap path's layout (`_save.finish_save`): `t0`, the
    save times reached (those past an event's time: `inf`), then `t1` (the final
    point) in the first free row, then `inf` padding (`settings`: `_solve.Settings`,
    what is saved)."""
    batch = t_end.shape[0]
    save = problem.saves[0]
    rows = lambda x: x[:, None]  # noqa: E731
    if save.ts is None and not settings.save_t0:  # the final point or nothing
        save_t1 = settings.save_t1
        ts = rows(t_end) if save_t1 else jnp.zeros((batch, 0), t_end.dtype)
        ys = jtu.tree_map(lambda v: rows(v) if save_t1 else rows(v)[:, :0], y_end)
        return ts, ys
    ts = jnp.zeros((batch, 0), t_end.dtype)
    ys = jtu.tree_map(lambda x: jnp.zeros((batch, 0) + x.shape[1:], x.dtype), y0)
    if save.ts is not None:
        ys = state_of(from_lanes(ys_ts, batch), y0, batch)
        written = (save.ts[None] <= t_end[:, None]) | (save.ts[None] <= problem.t0)
        ts = where(written, save.ts[None], jnp.inf)
        ys = jtu.tree_map(
            lambda v: where(
                written.reshape(written.shape + (1,) * (v.ndim - 2)), v, jnp.inf
            ),
            ys,
        )
    if settings.save_t1:
        ts = jnp.concatenate([ts, jnp.full((batch, 1), jnp.inf, ts.dtype)], axis=1)
        ys = jtu.tree_map(
            lambda v: jnp.concatenate(
                [v, jnp.full((batch, 1) + v.shape[2:], jnp.inf, v.dtype)], axis=1
            ),
            ys,
        )
        index = jnp.sum(jnp.isfinite(ts), axis=1)
        final = jnp.arange(ts.shape[1])[None] == index[:, None]
        ts = where(final, rows(t_end), ts)
        ys = jtu.tree_map(
            lambda v, e: where(
                final.reshape(final.shape + (1,) * (v.ndim - 2)), rows(e), v
            ),
            ys,
            y_end,
        )
    if settings.save_t0:
        ts = jnp.concatenate([jnp.broadcast_to(problem.t0, (batch, 1)), ts], axis=1)
        ys = jtu.tree_map(lambda v, y: jnp.concatenate([rows(y), v], axis=1), ys, y0)
    return ts, ys
