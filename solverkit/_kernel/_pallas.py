"""The whole-solve kernel: one `pallas_call` whose grid runs over blocks of
trajectories, each program solving its block to the end.

Layout: trajectories along the lane axis. A block is `rows x 128` trajectories; every
per-trajectory quantity is a `(rows, 128)` tile (a state of `n` components is `n`
tiles, kept in a `(n, rows, 128)` block). Shared values (times, save times, the
values the vector field closes over) are scalars in SMEM. Each lane has its own `t`,
step, controller history, counters and result; a finished lane idles, masked; the
block ends when all its lanes have.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._solution import EVENT as _EVENT, RESULTS, SUCCESS as _SUCCESS
from .._solver._rosenbrock_tableau import RosenbrockTableau
from .._solver._tableau import ButcherTableau
from . import _budget, _event, _rosenbrock, _step, _tangent, _tile
from ._step import Pid
from ._tile import where


LANES = 128
_MAX_STEPS = int(RESULTS.max_steps_reached.code)
_NONFINITE = int(RESULTS.nonfinite.code)
_DT_MIN = int(RESULTS.dt_min_reached.code)
# A proposed step end this close to `t1` (in units of its spacing) lands on it: the
# vmap path's rule (`_loop._LANDING_ULPS`).
LANDING_ULPS = 100


class Spec(NamedTuple):
    """What the kernel is compiled for (static)."""

    tableau: ButcherTableau | RosenbrockTableau  # explicit FSAL RK or Rosenbrock
    pid: Pid | None  # None: `ConstantStepSize` (every step accepted, no estimate)
    n: int  # state components per trajectory
    field: Callable  # (t, y tiles, arg tiles, const elements) -> dy/dt tiles
    num_args: tuple[int, ...]  # components of each per-trajectory argument
    const_shapes: tuple[tuple[int, ...], ...]  # each shared constant's shape
    num_ts: int  # save times (0: none)
    has_dt0: bool
    max_steps: int
    rows: int  # block rows (trajectories per block: rows * 128)
    # A terminal event: its condition `(t, y tiles, arg tiles, const elements) ->
    # [value tile]` (None: no event), whether it is real-valued, its direction,
    # and how many of the shared constants are the field's (the rest: its own).
    cond: Callable | None = None
    cond_real: bool = True
    cond_direction: bool | None = None
    field_consts: int = 0
    # Forward sensitivities (`_tangent`): the directions, and the state's own
    # components among the `n` (the rest: one tangent of them per direction).
    directions: tuple = ()
    primal: int = 0

    @property
    def rosenbrock(self) -> bool:
        return isinstance(self.tableau, RosenbrockTableau)

    @property
    def own(self) -> int:
        """The state's own components (the controller reads only these)."""
        return self.primal or self.n


class _State(NamedTuple):
    t: jax.Array
    tnext: jax.Array
    y: list
    f: list  # the field at (t, y): the next step's first stage (RK; none: Rosenbrock)
    prev: jax.Array
    prev_prev: jax.Array
    at_dtmin: jax.Array  # 0 or 1, as a float
    steps: jax.Array
    accepted: jax.Array
    rejected: jax.Array
    result: jax.Array  # the result code, as a float (see `_code`)
    kbase: jax.Array  # save times before this one are behind every lane
    iterations: jax.Array
    g: Any = None  # the event condition at (t, y)
    last: Any = None  # the last accepted step's (t0, y0, f0), to locate a crossing


def _read_const(ref, shape):
    """A shared constant (flattened in SMEM) as an object array of scalars."""
    out = np.empty(shape, dtype=object)
    for flat, index in enumerate(np.ndindex(shape)):
        out[index] = ref[flat]
    return out


def _code(code: int, like):
    """A result code as a floating value: codes are kept as floats in the kernel,
    as Mosaic can't select between int32 vectors and constants."""
    return jnp.asarray(code, like.dtype)


