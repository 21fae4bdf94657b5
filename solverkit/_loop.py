"""The step loop: step, accept or reject, save, detect events.

Knows nothing of adjoints: an adjoint supplies the function that runs
`body(params, carry)` while `cond(params, carry)` holds (see `_adjoint.py`). Every user
value reaches the loop through `Problem`, an explicit operand.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optimistix as optx
from jaxtyping import Array, PyTree

from ._closure import Closure
from ._controller import AbstractStepSizeController
from ._custom_types import RealScalarLike, Y
from ._errors import concrete
from ._progress import AbstractProgressMeter, NoProgressMeter
from ._reduce import all_true, and_all, or_all
from ._select import where
from ._solution import RESULTS
from ._solver import AbstractSolver
from ._term import AbstractTerm
from ._time import flip
from ._tree import tree_where
from ._unvmap import unvmap_max, while_loop


SUCCESS = int(RESULTS.successful.code)
_EVENT = int(RESULTS.event_occurred.code)
_MAX_STEPS = int(RESULTS.max_steps_reached.code)
_NONFINITE = int(RESULTS.nonfinite.code)


class Problem(eqx.Module):
    """Everything a solve needs, as one pytree (arrays are its leaves), in the loop's
    internal time `tau = direction * t`, which always increases."""

    solver: AbstractSolver
    controller: AbstractStepSizeController  # in internal time
    terms: AbstractTerm  # `ClosureTerm`s, alone or in a `MultiTerm`
    direction: Array | None  # -1 for a backwards solve, None forwards
    args: PyTree
    y0: PyTree
    t0: Array  # internal time
    t1: Array  # internal time
    dt0: Array | None  # internal time (positive)
    max_steps: int | None = eqx.field(static=True)
    saves: tuple["Save", ...] = ()  # one per SubSaveAt
    save_tree: Any = eqx.field(static=True, default=jtu.tree_structure(None))
    dense: bool = eqx.field(static=True, default=False)
    conds: PyTree | None = None  # pytree of Closures (t, y, args) -> value
    event_direction: tuple | None = eqx.field(static=True, default=None)
    root_finder: Any = None  # of the event time, or None for bisection
    meter: AbstractProgressMeter = NoProgressMeter()

    @property
    def error_order(self):
        return self.solver.error_order(self.terms)

    @property
    def saves_steps(self) -> bool:
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
    every: int = eqx.field(static=True)  # save every n-th step (0: none)
    saves_y: bool = eqx.field(static=True, default=True)  # `fn` is the default

    def step_rows(self, max_steps: int) -> int:
        return max_steps // self.every if self.every else 0

    def t1_row(self, max_steps: int) -> bool:
        """Whether `t1` needs a row of its own (else it may take a free step row)."""
        return self.t1 and (self.every == 0 or max_steps % self.every != 0)

    @property
    def empty(self) -> bool:
        return not (self.t0 or self.t1 or self.every) and self.ts is None


class LastStep(NamedTuple):
    """The last accepted step, for locating an event on its dense output."""

    t0: Array
    dense_info: PyTree


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
    last: LastStep | None  # only with real-valued event conditions


class SaveBuffer(NamedTuple):
    """The rows of one `Save` written during the loop (`None` where not saved)."""

    ts_ys: PyTree | None  # values at `Save.ts`
    steps_ts: Array | None  # times of the step saves
    steps_ys: PyTree | None  # values at the step saves


class Buffers(NamedTuple):
    saves: tuple[SaveBuffer, ...]
    dense_ts: Array | None  # step boundaries, for `SaveAt(dense=True)`
    dense_info: PyTree | None  # each accepted step's dense information


class StepOut(NamedTuple):
    """What one attempted step hands to the save buffers."""

    accepted: Array
    t0: Array
    t1: Array
    y1: PyTree
    dense_info: PyTree


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


def _eval_conds(problem: Problem, tau: RealScalarLike, y: Y):
    t = flip(problem.direction, tau)
    return jtu.tree_map(
        lambda c: c(t, y, problem.args),
        problem.conds,
        is_leaf=lambda x: isinstance(x, Closure),
    )


def _fired(problem: Problem, before, after) -> PyTree:
    """Which conditions fired over a step: a boolean one when it is true, a real one
    when its sign changes (in its direction), as diffrax decides."""

    def leaf(b, a, direction: Array | None):
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


def _save_value(problem: Problem, save: Save, tau: RealScalarLike, y: Y):
    return save.fn(flip(problem.direction, tau), y, problem.args)


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
    return problem.controller.adaptive


def _dense_info_zeros(problem: Problem, solver_state: PyTree) -> PyTree:
    """Zeros shaped like one step's dense information."""
    _, _, info, _, _ = eqx.filter_eval_shape(
        problem.solver.step,
        problem.terms,
        problem.t0,
        problem.t1,
        problem.y0,
        problem.args,
        solver_state,
        False,
    )
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), info)


