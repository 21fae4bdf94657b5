"""A solve's events for the loop: the user's `Event` and `TimedEvent` (`event=`)
told apart, and every function of theirs (conditions, effects) closure-converted
once and checked, gathered as the `Problem`'s `Events`."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._closure._convert import (
    array_outputs,
    Closure,
    closure_convert,
    output_struct,
)
from .._custom_types import Args, Y
from .._problem import Events
from .._time import Times
from ._event import Event, with_context
from ._timed import check_like_state, prepare as prepare_timed, TimedEvent


def convert_events(
    event: Event | None,
    timed: TimedEvent | None,
    context: dict,
    times: Times,
    y0: Y,
    args: Args,
) -> Events:
    """`diffeqsolve(event=...)` for the loop.

    **Arguments:**

    - `event`, `timed`: the `Event` and the `TimedEvent` (`split_events`), or `None`.
    - `context`: the keyword arguments a condition may read (`terms`, `solver`,
        `t0`, `t1`, `dt0`, `saveat`, `stepsize_controller`, `max_steps`).
    - `times`: the solve's times; `y0`, `args`: its state and arguments (for one
        trajectory), which the converted functions are traced with.

    **Returns:**

    The `Events` of the `Problem`.
    """
    return Events(
        conds=_conditions(event, context, times, y0, args),
        directions=None if event is None else tuple(event.directions()),
        root_finder=None if event is None else event.root_finder,
        effect=_effect(event, times, y0, args),
        continues=event is not None and event.continues,
        stop_at=None if event is None else event.stop_at,
        max_events=0 if event is None else event.max_events,
        timed=_timed_event(timed, times, y0, args),
    )


def _conditions(event: Event | None, context: dict, times: Times, y0: Y, args: Args):
    """Each of the event's conditions, closure-converted and checked (or `None`)."""
    if event is None:
        return None
    if not isinstance(event, Event):
        raise TypeError(f"`event` must be an Event, got {type(event).__name__}.")
    conds = jtu.tree_map(
        lambda f: closure_convert(
            array_outputs(with_context(f, **context)), times.t0, y0, args
        ),
        event.cond_fn,
        is_leaf=callable,
    )
    for c in jtu.tree_leaves(conds, is_leaf=lambda x: isinstance(x, Closure)):
        out = c.out_struct
        if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
            raise ValueError(
                "Event functions must return a scalar: an Event's cond_fn must return "
                f"a scalar (boolean or real), got {out}."
            )
        if not (
            jnp.issubdtype(out.dtype, jnp.bool_)
            or jnp.issubdtype(out.dtype, jnp.floating)
        ):
            raise ValueError(
                "Event functions must return either a boolean or a float, got "
                f"{out.dtype}."
            )
        if event.continues and jnp.issubdtype(out.dtype, jnp.bool_):
            raise ValueError(
                "An Event with an `effect` (or a `terminal` count) needs "
                "real-valued conditions, whose crossings can be located; got a "
                "boolean one. Return a float that changes sign where the event "
                "happens."
            )
    return conds


def split_events(event) -> tuple[Event | None, TimedEvent | None]:
    """`diffeqsolve(event=...)`: an `Event`, a `TimedEvent`, or one of each in a
    tuple or list."""
    parts = list(event) if isinstance(event, (tuple, list)) else [event]
    found: dict[type, Any] = {Event: None, TimedEvent: None}
    for part in parts:
        kind = type(part) if type(part) in found else None
        if part is None:
            continue
        if kind is None:
            raise TypeError(
                "`event` must be an Event, a TimedEvent, or one of each in a tuple, "
                f"got {type(part).__name__}."
            )
        if found[kind] is not None:
            raise ValueError(
                f"`event` holds two {kind.__name__}s: give one (an Event takes a "
                "pytree of conditions; a TimedEvent a list of times)."
            )
        found[kind] = part
    return found[Event], found[TimedEvent]


def _timed_event(timed: TimedEvent | None, times: Times, y0: Y, args: Args):
    """The `TimedEvent` for the engine (its effect converted), or `None`."""
    if timed is None:
        return None
    effect = None
    if timed.effect is not None:
        effect = closure_convert(timed.effect, times.t0, y0, args)
        check_like_state(output_struct(effect), y0, "TimedEvent(effect=...)'s output")
    return prepare_timed(
        timed,
        times.direction,
        times.dtype,
        times.known_t0,
        times.known_t1,
        y0,
        effect,
    )


def _effect(event: Event | None, times: Times, y0: Y, args: Args):
    """The event's effect, closure-converted and checked (or `None`)."""
    if event is None or event.effect is None:
        return None
    closure = closure_convert(event.effect, times.t0, y0, args)
    check_like_state(output_struct(closure), y0, "Event(effect=...)'s output")
    return closure