def _going(spec: Spec, s: _State, t1):
    """Whether a lane steps on. With fixed steps and no event a failure (a
    non-finite state) does not stop it: it runs to `t1`, as the `vmap` path's loop
    does (`_loop.cond`)."""
    going = (s.t < t1) & (s.steps < spec.max_steps)
    if spec.pid is None and spec.cond is None:
        return going
    return going & (s.result == _SUCCESS)


def _advance(spec: Spec, field, t0, h, y: list, f: list, estimate: bool):
    """One step of the method: `(y1, error or None, dense info, f1)`, `f1` the
    field at the end for an FSAL RK method (for Rosenbrock, none: `f`, empty)."""
    tab = spec.tableau
    if isinstance(tab, RosenbrockTableau):
        y1, error, us = _rosenbrock.step(tab, field, t0, h, y)
        return y1, error if estimate else None, us, f
    y1, error, ks = _step.rk_step(tab, field, t0, h, y, f, estimate)
    return y1, error, ks, ks[-1]


def _interpolate(spec: Spec, y0: list, info: list, h, theta) -> list:
    """The step's dense output at the fraction `theta` (`info` from `_advance`)."""
    tab = spec.tableau
    if isinstance(tab, RosenbrockTableau):
        return _rosenbrock.dense(tab, y0, info, theta)
    return _step.dense(tab, y0, info, h, theta)


def _init(spec: Spec, field, primal, cond, t0, t1, dt0, y0):
    # The field at t0: the first stage of an RK method, and the first step's
    # heuristic; a Rosenbrock step evaluates it with its Jacobian.
    f0 = None if spec.rosenbrock and spec.has_dt0 else field(t0, y0)
    if spec.has_dt0:
        dt = _tile.anchor(jnp.broadcast_to(dt0, y0[0].shape).astype(t0.dtype))
    else:
        assert spec.pid is not None  # (`ConstantStepSize.check` asks for `dt0`)
        p = spec.own
        assert f0 is not None
        dt = _step.initial_step(spec.pid, primal, t0, y0[:p], f0[:p])
    if spec.pid is None:  # `ConstantStepSize.init`: the first step is `dt0`
        tnext = jnp.minimum(t0 + dt, t1)
    else:
        dt = _step.clip_dt0(spec.pid, dt)
        tnext = jnp.minimum(jnp.maximum(t0 + dt, _step.next_float(t0)), t1)
    # Carried tiles start as real tiles (not splats): see `_tile`.
    zero = _tile.anchor(jnp.zeros(y0[0].shape, jnp.int32))
    one = _tile.anchor(jnp.ones(y0[0].shape, t0.dtype))
    result = _tile.anchor(jnp.full(y0[0].shape, _SUCCESS, t0.dtype))
    g = last = None
    f0 = [] if spec.rosenbrock else f0
    if cond is not None:
        # A boolean condition already true at t0 ends the solve there; a real one
        # needs a sign change first.
        g = cond(t0, y0)[0]
        if not spec.cond_real:
            result = where(g != 0, _code(_EVENT, result), result)
        last = (t0, y0, f0)
    assert f0 is not None
    return _State(
        t0, tnext, y0, f0, one, one, one * 0, zero, zero,
        zero, result, jnp.int32(0), jnp.int32(0), g, last,
    )  # fmt: skip


