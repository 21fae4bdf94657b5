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

Reverse mode: the lane loop is the forward pass of a `custom_vjp` whose operands
are the `Problem`'s arrays, `y0` and `args`; its backward pass (`_backward`)
solves each trajectory again with the adjoint, as `diffeqsolve` does, in chunks of
`lanes` trajectories sorted by the steps each took forwards.
"""

import contextlib
import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from . import _kernel, _loop
from ._adjoint import AbstractAdjoint, custom_vjp, fill_zeros, parameters
from ._checkpoint import RecursiveCheckpointAdjoint
from ._controller import AbstractStepSizeController, ConstantStepSize, StepTo
from ._custom_types import RealScalarLike
from ._errors import BadInputError, concrete, UnsupportedError
from ._event import Event, with_context
from ._integrate import (
    _as_state,
    _check_arguments,
    _MESSAGES,
    _problem,
    _split_events,
    _times,
)
from ._problem import Buffers, Carry, Problem
from ._progress import AbstractProgressMeter, NoProgressMeter
from ._saveat import is_sub, SaveAt
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


class _PerTrajectory(NamedTuple):
    """The times given one per trajectory (leading axis: trajectory), `None` where
    shared: `t0`, `t1`, and each `SubSaveAt`'s `ts` (in the order of
    `Problem.saves`). In user time on entry, in internal time in the loop."""

    t0: Any  # Array or None
    t1: Any
    ts: tuple


def _per_trajectory(name: str, t, batch: int):
    """`t` as a scalar (shared) or an array of shape `(batch,)`: `(shared, None)` or
    `(first, t)`."""
    shape = jnp.shape(t)
    if shape == ():
        return t, None
    if shape != (batch,):
        raise ValueError(
            f"`{name}` must be a scalar (the same for every trajectory) or have shape "
            f"(N,) = ({batch},) (one per trajectory), got shape {shape}."
        )
    t = t if isinstance(t, jax.Array) else np.asarray(t)
    return t[0], t


def _split_times(t0, t1, saveat: SaveAt, batch: int):
    """Check the shapes of `t0`, `t1` and `SaveAt(ts=...)`, and split them into the
    times of one trajectory (to build the `Problem` with; their values are replaced
    lane by lane) and the `_PerTrajectory` times (user time, `None` where shared).
    Every trajectory must run in one direction: checked here where the times are
    known, else at run time (`_check_direction`)."""
    t0_one, t0s = _per_trajectory("t0", t0, batch)
    t1_one, t1s = _per_trajectory("t1", t1, batch)
    subs, tree = jtu.tree_flatten(saveat.subs, is_leaf=is_sub)
    rows, per = [], []
    for k, sub in enumerate(subs):
        ts = sub.ts
        if ts is None or ts.ndim == 1:
            rows.append(sub)
            per.append(None)
            continue
        name = "saveat.ts" if is_sub(saveat.subs) else f"saveat.subs[{k}].ts"
        if ts.shape[0] != batch:
            raise ValueError(
                f"`{name}` must have shape (T,) (the same times for every trajectory) "
                f"or (N, T) = ({batch}, T) (one row per trajectory), got shape "
                f"{tuple(ts.shape)}."
            )
        rows.append(eqx.tree_at(lambda s: s.ts, sub, ts[0]))
        per.append(ts)
    times = _PerTrajectory(t0s, t1s, tuple(per))
    if all(x is None for x in jtu.tree_leaves(times)):
        return t0, t1, saveat, None
    c0, c1 = concrete(t0), concrete(t1)
    if c0 is not None and c1 is not None:
        c0, c1 = np.broadcast_to(c0, (batch,)), np.broadcast_to(c1, (batch,))
        sign = np.sign(c1 - c0)
        if np.any(sign > 0) and np.any(sign < 0):
            i, j = int(np.argmax(sign > 0)), int(np.argmax(sign < 0))
            raise ValueError(
                "ensemble_solve needs every trajectory to run in one direction "
                f"(`t1 - t0` of one sign, or zero), but trajectory {i} runs forwards "
                f"(t0={c0[i]}, t1={c1[i]}) and trajectory {j} backwards (t0={c0[j]}, "
                f"t1={c1[j]}). Solve the two groups with separate calls."
            )
        # Build the `Problem` from a trajectory that sets the direction.
        first = int(np.argmax(sign != 0))
        t0_one, t1_one = c0[first], c1[first]
        for k, sub in enumerate(subs):
            _check_save_times(sub.ts, c0, c1, k, is_sub(saveat.subs))
    subs = jtu.tree_unflatten(tree, rows)
    return t0_one, t1_one, eqx.tree_at(lambda s: s.subs, saveat, subs), times


def _check_save_times(ts, c0, c1, k: int, single: bool) -> None:
    """Known save times lie in each trajectory's `[t0, t1]`, in its direction."""
    cts = concrete(ts)
    if cts is None or cts.size == 0:
        return
    cts = np.broadcast_to(cts, (len(c0),) + cts.shape[-1:])
    lo, hi = np.minimum(c0, c1)[:, None], np.maximum(c0, c1)[:, None]
    outside = np.any((cts < lo) | (cts > hi), axis=1)
    backwards = np.any(np.diff(cts, axis=1) * (c1 - c0)[:, None] < 0, axis=1)
    name = "saveat.ts" if single else f"saveat.subs[{k}].ts"
    if np.any(outside):
        i = int(np.argmax(outside))
        raise BadInputError(
            f"`{name}` must lie between t0 and t1 of each trajectory: trajectory {i} "
            f"has [t0, t1] = [{c0[i]}, {c1[i]}] and save times from {cts[i].min()} to "
            f"{cts[i].max()}."
        )
    if np.any(backwards):
        i = int(np.argmax(backwards))
        raise BadInputError(
            f"`{name}` must be increasing or decreasing, in the direction from t0 to "
            f"t1: not so for trajectory {i}."
        )


