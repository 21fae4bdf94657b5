"""`ensemble_solve`: many trajectories of one ODE on a fixed number of lanes, each
lane taking the next trajectory from a queue as soon as its own has finished.

`jax.vmap(diffeqsolve)` is a lockstep loop: every batch element steps until the
slowest has finished, so with adaptive steps most of the batch idles for the last
part of the loop. Here one `lax.while_loop` holds `lanes` solves side by side (the
loop state of `_loop.py`, vmapped over lanes) and, per lane, the index of the
trajectory it is solving. Each iteration steps every lane (`_loop.body`); when lanes
have finished (`_loop.cond` false), a `lax.cond` writes their outputs
(`_loop.finish`) into the rows of their trajectories and starts each of them on the
next trajectory of the queue (`_loop.init`), so an iteration without a finished lane
pays nothing for it.

The `Problem` is built once, for one trajectory, by the same steps as
`diffeqsolve`'s; each lane swaps in its own `y0` and `args`.
"""

import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from . import _loop
from ._adjoint import AbstractAdjoint
from ._checkpoint import RecursiveCheckpointAdjoint
from ._controller import AbstractStepSizeController, ConstantStepSize
from ._custom_types import RealScalarLike
from ._errors import UnsupportedError
from ._event import Event
from ._integrate import _as_state, _check_arguments, _MESSAGES, _problem, _times
from ._problem import Buffers, Carry, Problem
from ._progress import AbstractProgressMeter, NoProgressMeter
from ._saveat import SaveAt
from ._select import where
from ._solution import Result, RESULTS, Solution
from ._solver import AbstractSolver
from ._term import AbstractTerm
from ._time import flip, flip_finite
from ._tree import tree_where
from ._unvmap import error_if, unvmap_max


_SUCCESS = int(RESULTS.successful.code)
_EVENT = int(RESULTS.event_occurred.code)

# Lanes per trajectory by default, on a CPU (see `default_lanes`).
_CPU_LANE_FRACTION = 16
_CPU_MIN_LANES = 64
_ACCELERATOR_MAX_LANES = 2**16
# Finished lanes wait until this fraction of them (or all) can be refilled at once.
_REFILL_FRACTION = 32


def _refill_at(lanes: int) -> int:
    """How many finished lanes wait before they are refilled together."""
    return max(1, lanes // _REFILL_FRACTION)


def default_lanes(batch: int, platform: str | None = None) -> int:
    """The number of lanes `ensemble_solve` uses for `batch` trajectories when not
    told: on a CPU, where each lane's step costs about the same whatever the number
    of lanes, `batch / 16` (at least 64): enough trajectories per lane that the last
    ones to finish leave few lanes idle; on an accelerator, whose cost per step
    hardly grows until it is full, every trajectory up to 65,536 lanes, and a
    quarter of them past that."""
    platform = jax.default_backend() if platform is None else platform
    if platform == "cpu":
        lanes = max(batch // _CPU_LANE_FRACTION, _CPU_MIN_LANES)
    else:
        lanes = max(batch // 4, _ACCELERATOR_MAX_LANES)
    return max(1, min(batch, lanes))


def _batch_size(y0: PyTree, args: PyTree) -> int:
    """The length of the leading axis that every array leaf of `y0` and `args`
    shares."""
    sizes = {}
    for name, tree in (("y0", y0), ("args", args)):
        for path, leaf in jtu.tree_leaves_with_path(tree):
            if name == "y0" or eqx.is_array(leaf):
                shape = np.shape(leaf)
                where_ = f"`{name}{jtu.keystr(path)}`"
                if len(shape) == 0:
                    raise ValueError(
                        "ensemble_solve takes a batch of problems: every array leaf "
                        f"of `y0` and `args` needs a leading batch axis, but {where_} "
                        "is a scalar. (Values shared by every trajectory can be "
                        "closed over by the vector field, or passed in `args` as "
                        "Python numbers.)"
                    )
                sizes[where_] = shape[0]
    if not sizes:
        raise ValueError("ensemble_solve needs `y0` with at least one array leaf.")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            "Every array leaf of `y0` and `args` must have the same leading (batch) "
            f"axis, got {listed}."
        )
    (size,) = set(sizes.values())
    if size < 1:
        raise ValueError("ensemble_solve needs at least one trajectory, got 0.")
    return int(size)


def _check_lanes(lanes, batch: int) -> int:
    if lanes is None:
        return default_lanes(batch)
    if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)):
        raise TypeError(f"`lanes` must be a positive int or None, got {lanes!r}.")
    if lanes < 1:
        raise ValueError(f"`lanes` must be a positive int or None, got {lanes}.")
    return int(min(lanes, batch))


