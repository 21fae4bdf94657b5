"""The step loop: step, accept or reject, save, detect events.

Knows nothing of adjoints: an adjoint supplies the function that runs
`body(params, carry)` while `cond(params, carry)` holds (see `_adjoint.py`). Every user
value reaches the loop through `Problem`, an explicit operand.
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from ._closure import Closure
from ._controller import (
    AbstractStepSizeController,
    ClipStepSizeController,
    ConstantStepSize,
    StepTo,
)
from ._progress import AbstractProgressMeter
from ._reduce import all_true, and_all, or_all
from ._select import where
from ._solution import RESULTS
from ._solver import AbstractSolver
from ._unvmap import unvmap_max, while_loop


_SUCCESS = int(RESULTS.successful.code)
_EVENT = int(RESULTS.event_occurred.code)
_MAX_STEPS = int(RESULTS.max_steps_reached.code)
_NONFINITE = int(RESULTS.nonfinite.code)


class VectorField(eqx.Module):
    """The converted vector field, run in internal time `tau = direction * t`, which
    always increases."""

    closure: Closure
    direction: Array | None  # None: forwards in time
    # Runge-Kutta stages in a loop (the field traced once): for large fields.
    loop_stages: bool = eqx.field(static=True, default=False)

    def to_user(self, tau):
        return tau if self.direction is None else self.direction * tau

    def vf(self, tau, y, args):
        out = self.closure(self.to_user(tau), y, args)
        if self.direction is None:
            return out
        return jtu.tree_map(lambda o: o * self.direction.astype(o.dtype), out)


class Problem(eqx.Module):
    """Everything a solve needs, as one pytree (arrays are its leaves)."""

    solver: AbstractSolver
    controller: AbstractStepSizeController
    term: VectorField
    args: PyTree
    y0: PyTree
    t0: Array  # internal time
    t1: Array  # internal time
    dt0: Array | None  # internal time (positive)
    saves: tuple["Save", ...]  # one per SubSaveAt
    save_tree: Any = eqx.field(static=True)  # the SubSaveAt pytree's structure
    dense: bool = eqx.field(static=True)
    conds: PyTree | None  # pytree of Closures (t, y, args) -> value, or None
    event_direction: tuple | None = eqx.field(static=True)  # one per condition
    root_finder: Any
    max_steps: int | None = eqx.field(static=True)
    meter: AbstractProgressMeter

    @property
    def error_order(self):
        return self.solver.error_order(self.term)

    @property
    def every(self) -> bool:
        """Whether any output is saved at steps."""
        return any(save.every for save in self.saves)


class Save(eqx.Module):
    """One `SubSaveAt`, in internal time, with its `fn` converted.

    Its rows are laid out as diffrax lays them out: `t0`, then the `ts` and step
    saves in time order, then `t1` (unless the last step save is the final point),
    then `inf` padding.
    """

    ts: Array | None  # internal times
    fn: Closure
    t0: bool = eqx.field(static=True)
    t1: bool = eqx.field(static=True)
    every: int = eqx.field(static=True)

    def step_rows(self, max_steps: int) -> int:
        return max_steps // self.every if self.every else 0

    def t1_row(self, max_steps: int) -> bool:
        """Whether `t1` needs a row of its own (else it may take a free step row)."""
        return self.t1 and (self.every == 0 or max_steps % self.every != 0)

    @property
    def empty(self) -> bool:
        return not (self.t0 or self.t1 or self.every) and self.ts is None


class Carry(NamedTuple):
    t: Array
    tnext: Array
    y: PyTree
    solver_state: PyTree
    controller_state: PyTree
    num_steps: Array
    num_accepted: Array
    num_rejected: Array
    result: Array
    cond_values: PyTree  # event conditions at (t, y), or None
    event_mask: PyTree  # which conditions fired, or None
    last: Any  # (start time, dense info) of the last accepted step, or None


def _where(pred, a, b):
    return jtu.tree_map(lambda x, y: where(pred, x, y), a, b)


def _all_finite(tree) -> Array:
    return and_all([all_true(jnp.isfinite(x)) for x in jtu.tree_leaves(tree)])


def _real_conds(problem: Problem) -> list[bool]:
    """For each event condition leaf: is it real-valued (True) or boolean (False)?"""
    return [
        not jnp.issubdtype(c.out_struct.dtype, jnp.bool_)
        for c in jtu.tree_leaves(
            problem.conds, is_leaf=lambda x: isinstance(x, Closure)
        )
    ]


def _eval_conds(problem: Problem, tau, y):
    t = problem.term.to_user(tau)
    return jtu.tree_map(
        lambda c: c(t, y, problem.args),
        problem.conds,
        is_leaf=lambda x: isinstance(x, Closure),
    )


def _fired(problem: Problem, before, after) -> PyTree:
    """Which conditions fired over a step: a boolean one when it is true, a real one
    when its sign changes (in its direction), as diffrax decides."""

    def leaf(b, a, direction):
        if jnp.issubdtype(a.dtype, jnp.bool_):
            return a
        sb, sa = jnp.sign(b), jnp.sign(a)
        if direction is None:
            return sb != sa
        if direction:
            return (sb <= 0) & (sa > 0)
        return (sb > 0) & (sa <= 0)

    leaves, tree = jtu.tree_flatten(after)
    fired = [
        leaf(b, a, d)
        for b, a, d in zip(jtu.tree_leaves(before), leaves, problem.event_direction)
    ]
    return jtu.tree_unflatten(tree, fired)


def _save_value(problem: Problem, save: Save, tau, y):
    return save.fn(problem.term.to_user(tau), y, problem.args)


def _inf_like(struct, lead: tuple[int, ...]):
    def leaf(s):
        shape = lead + tuple(s.shape)
        if jnp.issubdtype(s.dtype, jnp.inexact):
            return jnp.full(shape, jnp.inf, s.dtype)
        return jnp.zeros(shape, s.dtype)

    return jtu.tree_map(leaf, struct)


def batch_like(sources, tree):
    """`tree`, unchanged in value, but batched under `vmap` wherever `sources` is.

    With adaptive steps every part of a loop's carry depends on the state, so the loop
    body batches all of it. Batching it from the start lets `vmap` of the loop settle
    which parts are batched in one pass over the body instead of several, which
    shortens tracing (most of all for the nested loops of the backward passes).
    """
    leaves = [
        x
        for x in jtu.tree_leaves(eqx.filter(sources, eqx.is_array))
        if x.size and (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_)
    ]
    if not leaves:
        return tree
    # Any predicate computed from every source will do: both branches are equal.
    marker = and_all([jnp.reshape(x, (-1,))[0] == 0 for x in leaves])
    return jtu.tree_map(lambda x: where(marker, x, x), tree)


def adaptive(problem: Problem) -> bool:
    """Whether the step sequence depends on the state (see `batch_like`)."""
    return not isinstance(problem.controller, (ConstantStepSize, StepTo))


def init(problem: Problem) -> tuple[Carry, dict]:
    """The loop's initial carry and (empty, `inf`-filled) save buffers."""
    term, solver, controller = problem.term, problem.solver, problem.controller
    t0, y0, args = problem.t0, problem.y0, problem.args
    tnext, cstate = controller.init(
        term, t0, problem.t1, y0, problem.dt0, args, term.vf, problem.error_order
    )
    tnext = jnp.minimum(jnp.asarray(tnext, t0.dtype), problem.t1)
    fstate = solver.init(term, t0, problem.t1, y0, args)
    zero = jnp.asarray(0, jnp.int32)
    if problem.conds is None:
        cond_values = event_mask = None
        last = None
    else:
        cond_values = _eval_conds(problem, t0, y0)
        # A boolean condition already true at t0 ends the solve there, before any
        # step (as in diffrax); a real-valued one needs a sign change first.
        event_mask = [
            jnp.asarray(False) if real else jnp.asarray(value)
            for real, value in zip(_real_conds(problem), jtu.tree_leaves(cond_values))
        ]
        event_mask = jtu.tree_unflatten(jtu.tree_structure(cond_values), event_mask)
        last = None
        if any(_real_conds(problem)):
            _, _, info, _, _ = eqx.filter_eval_shape(
                solver.step, term, t0, problem.t1, y0, args, fstate
            )
            last = (t0, jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), info))
    carry = Carry(
        t=t0,
        tnext=tnext,
        y=y0,
        solver_state=fstate,
        controller_state=cstate,
        num_steps=zero,
        num_accepted=zero,
        num_rejected=zero,
        result=jnp.asarray(_SUCCESS, jnp.int32),
        cond_values=cond_values,
        event_mask=event_mask,
        last=last,
    )
    if event_mask is not None:
        at_t0 = or_all(jtu.tree_leaves(event_mask))
        carry = carry._replace(result=where(at_t0, _EVENT, _SUCCESS).astype(jnp.int32))
    if adaptive(problem):
        carry = batch_like(problem, carry)
    bufs: dict = {"saves": []}
    for save in problem.saves:
        out_struct = save.fn.out_struct
        buf = {}
        if save.ts is not None:
            buf["ts_ys"] = _inf_like(out_struct, (save.ts.shape[0],))
        if save.every:
            rows = save.step_rows(problem.max_steps)
            buf["steps_ts"] = jnp.full((rows,), jnp.inf, t0.dtype)
            buf["steps_ys"] = _inf_like(out_struct, (rows,))
        bufs["saves"].append(buf)
    if problem.dense:
        _, _, info, _, _ = eqx.filter_eval_shape(
            solver.step, term, t0, problem.t1, y0, args, fstate
        )
        bufs["dense_ts"] = jnp.full((problem.max_steps + 1,), jnp.inf, t0.dtype)
        bufs["dense_info"] = jtu.tree_map(
            lambda s: jnp.zeros((problem.max_steps,) + s.shape, s.dtype), info
        )
    return carry, bufs