def _init_events(problem: Problem, solver_state: PyTree):
    """`(cond_values, event_mask, last)` at the start of the loop."""
    if problem.conds is None:
        return None, None, None
    cond_values = _eval_conds(problem, problem.t0, problem.y0)
    # A boolean condition already true at t0 ends the solve there, before any step
    # (as in diffrax); a real-valued one needs a sign change first.
    event_mask = [
        jnp.asarray(False) if real else jnp.asarray(value)
        for real, value in zip(_real_conds(problem), jtu.tree_leaves(cond_values))
    ]
    event_mask = jtu.tree_unflatten(jtu.tree_structure(cond_values), event_mask)
    last = None
    if any(_real_conds(problem)):
        last = LastStep(problem.t0, _dense_info_zeros(problem, solver_state))
    return cond_values, event_mask, last


def _init_buffers(problem: Problem, solver_state: PyTree) -> Buffers:
    """Save buffers, `inf`-filled (rows not written stay `inf`)."""
    saves = []
    for save in problem.saves:
        struct = save.fn.out_struct
        ts_ys = steps_ts = steps_ys = None
        if save.ts is not None:
            ts_ys = _inf_like(struct, (save.ts.shape[0],))
        if save.every:
            rows = save.step_rows(problem.max_steps)
            steps_ts = jnp.full((rows,), jnp.inf, problem.t0.dtype)
            steps_ys = _inf_like(struct, (rows,))
        saves.append(SaveBuffer(ts_ys, steps_ts, steps_ys))
    dense_ts = dense_info = None
    if problem.dense:
        info = _dense_info_zeros(problem, solver_state)
        dense_ts = jnp.full((problem.max_steps + 1,), jnp.inf, problem.t0.dtype)
        dense_info = jtu.tree_map(
            lambda x: jnp.zeros((problem.max_steps,) + x.shape, x.dtype), info
        )
    return Buffers(tuple(saves), dense_ts, dense_info)


def init(problem: Problem) -> tuple[Carry, Buffers]:
    """The loop's initial carry and save buffers."""
    terms, t0, y0, args = problem.terms, problem.t0, problem.y0, problem.args
    tnext, controller_state = problem.controller.init(
        terms, t0, problem.t1, y0, problem.dt0, args, terms.vf, problem.error_order
    )
    tnext = jnp.minimum(jnp.asarray(tnext, t0.dtype), problem.t1)
    solver_state = problem.solver.init(terms, t0, problem.t1, y0, args)
    cond_values, event_mask, last = _init_events(problem, solver_state)
    result = jnp.asarray(SUCCESS, jnp.int32)
    if event_mask is not None:
        at_t0 = or_all(jtu.tree_leaves(event_mask))
        result = where(at_t0, _EVENT, SUCCESS).astype(jnp.int32)
    zero = jnp.asarray(0, jnp.int32)
    carry = Carry(
        t=t0,
        tnext=tnext,
        y=y0,
        solver_state=solver_state,
        controller_state=controller_state,
        num_steps=zero,
        num_accepted=zero,
        num_rejected=zero,
        result=result,
        cond_values=cond_values,
        event_mask=event_mask,
        last=last,
    )
    if adaptive(problem):
        carry = batch_like(problem, carry)
    return carry, _init_buffers(problem, solver_state)


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
    return going & (carry.result == SUCCESS)


# A proposed step end this close to `t1` (in units of `t1`'s spacing, at least 1)
# lands on `t1` exactly, so that no sliver of a step is left to take.
_LANDING_ULPS = 100


