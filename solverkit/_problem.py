"""The data of a solve: `Problem`, the one operand that every loop and custom
derivative rule receives (every user value reaches the engine through it), and the
loop's state types: the `Carry`, what a step hands to the saves (`StepOut`), and the
save buffers.

Everything is in the loop's internal time `tau = direction * t` (see `_time.py`).
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from ._closure._convert import Closure
from ._controller._base import AbstractStepSizeController
from ._progress import AbstractProgressMeter, NoProgressMeter
from ._solver import AbstractSolver
from ._term import AbstractTerm


class Events(eqx.Module):
    """A solve's events in the engine's form (internal time); each part `None` (or
    its default) where the solve has no such event."""

    conds: PyTree | None = None  # an `Event`'s conditions: Closures (t, y, args)
    directions: tuple | None = eqx.field(static=True, default=None)  # one a condition
    root_finder: Any = None  # of the event time, or None for the built-in search
    # An event that continues (`Event.continues`): its effect (or None), the
    # occurrence that stops the solve (None: none), and how many are recorded.
    effect: Closure | None = None
    continues: bool = eqx.field(static=True, default=False)
    stop_at: int | None = eqx.field(static=True, default=None)
    max_events: int = eqx.field(static=True, default=0)
    timed: Any = None  # events at given times: an `_event._timed.Timed` (`TimedEvent`)


class Problem(eqx.Module):
    """Everything a solve needs, as one pytree (arrays are its leaves), in the loop's
    internal time `tau = direction * t`, which always increases."""

    solver: AbstractSolver
    controller: AbstractStepSizeController  # in internal time
    terms: AbstractTerm  # `ClosureTerm`s, alone or in a `MultiTerm`
    direction: Array | None  # -1 for a backwards solve, None forwards
    args: PyTree
    y0: PyTree
    t0: Array  # internal time
    t1: Array  # internal time
    dt0: Array | None  # internal time (positive)
    max_steps: int | None = eqx.field(static=True)
    saves: tuple["Save", ...] = ()  # one per SubSaveAt
    save_tree: Any = eqx.field(static=True, default=jtu.tree_structure(None))
    dense: bool = eqx.field(static=True, default=False)
    event: "Events" = eqx.field(default_factory=lambda: Events())
    meter: AbstractProgressMeter = NoProgressMeter()
    resume: "Resume | None" = None  # states passed in to continue an earlier solve

    @property
    def error_order(self):
        return self.solver.error_order(self.terms)

    @property
    def saves_steps(self) -> bool:
        """Whether any output is saved at steps."""
        return any(save.every for save in self.saves)


class Resume(eqx.Module):
    """What `diffeqsolve` was passed to continue an earlier solve from its end (each
    `None` where not passed): the states that solve returned, and whether it ended
    at a jump of the vector field (then the solver's state is made anew)."""

    solver_state: PyTree | None
    controller_state: PyTree | None
    made_jump: Array | None


class Save(eqx.Module):
    """One `SubSaveAt`, in internal time, with its `fn` converted.

    Its rows are laid out as diffrax lays them out: `t0`, then the `ts` and step
    saves in time order, then `t1` (unless the last step save is the final point),
    then `inf` padding.
    """

    ts: Array | None  # internal times
    fn: Closure
    t0: bool = eqx.field(static=True)
    t1: bool = eqx.field(static=True)
    every: int = eqx.field(static=True)  # save every n-th step (0: none)
    saves_y: bool = eqx.field(static=True, default=True)  # `fn` is the default

    def step_rows(self, max_steps: int) -> int:
        return max_steps // self.every if self.every else 0

    def t1_row(self, max_steps: int | None) -> bool:
        """Whether `t1` needs a row of its own (else it may take a free step row)."""
        if self.every == 0:
            return self.t1
        assert max_steps is not None  # step saves need one (checked by `_saves`)
        return self.t1 and max_steps % self.every != 0

    @property
    def empty(self) -> bool:
        return not (self.t0 or self.t1 or self.every) and self.ts is None


class LastStep(NamedTuple):
    """The last accepted step, for locating an event on its dense output."""

    t0: Array
    dense_info: PyTree


class Continuing(NamedTuple):
    """The loop state of an event that continues."""

    count: Array  # occurrences so far
    last: Array  # the time of the last one (-inf before the first), without derivative


class Carry(NamedTuple):
    t: Array
    tnext: Array
    y: PyTree
    solver_state: PyTree
    controller_state: PyTree
    num_steps: Array
    num_accepted: Array
    num_rejected: Array
    result: Array
    cond_values: PyTree  # event conditions at (t, y), or None
    event_mask: PyTree  # which conditions fired, or None
    last: LastStep | None  # only with real-valued event conditions
    continuing: Continuing | None = None  # only with an event that continues
    timed_index: Array | None = None  # the next `TimedEvent` time (only with one)


class SaveBuffer(NamedTuple):
    """The rows of one `Save` written during the loop (`None` where not saved)."""

    ts_ys: PyTree | None  # values at `Save.ts`
    steps_ts: Array | None  # times of the step saves
    steps_ys: PyTree | None  # values at the step saves


class Buffers(NamedTuple):
    saves: tuple[SaveBuffer, ...]
    # Step boundaries, for `SaveAt(dense=True)` (row 0, `t0`, is set by `finish`).
    dense_ts: Array | None
    dense_info: PyTree | None  # each accepted step's dense information
    # An event that continues: the occurrences' times and states before them.
    event_ts: Array | None = None
    event_ys: PyTree | None = None
    # With dense output and an event that continues: the end of the interval each
    # step's dense information covers (a step cut at an occurrence ends before it).
    dense_ends: Array | None = None


class StepOut(NamedTuple):
    """What one attempted step hands to the save buffers."""

    accepted: Array
    t0: Array
    t1: Array
    y1: PyTree
    dense_info: PyTree
    landed: Array | None = None  # it ended at an occurrence of an event that continues
    # The end of the interval `dense_info` covers, where the step was cut short at
    # an occurrence (`t1` there); `None`: `t1`.
    t_info: Array | None = None
    # Whether the next step's end was moved onto `t1` (`_loop._landing`), which a
    # backward pass replays with the decision `accepted`; `None` before `_loop.step`
    # sets it.
    lands: Array | None = None

    @property
    def info_end(self) -> Array:
        return self.t1 if self.t_info is None else self.t_info


def adaptive(problem: Problem) -> bool:
    """Whether the step sequence depends on the state (see `_loop.batch_like`)."""
    return problem.controller.adaptive


def dense_info_zeros(problem: Problem, solver_state: PyTree) -> PyTree:
    """Zeros shaped like one step's dense information."""
    _, _, info, _, _ = eqx.filter_eval_shape(
        problem.solver.loop_step,
        problem.terms,
        problem.t0,
        problem.t1,
        problem.y0,
        problem.args,
        solver_state,
        False,
    )
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), info)
