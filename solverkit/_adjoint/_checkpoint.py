"""`RecursiveCheckpointAdjoint`: reverse mode through the step loop, from checkpoints.

The forward pass stores the carry before some steps (`_schedule.py` says which, and
where); the backward pass walks the steps back a chunk at a time, recomputing each
chunk's carries from the nearest stored one and pulling the cotangent back through
each step. Stored carries are packed rows of a `Stack` (`_stack.py`).
"""

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _loop, _save
from .._closure._loops import counted_loop
from .._closure._traced import Traced
from .._closure._unvmap import unvmap_first, unvmap_max
from .._errors import UnsupportedError
from .._loop import Outputs
from .._problem import Buffers, Carry, Problem
from .._select import where
from .._tree import tree_add, tree_where
from . import _replay, _schedule
from ._base import (
    AbstractAdjoint,
    custom_vjp,
    fill_zeros,
    parameters,
    run,
    zeros_cotangent,
)
from ._schedule import Layout
from ._stack import (
    fixed_leaves,
    get_row,
    get_rows,
    pack,
    put_row,
    put_rows,
    Stack,
    stack,
    unpack,
)


class RecursiveCheckpointAdjoint(AbstractAdjoint):
    """Discretise-then-optimise: differentiate the solver's own operations.

    The forward pass keeps `S` checkpoint slots. It stores the loop state before
    every step until the slots are full, then keeps every other checkpoint and stores
    every second step, and so on (the stride doubles whenever the slots fill up;
    checkpoints never move). The backward pass walks the steps back a chunk at a time:
    it recomputes the chunk's states from the checkpoint at its start, then
    backpropagates through its steps, last first.

    So the cost follows the steps actually taken (one forward pass, one recomputation,
    one backward pass; no recomputation for a solve of at most `S` steps) and
    `max_steps` only sizes the memory. With `checkpoints=None`, `S = 128` slots
    (`max_steps` if fewer) and a buffer of 32 steps, and past `128 * 32 = 4096` steps
    about `max_steps / 4096` mid checkpoints (the longest segment, a power of two
    steps, over 32): the backward pass walks a long segment back from evenly spaced
    carries stored while recomputing its first chunk (two recomputations). So the
    stored states grow slowly with `max_steps`: 160 up to 4096, 192 at `10**5`, 310
    at `10**6` (then like its cube root). With adaptive steps the forward pass also
    records each step's decisions and next step end, which the recomputation
    replays: it takes the forward pass's steps even where another compilation
    rounds an error estimate to the other side of the tolerance, or sizes a step
    otherwise (not with `max_steps=None`). The record is a byte and a time for each
    of `max_steps` steps (9 KiB per 1024 `max_steps` with float64 times), filled on
    every call: with adaptive steps, keep `max_steps` near what the solve needs.

    **Arguments:**

    - `checkpoints`: the number of checkpoint slots `S` (rounded up to even); `None`
        for the default above. Needed for reverse mode with `max_steps=None`
        (chunks are then `S` steps long; a step is recomputed once while the
        stride, a power of two, is at most `S`: for a solve of up to `S * 2**k`
        steps, `2**k <= S`).
    """

    checkpoints: int | None = None

    def __check_init__(self):
        if self.checkpoints is not None and self.checkpoints < 1:
            raise ValueError(
                "RecursiveCheckpointAdjoint(checkpoints=...) must be >= 1."
            )

    def loop(self, problem: Problem) -> Outputs:
        carry, bufs = _loop.init(problem)
        if problem.max_steps is None and self.checkpoints is None:
            fwd, bwd = _forward_plain, _no_reverse_mode
        else:
            layout = _schedule.layout(problem.max_steps, self.checkpoints)
            # The step, traced once for the forward pass and the backward pass.
            step = Traced(_loop.step)
            fwd = functools.partial(_checkpointed_forward, layout=layout, step=step)
            bwd = functools.partial(_checkpointed_backward, layout=layout, step=step)
        carry, bufs = custom_vjp(
            problem, run, fwd, bwd, carry, bufs, adjoint="RecursiveCheckpointAdjoint"
        )
        return _loop.finish(problem, carry, bufs)