def _depends_on_inputs(closed: jex.ClosedJaxpr) -> bool:
    """Whether any output of `closed` depends on any of its inputs (an equation
    whose inputs do makes all its outputs do)."""
    jaxpr = closed.jaxpr
    seen = set(jaxpr.invars)
    used = lambda v: not isinstance(v, jex.Literal) and v in seen  # noqa: E731
    for eqn in jaxpr.eqns:
        if any(used(v) for v in eqn.invars):
            seen.update(eqn.outvars)
    return any(used(v) for v in jaxpr.outvars)


def _check_event_context(event, context: dict, saveat: SaveAt, y0, args) -> None:
    """With per-trajectory times, an `Event`'s conditions must not read the `t0`,
    `t1` or `saveat` that diffrax passes them as keywords: they are bound once, for
    every trajectory, when the conditions are converted."""
    event, _ = _split_events(event)
    if not isinstance(event, Event):
        return
    subs, tree = jtu.tree_flatten(saveat.subs, is_leaf=is_sub)
    t, y, a = jnp.asarray(context["t0"]), y0, args

    def conditions(t0, t1, ts):
        new = [
            sub if x is None else eqx.tree_at(lambda s: s.ts, sub, x)
            for sub, x in zip(subs, ts)
        ]
        sv = eqx.tree_at(lambda s: s.subs, saveat, jtu.tree_unflatten(tree, new))
        kw = dict(context, t0=t0, t1=t1, saveat=sv)
        return [
            with_context(f, **kw)(t, y, a)
            for f in jtu.tree_leaves(event.cond_fn, is_leaf=callable)
        ]

    ts = [s.ts for s in subs]
    closed = jax.make_jaxpr(conditions)(context["t0"], context["t1"], ts)
    if _depends_on_inputs(closed):
        raise UnsupportedError(
            "With per-trajectory `t0`, `t1` or `SaveAt(ts=...)`, an Event's cond_fn "
            "can't use its `t0`, `t1` or `saveat` keyword arguments (ensemble_solve "
            "binds them once, for every trajectory): pass what it needs in `args`."
        )


