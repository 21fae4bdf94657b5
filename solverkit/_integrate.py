"""`diffeqsolve`: check the inputs, convert the vector field, hand over to the adjoint,
build the `Solution`."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._adjoint._base import AbstractAdjoint, reverse_only
from ._adjoint._checkpoint import RecursiveCheckpointAdjoint
from ._closure._raising import eager, error_if, raise_failed, transformed_in_jit
from ._closure._unvmap import unvmap_max
from ._controller._base import AbstractStepSizeController, ConstantStepSize
from ._custom_types import RealScalarLike
from ._event import Event, occurrences, TimedEvent
from ._interpolation._dense import DenseInterpolation
from ._kernel._vmap import vmap_aware
from ._problem import Problem
from ._progress import AbstractProgressMeter, NoProgressMeter
from ._save import flag_save_times
from ._saveat import SaveAt
from ._setup import (
    check_arguments,
    FinalStates,
    legacy_event,
    prepare,
    resume_states,
)
from ._solution import event_record, failure_code, MESSAGES, OK, Result, Solution
from ._solver import AbstractSolver
from ._term import AbstractTerm
from ._time import flip, flip_finite


def diffeqsolve(
    terms: AbstractTerm,
    solver: AbstractSolver,
    t0: RealScalarLike,
    t1: RealScalarLike,
    dt0: RealScalarLike | None,
    y0: PyTree,
    args: PyTree = None,
    *,
    saveat: SaveAt = SaveAt(t1=True),
    stepsize_controller: AbstractStepSizeController = ConstantStepSize(),
    adjoint: AbstractAdjoint = RecursiveCheckpointAdjoint(),
    event: Event | TimedEvent | tuple | None = None,
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

    Under `jax.vmap` on a TPU, a batch that the whole-solve kernel supports (an
    explicit Runge-Kutta or Rosenbrock method, the `vmap` over `y0`, `args` or values
    the vector field closes over; see the ensembles guide) is solved by that kernel,
    in reverse mode too; the results equal the vmapped loop's to the tolerance's
    order. `SOLVERKIT_VMAP_KERNEL=0` in the environment turns that off.

    **Arguments:**

    - `terms`: an [`solverkit.ODETerm`][], a [`solverkit.MultiTerm`][] (IMEX
        solvers take `MultiTerm(explicit_term, implicit_term)`; the others integrate
        the sum), or a user's [`solverkit.AbstractTerm`][].
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
    - `event`: an optional [`solverkit.Event`][] that terminates the solve (or,
        with an effect, changes the state and continues); or a
        [`solverkit.TimedEvent`][] that changes the state at given times (a dosing
        schedule); or one of each, as a tuple.
    - `max_steps`: the most steps to take (a positive int), or `None` for no bound
        (not with `SaveAt(steps=...)` or `SaveAt(dense=True)`, nor for reverse mode
        through `RecursiveCheckpointAdjoint`).
    - `throw`: raise on failure (a `RuntimeError` subclass; under `vmap`, if any batch
        element fails); with `False` check `Solution.result` instead. With fixed
        steps (`ConstantStepSize`, `StepTo`) a non-finite state is reported as
        `RESULTS.nonfinite`; without an event the solve still runs on to `t1`. An
        adaptive controller rejects such steps instead. Called outside `jit`,
        `vmap` and `grad`, the check runs on the host once the solve has finished;
        traced, it is a check in the program (a host callback: about 2 ms a call
        on a TPU).
    - `progress_meter`: `NoProgressMeter()`, `TextProgressMeter()` or
        `TqdmProgressMeter()`.
    - `solver_state`, `controller_state`, `made_jump`: to continue an earlier solve
        from its end, as in diffrax: pass what it returned with
        `SaveAt(t1=True, solver_state=True, controller_state=True, made_jump=True)`
        (and its final state as `y0`, its `t1` as `t0`). The solver's state (e.g.
        the vector field at the join, for first-same-as-last methods) is reused
        and the controller keeps its error history; the first step is `dt0` (or
        chosen anew if `None`). Use the same solver, controller and direction of
        time. Differentiable like `y0` (not through `BacksolveAdjoint`, whose
        adjoint equations don't depend on the solver's state).
    - `discrete_terminating_event`: deprecated (as in diffrax): a
        `DiscreteTerminatingEvent` or `SteadyStateEvent`; use `event=` instead.

    **Returns:**

    A [`solverkit.Solution`][].
    """
    check_arguments(solver, saveat, stepsize_controller, adjoint, max_steps)
    event = legacy_event(event, discrete_terminating_event)
    resume = resume_states(solver_state, controller_state, made_jump)
    problem, _, final, _ = prepare(
        terms, solver, t0, t1, dt0, y0, args, saveat=saveat,
        stepsize_controller=stepsize_controller, adjoint=adjoint, event=event,
        max_steps=max_steps, progress_meter=progress_meter, resume=resume,
    )  # fmt: skip
    # The engine mixes dtypes on purpose (float64 times with float32 states, complex
    # states with real tolerances) and casts where it must, so it is traced with
    # standard promotion whatever the user's setting; the user's own functions were
    # traced (converted) above, under theirs.
    # Called eagerly, a failure is raised from the host after the solve: no host
    # callback in the program (it costs ~2 ms a call on a TPU, and a program with one
    # is never stored in JAX's persistent compilation cache).
    concrete = eager(problem)  # not traced: no vmap to run on the kernel either
    on_host = throw and concrete
    with jax.numpy_dtype_promotion("standard"), reverse_only(adjoint):
        # Inside a `jit`, under `vmap` or `grad`: traced once, not traced as our own
        # `jit` and then again by each transformation (a first call ~10-30% sooner).
        solve = _solve_body if transformed_in_jit() else _solve
        throw = throw and not on_host
        if concrete:
            sol = solve(problem, adjoint, throw, final)
        else:  # on a TPU a `vmap` of it runs on the whole-solve kernel
            sol = vmap_aware(solve, problem, adjoint, throw, final)
    if on_host:
        raise_failed(sol.result.code, OK, MESSAGES)
    return sol