def _forward_plain(problem: Problem, carry: Carry, bufs: Buffers):
    return run(problem, carry, bufs), None


def _no_reverse_mode(static, dynamic, residuals, cotangents):
    raise UnsupportedError(
        "Cannot reverse-mode autodifferentiate when using "
        "`diffeqsolve(..., max_steps=None, "
        "adjoint=RecursiveCheckpointAdjoint(checkpoints=None))`: "
        "RecursiveCheckpointAdjoint can't differentiate a solve with "
        "`max_steps=None` in reverse mode without a number of checkpoints: pass an "
        "int `max_steps`, or RecursiveCheckpointAdjoint(checkpoints=...), or use "
        "BacksolveAdjoint()."
    )


class _Record(NamedTuple):
    """The checkpointing forward pass's own loop state."""

    store: Stack  # `slots` carries (and a scratch row), packed: the carry before
    # steps 0, w, 2w, ... (`_schedule.slot` says where)
    n: jax.Array  # steps taken by this batch element
    # The same for every batch element, and read unbatched (`unvmap_first`); carried
    # batched with adaptive steps (see `_checkpointed_forward`).
    it: jax.Array  # loop iterations so far
    level: jax.Array  # how often the stride has doubled: `w = 2**level`
    # Each step's decisions and next step end, which the recomputation replays
    # (`_replay.py`); `None` where nothing is recorded (fixed steps,
    # `max_steps=None`).
    steps: _replay.Record | None = None


def _checkpointed_forward(
    problem: Problem, carry: Carry, bufs: Buffers, layout, step: Traced
):
    """The loop, storing the carry before every `2**level`-th step.

    Every active batch element takes its `k`-th step in loop iteration `k`, so the
    checkpoints are indexed by the (unbatched) iteration count: under `vmap` a store
    is then a one-row write, not a scatter. Save buffers are written once per row and
    never read by the loop, so they are not checkpointed: the backward pass reads each
    written row's cotangent directly.

    Every element writes, finished or not, so that a store is a plain write (no read
    of the old row, no select): a finished element writes its final carry, into the
    checkpoints of steps at or past its `n`, which the backward pass masks out; an
    iteration off the stride writes a scratch row, `slots`, that is never read.

    `step` is `_loop.step` traced once: the loop evaluates the program traced for
    `_invariant`.
    """
    slots = layout.slots

    def record(rec: _Record, before: Carry, after: Carry, out, active) -> _Record:
        it = unvmap_first(rec.it)
        level, row = _schedule.record(it, unvmap_first(rec.level), slots)
        n = rec.n + jnp.asarray(active, jnp.int32)
        store = put_row(rec.store, row, pack(rec.store, before))
        steps = rec.steps
        if steps is not None:
            steps = _replay.write(steps, it, after, out)
        return _Record(store, n, it + 1, level, steps)

    zero = jnp.asarray(0, jnp.int32)
    store = stack(carry, slots + 1, _invariant(step, problem, carry))
    rec = _Record(store, zero, zero, zero, _replay.empty(problem))
    if _loop.adaptive(problem):
        # See `batch_like`: then every part of the loop's carry is batched, which
        # `vmap` batches the body for once, not twice (`counted_loop`). The
        # counters are read unbatched, so a store is still a one-row write.
        rec = _loop.batch_like(carry.num_steps, rec)
    stepper = step.simplified  # (not differentiated: merged equations)
    carry, bufs, rec = _loop.run_while(problem, carry, bufs, rec, record, stepper)
    return (carry, bufs), (rec, bufs, carry)