def _save(spec: Spec, ts_ref, out_ref, s: _State, t_end, going, keep, y0, info, h):
    """Write the dense output at every save time that a kept step crossed, into the
    rows of `out_ref`: rows `kbase ...` while a lane's step reached them. Returns the
    new `kbase`: rows at or before every going lane's `t` are never written again."""
    big = jnp.asarray(jnp.inf, s.t.dtype)
    lo = jnp.min(where(going, s.t, big))
    hi = jnp.max(where(keep, t_end, -big))
    last = spec.num_ts

    def skip(k):
        return lax.while_loop(
            lambda k: (k < last) & (ts_ref[jnp.minimum(k, last - 1)] <= lo),
            lambda k: k + 1,
            k,
        )

    def write(k):
        tk = ts_ref[k]
        hit = keep & (tk > s.t) & (tk <= t_end)
        theta = (tk - s.t) / where(h == 0, 1, h)
        values = _interpolate(spec, y0, info, h, theta)
        for j, v in enumerate(values):
            out_ref[k, j] = where(hit, v, out_ref[k, j])
        return k + 1

    kbase = skip(s.kbase)
    lax.while_loop(
        lambda k: (k < last) & (ts_ref[jnp.minimum(k, last - 1)] <= hi), write, kbase
    )
    return kbase


def _after_event(spec: Spec, cond, s: _State, t_end, y1, keep, result):
    """The condition after a step, whether it fired, and the last accepted step."""
    g1 = cond(t_end, y1)[0]
    fired = _event.fired(spec.cond_real, spec.cond_direction, s.g, g1) & keep
    result = where(fired & (result == _SUCCESS), _code(_EVENT, result), result)
    g = where(keep, g1, s.g)
    last = [s.t, s.y, s.f]
    last = [
        where(keep, new, old)
        if not isinstance(new, list)
        else [where(keep, a, b) for a, b in zip(new, old)]
        for new, old in zip(last, s.last)
    ]
    return result, g, tuple(last)


def _landing(t0, h, t1, land, d: _step.Decision):
    """The next step's end (`_loop._landing`): at or past `land` it is `t1` after an
    accepted step, and half of the rejected step `[t0, t0 + h]` after a rejected one
    (else a retry shrunk by less than the window is that step again, to
    `max_steps`)."""
    retry = t0 + 0.5 * h
    return where(d.next_t1 >= land, where(d.keep, t1, retry), d.next_t1)


class _Control(NamedTuple):
    """The controller's verdict on a step: accepted (`None`: always), the next
    step's end, the PID history and `dt_min_reached` (`None`: fixed steps)."""

    keep: Any
    next_t1: jax.Array
    history: Any
    too_small: Any


def _control(spec: Spec, s: _State, t_end, h, y1, error, t1, land, fixed) -> _Control:
    if spec.pid is None:  # `ConstantStepSize`, then `_loop._landing` (accepted)
        nxt = _step.fixed_next(s.steps, t_end, fixed)
        return _Control(None, where(nxt >= land, t1, nxt), None, None)
    p = spec.own  # the controller reads the state, not its tangents
    history = (s.prev, s.prev_prev, s.at_dtmin)
    d = _step.adapt(spec.pid, s.t, t_end, s.y[:p], y1[:p], error[:p], history)
    next_t1 = _landing(s.t, h, t1, land, d)
    return _Control(d.keep, next_t1, (d.prev, d.prev_prev, d.at_dtmin), d.too_small)