def _solver_step(problem: Problem, carry: Carry, t1: RealScalarLike):
    """The solver's step from `carry.t` to `t1`. A step that ends at a jump of the
    vector field stops just short of it (so that no stage sees the far side), and the
    next step starts from the field evaluated just past it, in the direction of
    travel: on its far side however the field tests `t` (`t < s` or `t <= s`)."""
    solver, terms, args = problem.solver, problem.terms, problem.args
    controller = problem.controller
    if not controller.has_jumps:
        return solver.step(terms, carry.t, t1, carry.y, args, carry.solver_state, False)
    at_jump = controller.ends_on_jump(carry.controller_state, t1)
    fixed = lax.stop_gradient(t1)
    below = fixed - jnp.nextafter(fixed, jnp.asarray(-jnp.inf, t1.dtype))
    above = jnp.nextafter(fixed, jnp.asarray(jnp.inf, t1.dtype)) - fixed
    t1_solve = where(at_jump, t1 - below, t1)
    y1, y_error, info, solver_state, result = solver.step(
        terms, carry.t, t1_solve, carry.y, args, carry.solver_state, False
    )
    restart = solver.init(terms, t1 + above, problem.t1, y1, args)
    solver_state = tree_where(at_jump, restart, solver_state)
    return y1, y_error, info, solver_state, result


def _solver_failed(result) -> Array | None:
    """Whether a solver's step failed (`None` where it can't: a constant success)."""
    code = concrete(result.code)
    if code is not None and code.shape == () and code == SUCCESS:
        return None
    return jnp.asarray(result.code) != SUCCESS


def _reject_failed(problem: Problem, failed, y_error: Y | None):
    """Under an adaptive controller a failed step (e.g. a Newton solve that did not
    converge) is rejected and the step shrinks: its error is infinite."""
    if y_error is None:
        raise ValueError(
            f"{type(problem.solver).__name__} returns no error estimate (`y_error` is "
            "None), so it can't be used with an adaptive step-size controller: use "
            "ConstantStepSize."
        )
    if failed is None:
        return y_error
    return jtu.tree_map(lambda e: where(failed, jnp.inf, e), y_error)


def step(problem: Problem, carry: Carry) -> tuple[Carry, StepOut]:
    """One attempted step. Returns the new carry and what this step saves."""
    t0 = carry.t
    t1 = jnp.minimum(carry.tnext, problem.t1)
    y1, y_error, info, solver_state, solver_result = _solver_step(problem, carry, t1)
    failed = _solver_failed(solver_result)
    if adaptive(problem):
        y_error = _reject_failed(problem, failed, y_error)
    accepted, next_t0, next_t1, _, controller_state, controller_result = (
        problem.controller.adapt_step_size(
            t0,
            t1,
            carry.y,
            y1,
            problem.args,
            y_error,
            problem.error_order,
            carry.controller_state,
        )
    )
    accepted = jnp.asarray(accepted)
    spacing = jnp.finfo(t0.dtype).eps * jnp.maximum(1, jnp.abs(problem.t1))
    close = next_t1 >= problem.t1 - _LANDING_ULPS * spacing
    next_t1 = where(close, problem.t1, next_t1)
    finite = _all_finite(y1)
    result = jnp.asarray(controller_result.code, jnp.int32)
    if failed is not None and not adaptive(problem):
        result = where(failed, jnp.asarray(solver_result.code, jnp.int32), result)
    result = where(accepted & ~finite, _NONFINITE, result)
    result = where(carry.result == SUCCESS, result, carry.result)
    cond_values, event_mask, last = carry.cond_values, carry.event_mask, carry.last
    if problem.conds is not None:
        new_values = _eval_conds(problem, t1, y1)
        fired = _fired(problem, carry.cond_values, new_values)
        fired = jtu.tree_map(lambda f: f & accepted & finite, fired)
        any_fired = or_all(jtu.tree_leaves(fired))
        result = where(any_fired & (result == SUCCESS), _EVENT, result)
        cond_values = tree_where(accepted, new_values, carry.cond_values)
        event_mask = fired
        if last is not None:
            last = tree_where(accepted, LastStep(t0, info), last)
    new = Carry(
        t=where(accepted, t1, t0),
        tnext=next_t1,
        y=tree_where(accepted, y1, carry.y),
        solver_state=tree_where(accepted, solver_state, carry.solver_state),
        controller_state=controller_state,
        num_steps=carry.num_steps + 1,
        num_accepted=carry.num_accepted + accepted.astype(jnp.int32),
        num_rejected=carry.num_rejected + (~accepted).astype(jnp.int32),
        result=result,
        cond_values=cond_values,
        event_mask=event_mask,
        last=last,
    )
    return new, StepOut(accepted, t0, t1, y1, info)


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
    dense_ts, dense_info = bufs.dense_ts, bufs.dense_info
    if problem.dense:
        row = jnp.maximum(carry.num_accepted - 1, 0)
        dense_ts = set_row(dense_ts, row + 1, out.accepted, out.t1)
        dense_info = jtu.tree_map(
            lambda b, v: set_row(b, row, out.accepted, v), dense_info, out.dense_info
        )
    return Buffers(saves, dense_ts, dense_info)


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
            y = problem.solver.interpolate(out.dense_info, t0, t1, tau)
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


