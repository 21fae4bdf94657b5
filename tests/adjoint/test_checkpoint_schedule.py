"""The checkpoint schedule's integer rules (`solverkit/_adjoint/_schedule.py`), checked
as properties by simulating the forward and backward passes of
`RecursiveCheckpointAdjoint` on step indices instead of carries: every chunk's
recomputation starts from a carry that is stored and still holds the right step,
the chunks tile the steps, the buffers are never exceeded, and the default layout
recomputes a step at most twice."""

import collections

import hypothesis.strategies as st
import jax
import pytest
from hypothesis import given, settings

from solverkit._adjoint import _schedule
from solverkit._adjoint._schedule import Layout


# The rules as the compiled loops run them: on int32 scalars (jitted once per layout).
_record = jax.jit(_schedule.record, static_argnums=2)
_chunk = jax.jit(_schedule.chunk, static_argnums=0)
_mid_row = jax.jit(_schedule.mid_row, static_argnums=0)


def _forward(layout: Layout, n: int):
    """The forward pass over `n` steps: which step's carry each store row holds at
    the end, and the final level."""
    store, level = {}, 0
    for it in range(n):
        level, row = _record(it, level, layout.slots)
        store[int(row)] = it  # the carry before step `it`
    return store, int(level)


def _backward(layout: Layout, n: int, store: dict, level: int) -> collections.Counter:
    """The backward pass over `n` steps, asserting every rule on the way. Returns how
    often each step is recomputed."""
    recomputed = collections.Counter()
    mids, mids_of, end = {}, -1, n
    while end > 0:
        b = _chunk(layout, level, end, mids_of)
        start, begin, segment = int(b.start), int(b.begin), int(b.segment)
        # The chunk: at most a buffer of steps, ending at `end`, within its segment.
        assert segment <= begin <= start < end, (segment, begin, start, end)
        assert end - start <= layout.buffer
        # Where the recomputation starts: a stored carry of step `begin`.
        if b.have is not None and bool(b.have):
            assert mids.get(int(b.mid_index)) == begin
        else:
            assert begin == segment
            assert store.get(int(b.segment_slot)) == segment
        if level == 0:  # every step stored in order: read, nothing recomputed
            assert all(store.get(k) == k for k in range(start, end))
        else:
            recomputed.update(range(begin, end - 1))
        if b.mid_stride is not None and level > 0:
            mids[int(_mid_row(layout, b, begin))] = begin
            for k in range(begin, end - 1):
                mids[int(_mid_row(layout, b, k + 1))] = k + 1
            assert set(mids) <= set(range(layout.mid + 1))  # the mid buffer's rows
        mids_of, end = segment, start
    return recomputed


def _check(layout: Layout, n: int) -> collections.Counter:
    store, level = _forward(layout, n)
    # The store's rows: `slots` checkpoints and the scratch row.
    assert set(store) <= set(range(layout.slots + 1))
    # Every checkpoint of the final stride is held, in its slot, unmoved.
    stride = 1 << level
    for index, step in enumerate(range(0, n, stride)):
        assert store[int(_schedule.slot(index, level, layout.slots))] == step
    return _backward(layout, n, store, level)


# The full suite; the quick loop checks the default layout
# (test_default_layout_recomputes_a_step_at_most_twice).
@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    slots=st.integers(1, 8).map(lambda k: 2 * k),
    buffer=st.integers(1, 12),
    mid=st.integers(0, 6),
    n=st.integers(1, 300),
)
def test_any_layout_walks_every_step_back_from_a_stored_carry(slots, buffer, mid, n):
    _check(Layout(slots, buffer, mid), n)


@pytest.mark.parametrize(
    "max_steps",
    [1, 7, 100, 4096, 5000, pytest.param(20000, marks=pytest.mark.slow)],
)
# Quick loop: [4096].
@pytest.mark.quick_cases("1", "7", "100", "4096")
def test_default_layout_recomputes_a_step_at_most_twice(max_steps):
    layout = _schedule.layout(max_steps, None)
    for n in sorted({1, max_steps // 3 + 1, max_steps}):
        recomputed = _check(layout, n)
        assert max(recomputed.values(), default=0) <= 2
        if n <= layout.slots:  # every step stored: nothing recomputed
            assert not recomputed


@pytest.mark.parametrize(
    "checkpoints, n, most", [(10, 10, 0), (10, 80, 1), (10, 100, 2), (16, 256, 1)]
)
def test_user_checkpoints_recompute_once_while_the_stride_fits(checkpoints, n, most):
    # `checkpoints=S` and `max_steps=None`: chunks of `S` steps; a step is recomputed
    # once while the stride (a power of two) is at most `S` (up to 80 steps for
    # S = 10, 256 for S = 16), and in pieces past that.
    layout = _schedule.layout(None, checkpoints)
    recomputed = _check(layout, n)
    assert max(recomputed.values(), default=0) == most


@pytest.mark.parametrize(
    "max_steps, states",
    # The memory `RecursiveCheckpointAdjoint`'s docstring promises: stored states.
    [(4096, 160), (10**5, 192), (10**6, 310)],
)
def test_default_layout_memory(max_steps, states):
    layout = _schedule.layout(max_steps, None)
    assert layout.slots + layout.buffer + layout.mid == states
    # Mid checkpoints at most a buffer apart in the longest segment (the stride
    # when `max_steps` steps fill the slots).
    segment = 1 << (-(-max_steps // layout.slots) - 1).bit_length()
    assert layout.buffer * max(layout.mid, 1) >= segment


def test_slot_products_fit_in_int32():
    # `slot` multiplies a checkpoint index by a power of two modulo `slots - 1`.
    layout = _schedule.layout(10**12, None)
    assert (layout.slots - 1) ** 2 < 2**31