def _body(
    spec: Spec, field, cond, t1, land, fixed, ts_ref, out_ref, s: _State
) -> _State:
    going = _going(spec, s, t1)
    t_end = jnp.minimum(s.tnext, t1)
    h = t_end - s.t
    estimate = spec.pid is not None
    y1, error, info, f1 = _advance(spec, field, s.t, h, s.y, s.f, estimate)
    c = _control(spec, s, t_end, h, y1, error, t1, land, fixed)
    p = spec.own  # the check reads the state, not its tangents
    finite = functools.reduce(lambda a, b: a & b, [_step.finite(v) for v in y1[:p]])
    keep = going if c.keep is None else going & c.keep
    ok = _code(_SUCCESS, s.result)
    result = ok if c.too_small is None else where(c.too_small, _code(_DT_MIN, ok), ok)
    bad = ~finite if c.keep is None else c.keep & ~finite
    result = where(bad, _code(_NONFINITE, ok), result)
    result = where(going & (s.result == _SUCCESS), result, s.result)
    g, last = s.g, s.last
    if cond is not None:
        ok = keep & finite
        result, g, last = _after_event(spec, cond, s, t_end, y1, ok, result)
    kbase = s.kbase
    if spec.num_ts:
        kbase = _save(spec, ts_ref, out_ref, s, t_end, going, keep, s.y, info, h)
    pick = lambda new, old: where(going, new, old)  # noqa: E731
    history = (s.prev, s.prev_prev, s.at_dtmin)
    if c.history is not None:
        history = tuple(pick(new, old) for new, old in zip(c.history, history))
    rejected = s.rejected
    if c.keep is not None:
        rejected = rejected + (going & ~c.keep).astype(jnp.int32)
    return _State(
        t=where(keep, t_end, s.t),
        tnext=pick(c.next_t1, s.tnext),
        y=[where(keep, a, b) for a, b in zip(y1, s.y)],
        f=[where(keep, a, b) for a, b in zip(f1, s.f)],
        prev=history[0],
        prev_prev=history[1],
        at_dtmin=history[2],
        steps=s.steps + going.astype(jnp.int32),
        accepted=s.accepted + keep.astype(jnp.int32),
        rejected=rejected,
        result=result,
        kbase=kbase,
        iterations=s.iterations + 1,
        g=g,
        last=last,
    )


class _Bound(NamedTuple):
    """The field with a block's arguments and shared values bound: `(t, y) -> f`;
    `jvp(t, y, dt, dy) -> (f, df)` and `autonomous` for a Rosenbrock step."""

    lane: Any  # a `_field.LaneField`
    args: list
    consts: list

    def __call__(self, t, y: list) -> list:
        return self.lane(t, y, self.args, self.consts)

    def jvp(self, t, y: list, dt, dy: list) -> tuple[list, list]:
        return self.lane.jvp(t, y, self.args, self.consts, dt, dy)

    @property
    def autonomous(self) -> bool:
        return self.lane.autonomous


def _kernel(spec: Spec, *refs):
    zero_ref, *refs = refs
    with _tile.anchored(zero_ref[...]):
        _kernel_body(spec, *refs)


def _kernel_body(spec: Spec, *refs):
    times_ref, ts_ref, y0_ref, *rest = refs
    nargs, nconsts = len(spec.num_args), len(spec.const_shapes)
    arg_refs, const_refs = rest[:nargs], rest[nargs : nargs + nconsts]
    y_ref, ys_ref, t_ref, count_ref = rest[nargs + nconsts :]
    t0, t1, dt0, land = times_ref[0], times_ref[1], times_ref[2], times_ref[3]
    fixed = None
    if spec.pid is None:
        n, n_or_1, span = times_ref[4], times_ref[5], times_ref[6]
        fixed = _step.FixedTimes(t0, t1, span, n, n_or_1, dt0)
    args = [[r[i] for i in range(m)] for r, m in zip(arg_refs, spec.num_args)]
    consts = [_read_const(r, shape) for r, shape in zip(const_refs, spec.const_shapes)]
    own = spec.field_consts if spec.cond is not None else len(consts)
    field = primal = _Bound(spec.field, args, consts[:own])
    if spec.directions:
        assert spec.cond is None, "no event with forward sensitivities"
        field = _tangent.augment(
            spec.field, spec.own, spec.directions, args, consts[:own]
        )
    cond = None
    if (cond_fn := spec.cond) is not None:
        cond = lambda t, y: cond_fn(t, y, args, consts[own:])  # noqa: E731
    y0 = [y0_ref[j] for j in range(spec.n)]
    t_tile = _tile.anchor(jnp.full(y0[0].shape, t0, t0.dtype))

    def first_rows(k, carry):  # rows at or before t0 show y0; the rest inf
        for j in range(spec.n):
            row = where(t_tile >= ts_ref[k], y0[j], jnp.inf)
            ys_ref[k, j] = row.astype(y0[j].dtype)
        return carry

    lax.fori_loop(0, spec.num_ts, first_rows, 0)
    state = _init(spec, field, primal, cond, t_tile, t1, dt0, y0)
    state = lax.while_loop(
        lambda s: jnp.any(_going(spec, s, t1)),
        lambda s: _body(spec, field, cond, t1, land, fixed, ts_ref, ys_ref, s),
        state,
    )
    t_end, y_end = state.t, state.y
    if cond is not None and spec.cond_real:
        event = state.result == _EVENT

        def advance(t0, h, y0, f0):
            return _advance(spec, field, t0, h, y0, f0, False)[2]

        interpolate = functools.partial(_interpolate, spec)
        t_end, y_end = _event.locate(
            advance, interpolate, cond, state.last, state.t, state.y, event
        )
    for j in range(spec.n):
        y_ref[j] = y_end[j]
    t_ref[...] = t_end
    unfinished = (state.result == _SUCCESS) & (state.t < t1)
    result = where(unfinished, _code(_MAX_STEPS, state.result), state.result)
    counts = (state.steps, state.accepted, state.rejected, result.astype(jnp.int32))
    for i, c in enumerate(counts):
        count_ref[i] = c
    count_ref[4] = state.steps * 0 + state.iterations