def _check_unsupported(saveat: SaveAt) -> None:
    if saveat.dense:
        raise UnsupportedError(
            "ensemble_solve does not support SaveAt(dense=True) (dense output); for "
            "that, use `jax.vmap(diffeqsolve)` (a lockstep batch) instead of "
            "ensemble_solve."
        )


@contextlib.contextmanager
def _reverse_only():
    """Turn JAX's error for forward-mode autodiff of the `custom_vjp` around the
    lanes into one that says what to use instead."""
    try:
        yield
    except TypeError as e:
        text = str(e)
        if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
            raise UnsupportedError(
                "ensemble_solve supports reverse-mode differentiation (jax.grad, "
                "jax.vjp) only, not forward mode (jax.jvp, jax.jacfwd): for forward "
                "mode differentiate a lockstep batch, `jax.vmap(diffeqsolve)` with "
                f"`adjoint=DirectAdjoint()`. (JAX said: {e})"
            ) from None
        raise


class _Lanes(NamedTuple):
    """The loop state: `lanes` solves side by side (leading axis: lane), and the
    rows of the outputs written so far (leading axis: trajectory)."""

    carry: Carry
    bufs: Buffers
    y0: PyTree  # each lane's initial state
    args: PyTree  # each lane's array leaves of `args`
    times: _PerTrajectory | None  # each lane's own times (internal), if any
    index: Array  # each lane's trajectory (>= batch: idle, the queue is empty)
    queue: Array  # the next trajectory to start
    done: Array  # trajectories finished and written
    iterations: Array  # loop iterations so far
    out: PyTree  # outputs, one row per trajectory
    shown: Any  # the progress last shown, or None


def _with_lane(
    problem: Problem, y0: PyTree, args_dynamic: PyTree, times: _PerTrajectory | None
) -> Problem:
    """`problem` for one lane: its own `y0`, array leaves of `args` and, where given
    per trajectory, times (internal)."""
    _, args_static = eqx.partition(problem.args, eqx.is_array)
    args = eqx.combine(args_dynamic, args_static)
    problem = dataclasses.replace(problem, y0=y0, args=args)
    if times is None:
        return problem
    saves = tuple(
        save if ts is None else dataclasses.replace(save, ts=ts)
        for save, ts in zip(problem.saves, times.ts)
    )
    return dataclasses.replace(
        problem,
        t0=problem.t0 if times.t0 is None else times.t0,
        t1=problem.t1 if times.t1 is None else times.t1,
        saves=saves,
    )


def _row(out: _loop.Outputs, keep) -> dict:
    """What a finished solve hands back for its trajectory (internal time)."""
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


def _lane_outputs(problem: Problem, carry: Carry, bufs: Buffers, keep) -> dict:
    """What a finished lane hands back for its trajectory (internal time)."""
    return _row(_loop.finish(problem, carry, bufs), keep)


def _gather(tree: PyTree, index: Array, batch: int) -> PyTree:
    if not jtu.tree_leaves(tree):
        return tree
    safe = jnp.minimum(index, batch - 1)
    return jtu.tree_map(lambda x: x[safe], tree)


