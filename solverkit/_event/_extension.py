"""The events' side of the loop: one interface that `_loop` calls at each point of a
solve, whatever events the problem has.

- `start`: before the solver's first state, a `TimedEvent` at `t0`.
- `init`: the events' part of the initial carry.
- `step_end` before each step (it lands on the next `TimedEvent` time), and
    `after_step` after it (an event that stops the solve: its conditions tested; one
    that continues: the step cut at a crossing and the occurrence applied; a
    `TimedEvent` time landed on: its change applied).
- `finish`: the time and state the solve ends at (a located crossing).

Each part is traced only where the problem has that kind of event, and where it
changes the state it is computed (inside a `lax.cond`) only when some batch element
needs it.
"""

from typing import NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._closure._unvmap import unvmap_any
from .._problem import Carry, Continuing, Problem, StepOut
from .._reduce import or_all
from .._select import where
from .._solution import EVENT as _EVENT, SUCCESS
from .._tree import moving_with, tree_where
from ._continuing import after_continuing, after_stopping, start_sides
from ._detect import eval_conds, init_events, locate
from ._timed import apply as apply_timed, first as first_time, next_time


class Start(NamedTuple):
    """The solve's start after a `TimedEvent` at `t0` (`None`s without one)."""

    y0: PyTree  # the state after it
    timed_index: Array | None  # the next `TimedEvent` time
    at_t0: Array | None  # whether one was applied at `t0`


class Fields(NamedTuple):
    """The events' fields of the initial `Carry`."""

    result: Array
    cond_values: PyTree
    event_mask: PyTree
    last: PyTree
    continuing: Continuing | None


def start(problem: Problem) -> Start:
    """The state to start from (after a `TimedEvent` at `t0`)."""
    if problem.event.timed is None:
        return Start(problem.y0, None, None)
    index, at_t0, y0 = _timed_at_t0(problem)
    return Start(y0, index, at_t0)


def init(problem: Problem, solver_state: PyTree) -> Fields:
    """The events' fields of the initial carry: the conditions at `t0` (a boolean one
    true there ends the solve before any step), and an event that continues' count."""
    cond_values, event_mask, last = init_events(problem, solver_state)
    result = jnp.asarray(SUCCESS, jnp.int32)
    if event_mask is not None:
        at_t0 = or_all(jtu.tree_leaves(event_mask))
        result = where(at_t0, _EVENT, SUCCESS).astype(jnp.int32)
    continuing = None
    if problem.event.continues:
        t0 = problem.t0
        continuing = Continuing(
            jnp.asarray(0, jnp.int32), jnp.full((), -jnp.inf, t0.dtype)
        )
        cond_values = start_sides(problem, cond_values)
    return Fields(result, cond_values, event_mask, last, continuing)


def step_end(problem: Problem, carry: Carry, t1: Array) -> tuple[Array, Array | None]:
    """The end of the next step, `t1`, moved back to land on the next `TimedEvent`
    time; and that time (`None` without a `TimedEvent`)."""
    if problem.event.timed is None:
        return t1, None
    assert carry.timed_index is not None
    t_timed = next_time(problem.event.timed, carry.timed_index)
    return where(t_timed < t1, t_timed, t1), t_timed


def after_step(
    problem: Problem, carry: Carry, new: Carry, out: StepOut, finite, t_timed
) -> tuple[Carry, StepOut]:
    """The carry after a step and what the step saves, once the events have acted on
    them (`carry`: before the step; `finite`: whether its state is finite)."""
    if problem.event.conds is not None and not problem.event.continues:
        cond_values, event_mask, last, result = after_stopping(
            problem, carry, out, finite, new.result
        )
        new = new._replace(
            cond_values=cond_values, event_mask=event_mask, last=last, result=result
        )
    if problem.event.continues:
        new, out = after_continuing(problem, carry, new, out, finite)
    if t_timed is not None:
        new = _after_timed(problem, new, out, t_timed)
    return new, out


def finish(problem: Problem, carry: Carry) -> tuple[Array, PyTree]:
    """The time and state the solve ends at: a stopping event's located crossing
    (`carry.result` the final result), else the carry's."""
    if problem.event.conds is None:
        return carry.t, carry.y
    return locate(problem, carry)


def _timed_at_t0(problem: Problem):
    """The first `TimedEvent` time at or after `t0`, applied there if it is at
    `t0`: the index of the next, whether one was applied, and the state after."""
    timed, direction, args = problem.event.timed, problem.direction, problem.args
    assert timed is not None
    t0, before = problem.t0, problem.y0
    index = first_time(timed, t0)
    t_event = next_time(timed, index)
    at_t0 = (t_event == t0) & (t0 < problem.t1)
    t_event = where(at_t0, t_event, t0)  # the event's own time, for its derivative
    effect = lambda y: apply_timed(timed, direction, t_event, y, args, index)
    rate = lambda y: problem.solver.func(problem.terms, t0, y, args)
    after, moved = jax.jvp(effect, (before,), (rate(before),))
    # Its derivative with respect to its time is the one-sided one, of moving it
    # into the solve (earlier, it would be skipped): as for an event at a later
    # time, where the step that lands on it carries this derivative.
    after = moving_with(after, t_event, jtu.tree_map(jnp.subtract, moved, rate(after)))
    y0 = tree_where(at_t0, after, before)
    return index + at_t0.astype(jnp.int32), at_t0, y0


def _after_timed(problem: Problem, new: Carry, out: StepOut, t_timed: Array) -> Carry:
    """After a step that landed on a `TimedEvent` time (and did not end the solve):
    the event's change of state, the solver's state made anew, the conditions of an
    `Event` evaluated anew. Computed only when some batch element landed."""
    timed = problem.event.timed
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
        y = apply_timed(timed, problem.direction, t, new.y, args, index)
        y = tree_where(due, y, new.y)
        restart = problem.solver.init(problem.terms, t, problem.t1, y, args)
        cond_values = new.cond_values
        if problem.event.conds is not None:
            cond_values = tree_where(due, eval_conds(problem, t, y), cond_values)
        # The next step shifts with the event's time (see `after_continuing`).
        tnext = t + lax.stop_gradient(new.tnext - t)
        return new._replace(
            y=y,
            tnext=where(due, tnext, new.tnext),
            solver_state=tree_where(due, restart, new.solver_state),
            cond_values=cond_values,
            timed_index=index + due.astype(jnp.int32),
        )

    return lax.cond(unvmap_any(due), land, lambda new: new, new)
