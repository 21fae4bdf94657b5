"""`ensemble_solve`: many trajectories of one ODE on a fixed number of lanes, each
lane taking the next trajectory from a queue as soon as its own has finished.

`jax.vmap(diffeqsolve)` is a lockstep loop: every batch element steps until the
slowest has finished, so with adaptive steps most of the batch idles for the last
part of the loop. Here the lane loop (`_lanes.py`) holds `lanes` solves side by
side and refills finished lanes from the queue; with as many lanes as
trajectories it is the lockstep loop itself (`_policy.py` chooses).

The `Problem` is built once, for one trajectory, by the setup `diffeqsolve` uses
(`_setup.prepare`); each lane swaps in its own `y0` and `args`.

Reverse mode: the lane loop is the forward pass of a `custom_vjp` whose operands
are the `Problem`'s arrays, `y0` and `args`; its backward pass (`_backward.py`)
solves each trajectory again with the adjoint, as `diffeqsolve` does, in chunks of
`lanes` trajectories sorted by the steps each took forwards.
"""

from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _backend, _kernel
from .._adjoint._base import AbstractAdjoint, custom_vjp
from .._adjoint._checkpoint import RecursiveCheckpointAdjoint
from .._closure._raising import eager, error_if, raise_failed
from .._closure._unvmap import unvmap_max
from .._controller._base import AbstractStepSizeController, ConstantStepSize
from .._custom_types import RealScalarLike
from .._errors import concrete, UnsupportedError
from .._event import Event, TimedEvent
from .._problem import Problem
from .._progress import AbstractProgressMeter, NoProgressMeter
from .._saveat import SaveAt
from .._setup import (
    check_arguments,
    FinalStates,
    prepare,
)
from .._solution import event_record, failure_code, MESSAGES, OK, Result, Solution
from .._solver import AbstractSolver
from .._term import AbstractTerm
from .._time import flip, flip_finite
from ._backward import backward
from ._inputs import (
    batch_size,
    check_event_context,
    check_unsupported,
    PerTrajectory,
    positive_int,
    reverse_only,
    split_times,
)
from ._lanes import run
from ._policy import Policy, policy


def _solve_lanes(
    problem: Problem, y0, args_dynamic, times, plan: Policy, final, adjoint
):
    """Every trajectory's outputs (its row) and the number of loop iterations,
    differentiable in reverse mode: a `custom_vjp` whose forward pass is the lane
    loop and whose backward pass solves each trajectory again with `adjoint`
    (`backward`). The problem's arrays (every value the user's functions close
    over), `y0`, `args` and the per-trajectory times cross it as operands."""

    def primal(problem: Problem, y0, args_dynamic, times):
        return run(problem, y0, args_dynamic, times, plan, final)

    def fwd(problem: Problem, y0, args_dynamic, times):
        out, iterations = primal(problem, y0, args_dynamic, times)
        return (out, iterations), (y0, args_dynamic, times, out["num_steps"])

    def bwd(static, dynamic, residuals, cotangents):
        ct_out, _ = cotangents
        lanes = plan.lanes
        return backward(static, dynamic, residuals, ct_out, lanes, final, adjoint)

    return custom_vjp(
        problem, primal, fwd, bwd, y0, args_dynamic, times,
        adjoint="ensemble_solve",
        second_order=(
            "Use forward-over-reverse, `jax.jacfwd(jax.grad(f))` (`jax.hessian` is "
            "that), or differentiate a lockstep batch, `jax.vmap(diffeqsolve)` with "
            "`adjoint=DirectAdjoint()`."
        ),
    )  # fmt: skip


def _check_direction(problem: Problem, times: Any) -> PerTrajectory:
    """`times` (user time) checked at run time to run in the direction of `problem`
    (known times are checked before tracing, by `split_times`)."""
    t0 = problem.t0 if times.t0 is None else flip(problem.direction, times.t0)
    t1 = problem.t1 if times.t1 is None else flip(problem.direction, times.t1)
    # In internal time every trajectory runs forwards (or not at all).
    wrong = jnp.any(jnp.asarray(t1) < jnp.asarray(t0))
    return eqx.error_if(
        times,
        wrong,
        "ensemble_solve needs every trajectory to run in one direction (`t1 - t0` "
        "of one sign, or zero); solve forwards and backwards trajectories with "
        "separate calls.",
    )