def _invariant(step: Traced, problem: Problem, carry: Carry) -> tuple[bool, ...]:
    """Per carry leaf: whether a step returns it unchanged (the same variable in
    the traced step, e.g. `ConstantStepSize`'s step count and interval ends; a leaf
    that is not traced counts as changed). Checkpoints keep such leaves once rather
    than in every row. Read from the program `step` is traced to, which the loop
    then evaluates: no trace of its own."""
    sources = step.passed_through(problem, carry)  # outputs: the new carry first
    first = len(jtu.tree_leaves(problem))
    count = len(jtu.tree_leaves(carry))
    return tuple(sources[i] == first + i for i in range(count))


class _Reverse(NamedTuple):
    """What every piece of the checkpointed backward pass reads."""

    static: Problem  # the problem's non-array part
    p_rest: Problem  # its arrays that are not differentiated
    diff_mask: Carry  # which carry leaves are differentiated
    bufs: Buffers
    ct_bufs: Buffers  # cotangents of the save buffers
    rec: _Record  # the checkpoints
    layout: Layout
    step: Traced  # `_loop.step`, traced once (see `Traced`)


def _vjp_step(rev: _Reverse, p_diff, carry: Carry, ct_next, replay: _loop.Replay):
    """Pull the cotangent of the carry after one step back through that step
    (and its saves), to the problem's parameters and the carry before it.

    `replay`: the step's decisions as the forward pass took them, replayed rather
    than decided again: this compilation of the step may round an error estimate
    within round-off of the tolerance to the other side (float32 Lorenz ensemble
    gradients were 1.6-2.2x off for 3 of 128 trajectories:
    tests/kernel/test_replayed_decisions.py).

    Evaluated from its traced program (`Traced`), which keeps only what the
    cotangents need: the step's new carry, counters and decisions, which `jax.vjp`
    computes as well, are dropped, and so are never batched or lowered; and, as the
    program is transposed already, its repeated equations are merged (`simplified`:
    the same values, bit for bit). LV ensemble gradient: the pullback loop's body
    729 -> 547 equations."""
    pull_back = Traced(_pull_back)  # every input explicit: its program is kept
    return pull_back.simplified(rev, p_diff, carry, ct_next, replay)


def _pull_back(rev: _Reverse, p_diff, carry: Carry, ct_next, replay: _loop.Replay):
    """`_vjp_step`, as Python. The rows at `SaveAt(ts=...)` are pulled back by
    `_save.pull_back_ts`, only those the step wrote; the step's other saves (at
    steps, dense output, events) are differentiated with it."""
    c_diff, c_rest = eqx.partition(carry, rev.diff_mask)
    problem_of = lambda p: eqx.combine(p, rev.p_rest, rev.static)  # noqa: E731
    rows = any(save.ts is not None for save in problem_of(p_diff).saves)

    def f(p_diff, c_diff):
        problem = problem_of(p_diff)
        new, out = rev.step(problem, eqx.combine(c_diff, c_rest), replay)
        new_bufs = _save.write(problem, new, out, rev.bufs, ts_rows="skip")
        out_diff, out_rest = eqx.partition(out, eqx.is_inexact_array)
        new_diff = eqx.filter(new, rev.diff_mask)
        bufs_diff = eqx.filter(new_bufs, eqx.is_inexact_array)
        return (new_diff, bufs_diff, out_diff if rows else None), out_rest

    (_, _, out_diff), pullback, out_rest = jax.vjp(f, p_diff, c_diff, has_aux=True)
    if not rows:
        return pullback((ct_next, rev.ct_bufs, None))
    out = eqx.combine(out_diff, out_rest)
    dp_rows, ct_out = _save.pull_back_ts(problem_of, p_diff, out, rev.ct_bufs.saves)
    dp, dc = pullback((ct_next, rev.ct_bufs, ct_out))
    return tree_add(dp, dp_rows), dc