class _LaneLoop:
    """The pieces of the lane loop for one problem (trace time only): each method
    acts on a `_Lanes` or on the lanes' slices of it."""

    def __init__(self, problem: Problem, y0, args_dynamic, times, refill_at, keep):
        self.problem, self.y0, self.args, self.times = problem, y0, args_dynamic, times
        self.batch = jtu.tree_leaves(y0)[0].shape[0]
        self.refill_at, self.keep = refill_at, keep
        self.meter = problem.meter
        self.token = self.meter.start()

    def lane(self, y, a, tm) -> Problem:
        return _with_lane(self.problem, y, a, tm)

    def init_lanes(self, index):
        """Start the lanes on the trajectories `index`: `(carry, bufs, y, a, tm)`."""
        y = _gather(self.y0, index, self.batch)
        a = _gather(self.args, index, self.batch)
        tm = _gather(self.times, index, self.batch)
        init = lambda y, a, tm: _loop.init(self.lane(y, a, tm))  # noqa: E731
        carry, bufs = jax.vmap(init)(y, a, tm)
        return carry, bufs, y, a, tm

    def going(self, s: _Lanes):
        """Per lane: solving a trajectory that has not finished."""
        cond = lambda y, a, tm, c: _loop.cond(self.lane(y, a, tm), c)  # noqa: E731
        running = jax.vmap(cond)(s.y0, s.args, s.times, s.carry)
        return running & (s.index < self.batch)

    def lane_outputs(self, y, a, tm, carry, bufs):
        return _lane_outputs(self.lane(y, a, tm), carry, bufs, self.keep)

    def refill(self, s: _Lanes, finished) -> _Lanes:
        """Write the `finished` lanes' rows and start them on the next trajectories
        of the queue (lanes past the queue's end go idle)."""
        rows = where(finished, s.index, self.batch)  # out of bounds: dropped
        new = jax.vmap(self.lane_outputs)(s.y0, s.args, s.times, s.carry, s.bufs)
        out = jtu.tree_map(lambda o, v: o.at[rows].set(v, mode="drop"), s.out, new)
        count = jnp.sum(finished, dtype=jnp.int32)
        rank = jnp.cumsum(finished, dtype=jnp.int32) - 1
        index = where(finished, s.queue + rank, s.index)
        fresh = self.init_lanes(index)
        old = (s.carry, s.bufs, s.y0, s.args, s.times)
        carry, bufs, y, a, tm = jax.vmap(tree_where)(finished, fresh, old)
        done = s.done + count
        shown = s.shown
        if self.token is not None:
            fraction = done / self.batch
            show = self.meter.wants(s.iterations, shown, fraction) & (fraction < 1)
            token = self.token
            lax.cond(show, lambda: self.meter.callback(token, fraction), lambda: None)
            shown = where(show, fraction, shown)
        return s._replace(
            carry=carry, bufs=bufs, y0=y, args=a, times=tm, index=index,
            queue=s.queue + count, done=done, out=out, shown=shown,
        )  # fmt: skip

    def body(self, s: _Lanes) -> _Lanes:
        """One step of every running lane, then a refill where it pays."""
        active = self.going(s)

        def step(y, a, tm, c, b, act):
            return _loop.body(self.lane(y, a, tm), (c, b), act)

        carry, bufs = jax.vmap(step)(s.y0, s.args, s.times, s.carry, s.bufs, active)
        s = s._replace(carry=carry, bufs=bufs, iterations=s.iterations + 1)
        occupied = s.index < self.batch
        finished = ~self.going(s) & occupied
        count = jnp.sum(finished, dtype=jnp.int32)
        # Refill once `refill_at` lanes wait, or when every occupied lane has
        # finished; with the queue empty, write the outputs once, at the end.
        enough = (count >= self.refill_at) & (s.queue < self.batch)
        everyone = count == jnp.sum(occupied, dtype=jnp.int32)
        return lax.cond(
            (count > 0) & (enough | everyone), self.refill, lambda s, _: s, s, finished
        )

    def start(self, lanes: int) -> _Lanes:
        """The first `lanes` trajectories started, no output written yet."""
        index = jnp.arange(lanes, dtype=jnp.int32)
        carry, bufs, y, a, tm = self.init_lanes(index)
        first = lambda tree: jtu.tree_map(lambda x: x[0], tree)  # noqa: E731
        one = jax.eval_shape(self.lane_outputs, *first((y, a, tm, carry, bufs)))
        out = jtu.tree_map(lambda s: jnp.zeros((self.batch,) + s.shape, s.dtype), one)
        zero = jnp.asarray(0, jnp.int32)
        shown = None
        if self.token is not None:
            # 0, computed from the initial state so that it is shown before the
            # loop runs.
            shown = jnp.minimum(jnp.min(carry.t - self.problem.t0), 0).astype(float)
            self.meter.callback(self.token, shown)
        return _Lanes(
            carry=carry, bufs=bufs, y0=y, args=a, times=tm, index=index,
            queue=jnp.asarray(lanes, jnp.int32), done=zero, iterations=zero,
            out=out, shown=shown,
        )  # fmt: skip


