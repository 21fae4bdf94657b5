"""From `diffeqsolve`'s arguments to a `Problem`: the checks of the inputs, the
times, and every user function (terms, saves, event conditions and effects, those of
the linear solvers) converted once (`make_problem`). Shared by `diffeqsolve`
(`_integrate.py`) and `ensemble_solve`."""

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from ._adjoint._base import AbstractAdjoint
from ._closure._convert import Closure, closure_convert
from ._controller._base import AbstractStepSizeController
from ._custom_types import Args, BoolScalarLike, RealScalarLike, Y
from ._errors import BadInputError, concrete, StructureError
from ._event import _timed, as_event, Event, TimedEvent, with_context
from ._linear._linear_solver import convert_linear_solvers
from ._problem import Events, Problem, Resume, Save
from ._saveat import is_sub, save_y, SaveAt
from ._select import where
from ._solver import AbstractSolver
from ._term import (
    AbstractTerm,
    check_term_structure,
    ClosureTerm,
    MultiTerm,
    MultiTermStructure,
    rate_function,
)
from ._time import flip
from ._user_solver import convert as convert_user_solver, is_user_solver


class Times(NamedTuple):
    """The times of a solve, checked: arrays of one floating dtype, their values where
    known before tracing (else `None`), and the direction of integration."""

    dtype: Any
    t0: Array
    t1: Array
    dt0: Array | None  # internal time (positive)
    known_t0: Any
    known_t1: Any
    known_dt0: Any
    direction: Array | None  # -1 backwards, None forwards (see `_time.py`)


def solve_times(
    t0: RealScalarLike, t1: RealScalarLike, dt0: RealScalarLike | None
) -> Times:
    """Check `t0`, `t1`, `dt0` and bring them to one floating dtype."""
    inputs = [t0, t1] + ([] if dt0 is None else [dt0])
    for name, value in zip(("t0", "t1", "dt0"), inputs):
        if jnp.ndim(value) != 0:
            raise ValueError(
                f"`{name}` must be a scalar, got shape {jnp.shape(value)}."
            )
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*inputs, float)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(  # diffrax's words
            "Cannot use complex dtype for `t0`, `t1`, `dt0`, or `SaveAt(ts=...)`: "
            f"times must be real, got dtype {dtype}."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"Times must be real, got dtype {dtype}.")
    # Read known values before `jnp.asarray`, which under `jit` makes even a Python
    # float a tracer (a traced direction would cost a differentiated parameter).
    c0, c1, cdt = concrete(t0), concrete(t1), concrete(dt0)
    if cdt is not None and c0 is not None and c1 is not None:
        # Both errors are also `RuntimeError`s, as diffrax's (raised by
        # `eqx.error_if`; with `dt0 == 0` diffrax runs out of steps).
        if cdt == 0 and c0 != c1:
            raise BadInputError("`dt0` must be non-zero.")
        if (c1 - c0) * cdt < 0:
            raise BadInputError(
                "Must have (t1 - t0) * dt0 >= 0: `dt0` must have the sign of "
                f"`t1 - t0`; got t0={c0}, t1={c1}, dt0={cdt}."
            )
    t0, t1 = jnp.asarray(t0, dtype), jnp.asarray(t1, dtype)
    if c0 is not None and c1 is not None:
        direction = None if c1 >= c0 else jnp.asarray(-1, dtype)
    else:
        direction = where(t1 >= t0, 1, -1).astype(dtype)
    times = Times(dtype, t0, t1, None, c0, c1, cdt, direction)
    if dt0 is not None:
        times = times._replace(dt0=flip(direction, jnp.asarray(dt0, dtype)))
    return times


def bind_controller(solver, controller, times: Times, dt0):
    """`solver`, given `controller`'s tolerances (for its Newton iterations), once
    `controller` is checked against the solver's error order and the times."""
    # No terms here to pass: the built-in solvers' error orders don't use them.
    error_order = solver.error_order(None)
    controller.check(error_order, times.known_t0, times.known_t1, dt0)
    return solver.bind_controller_tols(controller.tolerances())


