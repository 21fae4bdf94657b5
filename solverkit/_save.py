"""What a solve saves: the save buffers, written row by row as steps are accepted
(`write`), and the rows of each `SubSaveAt` assembled after the loop (`finish_save`),
laid out as diffrax lays them out."""

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from . import _backend
from ._closure._loops import while_loop
from ._custom_types import RealScalarLike, Y
from ._errors import concrete
from ._problem import (
    Buffers,
    Carry,
    dense_info_zeros,
    Problem,
    Save,
    SaveBuffer,
    StepOut,
)
from ._select import where
from ._solution import RESULTS
from ._term import ClosureTerm, MultiTerm, total_vf
from ._time import flip
from ._tree import moving_with, tree_add


# How `write` writes the rows at `SaveAt(ts=...)` (see there).
TsRows = Literal["loop", "masked", "skip"]
# Up to this many save times, a step finds its rows by comparing with each of them
# (one element-wise kernel), and on the backends of `ONE_HOT_BACKENDS` reads and
# writes a row as a one-hot select over them (see `_get`); past it, by bisection
# (log2 of them gathers) and by index.
_COMPARE_ALL_MAX = 64
# A TPU runs a scatter with batched indices as a serial loop over the batch; a CPU
# (and a GPU) runs the indexed forms faster than a select over every row (CPU,
# Lotka-Volterra gradient, 10 save times, N = 1024: 1.3x the time one-hot).
ONE_HOT_BACKENDS = ("tpu",)
# Where `set_row` reads and writes a row by indexing, not by slices (see there).
ROW_SCATTER_BACKENDS = ("tpu",)


def _save_value(problem: Problem, save: Save, tau: RealScalarLike, y: Y):
    return save.fn(flip(problem.direction, tau), y, problem.args)


def _inf_like(struct, lead: tuple[int, ...]):
    def leaf(s):
        shape = lead + tuple(s.shape)
        if jnp.issubdtype(s.dtype, jnp.inexact):
            return jnp.full(shape, jnp.inf, s.dtype)
        return jnp.zeros(shape, s.dtype)

    return jtu.tree_map(leaf, struct)


def init_buffers(problem: Problem, solver_state: PyTree) -> Buffers:
    """Save buffers, `inf`-filled (rows not written stay `inf`)."""
    saves = []
    for save in problem.saves:
        struct = save.fn.out_struct
        ts_ys = steps_ts = steps_ys = None
        if save.ts is not None:
            ts_ys = _inf_like(struct, (save.ts.shape[0],))
        if save.every:
            assert problem.max_steps is not None  # `_setup._saves` checked it
            rows = save.step_rows(problem.max_steps)
            steps_ts = jnp.full((rows,), jnp.inf, problem.t0.dtype)
            steps_ys = _inf_like(struct, (rows,))
        saves.append(SaveBuffer(ts_ys, steps_ts, steps_ys))
    dense_ts = dense_info = dense_ends = None
    if problem.dense:
        assert problem.max_steps is not None  # (likewise)
        info = dense_info_zeros(problem, solver_state)
        dense_ts = jnp.full((problem.max_steps + 1,), jnp.inf, problem.t0.dtype)
        dense_info = jtu.tree_map(
            lambda x: jnp.zeros((problem.max_steps,) + x.shape, x.dtype), info
        )
        if problem.event.continues:  # steps cut at an occurrence (see `StepOut.t_info`)
            dense_ends = jnp.full((problem.max_steps,), jnp.inf, problem.t0.dtype)
    event_ts = event_ys = None
    if problem.event.continues:
        event_ts = jnp.full((problem.event.max_events,), jnp.inf, problem.t0.dtype)
        event_ys = _inf_like(
            jtu.tree_map(lambda y: jax.ShapeDtypeStruct(y.shape, y.dtype), problem.y0),
            (problem.event.max_events,),
        )
    return Buffers(tuple(saves), dense_ts, dense_info, event_ts, event_ys, dense_ends)


