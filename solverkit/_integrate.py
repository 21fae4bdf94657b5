"""`diffeqsolve`: check the inputs, convert the vector field, hand over to the adjoint,
build the `Solution`."""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._adjoint import (
    AbstractAdjoint,
    forward_mode_error,
    is_forward_mode_error,
    RecursiveCheckpointAdjoint,
)
from ._closure import Closure, closure_convert
from ._controller import AbstractStepSizeController, ConstantStepSize, StepTo
from ._errors import BadInputError
from ._event import as_event, Event, with_context
from ._interpolation import DenseInterpolation
from ._loop import Problem, Save, VectorField
from ._progress import AbstractProgressMeter, NoProgressMeter
from ._saveat import is_sub, SaveAt
from ._select import where
from ._solution import Result, RESULTS, Solution
from ._solver import AbstractSolver
from ._term import ODETerm
from ._unvmap import unvmap_max


def _concrete(x):
    """`x` as a NumPy value if it is known now (not traced), else `None`."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except Exception:
        return None


def _as_state(y0):
    def leaf(y):
        y = jnp.asarray(y)
        if not jnp.issubdtype(y.dtype, jnp.inexact):
            y = y.astype(jnp.result_type(float))
        return y

    return jtu.tree_map(leaf, y0)


def _check_output(closure: Closure, y0, what: str) -> None:
    out = closure.out_struct
    y_tree, out_tree = jtu.tree_structure(y0), jtu.tree_structure(out)
    if y_tree != out_tree:
        raise TypeError(
            f"The {what} must return a pytree with the structure of `y0`: expected "
            f"{y_tree}, got {out_tree}."
        )
    for i, (y, o) in enumerate(zip(jtu.tree_leaves(y0), jtu.tree_leaves(out))):
        if tuple(y.shape) != tuple(o.shape):
            raise ValueError(
                f"The {what} must return arrays of the shapes of `y0`: leaf {i} should "
                f"have shape {tuple(y.shape)}, got {tuple(o.shape)}."
            )
        if y.dtype != o.dtype:
            raise TypeError(
                f"The {what} must return arrays of the dtypes of `y0`: leaf {i} should "
                f"have dtype {y.dtype}, got {o.dtype}. Cast the output (or `y0`)."
            )


def _save_times(ts, dtype, c0, c1, sign):
    """`SubSaveAt.ts` in internal time, checked against `[t0, t1]` where known."""
    if ts is None:
        return None
    ts = jnp.asarray(ts, dtype)
    cts = _concrete(ts)
    if cts is not None and c0 is not None and c1 is not None and cts.size:
        lo, hi = min(c0, c1), max(c0, c1)
        if cts.min() < lo or cts.max() > hi:
            raise BadInputError(
                f"SaveAt(ts=...) must lie within [t0, t1] = [{c0}, {c1}]; got "
                f"times from {cts.min()} to {cts.max()}."
            )
        if cts.size > 1 and np.any(np.diff(cts) * (c1 - c0) < 0):
            raise BadInputError(
                "SaveAt(ts=...) must run in the direction from t0 to t1."
            )
    return sign(ts)


def diffeqsolve(
    terms: ODETerm,
    solver: AbstractSolver,
    t0,
    t1,
    dt0,
    y0: PyTree,
    args: PyTree = None,
    *,
    saveat: SaveAt = SaveAt(t1=True),
    stepsize_controller: AbstractStepSizeController = ConstantStepSize(),
    adjoint: AbstractAdjoint = RecursiveCheckpointAdjoint(),
    event: Event | None = None,
    max_steps: int | None = 4096,
    throw: bool = True,
    progress_meter: AbstractProgressMeter = NoProgressMeter(),
    solver_state: Any = None,
    controller_state: Any = None,
    made_jump: Any = None,
    discrete_terminating_event: Any = None,
) -> Solution:
    """Solve the ODE `dy/dt = f(t, y, args)` from `t0` to `t1`.

    The vector field may close over anything (JAX arrays of any dtype, tracers of
    enclosing transformations): it is closure-converted once, here, and from then on is
    an explicit operand of every loop and custom derivative rule.

    **Arguments:**

    - `terms`: an [`solverkit.ODETerm`][].
    - `solver`: e.g. `Tsit5()`.
    - `t0`, `t1`: start and end times; `t1 < t0` integrates backwards.
    - `dt0`: the first step (signed like `t1 - t0`), or `None` to choose it
        automatically (adaptive controllers only).
    - `y0`: initial state, a pytree of floating or complex arrays (integer leaves are
        promoted to floating point).
    - `args`: passed to the vector field as its third argument.
    - `saveat`: what to save, a [`solverkit.SaveAt`][].
    - `stepsize_controller`: `ConstantStepSize()`, `StepTo(ts)`, `PIDController`, or
        a `ClipStepSizeController` around one.
    - `adjoint`: how to differentiate: `RecursiveCheckpointAdjoint()` (default),
        `BacksolveAdjoint()` or `DirectAdjoint()`.
    - `event`: an optional [`solverkit.Event`][] that terminates the solve.
    - `max_steps`: the most steps to take (a positive int), or `None` for no bound
        (not with `SaveAt(steps=...)` or `SaveAt(dense=True)`, nor for reverse mode
        through `RecursiveCheckpointAdjoint`).
    - `throw`: raise on failure (a `RuntimeError` subclass; under `vmap`, if any batch
        element fails); with `False` check `Solution.result` instead. With fixed
        steps (`ConstantStepSize`, `StepTo`) a non-finite state is reported as
        `RESULTS.nonfinite`; without an event the solve still runs on to `t1`. An
        adaptive controller rejects such steps instead.
    - `progress_meter`: `NoProgressMeter()`, `TextProgressMeter()` or
        `TqdmProgressMeter()`.
    - `solver_state`, `controller_state`, `made_jump`: accepted for diffrax
        compatibility; must be `None`.
    - `discrete_terminating_event`: deprecated (as in diffrax): a
        `DiscreteTerminatingEvent` or `SteadyStateEvent`; use `event=` instead.

    **Returns:**

    A [`solverkit.Solution`][].
    """
    if not isinstance(terms, ODETerm):
        raise TypeError(
            f"`terms` must be an ODETerm(vector_field), got {type(terms).__name__}."
        )
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
    if discrete_terminating_event is not None:
        warnings.warn(
            "`diffeqsolve(..., discrete_terminating_event=...)` is deprecated (as in "
            "diffrax): pass `event=Event(cond_fn)` instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        if event is not None:
            raise ValueError(
                "Pass `event=...` or `discrete_terminating_event=...`, not both."
            )
        event = as_event(discrete_terminating_event)
    if made_jump is False:
        made_jump = None  # no jump: the default
    if any(x is not None for x in (solver_state, controller_state, made_jump)):
        raise ValueError(
            "solverkit does not resume from `solver_state`, `controller_state` or "
            "`made_jump`: pass None (or `made_jump=False`)."
        )
    stepsize_controller.check(solver, dt0)
    solver = solver.bind_controller_tols(stepsize_controller)

    # Times: one floating dtype for t0, t1, dt0 and the save times.
    time_inputs = [t0, t1] + ([] if dt0 is None else [dt0])
    for name, value in zip(("t0", "t1", "dt0"), time_inputs):
        if jnp.ndim(value) != 0:
            raise ValueError(
                f"`{name}` must be a scalar, got shape {jnp.shape(value)}."
            )
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*time_inputs, float)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"Times must be real, got dtype {dtype}.")
    # Read known values before `jnp.asarray`, which under `jit` makes even a Python
    # float a tracer (a traced direction would cost a differentiated parameter).
    c0, c1, cdt = _concrete(t0), _concrete(t1), _concrete(dt0)
    t0 = jnp.asarray(t0, dtype)
    t1 = jnp.asarray(t1, dtype)
    if cdt is not None and c0 is not None and c1 is not None:
        if cdt == 0 and c0 != c1:
            raise ValueError("`dt0` must be non-zero.")
        if (c1 - c0) * cdt < 0:
            raise ValueError(
                "`dt0` must have the sign of `t1 - t0`: got "
                f"t0={c0}, t1={c1}, dt0={cdt}."
            )
    if c0 is not None and c1 is not None:
        direction = None if c1 >= c0 else jnp.asarray(-1, dtype)
    else:
        direction = where(t1 >= t0, 1, -1).astype(dtype)
    sign = (lambda x: x) if direction is None else (lambda x: direction * x)

    y0 = _as_state(y0)
    if any(jnp.iscomplexobj(y) for y in jtu.tree_leaves(y0)):
        warnings.warn(
            "Complex dtype in `y0`: solverkit integrates complex states; adaptive "
            "steps measure the modulus of the error, and autodiff follows JAX's "
            "conventions for complex numbers.",
            UserWarning,
            stacklevel=2,
        )
    closure = closure_convert(terms.vector_field, t0, y0, args)
    _check_output(closure, y0, "vector field")

    subs, save_tree = jtu.tree_flatten(saveat.subs, is_leaf=is_sub)
    saves = tuple(
        Save(
            ts=_save_times(sub.ts, dtype, c0, c1, sign),
            fn=closure_convert(sub.fn, t0, y0, args),
            t0=bool(sub.t0),
            t1=bool(sub.t1),
            every=sub.every,
        )
        for sub in subs
    )
    if max_steps is None and (saveat.dense or any(s.every for s in saves)):
        raise ValueError(
            "`max_steps=None` can't be used with SaveAt(steps=...) or "
            "SaveAt(dense=True), whose buffers have `max_steps` rows: pass an int."
        )
    if isinstance(stepsize_controller, StepTo):
        cts = _concrete(stepsize_controller.ts)
        if cts is not None and c0 is not None and c1 is not None:
            if cts[0] != c0 or cts[-1] != c1:
                raise BadInputError("StepTo(ts): `ts` must start at t0 and end at t1.")

    conds = None
    if event is not None:
        if not isinstance(event, Event):
            raise TypeError(f"`event` must be an Event, got {type(event).__name__}.")
        context = dict(
            terms=terms,
            solver=solver,
            t0=t0,
            t1=t1,
            dt0=dt0,
            saveat=saveat,
            stepsize_controller=stepsize_controller,
            max_steps=max_steps,
        )
        conds = jtu.tree_map(
            lambda f: closure_convert(with_context(f, **context), t0, y0, args),
            event.cond_fn,
            is_leaf=callable,
        )
        for c in jtu.tree_leaves(conds, is_leaf=lambda x: isinstance(x, Closure)):
            out = c.out_struct
            if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
                raise ValueError(
                    "An Event's cond_fn must return a scalar (boolean or real), got "
                    f"{out}."
                )
            if not (
                jnp.issubdtype(out.dtype, jnp.bool_)
                or jnp.issubdtype(out.dtype, jnp.floating)
            ):
                raise ValueError(
                    "An Event's cond_fn must return a boolean or a float, got "
                    f"{out.dtype}."
                )
    dt0_internal = None if dt0 is None else sign(jnp.asarray(dt0, dtype))
    problem = Problem(
        solver=solver,
        controller=stepsize_controller,
        term=VectorField(closure, direction),
        args=args,
        y0=y0,
        t0=sign(t0),
        t1=sign(t1),
        dt0=dt0_internal,
        saves=saves,
        save_tree=save_tree,
        dense=saveat.dense,
        conds=conds,
        event_direction=None if event is None else tuple(event.directions()),
        root_finder=None if event is None else event.root_finder,
        max_steps=None if max_steps is None else int(max_steps),
        meter=progress_meter,
    )
    adjoint.check(problem)
    try:
        keep = (saveat.solver_state, saveat.controller_state, saveat.made_jump)
        # The engine mixes dtypes on purpose (float64 times with float32 states,
        # complex states with real tolerances) and casts where it must, so it is
        # traced with standard promotion whatever the user's setting; the user's own
        # functions were traced (converted) above, under theirs.
        with jax.numpy_dtype_promotion("standard"):
            return _solve(problem, adjoint, throw, keep)
    except TypeError as e:
        if is_forward_mode_error(e):
            raise forward_mode_error(type(adjoint).__name__, e) from None
        raise


_MESSAGES = [r.message() or "successful" for r in RESULTS]


@eqx.filter_jit
def _solve(problem: Problem, adjoint, throw, keep: tuple[bool, bool, bool]):
    keep_solver_state, keep_controller_state, keep_made_jump = keep
    out = adjoint.loop(problem)
    term = problem.term
    direction = term.direction

    def user(tau):
        if direction is None:
            return tau
        return where(jnp.isfinite(tau), direction * tau, tau)

    ts, ys, t_end, result = out.ts, out.ys, out.t_end, out.result
    if throw:
        failed = (result != RESULTS.successful.code) & (
            result != RESULTS.event_occurred.code
        )
        # Unbatched and non-differentiated, as equinox's error machinery needs; one
        # reduction serves both (failure codes are positive).
        index = unvmap_max(where(failed, result, 0))
        ts, ys, t_end = eqx.branched_error_if(
            (ts, ys, t_end), index > 0, index, _MESSAGES
        )
    interpolation = None
    if problem.dense:
        dense_ts = out.bufs["dense_ts"].at[0].set(problem.t0)
        interpolation = DenseInterpolation(
            dense_ts,
            out.bufs["dense_info"],
            out.carry.num_accepted,
            direction,
            problem.solver,
            problem.y0,
        )
    carry = out.carry
    stats = dict(
        num_steps=carry.num_steps,
        num_accepted_steps=carry.num_accepted,
        num_rejected_steps=carry.num_rejected,
        max_steps=problem.max_steps,
    )
    return Solution(
        t0=term.to_user(problem.t0),
        t1=term.to_user(t_end),
        ts=jtu.tree_map(user, ts),
        ys=ys,
        stats=stats,
        result=Result(result),
        event_mask=carry.event_mask,
        made_jump=False if keep_made_jump else None,  # no jumps in an ODE
        solver_state=carry.solver_state if keep_solver_state else None,
        controller_state=carry.controller_state if keep_controller_state else None,
        interpolation=interpolation,
    )
