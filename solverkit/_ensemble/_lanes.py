"""The lane loop: `lanes` solves side by side in one `lax.while_loop` (the loop
state of `_loop.py`, vmapped over lanes), each lane refilled from a queue of
trajectories when its own has finished.

Each iteration steps every running lane (`_loop.body`). Finished lanes wait, idle,
until `wait` of them have finished (or no lane runs): then a `lax.cond` gathers up
to `refill` finished lanes by index into a buffer of `refill` lanes, finishes them
(`_loop.finish`: event location included) and scatters their rows into the
outputs, starts the buffer on the next trajectories (`_loop.init`) and scatters it
back into the lanes. So a refill costs the work of `refill` lanes, not of all, and
its predicate is unbatched (`unvmap_any`): under an outer `vmap` it stays a
branch, not a select run on every iteration. Lanes still running when the queue
is empty are written once, after the loop. With `refill == 0` (as many lanes as
trajectories) `lockstep` runs instead: `jax.vmap` of the single solve's loop.
"""

import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .. import _loop
from .._closure._unvmap import unvmap_any
from .._event import occurrences
from .._problem import Buffers, Carry, Problem
from .._select import where
from .._setup import FinalStates
from ._inputs import PerTrajectory
from ._policy import Policy


class Lanes(NamedTuple):
    """The loop state: `lanes` solves side by side (leading axis: lane), and the
    rows of the outputs written so far (leading axis: trajectory)."""

    carry: Carry
    bufs: Buffers
    y0: PyTree  # each lane's initial state
    args: PyTree  # each lane's array leaves of `args`
    times: PerTrajectory | None  # each lane's own times (internal), if any
    index: Array  # each lane's trajectory (>= batch: idle, the queue is empty)
    running: Array  # each lane's solve has not finished
    queue: Array  # the next trajectory to start
    done: Array  # trajectories finished and written
    iterations: Array  # loop iterations so far
    out: PyTree  # outputs, one row per trajectory
    shown: Any  # the progress last shown, or None