def _check_unsupported(saveat: SaveAt, adjoint) -> None:
    alternative = (
        "; for that, use `jax.vmap(diffeqsolve)` (a lockstep batch) instead of "
        "ensemble_solve."
    )
    if adjoint is not None:
        raise UnsupportedError(
            "ensemble_solve solves forward only and takes no `adjoint`: gradients "
            "through it are not supported" + alternative
        )
    if saveat.dense:
        raise UnsupportedError(
            "ensemble_solve does not support SaveAt(dense=True) (dense output)"
            + alternative
        )


@jax.custom_jvp
def _not_differentiable(x):
    return x


@_not_differentiable.defjvp
def _not_differentiable_jvp(primals, tangents):
    del primals, tangents
    raise UnsupportedError(
        "ensemble_solve can't be differentiated (neither jax.grad nor jax.jvp): its "
        "lanes take trajectories in an order that depends on the solve. To "
        "differentiate a batch of solves use `jax.vmap(diffeqsolve)` with the "
        "adjoint of your choice."
    )


def _guard(tree: PyTree) -> PyTree:
    """`tree`, raising a clear error if its floating-point arrays are
    differentiated."""
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(_not_differentiable(dynamic), static)


class _Lanes(NamedTuple):
    """The loop state: `lanes` solves side by side (leading axis: lane), and the
    rows of the outputs written so far (leading axis: trajectory)."""

    carry: Carry
    bufs: Buffers
    y0: PyTree  # each lane's initial state
    args: PyTree  # each lane's array leaves of `args`
    index: Array  # each lane's trajectory (>= batch: idle, the queue is empty)
    queue: Array  # the next trajectory to start
    done: Array  # trajectories finished and written
    iterations: Array  # loop iterations so far
    out: PyTree  # outputs, one row per trajectory
    shown: Any  # the progress last shown, or None


def _with_lane(problem: Problem, y0: PyTree, args_dynamic: PyTree) -> Problem:
    """`problem` for one lane: its own `y0` and array leaves of `args`."""
    _, args_static = eqx.partition(problem.args, eqx.is_array)
    args = eqx.combine(args_dynamic, args_static)
    return dataclasses.replace(problem, y0=y0, args=args)


def _lane_outputs(problem: Problem, carry: Carry, bufs: Buffers, keep) -> dict:
    """What a finished lane hands back for its trajectory (internal time)."""
    out = _loop.finish(problem, carry, bufs)
    keep_solver_state, keep_controller_state = keep
    return dict(
        ts=out.ts,
        ys=out.ys,
        t_end=out.t_end,
        result=out.result,
        num_steps=out.carry.num_steps,
        num_accepted=out.carry.num_accepted,
        num_rejected=out.carry.num_rejected,
        event_mask=out.carry.event_mask,
        solver_state=out.carry.solver_state if keep_solver_state else None,
        controller_state=out.carry.controller_state if keep_controller_state else None,
    )


def _gather(tree: PyTree, index: Array, batch: int) -> PyTree:
    safe = jnp.minimum(index, batch - 1)
    return jtu.tree_map(lambda x: x[safe], tree)


