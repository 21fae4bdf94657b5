"""The step loop: step, accept or reject, save, detect events.

Knows nothing of adjoints: an adjoint supplies the function that runs
`body(problem, carry)` while `cond(problem, carry)` holds (see `_adjoint/_base.py`).
Every user value reaches the loop through `Problem` (`_problem.py`), an explicit
operand. What a step saves is written by `_save.py`; events are detected and located by
`_event.py`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from . import _event, _save, _timed_event as _timed
from ._closure._unvmap import unvmap_any, unvmap_max, while_loop
from ._custom_types import Y
from ._errors import concrete
from ._problem import adaptive, Buffers, Carry, Hybrid, LastStep, Problem, StepOut
from ._reduce import all_true, and_all, or_all
from ._select import where
from ._solution import RESULTS
from ._term import like_state
from ._time import flip
from ._tree import tree_where
from ._user_solver import UserSolver


SUCCESS = int(RESULTS.successful.code)
_EVENT = int(RESULTS.event_occurred.code)
_MAX_STEPS = int(RESULTS.max_steps_reached.code)
_NONFINITE = int(RESULTS.nonfinite.code)
_MAX_EVENTS = int(RESULTS.max_events_reached.code)
_ACCUMULATED = int(RESULTS.events_accumulated.code)
_INCONSISTENT = int(RESULTS.inconsistent_initial_values.code)
_SINGULAR = int(RESULTS.singular.code)


def _all_finite(tree) -> Array:
    return and_all([all_true(jnp.isfinite(x)) for x in jtu.tree_leaves(tree)])


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


def init(problem: Problem) -> tuple[Carry, Buffers]:
    """The loop's initial carry and save buffers."""
    saves_from = problem  # saves at `t0` show `y0`, before any event there
    timed_index, at_t0 = None, None
    if problem.timed is not None:
        timed_index, at_t0, y0 = _timed_at_t0(problem)
        problem = dataclasses.replace(problem, y0=y0)
    terms, t0, y0, args = problem.terms, problem.t0, problem.y0, problem.args
    func = lambda t, y, args: problem.solver.func(terms, t, y, args)  # noqa: E731
    tnext, controller_state = problem.controller.loop_init(
        terms, t0, problem.t1, y0, problem.dt0, args, func, problem.error_order
    )
    tnext = jnp.minimum(jnp.asarray(tnext, t0.dtype), problem.t1)
    solver_state, controller_state = _initial_states(problem, controller_state)
    if at_t0 is not None and problem.resume is not None:  # made anew after an event
        fresh = problem.solver.init(terms, t0, problem.t1, y0, args)
        solver_state = tree_where(at_t0, fresh, solver_state)
    cond_values, event_mask, last = _event.init_events(problem, solver_state)
    result = jnp.asarray(SUCCESS, jnp.int32)
    if event_mask is not None:
        at_t0 = or_all(jtu.tree_leaves(event_mask))
        result = where(at_t0, _EVENT, SUCCESS).astype(jnp.int32)
    zero = jnp.asarray(0, jnp.int32)
    hybrid = None
    if problem.continues:
        hybrid = Hybrid(jnp.asarray(False), t0, zero, jnp.zeros_like(t0))
        cond_values = _start_sides(problem, cond_values)
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
        hybrid=hybrid,
        timed_index=timed_index,
    )
    if adaptive(problem):
        carry = batch_like(problem, carry)
    return carry, _save.init_buffers(saves_from, solver_state)


def _timed_at_t0(problem: Problem):
    """The first `TimedEvent` time at or after `t0`, applied there if it is at
    `t0`: the index of the next, whether one was applied, and the state after."""
    timed, direction, args = problem.timed, problem.direction, problem.args
    assert timed is not None
    t0, before = problem.t0, problem.y0
    index = _timed.first(timed, t0)
    t_event = _timed.next_time(timed, index)
    at_t0 = (t_event == t0) & (t0 < problem.t1)
    t_event = where(at_t0, t_event, t0)  # the event's own time, for its derivative
    effect = lambda y: _timed.apply(timed, direction, t_event, y, args, index)
    rate = lambda y: problem.solver.func(problem.terms, t0, y, args)
    after, moved = jax.jvp(effect, (before,), (rate(before),))
    # Its derivative with respect to its time is the one-sided one, of moving it
    # into the solve (earlier, it would be skipped): as for an event at a later
    # time, where the step that lands on it carries this derivative.
    shift = t_event - lax.stop_gradient(t_event)
    after = jtu.tree_map(lambda a, m, r: a + shift * (m - r), after, moved, rate(after))
    y0 = tree_where(at_t0, after, before)
    return index + at_t0.astype(jnp.int32), at_t0, y0