def _run(problem: Problem, y0, args_dynamic, times, lanes: int, refill_at: int, keep):
    """The lane loop; returns the final `_Lanes`."""
    loop = _LaneLoop(problem, y0, args_dynamic, times, refill_at, keep)
    state = loop.start(lanes)
    # Lanes already finished at their start (`t0 == t1`, an event at `t0`) are
    # written and refilled by the first iteration, which steps nothing for them.
    state = lax.while_loop(lambda s: jnp.any(s.index < loop.batch), loop.body, state)
    if loop.token is not None:
        # 1, computed from the final state (a float: `x - x` of an integer would be
        # folded away) so that it is shown after every tick.
        t = state.carry.t
        loop.meter.callback(loop.token, jnp.maximum(jnp.max(t - t), 0) + 1)
    return state


def _solve_lanes(
    problem: Problem, y0, args_dynamic, times, lanes: int, refill_at: int, keep, adjoint
):
    """Every trajectory's outputs (the rows of `_Lanes.out`) and the number of loop
    iterations, differentiable in reverse mode: a `custom_vjp` whose forward pass is
    the lane loop and whose backward pass solves each trajectory again with
    `adjoint` (`_backward`). The problem's arrays (every value the user's functions
    close over), `y0`, `args` and the per-trajectory times cross it as operands."""

    def primal(problem: Problem, y0, args_dynamic, times):
        state = _run(problem, y0, args_dynamic, times, lanes, refill_at, keep)
        return state.out, state.iterations

    def fwd(problem: Problem, y0, args_dynamic, times):
        out, iterations = primal(problem, y0, args_dynamic, times)
        return (out, iterations), (y0, args_dynamic, times, out["num_steps"])

    def bwd(static, dynamic, residuals, cotangents):
        ct_out, _ = cotangents
        return _backward(static, dynamic, residuals, ct_out, lanes, keep, adjoint)

    return custom_vjp(
        problem, primal, fwd, bwd, y0, args_dynamic, times,
        adjoint="ensemble_solve",
        second_order=(
            "Use forward-over-reverse, `jax.jacfwd(jax.grad(f))` (`jax.hessian` is "
            "that), or differentiate a lockstep batch, `jax.vmap(diffeqsolve)` with "
            "`adjoint=DirectAdjoint()`."
        ),
    )  # fmt: skip