def as_state(y0: Y):
    def leaf(y: Y):
        y = jnp.asarray(y)
        if not jnp.issubdtype(y.dtype, jnp.inexact):
            y = y.astype(jnp.result_type(float))
        # Strongly typed (as diffrax's): with a weak state, a closed-over float32
        # value would pull the vector field's arithmetic down to float32.
        return jnp.asarray(y, dtype=y.dtype) if y.weak_type else y

    y0 = jtu.tree_map(leaf, y0)
    if any(jnp.iscomplexobj(y) for y in jtu.tree_leaves(y0)):
        warnings.warn(
            "Complex dtype in `y0`: solverkit integrates complex states; adaptive "
            "steps measure the modulus of the error, and autodiff follows JAX's "
            "conventions for complex numbers.",
            UserWarning,
            stacklevel=3,
        )
    return y0


_NUMBERS = (bool, int, float, complex)


def _output_struct(closure: Closure) -> PyTree:
    """`closure.out_struct`, with Python-number outputs (static in a `Closure`, as in
    `equinox.filter_jit`) as the weakly typed scalars they become when used."""

    def leaf(o):
        if isinstance(o, _NUMBERS):
            return jax.eval_shape(jnp.asarray, o)
        return o

    return jtu.tree_map(leaf, closure.out_struct)


def _array_outputs(fn):
    """`fn` with its Python-number outputs made arrays, so that they are traced."""

    def with_arrays(*args, **kwargs):
        out = fn(*args, **kwargs)
        return jtu.tree_map(
            lambda o: jnp.asarray(o) if isinstance(o, _NUMBERS) else o, out
        )

    return with_arrays


def _check_output(closure: Closure, y0: Y, what: str) -> None:
    """The output of a converted function must be usable as `dy/dt`: the structure,
    shapes and dtypes of `y0`, except what diffrax also accepts (see `like_state`)."""
    out = _output_struct(closure)
    y_tree, out_tree = jtu.tree_structure(y0), jtu.tree_structure(out)
    out_leaves = jtu.tree_leaves(out)
    if y_tree != out_tree:
        if len(out_leaves) == 1 and out_leaves[0].shape == ():
            out_leaves = out_leaves * y_tree.num_leaves  # a scalar, broadcast
        else:
            raise StructureError(  # a TypeError; diffrax raises a ValueError
                f"The {what} must return a pytree with the same structure as `y0`: "
                f"expected {y_tree}, got {out_tree}."
            )
    for i, (y, o) in enumerate(zip(jtu.tree_leaves(y0), out_leaves)):
        if tuple(o.shape) not in ((), tuple(y.shape)):
            raise ValueError(
                f"The {what} must return arrays of the shapes of `y0`: leaf {i} should "
                f"have shape {tuple(y.shape)}, got {tuple(o.shape)}."
            )
        if jnp.iscomplexobj(o) and not jnp.iscomplexobj(y):
            raise TypeError(
                f"The {what} returns a complex value for the real leaf {i} of `y0` "
                f"(dtype {y.dtype}): casting would drop the imaginary part. Make "
                "`y0` complex, or return a real value."
            )


def _closure_term(term: AbstractTerm, times: Times, y0: Y, args: Args) -> ClosureTerm:
    closure = closure_convert(rate_function(term), times.t0, y0, args)
    _check_output(closure, y0, "vector field")
    return ClosureTerm(closure, times.direction)


def _convert_terms(terms, solver: AbstractSolver, times: Times, y0: Y, args: Args):
    """`(solver, terms)` for the loop: each term's vector field closure-converted
    once, in the structure the solver takes: one `ClosureTerm`, or a `MultiTerm` of
    them for a solver whose `term_structure` is a tuple (an IMEX solver); any other
    solver integrates the sum of a `MultiTerm`'s terms. A user's own solver gets
    the user's terms themselves, its functions converted with them inside
    (`_user_solver.py`); its terms may be a pytree of terms (a plain tuple for
    `SemiImplicitEuler`), checked against its `term_structure`."""
    structure, name = solver.term_structure, type(solver).__name__
    user = is_user_solver(solver)
    if isinstance(structure, (tuple, list, dict)):  # a built-in one: IMEX
        multi = structure if user else MultiTermStructure(structure)
        check_term_structure(terms, multi, name)
    elif not isinstance(terms, AbstractTerm):
        raise TypeError(
            "`terms` must be a term, e.g. ODETerm(vector_field) or MultiTerm(...), "
            f"got {type(terms).__name__}."
        )
    if user:
        return convert_user_solver(
            solver,
            terms,
            lambda: _closure_term(terms, times, y0, args),
            flip(times.direction, times.t0),
            flip(times.direction, times.t1),
            times.direction,
            y0,
            args,
        )
    if not isinstance(terms, MultiTerm) or not isinstance(structure, tuple):
        return solver, _closure_term(terms, times, y0, args)
    return solver, MultiTerm(*[_closure_term(t, times, y0, args) for t in terms.terms])


