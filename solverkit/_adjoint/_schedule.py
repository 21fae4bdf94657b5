"""The checkpoint schedule of `RecursiveCheckpointAdjoint`: integer rules only.

Which steps the forward pass stores, in which slot, and how the backward pass walks
the steps back in chunks: for each chunk, where it starts, and which stored carry (a
checkpoint, or a mid checkpoint) it is recomputed from. Nothing here touches a carry;
`_checkpoint.py` applies these rules to the loop, and
`tests/adjoint/test_checkpoint_schedule.py` checks them as properties (every step
recomputable from a carry that is still stored, the memory bound, slots never
overwritten while needed).

The rules run inside the compiled loops, on unbatched int32 scalars (the loop
iteration count and the stride level are the same for every batch element).
"""

import math
from typing import NamedTuple

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._select import where


class Layout(NamedTuple):
    """The memory of a checkpointed loop: `slots` checkpoints in the forward pass; in
    the backward pass a buffer of `buffer` recomputed states and, when a segment
    between two checkpoints can be longer than the buffer, `mid` checkpoints of the
    segment being walked back (0: none)."""

    slots: int
    buffer: int
    mid: int = 0


_MAX_SLOTS = 46340  # so that `slot`'s products of two slot numbers fit in int32
# Default slots at least: a solve of up to this many steps is never recomputed (most
# adaptive solves; measured: LV ensemble gradient, 104-125 steps, 46 ms against 56 ms
# with 64 slots), for at most 128 stored states per trajectory.
_MIN_SLOTS = 128
# Default buffer at least: a solve of up to `_MIN_SLOTS * _MIN_BUFFER` steps is
# recomputed once. Past that the default adds `mid` checkpoints instead of growing the
# buffer: every allocated row costs its fill on every call, whatever the steps taken
# (measured: Lorenz gradient, 111 steps, 28 ms with 161 rows, 50 ms with the 634 rows
# of a square-root layout at max_steps 1e5).
_MIN_BUFFER = 32


def ceil_sqrt(n: int) -> int:
    """`ceil(sqrt(n))` for a positive int (at least 1)."""
    return max(1, math.isqrt(n - 1) + 1)


def _ceil_cbrt(n: int) -> int:
    root = round(n ** (1 / 3))
    return root + (root**3 < n)