def _source(rev: _Reverse, bounds: _schedule.Chunk, mids: Stack | None):
    """The packed carry that the chunk's recomputation starts from (at
    `bounds.begin`): its segment's checkpoint, or a mid checkpoint of it."""
    source = get_row(rev.rec.store, bounds.segment_slot)
    if bounds.have is None:
        return source
    assert mids is not None  # `layout.mid`: there are mid checkpoints
    return lax.cond(
        bounds.have, lambda: get_row(mids, bounds.mid_index), lambda: source
    )


def _refill(
    rev: _Reverse,
    p_diff,
    buffer: Stack,
    mids: Stack | None,
    bounds: _schedule.Chunk,
    end,
):
    """`buffer` holding the carries before steps `first, ..., end - 1` (for `first`
    at most `bounds.start`), and `mids` updated with the mid checkpoints passed on
    the way. The carries are recomputed from the chunk's source, or copied from the
    store when it holds every step (stride 1).

    Recomputed, never loaded from the forward pass's checkpoints in between: a stored
    carry spliced into a recomputed run can differ from it in the last bit (another
    compilation of the step), which the step-size controller amplifies (measured:
    1e-9 relative gradient error on Lotka-Volterra at rtol 1e-10). Mid checkpoints
    come from this same recomputation, so they splice exactly.
    """
    problem = eqx.combine(p_diff, rev.p_rest, rev.static)
    start, begin = bounds.start, bounds.begin
    use_mids = bounds.mid_stride is not None

    # The loop carries the carry packed, as the stacks store it: one output (and
    # one kernel to compile) per packed array rather than per leaf.
    def body(k, state):  # step `k`; store the carry before step `k + 1`
        packed, buffer, mids = state
        # The forward pass's step `k` (where recorded; else decided again).
        new, _ = rev.step.simplified(
            problem, unpack(buffer, packed), _replay.decisions(rev.rec.steps, k)
        )
        new = new._replace(tnext=_replay.step_end(rev.rec.steps, k, new.tnext))
        active = k < rev.rec.n
        packed = tuple(where(active, a, b) for a, b in zip(pack(buffer, new), packed))
        row = jnp.maximum(k + 1 - start, 0)  # before `start`: overwritten later
        if use_mids:
            mids = put_row(mids, _schedule.mid_row(rev.layout, bounds, k + 1), packed)
        return packed, put_row(buffer, row, packed), mids

    # At stride 1, rows `start, ...` of the store (where it ends, its last `rows`);
    # else overwritten by the recomputation (a copy of a few rows, cheap beside
    # it). So `back` reads one array, with no `cond` of two reads (LV ensemble
    # gradient: 131 kernels to compile against 146).
    rows = min(rev.layout.buffer, rev.layout.slots + 1)
    first = jnp.minimum(start, rev.layout.slots + 1 - rows)
    buffer = put_rows(buffer, 0, get_rows(rev.rec.store, first, rows))
    source = _source(rev, bounds, mids)
    buffer = put_row(buffer, 0, source)
    if use_mids:
        assert mids is not None  # (likewise)
        mids = put_row(mids, _schedule.mid_row(rev.layout, bounds, begin), source)
    # With every step stored (stride 1) nothing is recomputed: `back` reads the copy.
    last = where(rev.rec.level == 0, begin, end - 1)
    _, buffer, mids = counted_loop(
        begin, last, body, (source, buffer, mids), (buffer, mids)
    )
    return buffer, mids, where(rev.rec.level == 0, first, start)


