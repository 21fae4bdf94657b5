"""What a solve saves: the save buffers, written row by row as steps are accepted
(`write`), and the rows of each `SubSaveAt` assembled after the loop (`finish_save`),
laid out as diffrax lays them out."""

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._closure._unvmap import while_loop
from ._custom_types import RealScalarLike, Y
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
from ._time import flip


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
    differentiable: bool = False,
) -> Buffers:
    """Write what an accepted step saves into the buffers; each row is written once.

    Save times inside the step are written one row at a time by a short loop; with
    `differentiable=True` (for reverse-mode autodiff of one step) every row is
    computed and masked instead, which costs `len(ts)` interpolations.
    """
    saves = tuple(
        _write_save(problem, save, carry, out, buf, differentiable)
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
        assert carry.hybrid is not None  # (an event that continues)
        row = jnp.minimum(carry.hybrid.count - 1, problem.event.max_events - 1)
        write = out.landed & (carry.hybrid.count <= problem.event.max_events)
        event_ts = set_row(event_ts, row, write, out.t1)
        event_ys = jtu.tree_map(
            lambda b, v: set_row(b, row, write, v), event_ys, out.y1
        )
    return Buffers(saves, dense_ts, dense_info, event_ts, event_ys, dense_ends)


def _write_save(
    problem: Problem,
    save: Save,
    carry: Carry,
    out: StepOut,
    buf: SaveBuffer,
    differentiable: bool,
) -> SaveBuffer:
    accepted, t0, t1 = out.accepted, out.t0, out.t1
    ts_ys, steps_ts, steps_ys = buf
    if save.ts is not None:
        ts = save.ts

        def at(tau: RealScalarLike):
            y = problem.solver.interpolate(out.dense_info, t0, out.info_end, tau)
            return _save_value(problem, save, tau, y)

        if differentiable:
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


def _write_rows(ts, t0: RealScalarLike, t1: RealScalarLike, accepted, at, buf):
    """Write `at(ts[i])` into row `i` for every `t0 < ts[i] <= t1`."""
    last = ts.shape[0] - 1
    lo = jnp.searchsorted(ts, t0, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ts, t1, side="right").astype(jnp.int32)
    hi = where(accepted, hi, lo)

    def body(state, active):
        i, buf = state
        value = at(ts[jnp.minimum(i, last)])
        index = jnp.minimum(i, last)
        buf = jtu.tree_map(lambda b, v: set_row(b, index, active, v), buf, value)
        return i + active.astype(jnp.int32), buf

    _, buf = while_loop(lambda s: s[0] < hi, body, (lo, buf))
    return buf


def set_row(buf, row, pred, value):
    old = lax.dynamic_index_in_dim(buf, row, keepdims=False)
    return lax.dynamic_update_index_in_dim(buf, where(pred, value, old), row, 0)


def finish_save(
    problem: Problem, save: Save, buf: SaveBuffer, carry: Carry, t_end, y_end
):
    """The rows of one `Save` (see its docstring), or `(None, None)`."""
    if save.empty:
        return None, None
    t_dtype = problem.t0.dtype
    struct = save.fn.out_struct
    times = [jnp.zeros((0,), t_dtype)]
    values = [_inf_like(struct, (0,))]
    if save.ts is not None:
        ts = save.ts
        at_start = ts <= problem.t0
        start = jax.vmap(lambda tau: _save_value(problem, save, tau, problem.y0))(ts)
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
    if save.t0:
        value = _save_value(problem, save, problem.t0, problem.y0)
        ts = jnp.concatenate([problem.t0[None], ts])
        ys = jtu.tree_map(lambda v, b: jnp.concatenate([v[None], b]), value, ys)
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
