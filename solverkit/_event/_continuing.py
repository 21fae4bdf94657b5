"""An event in the loop, after each step: one that stops the solve (the conditions
tested, the step kept for locating the crossing after the loop), and one that
continues: the step in which a crossing is found ends at it, and the occurrence's
effect is applied there (`after_continuing`)."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._closure._unvmap import unvmap_any
from .._problem import Buffers, Carry, Continuing, LastStep, Problem, StepOut
from .._reduce import or_all
from .._select import where
from .._solution import EVENT as _EVENT, RESULTS, SUCCESS
from .._term import like_state
from .._time import flip
from .._tree import tree_where
from . import _detect
from ._detect import eval_conds
from ._search import crossing, settle


_MAX_EVENTS = int(RESULTS.max_events_reached.code)
_ACCUMULATED = int(RESULTS.events_accumulated.code)


def occurrences(problem: Problem, bufs: Buffers, carry: Carry):
    """A continuing event's occurrences once the solve has finished, in internal
    time: `(ts, ys, num)` (the times and the states before each effect, padded to
    `max_events` rows, and how many occurred), or `None` without such an event."""
    if not problem.event.continues:
        return None
    assert bufs.event_ts is not None and carry.continuing is not None
    num = jnp.minimum(carry.continuing.count, problem.event.max_events)
    return bufs.event_ts, bufs.event_ys, num


def after_stopping(problem: Problem, carry: Carry, out: StepOut, finite, result):
    """An event that stops the solve, after a step: the conditions at its end,
    which fired, the step kept for locating a crossing, and the result."""
    accepted = out.accepted
    new_values = eval_conds(problem, out.t1, out.y1)
    fired = _detect.fired(problem, carry.cond_values, new_values)
    fired = jtu.tree_map(lambda f: f & accepted & finite, fired)
    any_fired = or_all(jtu.tree_leaves(fired))
    result = where(any_fired & (result == SUCCESS), _EVENT, result)
    cond_values = tree_where(accepted, new_values, carry.cond_values)
    last = carry.last
    if last is not None:
        last = tree_where(accepted, LastStep(out.t0, out.dense_info), last)
    return cond_values, fired, last, result


def after_continuing(problem: Problem, carry: Carry, new: Carry, out: StepOut, finite):
    """An event that continues, after a step: an accepted step in which a crossing
    is found ends at it (as a loop of solves that each stop at an event does), with
    the state there from the step's dense output, which its saves use up to there.
    The occurrence's effect is applied (the solver's state made anew, as after a
    jump) and recorded, or the occurrence ends the solve (`_occurrence_ends`)."""
    continuing = carry.continuing
    assert continuing is not None  # (`init` made it)
    t0, t1, info = out.t0, out.t1, out.dense_info
    values = eval_conds(problem, t1, out.y1)
    fired = _detect.fired(problem, carry.cond_values, values)
    fired = jtu.tree_map(lambda f: f & out.accepted & finite, fired)
    found = or_all(jtu.tree_leaves(fired))

    def cut():  # only when some batch element found a crossing
        if problem.event.root_finder is None:
            t = crossing(problem, t0, t1, info, fired, (carry.cond_values, values))
        else:
            t = _detect.crossing(problem, t0, t1, info, fired, carry.cond_values)
        t, y = settle(problem, t0, t1, info, fired, carry.cond_values, out.y1, t)
        return t, tree_where(found, y, out.y1)

    t_star, y_star = lax.cond(unvmap_any(found), cut, lambda: (t1, out.y1))
    count = continuing.count + found.astype(jnp.int32)
    out = out._replace(t1=t_star, y1=y_star, landed=found, t_info=t1)
    apply, result = _occurrence_ends(problem, continuing, found, count, out, new.result)
    # The next step, from the occurrence: the one the controller proposed, which
    # shifts with the occurrence's time and does not stretch with it (else the
    # derivative of each cut would reach every later step, multiplied by each
    # step's factor: a spike time's gradient grew ~25-fold a spike); after an
    # effect, as a solve started there would take (`_after_occurrence`).
    tnext = t_star + lax.stop_gradient(new.tnext - t1)
    y, states, cond_values = _after_occurrence(
        problem,
        t_star,
        tree_where(found, y_star, new.y),
        (found, apply),
        carry.cond_values,
        (new.solver_state, tnext, new.controller_state),
    )
    solver_state, tnext, controller_state = states
    accepted_values = tree_where(out.accepted, values, carry.cond_values)
    new = new._replace(
        t=where(found, t_star, new.t),
        y=y,
        solver_state=tree_where(found, solver_state, new.solver_state),
        controller_state=controller_state,
        cond_values=tree_where(found, cond_values, accepted_values),
        event_mask=tree_where(found, fired, carry.event_mask),
        result=result,
        continuing=Continuing(
            count, where(found, lax.stop_gradient(t_star), continuing.last)
        ),
        tnext=where(found, tnext, new.tnext),
    )
    return new, out


def _occurrence_ends(
    problem: Problem, continuing: Continuing, landed, count, out, result
):
    """Whether the occurrence at the end of a step (where `landed`) is applied, and
    the result: the solve stops at the `stop_at`-th (`event_occurred`, before the
    effect), past `max_events` (`max_events_reached`), or where an occurrence comes
    at the time of the previous one (to a hundred ulps): occurrences accumulate
    there and no solve goes past (`events_accumulated`). The previous occurrence's
    own time, not the start of the step: a step may end within a hundred ulps before
    a crossing that the next step finds (float32 spiking neurons stopped there, with
    a third of their spikes)."""
    t1 = out.t1
    stop = (
        landed & (count >= problem.event.stop_at)
        if problem.event.stop_at
        else jnp.zeros_like(landed)
    )
    over = landed & (count > problem.event.max_events)
    close = 100 * jnp.finfo(t1.dtype).eps * jnp.maximum(jnp.abs(t1), 1)
    accumulated = landed & (t1 - continuing.last <= close) & ~stop & ~over
    result = where(stop, _EVENT, result)
    result = where(over, _MAX_EVENTS, result)
    result = where(accumulated, _ACCUMULATED, result)
    return landed & ~stop & ~over & ~accumulated, result


def _after_occurrence(problem: Problem, t1, y, masks, reference, states):
    """Where `found` (`masks = (found, apply)`: an occurrence at `t1`, the state `y`
    there): the state after the effect where `apply`; the solver's state made anew
    at `t1`, and the next step and the controller's state made anew where an
    effect applies (the state jumped: the steps so far say nothing of what
    follows); the conditions evaluated anew (`reference`: their values at the
    start of the step that found the crossing). Elsewhere `y`, `states` (the
    solver's state, the next step's end, the controller's state) and `reference`.
    Computed only when some batch element found one, and the effect sees the state
    of one that does not apply it without its derivative, so that an effect
    singular away from its events puts no NaN into gradients.

    A condition left at (numerically) zero by the occurrence is taken to be on the
    side it moves to (the sign of its rate along the flow), so that the next
    crossing is found even within the next step; NaN (never fires for a step) where
    it does not move. But where it moves on to the far side of the crossing while,
    before the effect, it moved back (a crossing located within rounding of a
    vanishing bounce), its motion is a crossing of its own, starting there: it is
    taken to be on the side it comes from, so that it fires at once (as at `t0`),
    never to cross unseen."""
    found, apply = masks
    terms, args = problem.terms, problem.args

    def occur(y):
        _, before = _conditions_along_flow(problem, t1, y)
        solver_state, tnext, controller_state = states
        if problem.event.effect is not None:
            effect, t, seen, fn_args = _only_where(
                apply, (problem.event.effect, flip(problem.direction, t1), y, args)
            )
            y = tree_where(apply, like_state(effect(t, seen, fn_args), y), y)
            func = problem.solver.func  # called as func(terms, t, y, args)
            fresh, fresh_state = problem.controller.loop_init(
                terms, t1, problem.t1, y, problem.dt0, args, func, problem.error_order
            )
            fresh = t1 + lax.stop_gradient(jnp.asarray(fresh, t1.dtype) - t1)
            tnext = where(apply, fresh, tnext)
            controller_state = tree_where(apply, fresh_state, controller_state)
        solver_state = problem.solver.init(terms, t1, problem.t1, y, args)
        after, moving = _conditions_along_flow(problem, t1, y)
        side = lambda a, m, b, r: _side_after(a, m, b, r, _window(t1))
        values = jtu.tree_map(side, after, moving, before, reference)
        return y, (solver_state, tnext, controller_state), values

    skip = lambda y: (y, states, reference)  # noqa: E731
    return lax.cond(unvmap_any(found), occur, skip, y)


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
        lambda tau, x: eval_conds(problem, tau, x),
        (t, y),
        (jnp.ones_like(t), rates),
    )


def _window(t):
    """The time within which a located crossing is known: a thousand of `t`'s ulps."""
    return 1000 * jnp.finfo(t.dtype).eps * jnp.maximum(jnp.abs(t), 1)


def start_sides(problem: Problem, cond_values: PyTree) -> PyTree:
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