def cond(problem: Problem, carry: Carry) -> Array:
    """Whether the loop goes on.

    With a fixed step sequence (`ConstantStepSize`, `StepTo`) and no events, a
    non-finite value does not stop the loop early: it is recorded in `result` and the
    solve runs on to `t1`. Then nothing the loop tests depends on the state, so under
    `vmap` the time and the step counters stay unbatched, which makes each step
    cheaper.
    """
    going = carry.t < problem.t1
    if problem.max_steps is not None:
        going = going & (carry.num_steps < problem.max_steps)
    if not adaptive(problem) and problem.conds is None:
        return going
    return going & (carry.result == _SUCCESS)


def _step_to(controller: StepTo, problem: Problem, t1, cstate):
    ts = controller.internal(problem.term, problem.t0.dtype)
    index = cstate
    nxt = ts[jnp.minimum(index, ts.shape[0] - 1)]
    return True, t1, nxt, index + 1


def step(problem: Problem, carry: Carry) -> tuple[Carry, dict]:
    """One attempted step. Returns the new carry and what this step saves."""
    term, solver, controller = problem.term, problem.solver, problem.controller
    args = problem.args
    t0 = carry.t
    t1 = jnp.minimum(carry.tnext, problem.t1)
    jumps = isinstance(controller, ClipStepSizeController) and controller.has_jumps
    t1_solve = t1
    if jumps:
        # A step that ends at a jump of the vector field stops just short of it (so
        # that no stage sees the far side); the next step starts at the jump with the
        # field evaluated anew (below).
        at_jump = controller.ends_on_jump(carry.controller_state, t1)
        fixed = lax.stop_gradient(t1)
        below = fixed - jnp.nextafter(fixed, jnp.asarray(-jnp.inf, t1.dtype))
        t1_solve = where(at_jump, t1 - below, t1)
    y1, y_error, info, fstate1, _ = solver.step(
        term, t0, t1_solve, carry.y, args, carry.solver_state
    )
    if jumps:
        # Evaluated just past the jump in the direction of travel: on its far side
        # however the field tests `t` (`t < s` or `t <= s`), forwards or backwards.
        above = jnp.nextafter(fixed, jnp.asarray(jnp.inf, t1.dtype)) - fixed
        restart = solver.init(term, t1 + above, problem.t1, y1, args)
        fstate1 = _where(at_jump, restart, fstate1)
    if isinstance(controller, StepTo):
        keep, next_t0, next_t1, cstate = _step_to(
            controller, problem, t1, carry.controller_state
        )
        cresult = jnp.asarray(_SUCCESS, jnp.int32)
    else:
        keep, next_t0, next_t1, _, cstate, cres = controller.adapt_step_size(
            t0,
            t1,
            carry.y,
            y1,
            args,
            y_error,
            problem.error_order,
            carry.controller_state,
        )
        cresult = jnp.asarray(cres.code, jnp.int32)
    keep = jnp.asarray(keep)
    # Land exactly on t1 rather than leave a sliver of a step behind.
    eps = jnp.finfo(t0.dtype).eps
    close = next_t1 >= problem.t1 - 100 * eps * jnp.maximum(1, jnp.abs(problem.t1))
    next_t1 = where(close, problem.t1, next_t1)
    finite = _all_finite(y1)
    result = where(keep & ~finite, _NONFINITE, cresult)
    result = where(carry.result == _SUCCESS, result, carry.result)
    y = _where(keep, y1, carry.y)
    fstate = _where(keep, fstate1, carry.solver_state)
    cond_values, event_mask, last = carry.cond_values, carry.event_mask, carry.last
    if problem.conds is not None:
        new_values = _eval_conds(problem, t1, y1)
        fired = _fired(problem, carry.cond_values, new_values)
        fired = jtu.tree_map(lambda f: f & keep & finite, fired)
        any_fired = or_all(jtu.tree_leaves(fired))
        result = where(any_fired & (result == _SUCCESS), _EVENT, result)
        cond_values = _where(keep, new_values, carry.cond_values)
        event_mask = fired
        if last is not None:
            last = _where(keep, (t0, info), last)
    num_accepted = carry.num_accepted + keep.astype(jnp.int32)
    new = Carry(
        t=where(keep, t1, t0),
        tnext=next_t1,
        y=y,
        solver_state=fstate,
        controller_state=cstate,
        num_steps=carry.num_steps + 1,
        num_accepted=num_accepted,
        num_rejected=carry.num_rejected + (~keep).astype(jnp.int32),
        result=result,
        cond_values=cond_values,
        event_mask=event_mask,
        last=last,
    )
    return new, dict(keep=keep, t0=t0, t1=t1, y1=y1, info=info)


