"""`Event`, which stops a solve when a condition fires or changes the state and
continues; `steady_state_event`; and diffrax's deprecated discrete terminating
events, turned into an `Event`."""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._controller._base import AbstractAdaptiveStepSizeController
from .._controller._norm import rms_norm
from .._custom_types import Args, RealScalarLike, Y


class Event(eqx.Module):
    """Terminate the solve when a condition fires; or, with an `effect` (or a
    `terminal` count), change the state where it fires and continue.

    **Arguments:**

    - `cond_fn`: `cond_fn(t, y, args, **kwargs)`, or a pytree of such functions,
        each returning a scalar. A boolean-valued one fires when it returns `True`
        after a step (or at `t0`, which ends the solve there); a real-valued one
        fires when it crosses zero, and the solve then ends exactly at the crossing,
        located on the dense interpolant. The keyword
        arguments are diffrax's (`terms`, `solver`, `t0`, `t1`, `dt0`, `saveat`,
        `stepsize_controller`, `max_steps`): all of them for a `**kwargs`, else
        those it names.
    - `root_finder`: an optimistix root finder (e.g. `optx.Newton(rtol, atol)`) to
        locate real-valued crossings; `None` uses a built-in bisection to machine
        precision. Either way the event time is differentiable (implicit function
        theorem).
    - `direction`: `None` for any crossing (a change of sign), `True` for upward
        (from `<= 0` to `> 0`), `False` for downward (from `> 0` to `<= 0`)
        crossings only; or a pytree of these with the structure of `cond_fn`, one
        per condition.

    - `effect`: `effect(t, y, args) -> y_new`, applied where a condition crosses
        zero; the solve then restarts from `y_new` (the solver's state made anew,
        as after a jump) and continues. `y_new` has the structure, shapes and
        dtypes of `y` (nothing is broadcast). It may close over anything, as the
        vector field may. Conditions must then be real-valued.
    - `terminal`: whether (`True`) or at which occurrence (an int `k`: the `k`-th,
        as SciPy's) the solve stops; `False` never stops. Default: `True` without an
        `effect`, `False` with one. A stop ends the solve at the crossing, before
        the effect.
    - `max_events`: with an effect or a `terminal` count, how many occurrences
        `Solution.events` records; one more ends the solve with
        `RESULTS.max_events_reached` (so an effect that makes the event fire again
        at once stops, never hangs).

    `Solution.event_mask` has the structure of `cond_fn` and says which fired (for
    an event that continues: at its last occurrence). Occurrences of an event that
    continues are in `Solution.events` (an [`solverkit.EventRecord`][]); their
    times are differentiable (implicit function theorem), and so are the effects.
    """

    cond_fn: PyTree[Callable[..., Any]]
    root_finder: Any = None
    direction: PyTree[bool | None] = None
    effect: Callable[..., Any] | None = None
    terminal: bool | int | None = eqx.field(default=None, static=True)
    max_events: int = eqx.field(default=64, static=True)

    @property
    def continues(self) -> bool:
        """Whether the solve goes on past an occurrence (an effect or a count)."""
        return (
            self.effect is not None
            or self.terminal is not None
            and (self.terminal is False or not isinstance(self.terminal, bool))
        )

    @property
    def stop_at(self) -> int | None:
        """The occurrence that stops the solve (`None`: none does)."""
        terminal = self.terminal
        if terminal is None:
            terminal = self.effect is None
        if isinstance(terminal, bool):
            return 1 if terminal else None
        return int(terminal)

    def __check_init__(self):
        if self.effect is not None and not callable(self.effect):
            raise TypeError(
                f"Event(effect=...) must be a callable (t, y, args) -> y, got "
                f"{self.effect!r}."
            )
        if not (
            self.terminal is None
            or isinstance(self.terminal, bool)
            or isinstance(self.terminal, int)
            and self.terminal >= 1
        ):
            raise ValueError(
                "Event(terminal=...) must be True, False or a positive int (stop at "
                f"that occurrence), got {self.terminal!r}."
            )
        if not isinstance(self.max_events, int) or self.max_events < 1:
            raise ValueError(
                "Event(max_events=...) must be a positive int, got "
                f"{self.max_events!r}."
            )
        if not jtu.tree_leaves(self.cond_fn, is_leaf=callable):
            raise ValueError("Event(cond_fn=...) needs at least one condition.")
        for f in jtu.tree_leaves(self.cond_fn, is_leaf=callable):
            if not callable(f):
                raise TypeError(
                    f"Event(cond_fn=...) must be a pytree of callables, got {f!r}."
                )
        if self.direction is None or isinstance(self.direction, bool):
            return
        is_none = lambda x: x is None
        want = jtu.tree_structure(self.cond_fn, is_leaf=callable)
        got = jtu.tree_structure(self.direction, is_leaf=is_none)
        leaves = jtu.tree_leaves(self.direction, is_leaf=is_none)
        if got != want or not all(d is None or isinstance(d, bool) for d in leaves):
            raise ValueError(
                "Missmatch in the structure of `cond_fn` and `direction` (diffrax's "
                "words), or a direction that is not None or a bool: "
                "Event(direction=...) must be None, a bool, or a pytree of None/bool "
                f"with the structure of `cond_fn` ({want}); got {self.direction!r}."
            )

    def directions(self) -> list:
        """One direction per condition (leaf of `cond_fn`)."""
        n = len(jtu.tree_leaves(self.cond_fn, is_leaf=callable))
        if self.direction is None or isinstance(self.direction, bool):
            return [self.direction] * n
        return jtu.tree_leaves(self.direction, is_leaf=lambda x: x is None)