def write(
    problem: Problem,
    carry: Carry,
    out: StepOut,
    bufs: Buffers,
    ts_rows: TsRows = "loop",
) -> Buffers:
    """Write what an accepted step saves into the buffers; each row is written once.

    `ts_rows` says how the rows at `SaveAt(ts=...)` inside the step are written:
    `"loop"`, one at a time by a short loop; `"masked"` (for reverse-mode autodiff
    through the step), every row computed and masked, which costs `len(ts)`
    interpolations; `"skip"`, not at all (a backward pass that pulls their
    cotangents back itself, with `pull_back_ts`).
    """
    saves = tuple(
        _write_save(problem, save, carry, out, buf, ts_rows)
        for save, buf in zip(problem.saves, bufs.saves)
    )
    dense_ts, dense_info, dense_ends = bufs.dense_ts, bufs.dense_info, bufs.dense_ends
    if problem.dense:
        row = jnp.maximum(carry.num_accepted - 1, 0)
        dense_ts = set_row(dense_ts, row + 1, out.accepted, out.t1)
        dense_info = jtu.tree_map(
            lambda b, v: set_row(b, row, out.accepted, v), dense_info, out.dense_info
        )
        if dense_ends is not None:
            dense_ends = set_row(dense_ends, row, out.accepted, out.info_end)
    event_ts, event_ys = bufs.event_ts, bufs.event_ys
    if out.landed is not None:
        assert carry.continuing is not None  # (an event that continues)
        row = jnp.minimum(carry.continuing.count - 1, problem.event.max_events - 1)
        write = out.landed & (carry.continuing.count <= problem.event.max_events)
        # By one-hot selects on a TPU (`_put`): a scatter there, with each batch
        # element's own row, ran as a serial loop over the batch in every step
        # (spiking network, N = 1024, float32: 0.62 s, 4 ms a step, linear in N).
        event_ts = _put(event_ts, row, write, out.t1)
        event_ys = jtu.tree_map(lambda b, v: _put(b, row, write, v), event_ys, out.y1)
    return Buffers(saves, dense_ts, dense_info, event_ts, event_ys, dense_ends)