def _run(problem: Problem, y0, args_dynamic, lanes: int, refill_at: int, keep):
    """The lane loop; returns the final `_Lanes`."""
    batch = jtu.tree_leaves(y0)[0].shape[0]
    lane = lambda y, a: _with_lane(problem, y, a)  # noqa: E731

    def init_lanes(index):
        y, a = _gather(y0, index, batch), _gather(args_dynamic, index, batch)
        carry, bufs = jax.vmap(lambda y, a: _loop.init(lane(y, a)))(y, a)
        return carry, bufs, y, a

    def going(s: _Lanes):
        running = jax.vmap(lambda y, a, c: _loop.cond(lane(y, a), c))(
            s.y0, s.args, s.carry
        )
        return running & (s.index < batch)

    def lane_outputs(y, a, carry, bufs):
        return _lane_outputs(lane(y, a), carry, bufs, keep)

    meter = problem.meter
    token = meter.start()

    def refill(s: _Lanes, finished):
        rows = where(finished, s.index, batch)  # out of bounds: dropped
        new = jax.vmap(lane_outputs)(s.y0, s.args, s.carry, s.bufs)
        out = jtu.tree_map(lambda o, v: o.at[rows].set(v, mode="drop"), s.out, new)
        count = jnp.sum(finished, dtype=jnp.int32)
        rank = jnp.cumsum(finished, dtype=jnp.int32) - 1
        index = where(finished, s.queue + rank, s.index)
        fresh = init_lanes(index)
        old = (s.carry, s.bufs, s.y0, s.args)
        carry, bufs, y, a = jax.vmap(tree_where)(finished, fresh, old)
        done = s.done + count
        shown = s.shown
        if token is not None:
            fraction = done / batch
            show = meter.wants(s.iterations, shown, fraction) & (fraction < 1)
            lax.cond(show, lambda: meter.callback(token, fraction), lambda: None)
            shown = where(show, fraction, shown)
        return s._replace(
            carry=carry,
            bufs=bufs,
            y0=y,
            args=a,
            index=index,
            queue=s.queue + count,
            done=done,
            out=out,
            shown=shown,
        )

    def body(s: _Lanes) -> _Lanes:
        active = going(s)
        step = lambda y, a, c, b, act: _loop.body(lane(y, a), (c, b), act)  # noqa: E731
        carry, bufs = jax.vmap(step)(s.y0, s.args, s.carry, s.bufs, active)
        s = s._replace(carry=carry, bufs=bufs, iterations=s.iterations + 1)
        occupied = s.index < batch
        finished = ~going(s) & occupied
        count = jnp.sum(finished, dtype=jnp.int32)
        # Refill once `refill_at` lanes wait, or when every occupied lane has
        # finished; with the queue empty, write the outputs once, at the end.
        enough = (count >= refill_at) & (s.queue < batch)
        everyone = count == jnp.sum(occupied, dtype=jnp.int32)
        return lax.cond(
            (count > 0) & (enough | everyone), refill, lambda s, _: s, s, finished
        )

    index = jnp.arange(lanes, dtype=jnp.int32)
    carry, bufs, y, a = init_lanes(index)
    first = lambda tree: jtu.tree_map(lambda x: x[0], tree)  # noqa: E731
    one = jax.eval_shape(lane_outputs, *first((y, a, carry, bufs)))
    out = jtu.tree_map(lambda s: jnp.zeros((batch,) + s.shape, s.dtype), one)
    zero = jnp.asarray(0, jnp.int32)
    shown = None
    if token is not None:
        # 0, computed from the initial state so that it is shown before the loop runs.
        shown = jnp.minimum(jnp.min(carry.t - problem.t0), 0).astype(float)
        meter.callback(token, shown)
    state = _Lanes(
        carry=carry,
        bufs=bufs,
        y0=y,
        args=a,
        index=index,
        queue=jnp.asarray(lanes, jnp.int32),
        done=zero,
        iterations=zero,
        out=out,
        shown=shown,
    )
    # Lanes already finished at their start (`t0 == t1`, an event at `t0`) are
    # written and refilled by the first iteration, which steps nothing for them.
    state = lax.while_loop(lambda s: jnp.any(s.index < batch), body, state)
    if token is not None:
        # 1, computed from the final state (a float: `x - x` of an integer would be
        # folded away) so that it is shown after every tick.
        t = state.carry.t
        meter.callback(token, jnp.maximum(jnp.max(t - t), 0) + 1)
    return state