def _save_times(ts, times: Times):
    """`SubSaveAt.ts` in internal time, checked against `[t0, t1]` where known."""
    if ts is None:
        return None
    if jnp.ndim(ts) != 1:
        raise ValueError(
            "SaveAt(ts=...) must be a 1-D array of times, got shape "
            f"{jnp.shape(ts)} (2-D times, one row per trajectory, are for "
            "`ensemble_solve`)."
        )
    ts = jnp.asarray(ts, times.dtype)
    cts, c0, c1 = concrete(ts), times.known_t0, times.known_t1
    if cts is not None and c0 is not None and c1 is not None and cts.size:
        lo, hi = min(c0, c1), max(c0, c1)
        if cts.min() < lo or cts.max() > hi:
            raise BadInputError(
                "saveat.ts must lie between t0 and t1: [t0, t1] = "
                f"[{c0}, {c1}], got times from {cts.min()} to {cts.max()}."
            )
        if cts.size > 1 and np.any(np.diff(cts) * (c1 - c0) < 0):
            raise BadInputError(
                "saveat.ts must be increasing or decreasing, in the direction from "
                "t0 to t1."
            )
    return flip(times.direction, ts)


def _saves(saveat: SaveAt, times: Times, y0: Y, args: Args, max_steps):
    """One `Save` per `SubSaveAt`, and the structure they came in."""
    subs, save_tree = jtu.tree_flatten(saveat.subs, is_leaf=is_sub)
    saves = tuple(
        Save(
            ts=_save_times(sub.ts, times),
            fn=closure_convert(
                sub.fn if sub.fn is save_y else _array_outputs(sub.fn),
                times.t0,
                y0,
                args,
            ),
            t0=bool(sub.t0),
            t1=bool(sub.t1),
            every=sub.every,
            saves_y=sub.fn is save_y,
        )
        for sub in subs
    )
    if max_steps is None and any(s.every for s in saves):
        raise ValueError(
            "`max_steps=None` is incompatible with saving at `steps=n`: "
            "SaveAt(steps=...) keeps `max_steps` rows; pass an int."
        )
    if max_steps is None and saveat.dense:
        raise ValueError(
            "`max_steps=None` is incompatible with `saveat.dense=True`: the dense "
            "solution keeps `max_steps` steps; pass an int."
        )
    return saves, save_tree