def _internal(problem: Problem, times: PerTrajectory | None):
    """Per-trajectory `times` in the problem's dtype and internal time."""
    if times is None:
        return None
    dtype = problem.t0.dtype
    times = jtu.tree_map(lambda x: jnp.asarray(x, dtype), times)
    if problem.direction is not None and concrete(problem.direction) is None:
        times = _check_direction(problem, times)
    return jtu.tree_map(lambda x: flip(problem.direction, x), times)


@eqx.filter_jit
def _ensemble(
    problem: Problem, y0, args, times, plan: Policy, throw, final: FinalStates, adjoint
):
    args_dynamic, _ = eqx.partition(args, eqx.is_array)
    times = _internal(problem, times)
    out, iterations = _solve_lanes(
        problem, y0, args_dynamic, times, plan, final, adjoint
    )
    ts, ys, t_end, result = out["ts"], out["ys"], out["t_end"], out["result"]
    if throw:
        index = unvmap_max(failure_code(result))
        ts, ys, t_end = error_if((ts, ys, t_end), index > 0, index, MESSAGES)
    batch = result.shape[0]
    count = lambda n: n.astype(jnp.result_type(int))  # noqa: E731  # diffrax's dtype
    stats = dict(
        num_steps=count(out["num_steps"]),
        num_accepted_steps=count(out["num_accepted"]),
        num_rejected_steps=count(out["num_rejected"]),
        max_steps=None
        if problem.max_steps is None
        else jnp.full((batch,), problem.max_steps, jnp.result_type(int)),
        lanes=plan.lanes,
        refill=plan.refill,
        lane_steps=count(iterations) * plan.lanes,
    )
    t0 = problem.t0 if times is None or times.t0 is None else times.t0
    return Solution(
        t0=jnp.broadcast_to(flip(problem.direction, t0), (batch,)),
        t1=flip(problem.direction, t_end),
        ts=jtu.tree_map(lambda tau: flip_finite(problem.direction, tau), ts),
        ys=ys,
        stats=stats,
        result=Result(result),
        event_mask=out["event_mask"],
        made_jump=jnp.zeros((batch,), bool) if final.made_jump else None,
        solver_state=out["solver_state"],
        controller_state=out["controller_state"],
        events=event_record(problem.direction, out["events"]),
    )


def _use_kernel(
    kernel, problem: Problem, y0, per_trajectory, final: FinalStates
) -> bool:
    """Whether `ensemble_solve` takes the whole-solve kernel (`solverkit._kernel`):
    `True` raises where it can't; `None` takes it where supported, on a TPU (it
    lowers to TPUs only so far; elsewhere it would run in Pallas' interpreter), for
    the solvers measured faster there (`_kernel.by_default`)."""
    if kernel not in (True, False, None):
        raise TypeError(f"`kernel` must be True, False or None, got {kernel!r}.")
    if kernel is False:
        return False
    if kernel is None and (
        _backend.platform() != "tpu" or not _kernel.by_default(problem)
    ):
        return False
    why = _kernel.supported(problem, y0, per_trajectory, final)
    if why is not None and kernel:
        raise UnsupportedError(
            f"ensemble_solve(kernel=True) can't solve this: {why}. Use kernel=None "
            "(the lane loop where the kernel can't) or kernel=False."
        )
    return why is None


def _check_one_grid(controller: AbstractStepSizeController, per_trajectory) -> None:
    """A controller of one grid of times (`StepTo`) can't serve per-trajectory times."""
    if per_trajectory is not None and controller.one_grid:
        raise UnsupportedError(
            "StepTo(ts) steps to one grid of times, from t0 to t1: it can't be used "
            "with per-trajectory `t0`, `t1` in ensemble_solve (use a PIDController, "
            "or ConstantStepSize)."
        )