@eqx.filter_jit
def _ensemble(problem: Problem, y0, args, lanes: int, refill_at: int, throw, keep):
    problem, y0, args = _guard((problem, y0, args))
    args_dynamic, _ = eqx.partition(args, eqx.is_array)
    state = _run(problem, y0, args_dynamic, lanes, refill_at, keep[:2])
    out = state.out
    ts, ys, t_end, result = out["ts"], out["ys"], out["t_end"], out["result"]
    if throw:
        failed = (result != _SUCCESS) & (result != _EVENT)
        index = unvmap_max(where(failed, result, 0))
        ts, ys, t_end = error_if((ts, ys, t_end), index > 0, index, _MESSAGES)
    batch = result.shape[0]
    count = lambda n: n.astype(jnp.result_type(int))  # noqa: E731  # diffrax's dtype
    stats = dict(
        num_steps=count(out["num_steps"]),
        num_accepted_steps=count(out["num_accepted"]),
        num_rejected_steps=count(out["num_rejected"]),
        max_steps=None
        if problem.max_steps is None
        else jnp.full((batch,), problem.max_steps, jnp.result_type(int)),
        lanes=lanes,
        lane_steps=count(state.iterations) * lanes,
    )
    t0 = flip(problem.direction, problem.t0)
    return Solution(
        t0=jnp.broadcast_to(t0, (batch,)),
        t1=flip(problem.direction, t_end),
        ts=jtu.tree_map(lambda tau: flip_finite(problem.direction, tau), ts),
        ys=ys,
        stats=stats,
        result=Result(result),
        event_mask=out["event_mask"],
        made_jump=jnp.zeros((batch,), bool) if keep[2] else None,
        solver_state=out["solver_state"],
        controller_state=out["controller_state"],
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
    event: Event | None = None,
    max_steps: int | None = 4096,
    throw: bool = True,
    progress_meter: AbstractProgressMeter = NoProgressMeter(),
    lanes: int | None = None,
    adjoint: AbstractAdjoint | None = None,
) -> Solution:
    """Solve a batch of problems of one ODE, with finished lanes refilled.

    Takes the arguments of [`solverkit.diffeqsolve`][], except that `y0` and `args`
    hold a batch of `N` problems along a leading axis, and returns what
    `jax.vmap(diffeqsolve, in_axes=(None,)*5 + (0, 0))` returns for them: a
    [`solverkit.Solution`][] whose fields have a leading axis of length `N`, in the
    order of the input, equal to it up to round-off.

    The difference is how the batch runs. A vmapped solve is a lockstep loop: every
    element steps until the slowest has finished. Here a fixed number of `lanes`
    solve side by side inside one compiled loop, and a lane that finishes its
    trajectory takes the next one from the queue, so the work done is close to the
    sum of the trajectories' steps rather than `N` times the longest.

    **Arguments:**

    - `terms`, `solver`, `t0`, `t1`, `dt0`, `stepsize_controller`, `max_steps`,
        `event`: as for `diffeqsolve`; the same for every trajectory.
    - `y0`: the initial states, a pytree whose every leaf has a leading batch axis
        of length `N`.
    - `args`: passed to the vector field as its third argument: each trajectory
        gets its own slice of every array leaf (JAX or NumPy), which must all have
        the leading batch axis; other leaves (Python numbers, strings) are shared.
        A value shared by every trajectory (weights, forcing data) can also be
        closed over by the vector field.
    - `saveat`: as for `diffeqsolve` (`t0`, `t1`, `ts`, `steps`, `fn`, `subs`), the
        same save times for every trajectory; not `dense`.
    - `throw`: raise if any trajectory fails (the message of the worst failure, by
        result code); with `False` each trajectory's outcome is in `sol.result`.
    - `progress_meter`: shows the fraction of trajectories finished.
    - `lanes`: how many trajectories are solved side by side; default
        `default_lanes(N)` (on a CPU `N // 16`, at least 64; on an accelerator
        every trajectory up to 65,536). At most `N`.
    - `adjoint`: not supported (forward solves only); must be `None`.

    **Returns:**

    A `Solution` with a leading batch axis on `t0`, `t1`, `ts`, `ys`, `result`,
    `event_mask` and the per-trajectory `stats` (`num_steps`, ...). `stats` also
    holds `lanes` and `lane_steps` (steps taken over all lanes, idle ones
    included: the work done, to compare with the sum of `num_steps`).

    !!! note

        Not differentiable: `jax.grad` or `jax.jvp` through it raises. To
        differentiate a batch of solves use `jax.vmap(diffeqsolve)`. Composes with
        `jax.jit`; under `jax.vmap` it runs as a batch of ensembles.
    """
    _check_arguments(
        solver, saveat, stepsize_controller, RecursiveCheckpointAdjoint(), max_steps
    )
    _check_unsupported(saveat, adjoint)
    batch = _batch_size(y0, args)
    lanes = _check_lanes(lanes, batch)
    times = _times(t0, t1, dt0)
    stepsize_controller.check(solver, times.known_t0, times.known_t1, dt0)
    solver = solver.bind_controller_tols(stepsize_controller)
    y0 = _as_state(y0)
    first = lambda tree: jtu.tree_map(  # noqa: E731
        lambda x: x[0] if eqx.is_array(x) else x, tree
    )
    problem = _problem(
        terms, solver, times, first(y0), first(args), saveat, stepsize_controller,
        event, max_steps, progress_meter, dt0, None
    )  # fmt: skip
    keep = (saveat.solver_state, saveat.controller_state, saveat.made_jump)
    with jax.numpy_dtype_promotion("standard"):
        return _ensemble(problem, y0, args, lanes, _refill_at(lanes), throw, keep)