def _like(name: str, passed: PyTree, fresh: PyTree) -> PyTree:
    """`passed` (a state returned by an earlier solve), checked against the state
    this solve would start from, `fresh`, and cast to its dtypes."""
    passed_leaves, passed_tree = jtu.tree_flatten(passed)
    fresh_leaves, fresh_tree = jtu.tree_flatten(fresh)
    if passed_tree != fresh_tree:
        raise ValueError(
            f"`{name}` does not fit this solve: expected the structure {fresh_tree} "
            f"(what `SaveAt({name}=True)` returns for the same solver and "
            f"controller), got {passed_tree}."
        )
    out = []
    for i, (p, f) in enumerate(zip(passed_leaves, fresh_leaves)):
        p = jnp.asarray(p)
        f = f if isinstance(f, jax.ShapeDtypeStruct) else jnp.asarray(f)
        if p.shape != f.shape or not jnp.can_cast(p.dtype, f.dtype, "same_kind"):
            raise ValueError(
                f"`{name}` does not fit this solve: its leaf {i} should have shape "
                f"{f.shape} and dtype {f.dtype}, got shape {p.shape} and dtype "
                f"{p.dtype}."
            )
        out.append(p.astype(f.dtype))
    return jtu.tree_unflatten(passed_tree, out)


def _initial_states(problem: Problem, controller_state: PyTree):
    """The solver's and the controller's states to start from: made anew, or (to
    continue an earlier solve) the ones passed to `diffeqsolve`. A solver state is
    made anew anyway where the earlier solve ended at a jump (`made_jump`)."""
    terms, t0, y0, args = problem.terms, problem.t0, problem.y0, problem.args
    solver = problem.solver
    fresh = lambda: solver.init(terms, t0, problem.t1, y0, args)  # noqa: E731
    resume = problem.resume
    if resume is None:
        return fresh(), controller_state
    if resume.controller_state is not None:
        passed = _like("controller_state", resume.controller_state, controller_state)
        controller_state = problem.controller.resume(passed, controller_state)
    if resume.solver_state is None:
        return fresh(), controller_state
    passed = _like("solver_state", resume.solver_state, jax.eval_shape(fresh))
    jump = resume.made_jump
    known = concrete(jump)
    if jump is None or (known is not None and not known.any()):
        return passed, controller_state
    return tree_where(jump, fresh(), passed), controller_state


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


def _solver_step(problem: Problem, carry: Carry, t1: Array):
    """The solver's step from `carry.t` to `t1`. A step that ends at a jump of the
    vector field stops just short of it (so that no stage sees the far side), and the
    next step starts from the field evaluated just past it, in the direction of
    travel: on its far side however the field tests `t` (`t < s` or `t <= s`)."""
    solver, terms, args = problem.solver, problem.terms, problem.args
    controller = problem.controller
    if not controller.has_jumps:
        return solver.loop_step(
            terms, carry.t, t1, carry.y, args, carry.solver_state, False
        )
    at_jump = controller.ends_on_jump(carry.controller_state, t1)
    fixed = lax.stop_gradient(t1)
    below = fixed - jnp.nextafter(fixed, jnp.asarray(-jnp.inf, t1.dtype))
    above = jnp.nextafter(fixed, jnp.asarray(jnp.inf, t1.dtype)) - fixed
    t1_solve = where(at_jump, t1 - below, t1)
    y1, y_error, info, solver_state, result = solver.loop_step(
        terms, carry.t, t1_solve, carry.y, args, carry.solver_state, False
    )
    # Made anew only when some batch element ends on a jump (for BDF, a Jacobian).
    restart = lax.cond(
        unvmap_any(at_jump),
        lambda: tree_where(
            at_jump,
            solver.init(terms, t1 + above, problem.t1, y1, args),
            solver_state,
        ),
        lambda: solver_state,
    )
    return y1, y_error, info, restart, result