def _kernel_solve(
    problem: Problem, y0, args, throw, plan: Policy, final: FinalStates, adjoint
):
    """The kernel path, with the lane loop (`_ensemble`) as its reference and the
    lane loop's backward pass (`backward`) for reverse mode."""

    def reference(p, y, a):  # the lane loop, not raising
        return _ensemble(p, y, a, None, plan, False, final, adjoint)

    def pull_back(static, dynamic, y, a, num_steps, ct):
        residuals = (y, a, None, num_steps)
        return backward(static, dynamic, residuals, ct, plan.lanes, final, adjoint)

    return _kernel.kernel_solve(
        problem, y0, args, throw, reference, pull_back, tangents=adjoint.discrete
    )


def ensemble_solve(
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
    event: Event | TimedEvent | tuple | None = None,
    max_steps: int | None = 4096,
    throw: bool = True,
    progress_meter: AbstractProgressMeter = NoProgressMeter(),
    lanes: int | None = None,
    adjoint: AbstractAdjoint = RecursiveCheckpointAdjoint(),
    refill: int | None = None,
    kernel: bool | None = None,
) -> Solution:
    """Solve a batch of problems of one ODE, with finished lanes refilled.

    Takes the arguments of [`solverkit.diffeqsolve`][], except that `y0` and `args`
    hold a batch of `N` problems along a leading axis (and `t0`, `t1`, `SaveAt(ts)`
    may), and returns what
    `jax.vmap(diffeqsolve, in_axes=(None,)*5 + (0, 0))` returns for them: a
    [`solverkit.Solution`][] whose fields have a leading axis of length `N`, in the
    order of the input, equal to it up to round-off.

    The difference is how the batch runs. A vmapped solve is a lockstep loop: every
    element steps until the slowest has finished. Here a fixed number of `lanes`
    solve side by side inside one compiled loop, and a lane that finishes its
    trajectory takes the next one from the queue, so the work done is close to the
    sum of the trajectories' steps rather than `N` times the longest.

    **Arguments:**

    - `terms`, `solver`, `dt0`, `stepsize_controller`, `max_steps`, `event`: as
        for `diffeqsolve`; the same for every trajectory (with per-trajectory
        times, not `StepTo`, and an `Event` whose conditions do not read the `t0`,
        `t1`, `saveat` keywords).
    - `t0`, `t1`: scalars, the same for every trajectory, or arrays of shape
        `(N,)`, one per trajectory. Every trajectory must run in one direction
        (`t1 - t0` of one sign, or zero).
    - `y0`: the initial states, a pytree whose every leaf has a leading batch axis
        of length `N`.
    - `args`: passed to the vector field as its third argument: each trajectory
        gets its own slice of every array leaf (JAX or NumPy), which must all have
        the leading batch axis; other leaves (Python numbers, strings) are shared.
        A value shared by every trajectory (weights, forcing data) can also be
        closed over by the vector field.
    - `saveat`: as for `diffeqsolve` (`t0`, `t1`, `ts`, `steps`, `fn`, `subs`);
        `ts` of shape `(T,)`, the same for every trajectory, or `(N, T)`, a row per
        trajectory; not `dense`.
    - `throw`: raise if any trajectory fails (the message of the worst failure, by
        result code); with `False` each trajectory's outcome is in `sol.result`.
    - `progress_meter`: shows the fraction of trajectories finished (lockstep: the
        slowest trajectory's progress in time).
    - `lanes`: how many trajectories are solved side by side; default
        `default_lanes(N)` (on a CPU `N // 16`, at least 64; on an accelerator
        `N`, the lockstep loop, measured faster there). At most `N`; with
        `N` lanes the lockstep loop runs, without refill.
    - `adjoint`: how to differentiate each trajectory in reverse mode, as for
        `diffeqsolve`: `RecursiveCheckpointAdjoint()` (default; `None` means it
        too), `BacksolveAdjoint()`, `DirectAdjoint()` or `ImplicitAdjoint()`, with
        the options each supports (checked as `diffeqsolve` checks them).
    - `refill`: the most finished lanes one refill takes (it finishes and
        starts a buffer of that many lanes); default `lanes // 8`, at least 1. A
        refill runs once `min(refill, lanes // 32)` lanes (at least 1) have
        finished, or no lane runs.
    - `kernel`: solve in one whole-solve kernel (Pallas; see docs/ensembles.md):
        `True` (raise if this solve is one it can't do, saying why), `False` (the
        lane loop), `None` (default: the kernel where supported, on a TPU).

    **Returns:**

    A `Solution` with a leading batch axis on `t0`, `t1`, `ts`, `ys`, `result`,
    `event_mask` and the per-trajectory `stats` (`num_steps`, ...). `stats` also
    holds `lanes`, `refill` (the lanes refilled at once; `0`: the lockstep loop
    ran, without refill, as there are as many lanes as trajectories) and
    `lane_steps` (loop iterations times lanes, idle ones included: the work
    done, to compare with the sum of `num_steps`).

    **Differentiation:**

    Reverse mode (`jax.grad`, `jax.vjp`) with respect to `y0`, the floating-point
    leaves of `args`, every value the vector field (and `SaveAt.fn`, the event's
    functions) closes over, `t0`, `t1` and `SaveAt(ts=...)`, through the
    differentiable outputs (`ys`, `ts`, `t1`, and the solver's and controller's
    states where kept). The forward pass is the lane loop above; the backward pass
    solves each trajectory again with `adjoint`, as `diffeqsolve` would, and pulls
    its cotangent back through that solve: in chunks of `lanes` trajectories sorted
    by the steps each took (longest first), each chunk a lockstep `vmap`, so the
    work is close to the sum of the trajectories' steps rather than `N` times the
    longest. The gradient is that of `jax.vmap(diffeqsolve)` to round-off; a
    gradient costs one refill forward pass plus, per chunk, the reverse pass of
    `adjoint` for `lanes` trajectories at once (its memory too).

    Forward mode (`jax.jvp`, `jax.jacfwd`) is not supported: it raises (for
    forward mode use `jax.vmap(diffeqsolve)` with `adjoint=DirectAdjoint()`).
    Nor is reverse-over-reverse; forward-over-reverse (`jax.hessian`) works.

    Composes with `jax.jit`; under `jax.vmap` it runs as a batch of ensembles.
    """
    if adjoint is None:  # the default, as before `adjoint` was supported
        adjoint = RecursiveCheckpointAdjoint()
    check_arguments(solver, saveat, stepsize_controller, adjoint, max_steps)
    check_unsupported(saveat)
    batch = batch_size(y0, args)
    plan = policy(batch, positive_int("lanes", lanes), positive_int("refill", refill))
    t0, t1, saveat, per_trajectory = split_times(t0, t1, saveat, batch)
    _check_one_grid(stepsize_controller, per_trajectory)
    problem, y0, final, context = prepare(
        terms, solver, t0, t1, dt0, y0, args, saveat=saveat,
        stepsize_controller=stepsize_controller, adjoint=adjoint, event=event,
        max_steps=max_steps, progress_meter=progress_meter, batched=True,
    )  # fmt: skip
    if per_trajectory is not None and event is not None:
        check_event_context(event, context, saveat, problem.y0, problem.args)
    on_host = throw and eager((problem, y0, args))
    throw = throw and not on_host  # eagerly: no host callback in the program
    if _use_kernel(kernel, problem, y0, per_trajectory, final):
        sol = _kernel_solve(problem, y0, args, throw, plan, final, adjoint)
    else:
        with jax.numpy_dtype_promotion("standard"), reverse_only():
            sol = _ensemble(
                problem, y0, args, per_trajectory, plan, throw, final, adjoint
            )
    if on_host:
        raise_failed(sol.result.code, OK, MESSAGES)
    return sol
