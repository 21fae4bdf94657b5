"""`Stack`: rows of copies of one pytree, packed into one array per dtype.

A row is one write and one read per dtype, not one per leaf: fewer kernels to compile
(measured: compiling the LV and Lorenz ensemble gradients of
`benchmarks.gradient_ab`, 1.75-2.1 s and 1.8-2.3 s before, 1.65-1.7 s and 1.5-1.6 s
after, the same run time). The checkpointed adjoint stores its checkpoints and its
recomputed carries so; its recomputation loop keeps the carry packed, as a row
(`get_row`, `put_row`), and unpacks it where the step uses it (`unpack`).

How `pack` builds a row does not matter to XLA: writing each leaf into a zero row
with `lax.dynamic_update_slice` at static offsets, or summing padded leaves, compiles
to the same optimised HLO as the `concatenate` (checked on the LV ensemble gradient:
identical kernels). Most `concatenate` kernels of a gradient are the stage
computations around the user's `jnp.stack` and its transpose, not rows (LV: 23 of
34; the rows' are the recomputation loop's 2).
"""

import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._save import row_of, with_row


Row = tuple[jax.Array, ...]  # one row, packed: a flat array per array of the stack


class Stack(eqx.Module):
    """Rows of copies of one pytree, one `(rows, width)` array per dtype. Leaves that
    are the same in every row (`fixed`) are kept once, not in the rows."""

    arrays: tuple[jax.Array, ...]
    fixed: tuple[jax.Array, ...]  # the fixed leaves' values, in leaf order
    # (jaxlib has no stub for the class that `jtu.PyTreeDef` names)
    treedef: jtu.PyTreeDef = eqx.field(static=True)  # pyright: ignore[reportInvalidTypeForm]
    # Per leaf: which array (-1: fixed), where in the row, and its shape.
    places: tuple[tuple[int, int, tuple[int, ...]], ...] = eqx.field(static=True)


def stack(tree: PyTree, rows: int, fixed: tuple[bool, ...] | None = None) -> Stack:
    """`rows` zero copies of `tree`; the leaves where `fixed` (one flag per leaf) is
    true are kept once, with their values in `tree`."""
    leaves, treedef = jtu.tree_flatten(tree)
    fixed = fixed or (False,) * len(leaves)
    dtypes, widths, places, values = [], [], [], []
    for x, is_fixed in zip(leaves, fixed):
        if is_fixed:
            places.append((-1, len(values), jnp.shape(x)))
            values.append(jnp.asarray(x))
            continue
        dtype = jnp.result_type(x)
        if dtype not in dtypes:
            dtypes.append(dtype)
            widths.append(0)
        group = dtypes.index(dtype)
        places.append((group, widths[group], jnp.shape(x)))
        widths[group] += math.prod(jnp.shape(x))
    arrays = tuple(jnp.zeros((rows, w), d) for d, w in zip(dtypes, widths))
    return Stack(arrays, tuple(values), treedef, tuple(places))


def fixed_leaves(stack: Stack) -> tuple[bool, ...]:
    """Which leaves `stack` keeps once (for `stack(tree, rows, fixed_leaves(s))`)."""
    return tuple(g < 0 for g, _, _ in stack.places)


def pack(stack: Stack, tree: PyTree) -> Row:
    """`tree` as one row of `stack` (its fixed leaves left out)."""
    parts = [[] for _ in stack.arrays]
    for (g, _, _), x in zip(stack.places, jtu.tree_leaves(tree)):
        if g >= 0:
            parts[g].append(jnp.reshape(x, (-1,)))
    return tuple(jnp.concatenate(p) for p in parts)


def unpack(stack: Stack, row: Row) -> PyTree:
    """The pytree of a row of `stack` (see `pack`), with its fixed leaves."""
    leaves = [
        stack.fixed[start]
        if g < 0
        else lax.slice_in_dim(row[g], start, start + math.prod(shape)).reshape(shape)
        for g, start, shape in stack.places
    ]
    return jtu.tree_unflatten(stack.treedef, leaves)


def get_row(stack: Stack, i) -> Row:
    """Row `i` of `stack`, packed."""
    return tuple(row_of(a, i) for a in stack.arrays)


def put_row(stack: Stack, i, row: Row) -> Stack:
    """`stack` with the packed `row` written at `i`."""
    arrays = tuple(with_row(a, i, r) for a, r in zip(stack.arrays, row))
    return Stack(arrays, stack.fixed, stack.treedef, stack.places)


def get_rows(stack: Stack, i, rows: int) -> tuple[jax.Array, ...]:
    """Rows `i, ..., i + rows - 1` of `stack`, packed (`i` at most the last
    `rows`)."""
    return tuple(lax.dynamic_slice_in_dim(a, i, rows, 0) for a in stack.arrays)


def put_rows(stack: Stack, i, rows: tuple[jax.Array, ...]) -> Stack:
    """`stack` with the packed `rows` (see `get_rows`) written from row `i`."""
    arrays = tuple(
        lax.dynamic_update_slice_in_dim(a, r, i, 0) for a, r in zip(stack.arrays, rows)
    )
    return Stack(arrays, stack.fixed, stack.treedef, stack.places)