def write(
    problem: Problem, carry: Carry, out: dict, bufs: dict, differentiable: bool = False
) -> dict:
    """Write what an accepted step saves into the buffers; each row is written once.

    Save times inside the step are written one row at a time by a short loop; with
    `differentiable=True` (for reverse-mode autodiff of one step) every row is
    computed and masked instead, which costs `len(ts)` interpolations.
    """
    keep, t1, info = out["keep"], out["t1"], out["info"]
    bufs = dict(bufs)
    bufs["saves"] = [
        _write_save(problem, save, carry, out, buf, differentiable)
        for save, buf in zip(problem.saves, bufs["saves"])
    ]
    if problem.dense:
        row = jnp.maximum(carry.num_accepted - 1, 0)
        bufs["dense_ts"] = _set_row(bufs["dense_ts"], row + 1, keep, t1)
        bufs["dense_info"] = jtu.tree_map(
            lambda b, v: _set_row(b, row, keep, v), bufs["dense_info"], info
        )
    return bufs


def _write_save(
    problem, save: Save, carry: Carry, out: dict, buf: dict, differentiable
):
    keep, t0, t1, info = out["keep"], out["t0"], out["t1"], out["info"]
    buf = dict(buf)
    if save.ts is not None:
        ts = save.ts

        def at(tau):
            y = problem.solver.interpolate(info, t0, t1, tau)
            return _save_value(problem, save, tau, y)

        if differentiable:
            rows = keep & (ts > t0) & (ts <= t1)
            values = jax.vmap(at)(ts)
            buf["ts_ys"] = jtu.tree_map(
                lambda v, b: _mask_rows(rows, v, b), values, buf["ts_ys"]
            )
        else:
            buf["ts_ys"] = _write_rows(ts, t0, t1, keep, at, buf["ts_ys"])
    if save.every:
        n = save.every
        k = carry.num_accepted  # after this step
        hit = keep & (k % n == 0)
        row = jnp.maximum(k // n - 1, 0)
        value = _save_value(problem, save, t1, out["y1"])
        buf["steps_ts"] = _set_row(buf["steps_ts"], row, hit, t1)
        buf["steps_ys"] = jtu.tree_map(
            lambda b, v: _set_row(b, row, hit, v), buf["steps_ys"], value
        )
    return buf


def _write_rows(ts, t0, t1, keep, at, buf):
    """Write `at(ts[i])` into row `i` for every `t0 < ts[i] <= t1`."""
    last = ts.shape[0] - 1
    lo = jnp.searchsorted(ts, t0, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ts, t1, side="right").astype(jnp.int32)
    hi = where(keep, hi, lo)

    def body(state, active):
        i, buf = state
        value = at(ts[jnp.minimum(i, last)])
        index = jnp.minimum(i, last)
        buf = jtu.tree_map(lambda b, v: _set_row(b, index, active, v), buf, value)
        return i + active.astype(jnp.int32), buf

    _, buf = while_loop(lambda s: s[0] < hi, body, (lo, buf))
    return buf


def _set_row(buf, row, pred, value):
    old = lax.dynamic_index_in_dim(buf, row, keepdims=False)
    return lax.dynamic_update_index_in_dim(buf, where(pred, value, old), row, 0)


def body(
    problem: Problem,
    state: tuple[Carry, dict],
    active=True,
    differentiable: bool = False,
):
    """One iteration of the loop: a step, then its saves. Where `active` is False
    (a finished batch element) nothing changes."""
    carry, bufs = state
    new, out = step(problem, carry)
    if active is not True:
        out["keep"] = out["keep"] & active
        new = _where(active, new, carry)
    return new, write(problem, new, out, bufs, differentiable)


class Progress(NamedTuple):
    """Host callbacks that drive the progress meter from the forward loop only."""

    start: Any  # carry -> meter state
    tick: Any  # (meter state, carry before, carry after) -> meter state
    done: Any  # carry -> None


def progress(problem: Problem) -> Progress | None:
    meter = problem.meter
    token = meter.start()
    if token is None:
        return None
    span = problem.t1 - problem.t0
    span = where(span == 0, 1, span)

    def fraction(carry):
        # The slowest batch element, unbatched.
        return -unvmap_max(-(carry.t - problem.t0) / span)

    def start(carry):
        f = jnp.minimum(fraction(carry), 0)
        meter.callback(token, f)
        return f  # the fraction last shown (unbatched)

    def tick(shown, before, after):
        f = fraction(after)
        shown = unvmap_max(shown)  # unbatched, also where the loop batched it
        show = meter.wants(unvmap_max(after.num_steps), shown, f) & (f < 1)
        lax.cond(show, lambda: meter.callback(token, f), lambda: None)
        return where(show, f, shown)

    def done(carry):
        # Depends on the final carry, so the host sees it after every tick.
        meter.callback(token, jnp.maximum(carry.t - carry.t, 0) + 1)

    return Progress(start, tick, done)


def run_while(problem: Problem, state):
    """The loop as a plain `lax.while_loop` (not reverse-differentiable)."""
    meter = progress(problem)

    def loop_body(state, active):
        state, shown = state
        new = body(problem, state, active)
        if meter is not None:
            shown = meter.tick(shown, state[0], new[0])
        return new, shown

    shown = None if meter is None else meter.start(state[0])
    state, _ = while_loop(lambda s: cond(problem, s[0][0]), loop_body, (state, shown))
    if meter is not None:
        meter.done(state[0])
    return state


# --- After the loop ------------------------------------------------------------------


def _bisect(g, a, b, ga, iterations: int):
    def it(_, state):
        a, b, ga = state
        m = (a + b) / 2
        gm = g(m)
        same = jnp.sign(gm) == jnp.sign(ga)
        return where(same, m, a), where(same, b, m), where(same, gm, ga)

    a, b, _ = lax.fori_loop(0, iterations, it, (a, b, ga))
    return (a + b) / 2


def locate_event(problem: Problem, carry: Carry):
    """For a fired real-valued condition, find the crossing on the last step's dense
    output. The event time is differentiable by the implicit function theorem."""
    if carry.last is None:
        return carry.t, carry.y
    tstart, info = carry.last
    tend = carry.t
    solver = problem.solver
    is_real = _real_conds(problem)
    leaves = jtu.tree_leaves(problem.conds, is_leaf=lambda x: isinstance(x, Closure))
    fired = jtu.tree_leaves(carry.event_mask)
    event = carry.result == _EVENT
    iterations = 64 if tend.dtype == jnp.float64 else 32
    t_star = tend
    located = jnp.asarray(False)  # whether a real-valued condition fired
    for closure, real, f in zip(leaves, is_real, fired):
        if not real:
            continue

        def g(tau, closure=closure):
            y = solver.interpolate(info, tstart, tend, tau)
            return closure(problem.term.to_user(tau), y, problem.args)

        active = event & f
        a = lax.stop_gradient(where(active, tstart, tend - 1))
        b = lax.stop_gradient(tend)
        if problem.root_finder is None:
            root = _bisect(g, a, b, g(a), iterations)
        else:
            root = _optx_root(g, problem.root_finder, a, b)
        root = lax.stop_gradient(where(active, root, tend))
        # One Newton step at the root: the value stays, the derivative becomes the
        # implicit-function-theorem one, -(dg/dp) / (dg/dt).
        g_root, dg_dt = jax.jvp(g, (root,), (jnp.ones_like(root),))
        dg_dt = lax.stop_gradient(where(dg_dt == 0, 1, dg_dt))
        root = root - where(active, g_root / dg_dt.astype(root.dtype), 0)
        t_star = where(active, jnp.minimum(t_star, root), t_star)
        located = located | active
    # Only then is the last step's dense output meaningful (a boolean condition may
    # have fired at t0, before any step).
    y_star = solver.interpolate(info, tstart, tend, t_star)
    y = _where(located, y_star, carry.y)
    return where(event, t_star, tend), y


def _optx_root(g, root_finder, a, b):
    import optimistix as optx  # only when the user passes an optimistix root finder

    sol = optx.root_find(
        lambda tau, _: g(tau), root_finder, (a + b) / 2, throw=False, max_steps=64
    )
    return jnp.clip(sol.value, a, b)


class Outputs(NamedTuple):
    t_end: Array
    y_end: PyTree
    ts: Any
    ys: Any
    carry: Carry
    bufs: dict
    result: Array


def finish(problem: Problem, carry: Carry, bufs: dict) -> Outputs:
    """Turn the final carry and buffers into the saved outputs (internal time)."""
    result = where(
        (carry.result == _SUCCESS) & (carry.t < problem.t1), _MAX_STEPS, carry.result
    )
    t_end, y_end = carry.t, carry.y
    if problem.conds is not None:
        t_end, y_end = locate_event(problem, carry._replace(result=result))
    outs = [
        _finish_save(problem, save, buf, carry, t_end, y_end)
        for save, buf in zip(problem.saves, bufs["saves"])
    ]
    ts = jtu.tree_unflatten(problem.save_tree, [o[0] for o in outs])
    ys = jtu.tree_unflatten(problem.save_tree, [o[1] for o in outs])
    return Outputs(t_end, y_end, ts, ys, carry, bufs, result)


def _finish_save(problem: Problem, save: Save, buf: dict, carry: Carry, t_end, y_end):
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
                buf["ts_ys"],
            )
        )
    if save.every:
        valid = buf["steps_ts"] <= t_end
        times.append(where(valid, buf["steps_ts"], jnp.inf))
        values.append(
            jtu.tree_map(lambda b: _mask_rows(valid, b, jnp.inf), buf["steps_ys"])
        )
    ts = jnp.concatenate(times)
    ys = jtu.tree_map(lambda *p: jnp.concatenate(p), *values)
    if save.ts is not None and save.every:  # interleave, in time order
        order = jnp.argsort(ts, stable=True)
        ts = ts[order]
        ys = jtu.tree_map(lambda v: v[order], ys)
    if save.t1 or save.every:
        # The final point goes after the last row: for `t1`, unless the last step
        # save is the final point already; and always where a located event
        # removed that step save.
        if save.every == 0:
            by_steps = jnp.asarray(False)
        elif save.every == 1:
            by_steps = carry.num_accepted > 0
        else:
            by_steps = (carry.num_accepted % save.every == 0) & (carry.num_accepted > 0)
        removed = by_steps & (carry.t > t_end)
        put = removed | (save.t1 & ~by_steps)
        if save.t1_row(problem.max_steps):
            ts = jnp.concatenate([ts, jnp.full((1,), jnp.inf, t_dtype)])
            ys = jtu.tree_map(
                lambda v: jnp.concatenate(
                    [v, _inf_like(jax.ShapeDtypeStruct(v.shape[1:], v.dtype), (1,))]
                ),
                ys,
            )
        if ts.shape[0]:
            index = jnp.minimum(jnp.sum(jnp.isfinite(ts)), ts.shape[0] - 1)
            value = _save_value(problem, save, t_end, y_end)
            ts = _set_row(ts, index, put, t_end)
            ys = jtu.tree_map(lambda b, v: _set_row(b, index, put, v), ys, value)
    if save.t0:
        value = _save_value(problem, save, problem.t0, problem.y0)
        ts = jnp.concatenate([problem.t0[None], ts])
        ys = jtu.tree_map(lambda v, b: jnp.concatenate([v[None], b]), value, ys)
    return ts, ys


def _mask_rows(rows, v, other):
    """Rows of `v` where `rows`, else `other` (an array or a scalar such as inf)."""
    if np.ndim(other) == 0:
        fill = other if jnp.issubdtype(v.dtype, jnp.inexact) else 0
        other = jnp.full(v.shape, fill, v.dtype)
    return where(rows.reshape((-1,) + (1,) * (v.ndim - 1)), v, other)