def solve_blocks(spec: Spec, times, ts, y0, args, consts, interpret: bool):
    """Run the kernel.

    **Arguments:**

    - `spec`: the static description (`Spec`).
    - `times`: `(7,)` array (time dtype) of `t0, t1, dt0`, the landing time (a step
        ending at or past it ends at `t1`), and for `ConstantStepSize` the steps
        `n` in `[t0, t1]` (`-1` if infinite), `max(n, 1)` and `t1 - t0`
        (`_step.FixedTimes`; zeros otherwise).
    - `ts`: `(T,)` save times (`(1,)` of anything if none).
    - `y0`: `(n, R, 128)` initial states; `args`: per-trajectory arguments, each
        `(m, R, 128)`; `consts`: shared values, each flattened to 1-D.
    - `interpret`: run in Pallas' interpreter (CPU, tests).

    **Returns:**

    `(y_end (n, R, 128), ys (T, n, R, 128), t_end (R, 128), counts (5, R, 128))`, the
    counts being steps, accepted, rejected, result code, block iterations.
    """
    n, rows_total, _ = y0.shape
    r = spec.rows
    grid = (rows_total // r,)
    smem = pltpu.SMEM
    tiled = lambda lead: pl.BlockSpec(  # noqa: E731
        (*lead, r, LANES), lambda i: (*(0,) * len(lead), i, 0)
    )
    whole = pl.BlockSpec(memory_space=smem)
    in_specs = [tiled(()), whole, whole, tiled((n,))]
    in_specs += [tiled((a.shape[0],)) for a in args] + [whole] * len(consts)
    num_ts = max(spec.num_ts, 1)
    tdtype = times.dtype
    out_shape = (
        jax.ShapeDtypeStruct(y0.shape, y0.dtype),
        jax.ShapeDtypeStruct((num_ts, n, rows_total, LANES), y0.dtype),
        jax.ShapeDtypeStruct((rows_total, LANES), tdtype),
        jax.ShapeDtypeStruct((5, rows_total, LANES), jnp.int32),
    )
    out_specs = (tiled((n,)), tiled((num_ts, n)), tiled(()), tiled((5,)))
    call = pl.pallas_call(
        functools.partial(_kernel, spec),
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=None
        if interpret
        else pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=_budget.vmem_limit()
        ),
    )
    # The zero tile that every select in the kernel is anchored to (`_tile`).
    zero = jnp.full((rows_total, LANES), -0.0, tdtype)
    return call(zero, times, ts, y0, *args, *consts)