def _write_save(
    problem: Problem,
    save: Save,
    carry: Carry,
    out: StepOut,
    buf: SaveBuffer,
    ts_rows: TsRows,
) -> SaveBuffer:
    accepted, t0, t1 = out.accepted, out.t0, out.t1
    ts_ys, steps_ts, steps_ys = buf
    if save.ts is not None and ts_rows != "skip":
        ts = save.ts
        at = lambda tau: _interpolated(problem, save, out, tau)  # noqa: E731
        if ts_rows == "masked":
            rows = accepted & (ts > t0) & (ts <= t1)
            values = jax.vmap(at)(ts)
            ts_ys = jtu.tree_map(lambda v, b: _mask_rows(rows, v, b), values, ts_ys)
        else:
            ts_ys = _write_rows(ts, t0, t1, accepted, at, ts_ys)
    if save.every:
        n = save.every
        k = carry.num_accepted  # after this step
        hit = accepted & (k % n == 0)
        row = jnp.maximum(k // n - 1, 0)
        value = _save_value(problem, save, t1, out.y1)
        steps_ts = set_row(steps_ts, row, hit, t1)
        steps_ys = jtu.tree_map(lambda b, v: set_row(b, row, hit, v), steps_ys, value)
    return SaveBuffer(ts_ys, steps_ts, steps_ys)


def _interpolated(problem: Problem, save: Save, out: StepOut, tau: RealScalarLike):
    """The value `save` saves at `tau`, from the dense output of the step `out`."""
    y = problem.solver.interpolate(out.dense_info, out.t0, out.info_end, tau)
    return _save_value(problem, save, tau, y)


def _rows(ts, t0: RealScalarLike, t1: RealScalarLike, accepted):
    """`(lo, hi)`: the rows `lo <= i < hi` of the (sorted) save times `ts` in
    `t0 < ts[i] <= t1`, none where the step was rejected.

    Found without a loop: by comparing with every time for a few of them, else by
    an unrolled bisection (`searchsorted`'s default is a `while_loop`, two more
    loops in every step, forwards and backwards)."""
    method = "compare_all" if ts.shape[0] <= _COMPARE_ALL_MAX else "scan_unrolled"
    lo = jnp.searchsorted(ts, t0, side="right", method=method).astype(jnp.int32)
    hi = jnp.searchsorted(ts, t1, side="right", method=method).astype(jnp.int32)
    return lo, where(accepted, hi, lo)


def _get(buf, row):
    """Row `row` of `buf`, one of the rows at `SaveAt(ts=...)`.

    Under `vmap` each batch element reads its own row. By index that is a gather
    with batched indices, and writing (`_put`) or adding (`_add`) a scatter: a
    serial loop over the batch on a TPU (Lotka-Volterra gradient, 10 save times:
    time linear in N, 380 ms at N = 4096). There (`_one_hot`) it is a select
    against a one-hot mask of the rows instead, element-wise and exact.
    """
    if not _one_hot(buf):
        return row_of(buf, row)
    return jnp.sum(_mask_rows(_hot(buf, row), buf, 0), axis=0, dtype=buf.dtype)


def _put(buf, row, pred, value):
    """`buf` with row `row` set to `value` where `pred` (see `_get`)."""
    if not _one_hot(buf):
        return set_row(buf, row, pred, value)
    return _mask_rows(_hot(buf, row) & pred, jnp.broadcast_to(value, buf.shape), buf)


def _add(buf, row, value):
    """`buf` with `value` added to row `row` (see `_get`)."""
    if not _one_hot(buf):
        return buf.at[row].add(value)
    return buf + _mask_rows(_hot(buf, row), jnp.broadcast_to(value, buf.shape), 0)


def _one_hot(buf) -> bool:
    """Whether rows of `buf` are read and written by one-hot selects: on the
    backends of `ONE_HOT_BACKENDS`, up to `_COMPARE_ALL_MAX` rows (a select costs
    every row, in every step)."""
    small = buf.shape[0] <= _COMPARE_ALL_MAX
    return small and _backend.platform() in ONE_HOT_BACKENDS


def _hot(buf, row):
    return jnp.arange(buf.shape[0], dtype=jnp.int32) == row


def _write_rows(ts, t0: RealScalarLike, t1: RealScalarLike, accepted, at, buf):
    """Write `at(ts[i])` into row `i` for every `t0 < ts[i] <= t1`."""
    last = ts.shape[0] - 1
    lo, hi = _rows(ts, t0, t1, accepted)

    def body(state, active):
        i, buf = state
        index = jnp.minimum(i, last)
        value = at(_get(ts, index))
        buf = jtu.tree_map(lambda b, v: _put(b, index, active, v), buf, value)
        return i + active.astype(jnp.int32), buf

    _, buf = while_loop(lambda s: s[0] < hi, body, (lo, buf))
    return buf


def pull_back_ts(
    problem_of: Callable[[PyTree], Problem],
    p_diff: PyTree,
    out: StepOut,
    ct_saves: tuple[SaveBuffer, ...],
) -> tuple[PyTree, PyTree]:
    """Pull the cotangents of the rows at `SaveAt(ts=...)` that the step `out` writes
    back to the problem and the step, one row at a time.

    The loop runs as many times as the step has rows (under `vmap`, the most of any
    batch element: mostly 0 or 1), where differentiating `write(..., "masked")`
    would interpolate at every one of the `len(ts)` times in every step (Lotka-
    Volterra, 10 times, N=256: 7x the backward pass of `SaveAt(t1=True)`).

    **Arguments:**

    - `problem_of`: the `Problem` from its differentiated arrays.
    - `p_diff`: those arrays.
    - `out`: the step.
    - `ct_saves`: the cotangents of each save's buffers (their floating leaves, the
        others `None`).

    **Returns:**

    `(ct_p, ct_out)`: the cotangents of `p_diff` and of the floating leaves of `out`.
    """
    out_diff, out_rest = eqx.partition(out, eqx.is_inexact_array)
    problem = problem_of(p_diff)
    ct_p = jtu.tree_map(jnp.zeros_like, p_diff)
    ct_out = jtu.tree_map(jnp.zeros_like, out_diff)
    for index, (save, ct_buf) in enumerate(zip(problem.saves, ct_saves)):
        if save.ts is None or not jtu.tree_leaves(ct_buf.ts_ys):
            continue
        ts, last = save.ts, save.ts.shape[0] - 1
        lo, hi = _rows(ts, out.t0, out.t1, out.accepted)

        def value(p, o, tau, index=index):
            problem = problem_of(p)
            v = _interpolated(
                problem, problem.saves[index], eqx.combine(o, out_rest), tau
            )
            return eqx.filter(v, eqx.is_inexact_array)

        def body(state, active, ts_ys=ct_buf.ts_ys):
            i, ct_p, ct_out, ct_ts = state
            row = jnp.minimum(i, last)
            ct_row = jtu.tree_map(lambda c: _get(c, row), ts_ys)
            _, vjp = jax.vjp(value, p_diff, out_diff, _get(ts, row))
            masked = lambda tree: jtu.tree_map(lambda c: where(active, c, 0), tree)  # noqa: E731
            dp, do, dtau = masked(vjp(ct_row))
            ct_ts = _add(ct_ts, row, dtau)
            state = (
                i + active.astype(jnp.int32),
                tree_add(ct_p, dp),
                tree_add(ct_out, do),
                ct_ts,
            )
            return state

        state = (lo, ct_p, ct_out, jnp.zeros_like(ts))
        _, ct_p, ct_out, ct_ts = while_loop(lambda s: s[0] < hi, body, state)
        if _ts_of(p_diff, index) is not None:
            ct_p = eqx.tree_at(
                lambda p: _ts_of(p, index), ct_p, _ts_of(ct_p, index) + ct_ts
            )
    return ct_p, ct_out


def _ts_of(p: PyTree, index: int):
    return p.saves[index].ts


def row_of(buf, row):
    """Row `row` of `buf`: `lax.dynamic_index_in_dim(buf, row, 0, False)` without its
    `jit`, which every transformation of a solve would handle as a call of its own
    (batched, linearised, lowered apart; LV checkpointed gradient: 12 of them)."""
    return lax.squeeze(lax.dynamic_slice_in_dim(buf, row, 1, 0), (0,))


def with_row(buf, row, value):
    """`buf` with row `row` set to `value`: `lax.dynamic_update_index_in_dim(buf,
    value, row, 0)` without its `jit` (see `row_of`)."""
    return lax.dynamic_update_slice_in_dim(buf, lax.expand_dims(value, (0,)), row, 0)


def set_row(buf, row, pred, value):
    """`buf` with row `row` set to `value` where `pred`, for a `row` that may differ
    between batch elements (a step's count of accepted steps).

    Under `vmap`, `row_of` and `with_row` become a gather and a scatter over (batch,
    row, column), which a TPU runs as a serial loop over the batch; on the backends
    of `ROW_SCATTER_BACKENDS` the row is read and written by indexing instead, a
    gather and a scatter over (batch, row) of whole rows, as diffrax writes its rows
    (chip, `SaveAt(steps=True)`, vmapped Lorenz, N = 4096: 1.10 s -> 0.084 s,
    diffrax 0.077 s; `python -m benchmarks.chip.row_forms`). Elsewhere the slices
    (the CPU ran the indexed form slower: N = 256, 1.5 against 1.1 ms). Both clamp
    `row` into the buffer."""
    if _backend.platform() not in ROW_SCATTER_BACKENDS:
        return with_row(buf, row, where(pred, value, row_of(buf, row)))
    row = jnp.clip(row, 0, buf.shape[0] - 1)
    kw = dict(mode="promise_in_bounds", indices_are_sorted=True, unique_indices=True)
    old = buf.at[row].get(**kw)
    return buf.at[row].set(where(pred, value, old), **kw)


def finish_save(
    problem: Problem, save: Save, buf: SaveBuffer, carry: Carry, t_end, y_end
):
    """The rows of one `Save` (see its docstring), or `(None, None)`."""
    if save.empty:
        return None, None
    if save.ts is None and not save.every:
        ts, ys = _final_only(problem, save, t_end, y_end)
    else:
        ts, ys = _rows_and_final(problem, save, buf, carry, t_end, y_end)
    if save.t0:
        value = _save_value(problem, save, problem.t0, problem.y0)
        ts = jnp.concatenate([problem.t0[None], ts])
        ys = jtu.tree_map(lambda v, b: jnp.concatenate([v[None], b]), value, ys)
    return ts, ys


def _final_only(problem: Problem, save: Save, t_end, y_end):
    """The rows of a `Save` with neither `ts` nor step saves: the final point if
    `t1`, else none. What `_rows_and_final` computes for it (a row of `inf` set to
    the final point, where it always is), without the row operations that every
    transformation of the solve would trace (~4% of a checkpointed gradient's
    trace)."""
    t_dtype = problem.t0.dtype
    struct = save.fn.out_struct
    if not save.t1:
        return jnp.zeros((0,), t_dtype), _inf_like(struct, (0,))
    value = _save_value(problem, save, t_end, y_end)
    ts = jnp.reshape(jnp.asarray(t_end, t_dtype), (1,))
    ys = jtu.tree_map(
        lambda v, s: jnp.reshape(jnp.asarray(v, s.dtype), (1, *s.shape)), value, struct
    )
    return ts, ys


def _start_state(problem: Problem):
    """`tau -> y0` for the rows saved at `t0` (`ts[i] == t0`), moving with `tau` as
    the solution does: value `y0`, derivative `f(t0, y0)` with respect to `tau` (the
    one-sided derivative of a save time moved into the solve; diffrax's, whose first
    step interpolates it). For `y' = f` (a `MultiTerm`: its parts' sum); a solver
    stepping the user's own terms or a mass matrix keep `y0` (derivative 0)."""
    y0, t0, terms = problem.y0, problem.t0, problem.terms
    parts = terms.terms if isinstance(terms, MultiTerm) else (terms,)
    plain = all(isinstance(p, ClosureTerm) for p in parts)
    if (
        not plain
        or problem.solver.steps_user_terms
        or getattr(problem.solver, "mass_matrix", None) is not None
    ):
        return lambda tau: y0
    rate = total_vf(terms, t0, y0, problem.args)
    return lambda tau: moving_with(y0, tau, rate)


def _rows_and_final(
    problem: Problem, save: Save, buf: SaveBuffer, carry: Carry, t_end, y_end
):
    """The rows at `ts` and at steps, in time order, then the final point."""
    t_dtype = problem.t0.dtype
    struct = save.fn.out_struct
    times = [jnp.zeros((0,), t_dtype)]
    values = [_inf_like(struct, (0,))]
    if save.ts is not None:
        ts = save.ts
        at_start = ts <= problem.t0
        moved = _start_state(problem)
        start = jax.vmap(lambda tau: _save_value(problem, save, tau, moved(tau)))(ts)
        # Rows past the end: not reached, or past a located event.
        written = ts <= t_end
        times.append(where(written | at_start, ts, jnp.inf))
        values.append(
            jtu.tree_map(
                lambda s, b: _mask_rows(at_start, s, _mask_rows(written, b, jnp.inf)),
                start,
                buf.ts_ys,
            )
        )
    if save.every:
        valid = buf.steps_ts <= t_end
        times.append(where(valid, buf.steps_ts, jnp.inf))
        values.append(
            jtu.tree_map(lambda b: _mask_rows(valid, b, jnp.inf), buf.steps_ys)
        )
    ts = jnp.concatenate(times)
    ys = jtu.tree_map(lambda *p: jnp.concatenate(p), *values)
    if save.ts is not None and save.every:  # interleave, in time order
        order = jnp.argsort(ts, stable=True)
        ts = ts[order]
        ys = jtu.tree_map(lambda v: v[order], ys)
    if save.t1 or save.every:
        ts, ys = _put_final_row(problem, save, carry, t_end, y_end, ts, ys)
    return ts, ys


def _put_final_row(problem: Problem, save: Save, carry: Carry, t_end, y_end, ts, ys):
    """The final point goes after the last row: for `t1`, unless the last step save
    is the final point already; and always where a located event removed that step
    save."""
    if save.every == 0:
        by_steps = jnp.asarray(False)
    elif save.every == 1:
        by_steps = carry.num_accepted > 0
    else:
        by_steps = (carry.num_accepted % save.every == 0) & (carry.num_accepted > 0)
    removed = by_steps & (carry.t > t_end)
    put = removed | (save.t1 & ~by_steps)
    if save.t1_row(problem.max_steps):
        ts = jnp.concatenate([ts, jnp.full((1,), jnp.inf, ts.dtype)])
        ys = jtu.tree_map(
            lambda v: jnp.concatenate(
                [v, _inf_like(jax.ShapeDtypeStruct(v.shape[1:], v.dtype), (1,))]
            ),
            ys,
        )
    if ts.shape[0]:
        index = jnp.minimum(jnp.sum(jnp.isfinite(ts)), ts.shape[0] - 1)
        value = _save_value(problem, save, t_end, y_end)
        ts = set_row(ts, index, put, t_end)
        ys = jtu.tree_map(lambda b, v: set_row(b, index, put, v), ys, value)
    return ts, ys


def _mask_rows(rows, v, other):
    """Rows of `v` where `rows`, else `other` (an array or a scalar such as inf)."""
    if np.ndim(other) == 0:
        fill = other if jnp.issubdtype(v.dtype, jnp.inexact) else 0
        other = jnp.full(v.shape, fill, v.dtype)
    return where(rows.reshape((-1,) + (1,) * (v.ndim - 1)), v, other)


def flag_save_times(problem, result):
    """`result` (the solve's codes), `RESULTS.invalid_save_times` where traced save
    times are out of order or outside `[t0, t1]` (known ones are checked before the
    solve, `_save_times`; the loop and the kernel assume them in order)."""
    traced = [
        s.ts for s in problem.saves if s.ts is not None and concrete(s.ts) is None
    ]
    bad = jnp.zeros((), bool)
    for ts in traced:  # internal time: increasing from t0 to t1
        if ts.shape[0]:
            outside = (jnp.min(ts) < problem.t0) | (jnp.max(ts) > problem.t1)
            bad = bad | outside | jnp.any(ts[1:] < ts[:-1])
    if not traced:
        return result
    return where(bad, RESULTS.invalid_save_times.code, result)