def _event_conditions(
    event: Event | None, context: dict, times: Times, y0: Y, args: Args
):
    """Each of the event's conditions, closure-converted and checked (or `None`)."""
    if event is None:
        return None
    if not isinstance(event, Event):
        raise TypeError(f"`event` must be an Event, got {type(event).__name__}.")
    conds = jtu.tree_map(
        lambda f: closure_convert(
            _array_outputs(with_context(f, **context)), times.t0, y0, args
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
        _timed.check_like_state(
            _output_struct(effect), y0, "TimedEvent(effect=...)'s output"
        )
    return _timed.prepare(
        timed,
        times.direction,
        times.dtype,
        times.known_t0,
        times.known_t1,
        y0,
        effect,
    )


def _event_effect(event: Event | None, times: Times, y0: Y, args: Args):
    """The event's effect, closure-converted and checked (or `None`)."""
    if event is None or event.effect is None:
        return None
    closure = closure_convert(event.effect, times.t0, y0, args)
    _timed.check_like_state(_output_struct(closure), y0, "Event(effect=...)'s output")
    return closure


def check_arguments(solver, saveat, stepsize_controller, adjoint, max_steps):
    if not isinstance(solver, AbstractSolver):
        raise TypeError(f"`solver` must be a solverkit solver, got {solver!r}.")
    if not isinstance(saveat, SaveAt):
        raise TypeError(f"`saveat` must be a SaveAt, got {type(saveat).__name__}.")
    if not isinstance(stepsize_controller, AbstractStepSizeController):
        raise TypeError(
            "`stepsize_controller` must be ConstantStepSize(), StepTo(ts), "
            "PIDController(...) or ClipStepSizeController(...), got "
            f"{stepsize_controller!r}."
        )
    if not isinstance(adjoint, AbstractAdjoint):
        raise TypeError(f"`adjoint` must be a solverkit adjoint, got {adjoint!r}.")
    if max_steps is not None and (
        isinstance(max_steps, bool)
        or not isinstance(max_steps, (int, np.integer))
        or max_steps < 1
    ):
        raise ValueError(
            f"`max_steps` must be a positive integer or None, got {max_steps!r}."
        )


def legacy_event(event, discrete_terminating_event):
    """diffrax's deprecated `discrete_terminating_event=`, as an `Event`."""
    if discrete_terminating_event is None:
        return event
    warnings.warn(
        "`diffeqsolve(..., discrete_terminating_event=...)` is deprecated (as in "
        "diffrax): pass `event=Event(cond_fn)` instead.",
        DeprecationWarning,
        stacklevel=3,
    )
    if event is not None:
        raise ValueError(
            "Cannot pass both `event=...` and `discrete_terminating_event=...`: "
            "pass either, not both (`event=...` is the current spelling)."
        )
    return as_event(discrete_terminating_event)


def resume_states(
    solver_state: PyTree, controller_state: PyTree, made_jump: BoolScalarLike | None
) -> Resume | None:
    """The states passed in to continue an earlier solve, or `None`."""
    if solver_state is None and controller_state is None:
        return None
    if made_jump is not None:
        if jnp.shape(made_jump) != () or jnp.result_type(made_jump) != jnp.bool_:
            raise ValueError(
                "`made_jump` must be a boolean scalar (as `SaveAt(made_jump=True)` "
                f"returns it), got {made_jump!r}."
            )
        made_jump = jnp.asarray(made_jump)
    return Resume(solver_state, controller_state, made_jump)


class Keep(NamedTuple):
    """Which final internal states a solve returns, as `SaveAt(solver_state=...,
    controller_state=..., made_jump=...)` asks."""

    solver_state: bool
    controller_state: bool
    made_jump: bool

    @classmethod
    def of(cls, saveat: SaveAt) -> "Keep":
        return cls(saveat.solver_state, saveat.controller_state, saveat.made_jump)


def make_problem(
    terms,
    solver,
    times: Times,
    y0,
    args,
    saveat,
    controller,
    event,
    max_steps,
    meter,
    dt0,
    resume,
) -> Problem:
    """Convert every user function (terms, saves, event conditions, those of the
    linear solvers) once and gather all a solve needs, in internal time."""
    saves, save_tree = _saves(saveat, times, y0, args, max_steps)
    event, timed = split_events(event)
    context = dict(
        terms=terms,
        solver=solver,
        t0=times.t0,
        t1=times.t1,
        dt0=dt0,
        saveat=saveat,
        stepsize_controller=controller,
        max_steps=max_steps,
    )
    if not is_user_solver(solver):  # e.g. a callable preconditioner, converted
        solver = convert_linear_solvers(solver, y0)
    engine_solver, engine_terms = _convert_terms(terms, solver, times, y0, args)
    return Problem(
        solver=engine_solver,
        controller=controller.to_internal(times.direction),
        terms=engine_terms,
        direction=times.direction,
        args=args,
        y0=y0,
        t0=flip(times.direction, times.t0),
        t1=flip(times.direction, times.t1),
        dt0=times.dt0,
        saves=saves,
        save_tree=save_tree,
        dense=saveat.dense,
        event=Events(
            conds=_event_conditions(event, context, times, y0, args),
            directions=None if event is None else tuple(event.directions()),
            root_finder=None if event is None else event.root_finder,
            effect=_event_effect(event, times, y0, args),
            continues=event is not None and event.continues,
            stop_at=None if event is None else event.stop_at,
            max_events=0 if event is None else event.max_events,
            timed=_timed_event(timed, times, y0, args),
        ),
        max_steps=None if max_steps is None else int(max_steps),
        meter=meter,
        resume=resume,
    )
