"""Adjoints: how reverse- (and forward-) mode differentiation goes through a solve.

Each adjoint is a small strategy object with one method, `loop(problem)`, which runs
the step loop of `_loop.py` and returns its `Outputs`. The `Problem`, which holds the
closure-converted vector field, is an explicit operand of every `custom_vjp` and loop.
"""

import abc
import contextlib
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _loop
from ._closure import closure_convert
from ._controller import rms_norm
from ._custom_types import RealScalarLike, Y
from ._errors import UnsupportedError
from ._loop import Buffers, Carry, Outputs, Problem
from ._select import where
from ._solver._linalg import lu_factorisation, value_and_jacobian
from ._term import ClosureTerm, MultiTerm, total_vf
from ._unvmap import unvmap_any, unvmap_max


def _standard_promotion(fn):
    """Trace `fn` (a backward pass, traced after `diffeqsolve` has returned) with
    standard dtype promotion, as `diffeqsolve` traces the forward pass."""

    @functools.wraps(fn)
    def wrapper(*args):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args)

    return wrapper


def _zeros_cotangent(x):
    """A zero cotangent for a primal leaf (float0 for integer and boolean leaves)."""
    if x is None:
        return None
    if eqx.is_inexact_array(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _fill_zeros(cotangent, primal):
    """`cotangent` with every `None` (a leaf not differentiated) replaced by a zero
    cotangent of the primal leaf."""
    return jtu.tree_map(
        lambda c, x: _zeros_cotangent(x) if c is None else c,
        cotangent,
        primal,
        is_leaf=lambda x: x is None,
    )


def _parameters(tree):
    """Filter spec of the leaves of `tree` to differentiate: its inexact arrays,
    except the time direction (of a `Problem` or a `ClosureTerm`: a sign, whose
    derivative is zero; carrying its cotangent would only cost work, and backward
    steps)."""

    def spec(x):
        if not _is_term(x):
            return eqx.is_inexact_array(x)
        out = jtu.tree_map(eqx.is_inexact_array, x)
        if isinstance(x, Problem):
            out = eqx.tree_at(lambda p: p.terms, out, _parameters(x.terms))
        if x.direction is None:
            return out
        return eqx.tree_at(lambda v: v.direction, out, False)

    return jtu.tree_map(spec, tree, is_leaf=_is_term)


def _is_term(x) -> bool:
    return isinstance(x, (ClosureTerm, Problem))


@contextlib.contextmanager
def reverse_only(adjoint: "AbstractAdjoint"):
    """Turn JAX's error for forward-mode autodiff of a `custom_vjp` (the adjoints
    that support reverse mode only) into one that says what to use instead."""
    try:
        yield
    except TypeError as e:
        text = str(e)
        if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
            raise TypeError(
                f"{type(adjoint).__name__} supports reverse-mode differentiation "
                "(jax.grad, jax.vjp) only; for forward mode (jax.jvp, jax.jacfwd) use "
                f"`adjoint=DirectAdjoint()`. (JAX said: {e})"
            ) from None
        raise


def _custom_vjp(problem: Problem, primal: Callable, fwd: Callable, bwd: Callable, *ops):
    """`primal(problem, *ops)` as a `custom_vjp` with the rules `fwd(problem, *ops)
    -> (out, residuals)` and `bwd(static, dynamic, residuals, cotangents)`, which
    returns the cotangents of `(dynamic, *ops)`.

    The problem's arrays (`dynamic`) are an explicit operand, so every user value
    crosses the boundary explicitly; its non-array part (`static`) is static.
    """
    dynamic, static = eqx.partition(problem, eqx.is_array)

    @jax.custom_vjp
    def run(dynamic, *operands):
        return primal(eqx.combine(dynamic, static), *operands)

    def run_fwd(dynamic, *operands):
        out, residuals = fwd(eqx.combine(dynamic, static), *operands)
        return out, (dynamic, residuals)

    @_standard_promotion
    def run_bwd(residuals, cotangents):
        dynamic, residuals = residuals
        return bwd(static, dynamic, residuals, cotangents)

    run.defvjp(run_fwd, run_bwd)
    return run(dynamic, *ops)


class AbstractAdjoint(eqx.Module):
    """Base class of the adjoints."""

    @abc.abstractmethod
    def loop(self, problem: Problem) -> Outputs:
        """Run the solve described by `problem`."""

    def check(self, problem: Problem) -> None:
        """Raise a `ValueError` before tracing for an unsupported combination."""


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
    `ceil(max_steps / 4096)` mid checkpoints: the backward pass walks a long segment
    back from evenly spaced carries stored while recomputing its first chunk (two
    recomputations). So a short solve costs the same whatever `max_steps` is, and
    memory grows slowly with `max_steps`: 160 states up to 4096, 185 at `10**5`,
    305 at `10**6` (then like its cube root).

    **Arguments:**

    - `checkpoints`: the number of checkpoint slots `S` (rounded up to even); `None`
        for the default above. Needed for reverse mode with `max_steps=None`
        (chunks are then `S` steps long, and a solve of more than `S**2` steps is
        recomputed more than once).
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
            layout = _layout(problem.max_steps, self.checkpoints)
            fwd = functools.partial(_checkpointed_forward, layout=layout)
            bwd = functools.partial(_checkpointed_backward, layout=layout)
        carry, bufs = _custom_vjp(problem, _run, fwd, bwd, carry, bufs)
        return _loop.finish(problem, carry, bufs)


def _ceil_sqrt(n: int) -> int:
    return max(1, math.isqrt(n - 1) + 1)


class Layout(NamedTuple):
    """The memory of a checkpointed loop: `slots` checkpoints in the forward pass; in
    the backward pass a buffer of `buffer` recomputed states and, when a segment
    between two checkpoints can be longer than the buffer, `mid` checkpoints of the
    segment being walked back (0: none)."""

    slots: int
    buffer: int
    mid: int = 0


_MAX_SLOTS = 46340  # so that `_slot`'s products of two slot numbers fit in int32
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


def _ceil_cbrt(n: int) -> int:
    root = round(n ** (1 / 3))
    return root + (root**3 < n)


def _layout(max_steps: int | None, checkpoints: int | None) -> Layout:
    if checkpoints is not None:
        slots = checkpoints if max_steps is None else min(checkpoints, max_steps)
        slots = min(max(2, slots + slots % 2), _MAX_SLOTS)  # even: thinning halves
        buffer = slots if max_steps is None else max(1, -(-max_steps // slots))
        return Layout(slots, buffer)
    # At most two recomputations of a step. Memory: 128 + 32 states, plus one mid
    # checkpoint per 4096 steps of `max_steps`; for huge `max_steps`, about
    # `3 * max_steps**(1/3)` states.
    slots = max(_ceil_cbrt(max_steps), min(_MIN_SLOTS, max_steps))
    slots = min(max(2, slots + slots % 2), _MAX_SLOTS)
    per_slot = max(1, -(-max_steps // slots))
    buffer = min(per_slot, max(_MIN_BUFFER, _ceil_sqrt(per_slot)))
    mid = 0 if per_slot <= buffer else -(-per_slot // buffer)
    return Layout(slots, buffer, mid)


def _run(problem: Problem, carry: Carry, bufs: Buffers):
    return _loop.run_while(problem, carry, bufs)[:2]


def _forward_plain(problem: Problem, carry: Carry, bufs: Buffers):
    return _run(problem, carry, bufs), None


def _no_reverse_mode(static, dynamic, residuals, cotangents):
    raise UnsupportedError(
        "RecursiveCheckpointAdjoint can't differentiate a solve with "
        "`max_steps=None` in reverse mode without a number of checkpoints: pass an "
        "int `max_steps`, or RecursiveCheckpointAdjoint(checkpoints=...), or use "
        "BacksolveAdjoint()."
    )


class _Stack(eqx.Module):
    """Rows of copies of one pytree, packed into one `(rows, width)` array per dtype:
    a row is one write and one read per dtype, not one per leaf (fewer kernels to
    compile; measured: compiling the LV and Lorenz ensemble gradients of
    `benchmarks.gradient_ab`, 1.75-2.1 s and 1.8-2.3 s before, 1.65-1.7 s and 1.5-1.6 s
    after, the same run time). The recomputation loop keeps its carry packed, as a
    row (`_get`, `_put`), and unpacks it where the step uses it (`_unpack`)."""

    arrays: tuple[jax.Array, ...]
    treedef: jtu.PyTreeDef = eqx.field(static=True)
    # Per leaf: which array, where in the row, and its shape.
    places: tuple[tuple[int, int, tuple[int, ...]], ...] = eqx.field(static=True)


def _stack(tree, rows: int) -> _Stack:
    """`rows` zero copies of `tree`."""
    leaves, treedef = jtu.tree_flatten(tree)
    dtypes, widths, places = [], [], []
    for x in leaves:
        dtype = jnp.result_type(x)
        if dtype not in dtypes:
            dtypes.append(dtype)
            widths.append(0)
        group = dtypes.index(dtype)
        places.append((group, widths[group], jnp.shape(x)))
        widths[group] += math.prod(jnp.shape(x))
    arrays = tuple(jnp.zeros((rows, w), d) for d, w in zip(dtypes, widths))
    return _Stack(arrays, treedef, tuple(places))


def _pack(stack: _Stack, tree) -> tuple[jax.Array, ...]:
    """`tree` as one row of `stack`: one flat array per array of the stack."""
    parts = [[] for _ in stack.arrays]
    for (g, _, _), x in zip(stack.places, jtu.tree_leaves(tree)):
        parts[g].append(jnp.reshape(x, (-1,)))
    return tuple(jnp.concatenate(p) for p in parts)


def _unpack(stack: _Stack, row: tuple[jax.Array, ...]):
    """The pytree of a row of `stack` (see `_pack`)."""
    leaves = [
        lax.slice_in_dim(row[g], start, start + math.prod(shape)).reshape(shape)
        for g, start, shape in stack.places
    ]
    return jtu.tree_unflatten(stack.treedef, leaves)


def _get(stack: _Stack, i) -> tuple[jax.Array, ...]:
    """Row `i` of `stack`, packed."""
    return tuple(lax.dynamic_index_in_dim(a, i, 0, False) for a in stack.arrays)


def _put(stack: _Stack, i, row: tuple[jax.Array, ...]) -> _Stack:
    """`stack` with the packed `row` written at `i`."""
    arrays = tuple(
        lax.dynamic_update_index_in_dim(a, r, i, 0) for a, r in zip(stack.arrays, row)
    )
    return _Stack(arrays, stack.treedef, stack.places)


class _Record(NamedTuple):
    """The checkpointing forward pass's own loop state."""

    store: Carry  # `slots` carries (and a scratch row), stacked: the carry before
    # steps 0, w, 2w, ... (`_slot` says where)
    n: jax.Array  # steps taken by this batch element
    it: jax.Array  # loop iterations so far (never batched: the same for every element)
    level: jax.Array  # how often the stride has doubled: `w = 2**level` (never batched)


def _div(a, b):
    """`a // b` for non-negative int32 scalars, as C division: with no sign
    corrections (as `//` has), XLA fuses it into its users instead of compiling a
    kernel for each intermediate (on the CPU every kernel is an LLVM module of its
    own, 4-10 ms to compile even for a scalar)."""
    return lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _rem(a, b):
    """`a % b` for non-negative int32 scalars (see `_div`)."""
    return lax.rem(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def _slot(index, level, slots: int):
    """Where checkpoint `index` (of step `index * 2**level`) is stored.

    Checkpoints never move. When the stride doubles, those of even index stay where
    they are (index `m` becomes `m // 2`), and the new ones take the slots of those of
    odd index, in order: index `m` at one level was index `2 m` (first half) or
    `2 m - slots + 1` (second half) at the level before, which is `2 m` modulo
    `slots - 1`, except for the last slot, which maps to itself. So the slot is
    `index * 2**level` modulo `slots - 1` (`_layout` keeps the product in int32).
    """
    if slots == 2:
        return index
    power = _rem(lax.shift_left(jnp.asarray(1, jnp.int32), level), slots - 1)
    return jnp.where(index == slots - 1, index, _rem(index * power, slots - 1))


def _checkpointed_forward(problem: Problem, carry: Carry, bufs: Buffers, layout):
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
    """
    slots = layout.slots

    def record(rec: _Record, before: Carry, active) -> _Record:
        level = rec.level + (rec.it == slots << rec.level).astype(jnp.int32)
        due = (rec.it & ((1 << level) - 1)) == 0  # a multiple of the stride
        row = where(due, _slot(rec.it >> level, level, slots), slots)
        n = rec.n + jnp.asarray(active, jnp.int32)
        store = _put(rec.store, row, _pack(rec.store, before))
        return _Record(store, n, rec.it + 1, level)

    zero = jnp.asarray(0, jnp.int32)
    store, n = _stack(carry, slots + 1), zero
    if _loop.adaptive(problem):  # see `batch_like`; the counters stay unbatched
        store, n = _loop.batch_like(carry.num_steps, (store, n))
    rec = _Record(store, n, zero, zero)
    carry, bufs, rec = _loop.run_while(problem, carry, bufs, rec, record)
    return (carry, bufs), (rec, bufs, carry)


class _Reverse(NamedTuple):
    """What every piece of the checkpointed backward pass reads."""

    static: Problem  # the problem's non-array part
    p_rest: Problem  # its arrays that are not differentiated
    diff_mask: Carry  # which carry leaves are differentiated
    bufs: Buffers
    ct_bufs: Buffers  # cotangents of the save buffers
    rec: _Record  # the checkpoints
    layout: Layout


def _vjp_step(rev: _Reverse, p_diff, carry: Carry, ct_next):
    """Pull the cotangent of the carry after one step back through that step
    (writing its saves), to the problem's parameters and the carry before it."""
    c_diff, c_rest = eqx.partition(carry, rev.diff_mask)

    def f(p_diff, c_diff):
        problem = eqx.combine(p_diff, rev.p_rest, rev.static)
        new, new_bufs = _loop.body(
            problem, (eqx.combine(c_diff, c_rest), rev.bufs), differentiable=True
        )
        return eqx.filter(new, rev.diff_mask), eqx.filter(
            new_bufs, eqx.is_inexact_array
        )

    _, pullback = jax.vjp(f, p_diff, c_diff)
    return pullback((ct_next, rev.ct_bufs))


class _Chunk(NamedTuple):
    """Where a chunk of the backward pass starts, and where its recomputation does."""

    start: jax.Array  # the chunk's first step (its carry goes to the buffer's row 0)
    source: tuple[jax.Array, ...]  # the carry before step `begin`, packed
    begin: jax.Array  # recompute from here: a checkpoint at or before `start`
    segment: jax.Array  # the checkpoint that starts the chunk's segment
    mid_stride: jax.Array | None  # steps between mid checkpoints; None: not used


def _chunk(rev: _Reverse, end, mids, mids_of) -> _Chunk:
    """The chunk that ends before step `end`, and the checkpoint to recompute it from.

    Chunks hold at most `layout.buffer` steps: whole segments (between two
    checkpoints) where they fit, else pieces of one segment. With `layout.mid` and
    segments longer than the buffer, the first chunk of a segment is recomputed from
    the segment's checkpoint, storing `mid` evenly spaced carries of the segment on
    the way (`mids`, valid for the segment starting at `mids_of`); its other chunks
    start from the nearest of those.
    """
    layout, level = rev.layout, rev.rec.level
    stride = 1 << level
    last = end - 1
    span = jnp.maximum((layout.buffer >> level) << level, stride)
    segment = _div(last, span) * span
    source = _get(rev.rec.store, _slot(segment >> level, level, layout.slots))
    if not layout.mid:
        start = segment + _div(last - segment, layout.buffer) * layout.buffer
        return _Chunk(start, source, segment, segment, None)
    deep = layout.buffer < stride  # unbatched, and the same for every chunk
    # Not deep: only the segment's first carry is due, and never read.
    mid_stride = jnp.where(deep, _div(stride + layout.mid - 1, layout.mid), span)
    mid = segment + _div(last - segment, mid_stride) * mid_stride
    have = deep & (mids_of == segment)
    source = lax.cond(
        have, lambda: _get(mids, _div(mid - segment, mid_stride)), lambda: source
    )
    start = mid + _div(last - mid, layout.buffer) * layout.buffer
    return _Chunk(start, source, jnp.where(have, mid, segment), segment, mid_stride)


def _refill(rev: _Reverse, p_diff, buffer: _Stack, mids, chunk: _Chunk, end):
    """`buffer` holding the carries before steps `chunk.start, ..., end - 1`,
    recomputed from `chunk.source` (nothing, when every step is stored), and `mids`
    updated with the mid checkpoints passed on the way.

    Recomputed, never loaded from the forward pass's checkpoints in between: a stored
    carry spliced into a recomputed run can differ from it in the last bit (another
    compilation of the step), which the step-size controller amplifies (measured:
    1e-9 relative gradient error on Lotka-Volterra at rtol 1e-10). Mid checkpoints
    come from this same recomputation, so they splice exactly.
    """
    problem = eqx.combine(p_diff, rev.p_rest, rev.static)
    start, begin = chunk.start, chunk.begin
    use_mids = chunk.mid_stride is not None

    def mid_row(k):  # where the carry before step `k` goes; `mid` is a scratch row
        # (the bound only matters when segments fit the buffer: see `_chunk`)
        offset = k - chunk.segment
        index = _div(offset, chunk.mid_stride)
        due = (_rem(offset, chunk.mid_stride) == 0) & (index < rev.layout.mid)
        return jnp.where(due, index, rev.layout.mid)

    # The loop carries the carry packed, as the stacks store it: one output (and
    # one kernel to compile) per packed array rather than per leaf.
    def body(k, state):  # step `k`; store the carry before step `k + 1`
        packed, buffer, mids = state
        new, _ = _loop.step(problem, _unpack(buffer, packed))
        active = k < rev.rec.n
        packed = tuple(where(active, a, b) for a, b in zip(_pack(buffer, new), packed))
        row = jnp.maximum(k + 1 - start, 0)  # before `start`: overwritten later
        if use_mids:
            mids = _put(mids, mid_row(k + 1), packed)
        return packed, _put(buffer, row, packed), mids

    source = chunk.source
    buffer = _put(buffer, 0, source)
    if use_mids:
        mids = _put(mids, mid_row(begin), source)
    # With every step stored (stride 1) nothing is recomputed: `back` reads the store.
    last = jnp.where(rev.rec.level == 0, begin, end - 1)
    _, buffer, mids = lax.fori_loop(begin, last, body, (source, buffer, mids))
    return buffer, mids


def _checkpointed_backward(static, dynamic, residuals, cotangents, layout):
    """The steps in reverse, a chunk of at most `layout.buffer` steps at a time:
    refill the buffer with the chunk's carries, then pull the cotangent back through
    its steps, last first."""
    rec, bufs, final = residuals
    ct_carry, ct_bufs = cotangents
    # Both are the same for every batch element; make sure `vmap` knows it.
    rec = rec._replace(it=unvmap_max(rec.it), level=unvmap_max(rec.level))
    diff_mask = jtu.tree_map(eqx.is_inexact_array, final)
    p_diff, p_rest = eqx.partition(dynamic, _parameters(dynamic))
    ct_bufs = eqx.filter(ct_bufs, eqx.is_inexact_array)
    rev = _Reverse(static, p_rest, diff_mask, bufs, ct_bufs, rec, layout)

    def chunk(state):
        end, mids_of, buffer, mids, ct_p, ct_c = state
        where_from = _chunk(rev, end, mids, mids_of)
        start = where_from.start
        buffer, mids = _refill(rev, p_diff, buffer, mids, where_from, end)

        def back(i, cts):
            ct_p, ct_c = cts
            k = end - 1 - i  # the step to pull back through
            # At stride 1 the store holds every step, in order (`_slot(k, 0) == k`).
            # A `cond` (the predicate is unbatched) reads one of the two: a select of
            # both let XLA fuse both strided reads into the pullback's fusions, once
            # per consumer (measured: LV gradient 31 -> 20 ms with the cond). The
            # row is unpacked inside the branches for the same reason (unpacked
            # after the cond: Lorenz gradient 21.7-22.0 -> 24.2 ms). The store and
            # the buffer hold the same pytree, so either's layout unpacks both.
            carry = lax.cond(
                rec.level == 0,
                lambda: _unpack(buffer, _get(rec.store, k)),
                lambda: _unpack(buffer, _get(buffer, k - start)),
            )
            dp, dc = _vjp_step(rev, p_diff, carry, ct_c)
            active = k < rec.n
            ct_p = jtu.tree_map(lambda a, b: a + where(active, b, 0), ct_p, dp)
            return ct_p, _loop.tree_where(active, dc, ct_c)

        ct_p, ct_c = lax.fori_loop(0, end - start, back, (ct_p, ct_c))
        return start, where_from.segment, buffer, mids, ct_p, ct_c

    loop_state = (
        _stack(final, layout.buffer),
        _stack(final, layout.mid + 1) if layout.mid else None,
        jtu.tree_map(jnp.zeros_like, p_diff),
        eqx.filter(ct_carry, diff_mask),
    )
    # Batched up front wherever anything is (see `batch_like`); the chunk bounds
    # stay unbatched.
    loop_state = _loop.batch_like((rec, dynamic, ct_carry), loop_state)
    init = (rec.it, jnp.asarray(-1, jnp.int32), *loop_state)
    *_, ct_p, ct_c = lax.while_loop(lambda s: s[0] > 0, chunk, init)
    ct_dynamic = _fill_zeros(
        eqx.combine(ct_p, jtu.tree_map(lambda _: None, p_rest)), dynamic
    )
    return ct_dynamic, _fill_zeros(ct_c, final), jtu.tree_map(_zeros_cotangent, bufs)


class DirectAdjoint(AbstractAdjoint):
    """Differentiate straight through a loop bounded by `max_steps`.

    The loop is a `lax.scan` over blocks of `ceil(sqrt(max_steps))` steps; each block
    is checkpointed (recomputed in the backward pass) and skipped entirely once every
    batch element has finished. Supports forward mode (`jax.jvp`, `jax.jacfwd`) as
    well as reverse mode; memory grows like `sqrt(max_steps)` loop states (save
    buffers included). Prefer `RecursiveCheckpointAdjoint` for reverse mode.
    """

    def check(self, problem: Problem) -> None:
        if problem.max_steps is None:
            raise UnsupportedError(
                "DirectAdjoint needs an int `max_steps` (it loops over a bounded "
                "number of steps): pass an int `max_steps`, or use "
                "BacksolveAdjoint() for an unbounded solve."
            )

    def loop(self, problem: Problem) -> Outputs:
        carry, bufs = _loop.init(problem)
        block = _ceil_sqrt(problem.max_steps)
        blocks = -(-problem.max_steps // block)

        def step(state, _):
            active = _loop.cond(problem, state[0])
            return _loop.body(problem, state, active, differentiable=True), None

        @jax.checkpoint
        def run_block(state, _):
            running = unvmap_any(_loop.cond(problem, state[0]))
            state = lax.cond(
                running,
                lambda s: lax.scan(step, s, None, length=block)[0],
                lambda s: s,
                state,
            )
            return state, None

        (carry, bufs), _ = lax.scan(run_block, (carry, bufs), None, length=blocks)
        return _loop.finish(problem, carry, bufs)


class ImplicitAdjoint(AbstractAdjoint):
    """Differentiate a steady state by the implicit function theorem.

    For a solve that ends at a steady state `y*` (`f(t, y*, θ) = 0`, e.g. with
    `event=Event(steady_state_event())`), the derivative of `y*` is
    `-(∂f/∂y)^{-1} ∂f/∂θ`, whatever the path to it: the solve itself is not
    differentiated, so memory and cost do not depend on its steps. `θ` is everything
    the vector field depends on (`args` and every value it closes over); the initial
    state has no influence on a steady state, and gets a zero derivative. Forward and
    reverse mode alike.

    Supports `SaveAt(t1=True)` (with any `fn`), and `t0=True`; not `ts`, `steps` or
    `dense`, whose values are not steady states.

    !!! note

        The gradient is only meaningful at a steady state: check that the solve
        ended there (`sol.result`, or the event that fired). It is the derivative of
        the steady state near the one found, as in diffrax.
    """

    def check(self, problem: Problem) -> None:
        unsupported = []
        if any(save.ts is not None or save.every for save in problem.saves):
            unsupported.append("SaveAt(ts=...) or SaveAt(steps=...)")
        if problem.dense:
            unsupported.append("SaveAt(dense=True)")
        if unsupported:
            raise UnsupportedError(
                "ImplicitAdjoint differentiates the final (steady) state only; it "
                "does not support " + ", ".join(unsupported) + "."
            )

    def loop(self, problem: Problem) -> Outputs:
        fixed = _stop_gradient(problem)
        carry, bufs = _run(fixed, *_loop.init(fixed))
        carry = carry._replace(y=_steady_state(problem, carry.t, carry.y))
        return _loop.finish(problem, carry, bufs)


def _stop_gradient(tree):
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(lax.stop_gradient(dynamic), static)


def _steady_state(problem: Problem, t, y_star):
    """`y_star`, with the derivative of the root of `f(t, ·, θ)` by the implicit
    function theorem: one Newton correction `δ = -J^{-1} f(y*)` (with `J = ∂f/∂y` at
    `y*`, not differentiated) whose value is taken away again."""
    t, y_star = lax.stop_gradient((t, y_star))
    rate = lambda y: total_vf(problem.terms, t, y, problem.args)  # noqa: E731
    _, jac, _ = value_and_jacobian(lambda _, y: rate(y), t, y_star)
    lu = lu_factorisation(lax.stop_gradient(jac))
    delta = lu.solve(jtu.tree_map(jnp.negative, rate(y_star)))
    return jtu.tree_map(lambda y, d: y + d - lax.stop_gradient(d), y_star, delta)


class ForwardMode(DirectAdjoint):
    """Differentiate in forward mode (`jax.jvp`, `jax.jacfwd`): diffrax's name for
    it. Here it is [`solverkit.DirectAdjoint`][], which supports forward mode and
    reverse mode alike."""


_LOOP_STAGES_MAX_SIZE = 256


def _augmented(tau: RealScalarLike, state, aux, part: int | None = None):
    """The adjoint system of `dy/dtau = g(tau, y, theta)` in the outer internal time:
    `dy = g`, `da = -a dg/dy`, `dtheta_bar = -a dg/dtheta`; for a `MultiTerm`, the
    part of it that comes from its term `part` (the parts sum to the whole)."""
    terms, args = aux
    y, a, _ = state
    theta, rest = eqx.partition((terms, args), _parameters((terms, args)))

    def g(theta, y: Y):
        terms, args = eqx.combine(theta, rest)
        term = terms if part is None else terms.terms[part]
        return term.vf(tau, y, args)

    fy, pullback = jax.vjp(g, theta, y)
    g_theta, g_y = pullback(a)
    neg = lambda x: jtu.tree_map(jnp.negative, x)
    return fy, neg(g_y), neg(g_theta)


def adjoint_rms_seminorm(x) -> jax.Array:
    """A norm for the step-size controller of [`solverkit.BacksolveAdjoint`][] that
    measures only the state and its adjoint, not the parameter cotangents being
    accumulated: the backward solve then takes fewer steps (Kidger, Chen and Lyons,
    "Hey, that's not an ODE", ICML 2021). Use as `BacksolveAdjoint(
    stepsize_controller=PIDController(..., norm=adjoint_rms_seminorm))`.

    **Arguments:**

    - `x`: the augmented state `(y, a, parameter cotangents...)`.

    **Returns:**

    The RMS norm of `(y, a)`.
    """
    if not isinstance(x, tuple) or len(x) < 3:
        raise ValueError(
            "adjoint_rms_seminorm is a norm for the adjoint system of "
            "BacksolveAdjoint (a tuple (y, a, parameter cotangents)); got "
            f"{jtu.tree_structure(x)}."
        )
    return rms_norm((x[0], x[1]))


def _dot(a, b):
    leaves = [
        jnp.sum((x * y).real).astype(jnp.result_type(float))
        for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    ]
    return sum(leaves) if leaves else jnp.asarray(0.0)


def _solve_whole(problem: Problem) -> Outputs:
    carry, bufs = _loop.init(problem)
    return _loop.finish(problem, *_run(problem, carry, bufs))


def _with_outputs(problem: Problem):
    """Forward rule whose residuals are the outputs themselves."""
    out = _solve_whole(problem)
    return out, out


class BacksolveAdjoint(AbstractAdjoint):
    """Optimise-then-discretise: solve the continuous adjoint equations backwards in
    time, in constant memory.

    Differentiates with respect to `y0`, `args`, **every floating-point value the
    vector field closes over**, `t0`, `t1` and `SaveAt(ts=...)`. Supports
    `SaveAt(t0=..., t1=..., ts=...)` with the default `fn`; no events, `steps` or
    `dense`. Gradients are accurate to about the solve's tolerance (not to machine
    precision, as with `RecursiveCheckpointAdjoint`). Reverse mode only.

    **Arguments:**

    - `solver`: solver for the backward solve (default: the forward one).
    - `stepsize_controller`: controller for the backward solve (default: the
        forward one).
    """

    solver: object = None
    stepsize_controller: object = None

    def check(self, problem: Problem) -> None:
        unsupported = []
        if len(problem.saves) != 1:
            unsupported.append("SaveAt(subs=...) with several SubSaveAts")
        if problem.saves_steps:
            unsupported.append("SaveAt(steps=...)")
        if problem.dense:
            unsupported.append("SaveAt(dense=True)")
        if problem.conds is not None:
            unsupported.append("events")
        if not all(save.saves_y for save in problem.saves):
            unsupported.append("SaveAt(fn=...)")
        if unsupported:
            raise UnsupportedError(
                "BacksolveAdjoint does not support "
                + ", ".join(unsupported)
                + "; use RecursiveCheckpointAdjoint() instead."
            )

    def loop(self, problem: Problem) -> Outputs:
        def bwd(static, dynamic, out, ct_out):
            problem = eqx.combine(dynamic, static)
            return (self._backward(problem, out, ct_out.ys),)

        return _custom_vjp(problem, _solve_whole, _with_outputs, bwd)

    def _solve_back(self, problem: Problem, aux, state, ta, tb):
        """Integrate the augmented state from internal time `ta` back to `tb`."""
        solver = problem.solver if self.solver is None else self.solver
        controller = problem.controller  # in the forward solve's internal time
        if self.stepsize_controller is not None:
            controller = self.stepsize_controller.to_internal(problem.direction)
        backwards = -jnp.ones_like(ta)
        neg_ta = -ta
        # The adjoint system's vector field (a field and its vjp) is large. For a
        # small augmented state its Runge-Kutta stages run in a loop, which compiles
        # faster and runs as fast (measured: LV, 8 numbers per trajectory); for a
        # large one (a neural ODE's parameter cotangents) the loop's stacked stages
        # cost more than they save, so the stages stay unrolled.
        loop = sum(x.size for x in jtu.tree_leaves(state)) <= _LOOP_STAGES_MAX_SIZE

        def adjoint_term(part):
            augmented = functools.partial(_augmented, part=part)
            closure = closure_convert(augmented, neg_ta, state, aux)
            return ClosureTerm(closure, backwards, loop_stages=loop)

        if isinstance(problem.terms, MultiTerm):  # the adjoint of each part
            parts = range(len(problem.terms.terms))
            terms = MultiTerm(*[adjoint_term(i) for i in parts])
        else:
            terms = adjoint_term(None)
        inner = Problem(
            solver=solver,
            controller=controller.to_internal(backwards),
            terms=terms,
            direction=backwards,
            args=aux,
            y0=state,
            t0=neg_ta,
            t1=-tb,
            dt0=problem.dt0,
            max_steps=problem.max_steps,
        )
        carry, _ = _run(inner, *_loop.init(inner))
        failed = (carry.t < inner.t1) | (carry.result != _loop.SUCCESS)
        y = eqx.error_if(
            carry.y,
            failed,
            "BacksolveAdjoint: the backward (adjoint) solve failed, so no gradient "
            "can be given. Increase `max_steps` or pass BacksolveAdjoint("
            "stepsize_controller=...) with looser tolerances. A problem that is "
            "unstable backwards in time (diffusion, stiff decay) can't be solved "
            "backwards at all: use RecursiveCheckpointAdjoint() instead.",
        )
        return y

    def _backward(self, problem: Problem, out: Outputs, ct_ys):
        aux = (problem.terms, problem.args)
        theta, _ = eqx.partition(aux, _parameters(aux))
        g = lambda tau, y: total_vf(problem.terms, tau, y, problem.args)
        (save,) = problem.saves
        rows_t0 = 1 if save.t0 else 0
        num_ts = 0 if save.ts is None else save.ts.shape[0]
        take = lambda tree, i: jtu.tree_map(lambda x: x[i], tree)
        zeros_y = jtu.tree_map(jnp.zeros_like, problem.y0)
        ct_y1 = take(ct_ys, rows_t0 + num_ts) if save.t1 else zeros_y
        T = out.t_end
        ct_T = _dot(ct_y1, g(T, out.y_end)) if save.t1 else jnp.zeros_like(T)
        a = ct_y1
        theta_bar = jtu.tree_map(jnp.zeros_like, theta)
        y = out.y_end
        t_cur = T
        ct_ts = None
        if num_ts:
            ts = save.ts

            def segment(k, state):
                i = num_ts - 1 - k
                y, a, theta_bar, t_cur, ct_ts = state
                t_i = ts[i]
                y, a, theta_bar = self._solve_back(
                    problem, aux, (y, a, theta_bar), t_cur, t_i
                )
                y = take(out.ys, rows_t0 + i)  # restart from the saved forward value
                ct_row = take(ct_ys, rows_t0 + i)
                a = jtu.tree_map(jnp.add, a, ct_row)
                ct_ts = ct_ts.at[i].set(_dot(ct_row, g(t_i, y)).astype(ts.dtype))
                return y, a, theta_bar, t_i, ct_ts

            state = (y, a, theta_bar, t_cur, jnp.zeros_like(ts))
            y, a, theta_bar, t_cur, ct_ts = lax.fori_loop(0, num_ts, segment, state)
        y, a, theta_bar = self._solve_back(
            problem, aux, (y, a, theta_bar), t_cur, problem.t0
        )
        ct_t0 = -_dot(a, g(problem.t0, problem.y0))
        if save.t0:
            a = jtu.tree_map(jnp.add, a, take(ct_ys, 0))
        dynamic, _ = eqx.partition(problem, eqx.is_array)
        ct = jtu.tree_map(_zeros_cotangent, dynamic)
        ct_aux = _fill_zeros(theta_bar, eqx.partition(aux, eqx.is_array)[0])
        ct = eqx.tree_at(
            lambda p: (p.y0, p.t0, p.t1),
            ct,
            (a, ct_t0.astype(problem.t0.dtype), ct_T.astype(problem.t1.dtype)),
        )
        ct = _replace_subtrees(ct, ct_aux)
        if ct_ts is not None:
            ct = eqx.tree_at(lambda p: p.saves[0].ts, ct, ct_ts)
        return ct


def _replace_subtrees(ct, ct_aux):
    term, args = ct_aux
    ct = eqx.tree_at(lambda p: p.terms, ct, term, is_leaf=lambda x: x is None)
    return eqx.tree_at(lambda p: p.args, ct, args, is_leaf=lambda x: x is None)