def layout(max_steps: int | None, checkpoints: int | None) -> Layout:
    """The layout for a solve of at most `max_steps` steps (`None`: unbounded, which
    needs `checkpoints`), with `checkpoints` slots or the default (see
    `RecursiveCheckpointAdjoint`)."""
    if checkpoints is not None:
        slots = checkpoints if max_steps is None else min(checkpoints, max_steps)
        slots = min(max(2, slots + slots % 2), _MAX_SLOTS)  # even: thinning halves
        buffer = slots if max_steps is None else max(1, -(-max_steps // slots))
        return Layout(slots, buffer)
    assert max_steps is not None
    # At most two recomputations of a step. Memory: 128 + 32 states, plus one mid
    # checkpoint per 32 steps of the longest segment, 1/128 of `max_steps` rounded up
    # to a power of two; for huge `max_steps`, about `3 * (2 max_steps)**(1/3)`
    # states.
    slots = max(_ceil_cbrt(max_steps), min(_MIN_SLOTS, max_steps))
    slots = min(max(2, slots + slots % 2), _MAX_SLOTS)
    per_slot = max(1, -(-max_steps // slots))
    # A segment is as long as the stride, a power of two: up to twice `per_slot`. Its
    # mid checkpoints must be at most a buffer apart, or a chunk between two of them
    # is recomputed in pieces (a third recomputation:
    # `tests/adjoint/test_checkpoint_schedule.py`).
    segment = 1 << (per_slot - 1).bit_length()
    buffer = min(segment, max(_MIN_BUFFER, ceil_sqrt(segment)))
    mid = 0 if segment <= buffer else -(-segment // buffer)
    return Layout(slots, buffer, mid)


def div(a, b) -> Array:
    """`a // b` for non-negative int32 scalars, as C division: with no sign
    corrections (as `//` has), XLA fuses it into its users instead of compiling a
    kernel for each intermediate (on the CPU every kernel is an LLVM module of its
    own, 4-10 ms to compile even for a scalar)."""
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def rem(a, b) -> Array:
    """`a % b` for non-negative int32 scalars (see `div`)."""
    return lax.rem(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def slot(index, level, slots: int) -> Array:
    """Where checkpoint `index` (of step `index * 2**level`) is stored.

    Checkpoints never move. When the stride doubles, those of even index stay where
    they are (index `m` becomes `m // 2`), and the new ones take the slots of those of
    odd index, in order: index `m` at one level was index `2 m` (first half) or
    `2 m - slots + 1` (second half) at the level before, which is `2 m` modulo
    `slots - 1`, except for the last slot, which maps to itself. So the slot is
    `index * 2**level` modulo `slots - 1` (`layout` keeps the product in int32).
    """
    if slots == 2:
        return index
    power = rem(lax.shift_left(jnp.asarray(1, jnp.int32), level), slots - 1)
    return where(index == slots - 1, index, rem(index * power, slots - 1))


def record(it, level, slots: int) -> tuple[Array, Array]:
    """The forward pass's rule before loop iteration `it` (the carry before step
    `it`), at stride `2**level`.

    **Returns:**

    `(level, row)`: the level after this iteration (the stride doubles when the
    slots are full), and the row the carry is written to: its slot when `it` is a
    multiple of the stride, else the scratch row `slots`, which is never read.
    """
    level = level + (it == slots << level).astype(jnp.int32)
    due = (it & ((1 << level) - 1)) == 0  # a multiple of the stride
    return level, where(due, slot(it >> level, level, slots), slots)


class Chunk(NamedTuple):
    """Where a chunk of the backward pass starts, and where its recomputation does."""

    start: Array  # the chunk's first step (its carry goes to the buffer's row 0)
    begin: Array  # recompute from here: a checkpoint at or before `start`
    segment: Array  # the checkpoint that starts the chunk's segment
    segment_slot: Array  # where that checkpoint is stored
    # With mid checkpoints (else None): steps between them; whether the chunk
    # starts from one (`have`), and which (`mid_index`, a row of the mid buffer).
    mid_stride: Array | None
    have: Array | None
    mid_index: Array | None


def chunk(layout: Layout, level, end, mids_of) -> Chunk:
    """The chunk that ends before step `end`, and the carry to recompute it from.

    Chunks hold at most `layout.buffer` steps: whole segments (between two
    checkpoints) where they fit, else pieces of one segment. With `layout.mid` and
    segments longer than the buffer, the first chunk of a segment is recomputed from
    the segment's checkpoint, storing `mid` evenly spaced carries of the segment on
    the way (see `mid_row`; they are valid for the segment starting at `mids_of`);
    its other chunks start from the nearest of those.
    """
    stride = 1 << level
    last = end - 1
    span = jnp.maximum((layout.buffer >> level) << level, stride)
    segment = div(last, span) * span
    segment_slot = slot(segment >> level, level, layout.slots)
    if not layout.mid:
        start = segment + div(last - segment, layout.buffer) * layout.buffer
        return Chunk(start, segment, segment, segment_slot, None, None, None)
    deep = layout.buffer < stride  # unbatched, and the same for every chunk
    # Not deep: only the segment's first carry is due, and never read.
    mid_stride = where(deep, div(stride + layout.mid - 1, layout.mid), span)
    mid = segment + div(last - segment, mid_stride) * mid_stride
    have = deep & (mids_of == segment)
    start = mid + div(last - mid, layout.buffer) * layout.buffer
    begin = where(have, mid, segment)
    mid_index = div(mid - segment, mid_stride)
    return Chunk(start, begin, segment, segment_slot, mid_stride, have, mid_index)


def mid_row(layout: Layout, chunk: Chunk, k) -> Array:
    """The row of the mid buffer that the carry before step `k`, recomputed for
    `chunk`, goes to: `k`'s mid checkpoint, or the scratch row `layout.mid`. (The
    bound only matters when segments fit the buffer: see `chunk`.)"""
    offset = k - chunk.segment
    index = div(offset, chunk.mid_stride)
    due = (rem(offset, chunk.mid_stride) == 0) & (index < layout.mid)
    return where(due, index, layout.mid)