def _chunk(rev: _Reverse, p_diff, state):
    """One chunk of the backward pass: refill the buffer with its carries, then
    pull the cotangent back through its steps, last first."""
    end, mids_of, buffer, mids, ct_p, ct_c, after = state
    end, mids_of = unvmap_first(end), unvmap_first(mids_of)  # `counted_loop`
    bounds = _schedule.chunk(rev.layout, rev.rec.level, end, mids_of)
    start = bounds.start
    buffer, mids, first = _refill(rev, p_diff, buffer, mids, bounds, end)

    steps = rev.rec.steps

    def back(i, state):
        ct_p, ct_c, row, replay, after = state
        k = end - 1 - i  # the step to pull back through
        # The row and the step's recorded decisions were read by the iteration
        # before (loop state): arrays of their own, not strided reads fused into
        # each kernel of the pullback that uses them (reading the row here: Lorenz
        # gradient 23-24 -> 31-35 ms, barrier or not; the decisions, a byte in
        # each of N rows of `max_steps`, were read by 16 kernels a step).
        carry = unpack(buffer, row)
        if replay is None:
            # As the carries after and before step `k` count accepted steps.
            replay = _loop.Replay(after > carry.num_accepted)
            after = carry.num_accepted
        # Else the recorded decision: the stored counters are then read by nothing
        # and XLA drops them from the checkpoints (Lorenz adaptive gradient: 2.5 KiB
        # per trajectory, `s32[N,129,4]` and `s32[N,32,4]`).
        dp, dc = _vjp_step(rev, p_diff, carry, ct_c, replay)
        active = k < rev.rec.n
        ct_p = jtu.tree_map(lambda a, b: a + where(active, b, 0), ct_p, dp)
        row = get_row(buffer, jnp.maximum(k - 1 - first, 0))
        replay = _replay.decisions(steps, jnp.maximum(k - 1, 0))
        return ct_p, tree_where(active, dc, ct_c), row, replay, after

    row = get_row(buffer, end - 1 - first)
    state = (ct_p, ct_c, row, _replay.decisions(steps, end - 1), after)
    ct_p, ct_c, _, _, after = counted_loop(0, end - start, back, state, ct_c)
    return start, bounds.segment, buffer, mids, ct_p, ct_c, after


def _checkpointed_backward(static, dynamic, residuals, cotangents, layout, step):
    """The steps in reverse, a chunk of at most `layout.buffer` steps at a time:
    refill the buffer with the chunk's carries, then pull the cotangent back through
    its steps, last first."""
    rec, bufs, final = residuals
    ct_carry, ct_bufs = cotangents
    # Both are the same for every batch element; make sure `vmap` knows it.
    rec = rec._replace(it=unvmap_max(rec.it), level=unvmap_max(rec.level))
    diff_mask = jtu.tree_map(eqx.is_inexact_array, final)
    p_diff, p_rest = eqx.partition(dynamic, parameters(dynamic))
    ct_bufs = eqx.filter(ct_bufs, eqx.is_inexact_array)
    rev = _Reverse(static, p_rest, diff_mask, bufs, ct_bufs, rec, layout, step)

    loop_state = (
        stack(final, layout.buffer, fixed_leaves(rec.store)),
        stack(final, layout.mid + 1, fixed_leaves(rec.store)) if layout.mid else None,
        jtu.tree_map(jnp.zeros_like, p_diff),
        eqx.filter(ct_carry, diff_mask),
        # The count after the last step (read where nothing is recorded).
        final.num_accepted if rec.steps is None else None,
    )
    # Batched up front wherever anything is (see `batch_like`), the chunk bounds
    # too: they are read unbatched (see `counted_loop`).
    init = (rec.it, jnp.asarray(-1, jnp.int32), *loop_state)
    init = _loop.batch_like((rec, dynamic, ct_carry), init)
    # Evaluated from its program with repeated equations merged (the index
    # arithmetic of the schedule, the refill and the buffer reads; not differentiated
    # again), traced once: `Traced`.
    chunk = functools.partial(Traced(_chunk).simplified, rev, p_diff)
    *_, ct_p, ct_c, _ = lax.while_loop(lambda s: unvmap_first(s[0]) > 0, chunk, init)
    ct_dynamic = fill_zeros(
        eqx.combine(ct_p, jtu.tree_map(lambda _: None, p_rest)), dynamic
    )
    return ct_dynamic, fill_zeros(ct_c, final), jtu.tree_map(zeros_cotangent, bufs)