def with_lane(
    problem: Problem, y0: PyTree, args_dynamic: PyTree, times: PerTrajectory | None
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


def row(problem: Problem, out: _loop.Outputs, final: FinalStates) -> dict:
    """What a finished solve hands back for its trajectory (internal time): every
    per-trajectory field of `diffeqsolve`'s `Solution`."""
    carry = out.carry
    return dict(
        ts=out.ts,
        ys=out.ys,
        t_end=out.t_end,
        result=out.result,
        num_steps=carry.num_steps,
        num_accepted=carry.num_accepted,
        num_rejected=carry.num_rejected,
        event_mask=carry.event_mask,
        solver_state=carry.solver_state if final.solver_state else None,
        controller_state=carry.controller_state if final.controller_state else None,
        events=occurrences(problem, out.bufs, carry),  # internal time
    )


def _take(tree: PyTree, index: Array, size: int) -> PyTree:
    """Rows `index` of every leaf (clipped to `size - 1`: out-of-range rows are
    masked by the caller)."""
    safe = jnp.minimum(index, size - 1)
    return jtu.tree_map(lambda x: x[safe], tree)


def _put(tree: PyTree, index: Array, rows: PyTree) -> PyTree:
    """`tree` with rows `index` replaced by `rows` (out-of-range indices dropped)."""
    return jtu.tree_map(lambda x, r: x.at[index].set(r, mode="drop"), tree, rows)


class LaneLoop:
    """The pieces of the lane loop for one problem (trace time only)."""

    def __init__(self, problem: Problem, y0, args_dynamic, times, plan: Policy, final):
        self.problem, self.y0, self.args, self.times = problem, y0, args_dynamic, times
        self.batch = jtu.tree_leaves(y0)[0].shape[0]
        self.plan, self.final = plan, final
        self.meter = problem.meter
        self.token = self.meter.start()

    def lane(self, y, a, tm) -> Problem:
        return with_lane(self.problem, y, a, tm)

    def init_lanes(self, index):
        """Lanes started on the trajectories `index` (idle where `>= batch`):
        `((carry, bufs, y, a, tm), running)`."""
        y, a, tm = (
            _take(x, index, self.batch) for x in (self.y0, self.args, self.times)
        )
        init = lambda y, a, tm: _loop.init(self.lane(y, a, tm))  # noqa: E731
        carry, bufs = jax.vmap(init)(y, a, tm)
        return (carry, bufs, y, a, tm), self.going(y, a, tm, carry) & (
            index < self.batch
        )

    def going(self, y, a, tm, carry):
        """Per lane: its solve goes on (`_loop.cond`)."""
        cond = lambda y, a, tm, c: _loop.cond(self.lane(y, a, tm), c)  # noqa: E731
        return jax.vmap(cond)(y, a, tm, carry)

    def outputs(self, y, a, tm, carry, bufs):
        """Per lane: its trajectory's row (`row`, after `_loop.finish`)."""

        def one(y, a, tm, carry, bufs):
            problem = self.lane(y, a, tm)
            return row(problem, _loop.finish(problem, carry, bufs), self.final)

        return jax.vmap(one)(y, a, tm, carry, bufs)

    def step(self, s: Lanes, member) -> Lanes:
        """One step of every running lane."""

        def one(y, a, tm, c, b, act):
            return _loop.body(self.lane(y, a, tm), (c, b), act)

        carry, bufs = jax.vmap(one)(s.y0, s.args, s.times, s.carry, s.bufs, s.running)
        running = s.running & self.going(s.y0, s.args, s.times, carry)
        iterations = s.iterations + jnp.asarray(member, jnp.int32)
        return s._replace(
            carry=carry, bufs=bufs, running=running, iterations=iterations
        )

    def refill(self, s: Lanes, take) -> Lanes:
        """Up to `refill` of the lanes `take` (finished ones) written and started on
        the next trajectories of the queue (lanes past its end go idle), through a
        buffer of `refill` lanes gathered by index."""
        size, lanes = self.plan.refill, self.plan.lanes
        rank = jnp.cumsum(take, dtype=jnp.int32) - 1
        slot = where(take & (rank < size), rank, size)  # out of range: dropped
        slots = jnp.full((size,), lanes, jnp.int32)
        slots = slots.at[slot].set(jnp.arange(lanes, dtype=jnp.int32), mode="drop")
        valid = slots < lanes
        old = _take((s.y0, s.args, s.times, s.carry, s.bufs), slots, lanes)
        rows = self.outputs(*old)
        trajectory = where(valid, _take(s.index, slots, lanes), self.batch)
        out = _put(s.out, trajectory, rows)
        count = jnp.sum(valid, dtype=jnp.int32)
        index = where(valid, s.queue + jnp.arange(size, dtype=jnp.int32), self.batch)
        (carry, bufs, y, a, tm), running = self.init_lanes(index)
        lane_state = (s.carry, s.bufs, s.y0, s.args, s.times, s.index, s.running)
        new = (carry, bufs, y, a, tm, index, running)
        carry, bufs, y, a, tm, index, running = _put(lane_state, slots, new)
        done = s.done + count
        return s._replace(
            carry=carry, bufs=bufs, y0=y, args=a, times=tm, index=index,
            running=running, queue=jnp.minimum(s.queue + count, self.batch),
            done=done, out=out, shown=self.show(s, done),
        )  # fmt: skip

    def show(self, s: Lanes, done):
        """The progress meter after a refill: the fraction of trajectories done."""
        if self.token is None:
            return s.shown
        fraction = done / self.batch
        show = self.meter.wants(s.iterations, s.shown, fraction) & (fraction < 1)
        token = self.token
        lax.cond(show, lambda: self.meter.callback(token, fraction), lambda: None)
        return where(show, fraction, s.shown)

    def body(self, s: Lanes, member) -> Lanes:
        """One step of every running lane, then a refill where it pays: once
        `wait` finished lanes wait, or no lane runs, while the queue lasts."""
        s = self.step(s, member)
        finished = (s.index < self.batch) & ~s.running
        count = jnp.sum(finished, dtype=jnp.int32)
        enough = (count >= self.plan.wait) | ~jnp.any(s.running)
        due = (count > 0) & enough & (s.queue < self.batch) & member
        return lax.cond(unvmap_any(due), self.refill, lambda s, _: s, s, finished & due)

    def start(self) -> Lanes:
        """The first `lanes` trajectories started, no output written yet."""
        lanes = self.plan.lanes
        index = jnp.arange(lanes, dtype=jnp.int32)
        (carry, bufs, y, a, tm), running = self.init_lanes(index)
        first = lambda tree: jtu.tree_map(lambda x: x[:1], tree)  # noqa: E731
        one = jax.eval_shape(self.outputs, *first((y, a, tm, carry, bufs)))
        shape = lambda x: jnp.zeros((self.batch,) + x.shape[1:], x.dtype)  # noqa: E731
        out = jtu.tree_map(shape, one)
        zero = jnp.asarray(0, jnp.int32)
        shown = None
        if self.token is not None:
            # 0, computed from the initial state so that it is shown before the
            # loop runs.
            shown = jnp.minimum(jnp.min(carry.t - self.problem.t0), 0).astype(float)
            self.meter.callback(self.token, shown)
        return Lanes(
            carry=carry, bufs=bufs, y0=y, args=a, times=tm, index=index,
            running=running, queue=jnp.asarray(lanes, jnp.int32), done=zero,
            iterations=zero, out=out, shown=shown,
        )  # fmt: skip

    def finish(self, s: Lanes) -> PyTree:
        """Every trajectory's row: those of the lanes still occupied written now."""
        rows = self.outputs(s.y0, s.args, s.times, s.carry, s.bufs)
        return _put(s.out, where(s.index < self.batch, s.index, self.batch), rows)


def lockstep(problem: Problem, y0, args_dynamic, times, final: FinalStates):
    """As many lanes as trajectories: `jax.vmap` of the single solve's loop
    (`_loop.run_while`), the program of `jax.vmap(diffeqsolve)` itself (the lane
    loop's state and bookkeeping cost a TPU v5e 1.2x the vmapped BDF solve). Its
    iterations are the most steps of a trajectory."""

    def one(y, a, tm):
        lane = with_lane(problem, y, a, tm)
        carry, bufs = _loop.init(lane)
        carry, bufs, _ = _loop.run_while(lane, carry, bufs)
        return row(lane, _loop.finish(lane, carry, bufs), final)

    rows = jax.vmap(one)(y0, args_dynamic, times)
    return rows, jnp.max(rows["num_steps"])


def run(problem: Problem, y0, args_dynamic, times, plan: Policy, final: FinalStates):
    """The lane loop: every trajectory's row (leading axis: trajectory) and the
    number of loop iterations (`lockstep` where nothing is refilled)."""
    if not plan.refill:
        return lockstep(problem, y0, args_dynamic, times, final)
    loop = LaneLoop(problem, y0, args_dynamic, times, plan, final)
    state = loop.start()

    def going(s: Lanes):
        return jnp.any(s.running) | (s.queue < loop.batch)

    # Under an outer `vmap` the loop runs while any member goes on; `body` leaves
    # a finished member as it is (its lanes are not running, its queue is empty).
    state = lax.while_loop(
        lambda s: unvmap_any(going(s)), lambda s: loop.body(s, going(s)), state
    )
    if loop.token is not None:
        # 1, computed from the final state (a float: `x - x` of an integer would be
        # folded away) so that it is shown after every tick.
        t = state.carry.t
        loop.meter.callback(loop.token, jnp.maximum(jnp.max(t - t), 0) + 1)
    return loop.finish(state), state.iterations