def body(
    problem: Problem,
    state: tuple[Carry, Buffers],
    active=True,
    differentiable: bool = False,
):
    """One iteration of the loop: a step, then its saves. Where `active` is False
    (a finished batch element) nothing changes."""
    carry, bufs = state
    new, out = step(problem, carry)
    if active is not True:
        out = out._replace(accepted=out.accepted & active)
        new = tree_where(active, new, carry)
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


def run_while(
    problem: Problem,
    carry: Carry,
    bufs: Buffers,
    extra: PyTree = None,
    record: Callable[[PyTree, Carry, Array], PyTree] | None = None,
) -> tuple[Carry, Buffers, PyTree]:
    """The loop as a plain `lax.while_loop` (not reverse-differentiable), with the
    progress meter.

    **Arguments:**

    - `problem`, `carry`, `bufs`: the solve and its initial state.
    - `extra`, `record`: more loop state, updated before each step as
        `record(extra, carry, active)` (a checkpointing forward pass stores carries).

    **Returns:**

    The final `(carry, bufs, extra)`.
    """
    meter = progress(problem)

    def loop_body(state, active):
        carry, bufs, extra, shown = state
        if record is not None:
            extra = record(extra, carry, active)
        new, bufs = body(problem, (carry, bufs), active)
        if meter is not None:
            shown = meter.tick(shown, carry, new)
        return new, bufs, extra, shown

    shown = None if meter is None else meter.start(carry)
    init = (carry, bufs, extra, shown)
    carry, bufs, extra, _ = while_loop(lambda s: cond(problem, s[0]), loop_body, init)
    if meter is not None:
        meter.done(carry)
    return carry, bufs, extra


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


def _bisections(dtype) -> int:
    """Bisections of a step that locate an event to the resolution of its time: the
    53 (float64) or 24 (float32) bits of the mantissa, with margin for a step much
    shorter than its time."""
    return 64 if dtype == jnp.float64 else 32


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
    iterations = _bisections(tend.dtype)
    t_star = tend
    located = jnp.asarray(False)  # whether a real-valued condition fired
    for closure, real, f in zip(leaves, is_real, fired):
        if not real:
            continue

        def g(tau: RealScalarLike, closure=closure):
            y = solver.interpolate(info, tstart, tend, tau)
            return closure(flip(problem.direction, tau), y, problem.args)

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
    y = tree_where(located, y_star, carry.y)
    return where(event, t_star, tend), y


# Iterations of an optimistix root finder locating an event in one step: far more
# than a Newton-type method needs on a smooth, bracketed crossing.
_EVENT_ROOT_MAX_STEPS = 64


def _optx_root(g, root_finder, a, b):
    sol = optx.root_find(
        lambda tau, _: g(tau),
        root_finder,
        (a + b) / 2,
        throw=False,
        max_steps=_EVENT_ROOT_MAX_STEPS,
    )
    return jnp.clip(sol.value, a, b)


class Outputs(NamedTuple):
    t_end: Array
    y_end: PyTree
    ts: Any
    ys: Any
    carry: Carry
    bufs: Buffers
    result: Array


def finish(problem: Problem, carry: Carry, bufs: Buffers) -> Outputs:
    """Turn the final carry and buffers into the saved outputs (internal time)."""
    result = where(
        (carry.result == SUCCESS) & (carry.t < problem.t1), _MAX_STEPS, carry.result
    )
    t_end, y_end = carry.t, carry.y
    if problem.conds is not None:
        t_end, y_end = locate_event(problem, carry._replace(result=result))
    outs = [
        _finish_save(problem, save, buf, carry, t_end, y_end)
        for save, buf in zip(problem.saves, bufs.saves)
    ]
    ts = jtu.tree_unflatten(problem.save_tree, [o[0] for o in outs])
    ys = jtu.tree_unflatten(problem.save_tree, [o[1] for o in outs])
    if problem.dense:  # the first step boundary (never written by a step)
        bufs = bufs._replace(dense_ts=bufs.dense_ts.at[0].set(problem.t0))
    return Outputs(t_end, y_end, ts, ys, carry, bufs, result)


def _finish_save(
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