def with_context(cond_fn: Callable, **context) -> Callable:
    """`cond_fn` with diffrax's keyword arguments bound (`terms`, `solver`, `t0`,
    `t1`, `dt0`, `saveat`, `stepsize_controller`, `max_steps`): all of them if it takes
    `**kwargs`, else those it names."""
    try:
        params = inspect.signature(cond_fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass none
        return cond_fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return functools.partial(cond_fn, **context)
    named = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    bound = {k: v for k, v in context.items() if k in named}
    return functools.partial(cond_fn, **bound) if bound else cond_fn


def steady_state_event(rtol=None, atol=None, norm=None) -> Callable:
    """A condition for [`solverkit.Event`][] that fires once the solve reaches a
    steady state: `norm(f(t, y)) < atol + rtol * norm(y)`.

    **Arguments:**

    - `rtol`, `atol`, `norm`: default to those of the solve's `PIDController`.

    **Returns:**

    `cond_fn(t, y, args, **kwargs)`.
    """

    def cond_fn(
        t: RealScalarLike,
        y: Y,
        args: Args,
        *,
        terms,
        solver,
        stepsize_controller,
        **kwargs,
    ):
        def default(value, name):
            if value is not None:
                return value
            if not isinstance(stepsize_controller, AbstractAdaptiveStepSizeController):
                raise ValueError(
                    "The `rtol`, `atol`, and `norm` for `steady_state_event` default "
                    "to the values used with an adaptive step size controller (such "
                    "as `PIDController`). Either use an adaptive step size "
                    "controller, or pass `rtol`, `atol` and `norm` to "
                    "steady_state_event."
                )
            return getattr(stepsize_controller, name)

        _rtol, _atol = default(rtol, "rtol"), default(atol, "atol")
        _norm = default(norm, "norm")
        return _norm(solver.func(terms, t, y, args)) < _atol + _rtol * _norm(y)

    return cond_fn


# --- diffrax's deprecated `discrete_terminating_event=` -------------------------------


class AbstractDiscreteTerminatingEvent(eqx.Module):
    """Deprecated (as in diffrax): a condition `event(state, **kwargs)` on the state
    after each step (`state.y`, `state.tprev`). Use [`solverkit.Event`][]."""

    def __call__(self, state, **kwargs):
        raise NotImplementedError


class DiscreteTerminatingEvent(AbstractDiscreteTerminatingEvent):
    """Deprecated: `Event(lambda t, y, args, **kw: ...)` instead.

    **Arguments:**

    - `cond_fn`: `cond_fn(state, **kwargs) -> bool`.
    """

    cond_fn: Callable[..., Any]

    def __call__(self, state, **kwargs):
        return self.cond_fn(state, **kwargs)


class SteadyStateEvent(AbstractDiscreteTerminatingEvent):
    """Deprecated: `Event(steady_state_event(rtol, atol, norm))` instead.

    **Arguments:**

    - `rtol`, `atol`: default to the step-size controller's.
    - `norm`: default RMS.
    """

    rtol: float | None = None
    atol: float | None = None
    norm: Callable | None = None

    def __call__(self, state, *, args: Args, **kwargs):
        norm = rms_norm if self.norm is None else self.norm
        return steady_state_event(self.rtol, self.atol, norm)(
            state.tprev, state.y, args, **kwargs
        )


class _State(eqx.Module):
    tprev: Any
    y: Any


class _DiscreteAsCondition(eqx.Module):
    event: AbstractDiscreteTerminatingEvent

    def __call__(self, t: RealScalarLike, y: Y, args: Args, **kwargs):
        return self.event(_State(tprev=t, y=y), args=args, **kwargs)


def as_event(discrete) -> Event:
    """A deprecated discrete terminating event as an `Event`."""
    if not isinstance(discrete, AbstractDiscreteTerminatingEvent):
        raise TypeError(
            "`discrete_terminating_event` must be a DiscreteTerminatingEvent or "
            f"SteadyStateEvent, got {discrete!r}."
        )
    return Event(_DiscreteAsCondition(discrete))