def solver_name(solver) -> str:
    """The name of the solver the user chose."""
    return type(solver.solver if isinstance(solver, UserSolver) else solver).__name__


def _solver_failed(result) -> Array | None:
    """Whether a solver's step failed (`None` where it can't: a constant success)."""
    code = concrete(result.code)
    if code is not None and code.shape == () and code == SUCCESS:
        return None
    return jnp.asarray(result.code) != SUCCESS


def _reject_failed(problem: Problem, failed, y_error: Y | None, y1: Y):
    """Under an adaptive controller a failed step (e.g. a Newton solve that did not
    converge) is rejected and the step shrinks: its error is infinite. An empty state
    (`y0=None`) has an empty error, as in diffrax."""
    if y_error is None and not jtu.tree_leaves(y1):
        return y_error
    if y_error is None:
        raise ValueError(
            f"{solver_name(problem.solver)} returns no error estimate (`y_error` is "
            "None), so it can't be used with an adaptive step-size controller: use "
            "ConstantStepSize."
        )
    if failed is None:
        return y_error
    return jtu.tree_map(lambda e: where(failed, jnp.inf, e), y_error)


def _step_result(
    problem: Problem, carry: Carry, accepted, finite, failed, solver_result, ctrl
) -> Array:
    """The solve's result code after a step: the first failure sticks; a step
    accepted with a non-finite state fails; a solver failure fails the solve unless
    an adaptive controller can retry it with a smaller step (it can't mend
    inconsistent initial values or a singular iteration matrix)."""
    result = jnp.asarray(ctrl.code, jnp.int32)
    if failed is not None:
        code = jnp.asarray(solver_result.code, jnp.int32)
        fatal = (
            failed
            if not adaptive(problem)
            else (code == _INCONSISTENT) | (code == _SINGULAR)
        )
        result = where(fatal, code, result)
    result = where(accepted & ~finite, _NONFINITE, result)
    return where(carry.result == SUCCESS, result, carry.result)