def _backward(static, dynamic, residuals, ct_out, lanes: int, keep, adjoint):
    """The cotangents of the problem's arrays, `y0` and `args` (its array leaves),
    from those of every trajectory's outputs.

    Each trajectory is solved again as `diffeqsolve` solves it, with `adjoint`, and
    pulled back through that solve (the same steps as the lane loop took for it). The
    trajectories go through in chunks of `lanes`, each chunk a lockstep `vmap`,
    longest first (sorted by the steps each took forwards), so that the trajectories
    of a chunk take about as many steps as one another and few lanes idle: the work
    is close to the sum of the steps, as in the forward pass, rather than `N` times
    the longest.
    """
    y0, args_dynamic, times, num_steps = residuals
    ct_out = eqx.filter(ct_out, eqx.is_inexact_array)
    # A lane's own `y0` and `args` replace the problem's (`_with_lane`).
    spec = dataclasses.replace(parameters(dynamic), y0=False, args=False)
    p_diff, p_rest = eqx.partition(dynamic, spec)
    a_diff, a_rest = eqx.partition(args_dynamic, eqx.is_inexact_array)

    def one(p_diff, y, a_diff, tm, a_rest):
        problem = eqx.combine(p_diff, p_rest, static)
        problem = dataclasses.replace(problem, meter=NoProgressMeter())
        problem = _with_lane(problem, y, eqx.combine(a_diff, a_rest), tm)
        return eqx.filter(_row(adjoint.loop(problem), keep), eqx.is_inexact_array)

    def pull_back(y, a_diff, tm, a_rest, ct):
        solve = jax.vmap(one, in_axes=(None, 0, 0, 0, 0))
        _, vjp = jax.vjp(
            lambda p, y, a, tm: solve(p, y, a, tm, a_rest), p_diff, y, a_diff, tm
        )
        return vjp(ct)

    batch = num_steps.shape[0]
    chunks = -(-batch // lanes)
    if chunks == 1:
        ct_p, ct_y, ct_a, ct_t = pull_back(y0, a_diff, times, a_rest, ct_out)
    else:
        size = chunks * lanes
        # The last chunk is padded with copies of the shortest trajectory, which get
        # no cotangent.
        order = jnp.argsort(-num_steps, stable=True)
        order = jnp.concatenate([order, jnp.full(size - batch, order[-1])])
        valid = jnp.arange(size) < batch

        def rows(x, mask: bool = False):
            x = x[order]
            if mask:
                x = jnp.where(valid.reshape((size,) + (1,) * (x.ndim - 1)), x, 0)
            return x.reshape((chunks, lanes) + x.shape[1:])

        def body(ct_p, xs):
            dp, dy, da, dt = pull_back(*xs)
            ct_p = jtu.tree_map(lambda c, d: c + d.astype(c.dtype), ct_p, dp)
            return ct_p, (dy, da, dt)

        xs = jtu.tree_map(rows, (y0, a_diff, times, a_rest))
        xs = (*xs, jtu.tree_map(lambda c: rows(c, mask=True), ct_out))
        zeros = jtu.tree_map(lambda p: jnp.zeros(p.shape, p.dtype), p_diff)
        ct_p, (ct_y, ct_a, ct_t) = lax.scan(body, zeros, xs)
        # Trajectory `i` is row `position[i]` of the chunks.
        position = (
            jnp.zeros(batch, order.dtype)
            .at[order[:batch]]
            .set(jnp.arange(batch, dtype=order.dtype))
        )
        unsort = lambda x: x.reshape((size,) + x.shape[2:])[position]  # noqa: E731
        ct_y, ct_a, ct_t = jtu.tree_map(unsort, (ct_y, ct_a, ct_t))
    nothing = lambda tree: jtu.tree_map(lambda _: None, tree)  # noqa: E731
    ct_dynamic = fill_zeros(eqx.combine(ct_p, nothing(p_rest)), dynamic)
    ct_args = fill_zeros(eqx.combine(ct_a, nothing(a_rest)), args_dynamic)
    # `times` holds floating arrays only, each differentiated.
    return ct_dynamic, fill_zeros(ct_y, y0), ct_args, ct_t


def _check_direction(problem: Problem, times: Any) -> _PerTrajectory:
    """`times` (user time) checked at run time to run in the direction of `problem`
    (known times are checked before tracing, by `_split_times`)."""
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


def _internal(problem: Problem, times: _PerTrajectory | None):
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
    problem: Problem, y0, args, times, lanes: int, refill_at: int, throw, keep, adjoint
):
    args_dynamic, _ = eqx.partition(args, eqx.is_array)
    times = _internal(problem, times)
    out, iterations = _solve_lanes(
        problem, y0, args_dynamic, times, lanes, refill_at, keep[:2], adjoint
    )
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
        lane_steps=count(iterations) * lanes,
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
        made_jump=jnp.zeros((batch,), bool) if keep[2] else None,
        solver_state=out["solver_state"],
        controller_state=out["controller_state"],
    )


def _use_kernel(kernel, problem, y0, per_trajectory, keep) -> bool:
    """Whether `ensemble_solve` takes the kernel path (issue #39's hook): `kernel`
    True raises where it can't; None takes it where supported, on a TPU (it lowers
    to TPUs only so far; elsewhere it runs in Pallas' slow interpreter)."""
    if kernel not in (True, False, None):
        raise TypeError(f"`kernel` must be True, False or None, got {kernel!r}.")
    if kernel is False:
        return False
    if kernel is None and jax.default_backend() != "tpu":
        return False
    why = _kernel.supported(problem, y0, per_trajectory, keep)
    if why is not None and kernel:
        raise UnsupportedError(
            f"ensemble_solve(kernel=True) can't solve this: {why}. Use kernel=None "
            "(the lane loop where the kernel can't) or kernel=False."
        )
    return why is None


