"""`Event`: stop a solve when a condition fires (and diffrax's deprecated discrete
terminating events, turned into one)."""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._controller import AbstractAdaptiveStepSizeController
from ._custom_types import Args, RealScalarLike, Y
from ._norm import rms_norm


class Event(eqx.Module):
    """Terminate the solve when a condition fires.

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

    `Solution.event_mask` has the structure of `cond_fn` and says which fired.
    """

    cond_fn: PyTree[Callable[..., Any]]
    root_finder: Any = None
    direction: PyTree[bool | None] = None

    def __check_init__(self):
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
                    "steady_state_event: pass `rtol`, `atol` and `norm`, or solve "
                    "with an adaptive controller (PIDController) to take them from."
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