def step(problem: Problem, carry: Carry) -> tuple[Carry, StepOut]:
    """One attempted step. Returns the new carry and what this step saves."""
    t0 = carry.t
    t1 = jnp.minimum(carry.tnext, problem.t1)
    t_timed = None
    if problem.timed is not None:  # land on the next `TimedEvent` time
        assert carry.timed_index is not None
        t_timed = _timed.next_time(problem.timed, carry.timed_index)
        t1 = where(t_timed < t1, t_timed, t1)
    y1, y_error, info, solver_state, solver_result = _solver_step(problem, carry, t1)
    failed = _solver_failed(solver_result)
    if adaptive(problem):
        y_error = _reject_failed(problem, failed, y_error, y1)
    accepted, next_t0, next_t1, _, controller_state, controller_result = (
        problem.controller.loop_adapt_step_size(
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
    result = _step_result(
        problem, carry, accepted, finite, failed, solver_result, controller_result
    )
    cond_values, event_mask, last = carry.cond_values, carry.event_mask, carry.last
    if problem.conds is not None and not problem.continues:
        out = StepOut(accepted, t0, t1, y1, info)
        cond_values, event_mask, last, result = _stopping_event(
            problem, carry, out, finite, result
        )
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
        hybrid=carry.hybrid,
        timed_index=carry.timed_index,
    )
    out = StepOut(accepted, t0, t1, y1, info)
    if problem.continues:
        new, out = _continue(problem, carry, new, out, finite)
    if t_timed is not None:
        new = _after_timed(problem, new, out, t_timed)
    return new, out


def _after_timed(problem: Problem, new: Carry, out: StepOut, t_timed: Array) -> Carry:
    """After a step that landed on a `TimedEvent` time (and did not end the solve):
    the event's change of state, the solver's state made anew, the conditions of an
    `Event` evaluated anew. Computed only when some batch element landed."""
    timed = problem.timed
    assert timed is not None and new.timed_index is not None
    due = (
        out.accepted
        & (out.t1 == t_timed)
        & (t_timed < problem.t1)
        & (new.result == SUCCESS)
    )

    def land(new: Carry) -> Carry:
        t, args, index = out.t1, problem.args, new.timed_index
        assert index is not None
        y = _timed.apply(timed, problem.direction, t, new.y, args, index)
        y = tree_where(due, y, new.y)
        restart = problem.solver.init(problem.terms, t, problem.t1, y, args)
        cond_values = new.cond_values
        if problem.conds is not None:
            cond_values = tree_where(due, _event.eval_conds(problem, t, y), cond_values)
        # The next step shifts with the event's time (see `_continue`).
        tnext = t + lax.stop_gradient(new.tnext - t)
        return new._replace(
            y=y,
            tnext=where(due, tnext, new.tnext),
            solver_state=tree_where(due, restart, new.solver_state),
            cond_values=cond_values,
            timed_index=index + due.astype(jnp.int32),
        )

    return lax.cond(unvmap_any(due), land, lambda new: new, new)


def _stopping_event(problem: Problem, carry: Carry, out: StepOut, finite, result):
    """An event that stops the solve, after a step: the conditions at its end,
    which fired, the step kept for locating a crossing, and the result."""
    accepted = out.accepted
    new_values = _event.eval_conds(problem, out.t1, out.y1)
    fired = _event.fired(problem, carry.cond_values, new_values)
    fired = jtu.tree_map(lambda f: f & accepted & finite, fired)
    any_fired = or_all(jtu.tree_leaves(fired))
    result = where(any_fired & (result == SUCCESS), _EVENT, result)
    cond_values = tree_where(accepted, new_values, carry.cond_values)
    last = carry.last
    if last is not None:
        last = tree_where(accepted, LastStep(out.t0, out.dense_info), last)
    return cond_values, fired, last, result


def _continue(problem: Problem, carry: Carry, new: Carry, out: StepOut, finite):
    """An event that continues, after a step: a crossing found in an accepted step
    turns it into a rejected one, and the next steps land exactly on the located
    occurrence; a step that lands there applies the effect (the solver's state made
    anew, as after a jump), records it, or ends the solve (`_occurrence_ends`)."""
    hybrid = carry.hybrid
    assert hybrid is not None  # (`init` made it)
    t0, t1, accepted = out.t0, out.t1, out.accepted
    landing = hybrid.landing
    landed = accepted & landing & (t1 >= hybrid.t_land)
    # A crossing in a free step: locate it (only when some batch element has one).
    values = _event.eval_conds(problem, t1, out.y1)
    fired = _event.fired(problem, carry.cond_values, values)
    fired = jtu.tree_map(lambda f: f & accepted & ~landing & finite, fired)
    found = or_all(jtu.tree_leaves(fired))
    t_star = lax.cond(
        unvmap_any(found),
        lambda: _event.crossing(
            problem, t0, t1, out.dense_info, fired, carry.cond_values
        ),
        lambda: t1,
    )
    # The occurrence reached: its effect, a fresh solver state, the conditions anew.
    count = hybrid.count + landed.astype(jnp.int32)
    apply, result = _occurrence_ends(problem, hybrid, landed, count, out, new.result)
    y, restart, after = _after_occurrence(
        problem, t1, new.y, apply, carry.cond_values, new.solver_state
    )
    new = new._replace(
        y=y,
        solver_state=tree_where(apply, restart, new.solver_state),
        cond_values=tree_where(
            apply, after, tree_where(accepted & ~landing, values, carry.cond_values)
        ),
        result=result,
        hybrid=hybrid._replace(landing=landing & ~landed, count=count),
        tnext=where(
            landing & ~landed,
            jnp.minimum(new.tnext, hybrid.t_land),
            # After the occurrence, at least the step that found it: the landing
            # step may be far shorter (or of no length, for one at `t0`).
            # It shifts with the occurrence's time, it does not stretch with the
            # landing step: else that step's derivative would reach every later
            # step, multiplied by each step's factor (a spike time's gradient grew
            # ~25-fold a spike).
            where(
                landed,
                t1 + lax.stop_gradient(jnp.maximum(new.tnext - t1, hybrid.h)),
                new.tnext,
            ),
        ),
    )
    # ... and a crossing found: the step is undone, the next one ends at it.
    undone = carry._replace(
        tnext=t_star,
        num_steps=new.num_steps,
        num_rejected=carry.num_rejected + 1,
        event_mask=fired,
        hybrid=Hybrid(jnp.asarray(True), t_star, hybrid.count, t1 - t0),
    )
    new = tree_where(found, undone, new)
    out = out._replace(accepted=accepted & ~found, landed=landed)
    return new, out


def _occurrence_ends(problem: Problem, hybrid: Hybrid, landed, count, out, result):
    """Whether the occurrence a step `landed` on is applied, and the result: the
    solve stops at the `stop_at`-th (`event_occurred`, before the effect), past
    `max_events` (`max_events_reached`), or where an occurrence comes at the time
    of the previous one (its landing step has no length, to a hundred ulps):
    occurrences accumulate there and no solve goes past (`events_accumulated`)."""
    t0, t1 = out.t0, out.t1
    stop = (
        landed & (count >= problem.stop_at)
        if problem.stop_at
        else jnp.zeros_like(landed)
    )
    over = landed & (count > problem.max_events)
    close = 100 * jnp.finfo(t1.dtype).eps * jnp.maximum(jnp.abs(t1), 1)
    accumulated = landed & (t1 - t0 <= close) & (hybrid.count > 0) & ~stop & ~over
    result = where(stop, _EVENT, result)
    result = where(over, _MAX_EVENTS, result)
    result = where(accumulated, _ACCUMULATED, result)
    return landed & ~stop & ~over & ~accumulated, result


def _after_occurrence(problem: Problem, t1, y, apply, reference, solver_state):
    """Where `apply`: the state after the effect at `t1`, the solver's state made
    anew there, and the conditions evaluated anew (`reference`: their values at the
    start of the step that found the crossing); elsewhere `y`, `solver_state` and
    `reference`. Computed only when some batch element applies an occurrence, and
    the effect sees the state of one that does not without its derivative, so that
    an effect singular away from its events puts no NaN into gradients.

    A condition left at (numerically) zero by the occurrence is taken to be on the
    side it moves to (the sign of its rate along the flow), so that the next
    crossing is found even within the next step; NaN (never fires for a step) where
    it does not move. But where it moves on to the far side of the crossing while,
    before the effect, it moved back (a crossing located within rounding of a
    vanishing bounce), its motion is a crossing of its own, starting there: it is
    taken to be on the side it comes from, so that it fires at once (as at `t0`),
    never to cross unseen."""

    def occur(y):
        _, before = _conditions_along_flow(problem, t1, y)
        if problem.effect is not None:
            effect, t, seen, args = _only_where(
                apply, (problem.effect, flip(problem.direction, t1), y, problem.args)
            )
            y = tree_where(apply, like_state(effect(t, seen, args), y), y)
        restart = problem.solver.init(problem.terms, t1, problem.t1, y, problem.args)
        after, moving = _conditions_along_flow(problem, t1, y)
        side = lambda a, m, b, r: _side_after(a, m, b, r, _window(t1))
        return y, restart, jtu.tree_map(side, after, moving, before, reference)

    return lax.cond(unvmap_any(apply), occur, lambda y: (y, solver_state, reference), y)


def _only_where(pred, tree: PyTree) -> PyTree:
    """`tree`, its floating-point arrays differentiable only where `pred`: a function
    of it selected by `pred` then sends no NaN back from where it is not (the
    "double where")."""
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    dynamic = jtu.tree_map(lambda x: where(pred, x, lax.stop_gradient(x)), dynamic)
    return eqx.combine(dynamic, static)


def _conditions_along_flow(problem: Problem, t, y) -> tuple[PyTree, PyTree]:
    """The event conditions at `(t, y)` and their rates of change along the flow."""
    rates = problem.solver.func(problem.terms, t, y, problem.args)
    return jax.jvp(
        lambda tau, x: _event.eval_conds(problem, tau, x),
        (t, y),
        (jnp.ones_like(t), rates),
    )


def _window(t):
    """The time within which a located crossing is known: a thousand of `t`'s ulps."""
    return 1000 * jnp.finfo(t.dtype).eps * jnp.maximum(jnp.abs(t), 1)


def _start_sides(problem: Problem, cond_values: PyTree) -> PyTree:
    """An event that continues, at `t0`: a real condition at zero there (to within
    the time its crossings are located to) is taken to be on the side it comes
    from, against its rate, so that it fires in the first step if its direction
    allows (an occurrence at `t0`, as SciPy's `solve_ivp` finds one)."""
    t0 = problem.t0
    _, moving = _conditions_along_flow(problem, t0, problem.y0)
    zero = jnp.zeros((), t0.dtype)
    side = lambda v, m: _side(v, -m, zero, _window(t0))
    return jtu.tree_map(side, cond_values, moving)


def _side(value, rate, reference, window):
    """A real condition's `value` just after an occurrence; where it is zero to
    within rounding (relative to its `reference`, at the start of the step that
    found the crossing; or less than its `rate` moves it in the time `window` that
    the crossing's location is known to), a tiny value on the side its `rate`
    moves it to."""
    if jnp.issubdtype(value.dtype, jnp.bool_):
        return value
    at_zero, size = _near_zero(value, rate, reference, window)
    tiny = where(rate == 0, jnp.nan, jnp.sign(rate) * size)
    return where(at_zero, tiny.astype(value.dtype), value)


def _near_zero(value, rate, reference, window):
    """Whether a real condition's `value` is zero to within rounding (see `_side`),
    and the size of the tiny value that stands for it then."""
    tol = jnp.sqrt(jnp.finfo(value.dtype).eps)
    scale = tol * jnp.abs(reference)
    at_zero = (jnp.abs(value) <= scale) | (jnp.abs(value) <= jnp.abs(rate) * window)
    return at_zero, jnp.maximum(scale, tol)


def _side_after(value, rate, rate_before, reference, window):
    """A real condition's `value` just after an occurrence: as `_side`, but on the
    `reference` side where it is at zero and moves away from it while, before the
    effect, it moved towards it (`rate_before`): a crossing starting there."""
    out = _side(value, rate, reference, window)
    if jnp.issubdtype(value.dtype, jnp.bool_):
        return out
    at_zero, size = _near_zero(value, rate, reference, window)
    back = jnp.sign(reference)
    again = (jnp.sign(rate) == -back) & (jnp.sign(rate_before) == back) & (back != 0)
    return where(at_zero & again, (back * size).astype(value.dtype), out)


def body(
    problem: Problem,
    state: tuple[Carry, Buffers],
    active: Array | bool = True,
    differentiable: bool = False,
):
    """One iteration of the loop: a step, then its saves. Where `active` is False
    (a finished batch element) nothing changes."""
    carry, bufs = state
    new, out = step(problem, carry)
    if active is not True:
        out = out._replace(accepted=out.accepted & active)
        new = tree_where(active, new, carry)
    return new, _save.write(problem, new, out, bufs, differentiable)


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
        t_end, y_end = _event.locate(problem, carry._replace(result=result))
    outs = [
        _save.finish_save(problem, save, buf, carry, t_end, y_end)
        for save, buf in zip(problem.saves, bufs.saves)
    ]
    ts = jtu.tree_unflatten(problem.save_tree, [o[0] for o in outs])
    ys = jtu.tree_unflatten(problem.save_tree, [o[1] for o in outs])
    if problem.dense:  # the first step boundary (never written by a step)
        assert bufs.dense_ts is not None  # `init_buffers` made it
        bufs = bufs._replace(dense_ts=bufs.dense_ts.at[0].set(problem.t0))
    return Outputs(t_end, y_end, ts, ys, carry, bufs, result)