def _solve_body(problem: Problem, adjoint, throw, final: "FinalStates"):
    out = adjoint.loop(problem)
    ts, ys, t_end, result = out.ts, out.ys, out.t_end, out.result
    result = flag_save_times(problem, result)
    if throw:
        # Unbatched and non-differentiated, as equinox's error machinery needs; one
        # reduction serves both.
        index = unvmap_max(failure_code(result))
        ts, ys, t_end = error_if((ts, ys, t_end), index > 0, index, MESSAGES)
    interpolation = None
    if problem.dense:
        interpolation = DenseInterpolation(
            out.bufs.dense_ts,
            out.bufs.dense_info,
            out.carry.num_accepted,
            problem.direction,
            problem.solver,
            problem.y0,
            out.bufs.dense_ends,
        )
    carry = out.carry
    count = lambda n: n.astype(jnp.result_type(int))  # noqa: E731  # diffrax's dtype
    stats = dict(
        num_steps=count(carry.num_steps),
        num_accepted_steps=count(carry.num_accepted),
        num_rejected_steps=count(carry.num_rejected),
        max_steps=problem.max_steps,
    )
    return Solution(
        t0=flip(problem.direction, problem.t0),
        t1=flip(problem.direction, t_end),
        ts=jtu.tree_map(lambda tau: flip_finite(problem.direction, tau), ts),
        ys=ys,
        stats=stats,
        result=Result(result),
        event_mask=carry.event_mask,
        made_jump=False if final.made_jump else None,  # no jumps in an ODE
        solver_state=carry.solver_state if final.solver_state else None,
        controller_state=carry.controller_state if final.controller_state else None,
        interpolation=interpolation,
        events=event_record(problem.direction, occurrences(problem, out.bufs, carry)),
    )


_solve = eqx.filter_jit(_solve_body)