def _kernel_solve(problem, y0, args, throw, lanes: int, keep, adjoint) -> Solution:
    """The kernel path (issue #39's hook), with the lane loop (`_ensemble`) as the
    reference and its backward pass (`_backward`) for reverse mode."""

    def reference(p, y, a):  # the lane loop, not raising
        return _ensemble(p, y, a, None, lanes, _refill_at(lanes), False, keep, adjoint)

    def backward(static, dynamic, y, a, num_steps, ct):  # its backward pass
        residuals = (y, a, None, num_steps)
        return _backward(static, dynamic, residuals, ct, lanes, keep[:2], adjoint)

    return _kernel.kernel_solve(problem, y0, args, throw, reference, backward)


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
    adjoint: AbstractAdjoint = RecursiveCheckpointAdjoint(),
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
    - `progress_meter`: shows the fraction of trajectories finished.
    - `lanes`: how many trajectories are solved side by side; default
        `default_lanes(N)` (on a CPU `N // 16`, at least 64; on an accelerator
        every trajectory up to 65,536). At most `N`.
    - `adjoint`: how to differentiate each trajectory in reverse mode, as for
        `diffeqsolve`: `RecursiveCheckpointAdjoint()` (default; `None` means it
        too), `BacksolveAdjoint()`, `DirectAdjoint()` or `ImplicitAdjoint()`, with
        the options each supports (checked as `diffeqsolve` checks them).
    - `kernel`: solve in one whole-solve kernel (Pallas; see docs/ensembles.md):
        `True` (raise if this solve is one it can't do, saying why), `False` (the
        lane loop), `None` (default: the kernel where supported, on a TPU).

    **Returns:**

    A `Solution` with a leading batch axis on `t0`, `t1`, `ts`, `ys`, `result`,
    `event_mask` and the per-trajectory `stats` (`num_steps`, ...). `stats` also
    holds `lanes` and `lane_steps` (steps taken over all lanes, idle ones
    included: the work done, to compare with the sum of `num_steps`).

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
    _check_arguments(solver, saveat, stepsize_controller, adjoint, max_steps)
    _check_unsupported(saveat)
    batch = _batch_size(y0, args)
    lanes = _check_lanes(lanes, batch)
    t0, t1, saveat, per_trajectory = _split_times(t0, t1, saveat, batch)
    if per_trajectory is not None and isinstance(stepsize_controller, StepTo):
        raise UnsupportedError(
            "StepTo(ts) steps to one grid of times, from t0 to t1: it can't be used "
            "with per-trajectory `t0`, `t1` in ensemble_solve (use a PIDController, "
            "or ConstantStepSize)."
        )
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
    adjoint.check(problem)
    if per_trajectory is not None and event is not None:
        context = dict(
            terms=terms, solver=solver, t0=times.t0, t1=times.t1, dt0=dt0,
            saveat=saveat, stepsize_controller=stepsize_controller,
            max_steps=max_steps,
        )  # fmt: skip
        _check_event_context(event, context, saveat, first(y0), first(args))
    keep = (saveat.solver_state, saveat.controller_state, saveat.made_jump)
    # --- kernel hook (issue #39): the whole-solve kernel, where chosen ---
    if _use_kernel(kernel, problem, y0, per_trajectory, keep):
        return _kernel_solve(problem, y0, args, throw, lanes, keep, adjoint)
    # --- end of the kernel hook ---
    with jax.numpy_dtype_promotion("standard"), _reverse_only():
        return _ensemble(
            problem, y0, args, per_trajectory, lanes, _refill_at(lanes), throw, keep,
            adjoint,
        )  # fmt: skip
