"""`RESULTS`, the outcome of a solve, and `Solution`, what a solve returns."""

import warnings
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, PyTree

from ._select import where
from ._time import flip_finite


class Result(eqx.Module):
    """One outcome of a solve (an item of [`solverkit.RESULTS`][]); a pytree holding an
    integer code, so it can be returned from `jit` and batched by `vmap`."""

    code: Any

    def __eq__(self, other) -> Bool[Array, "..."]:  # pyright: ignore
        if not isinstance(other, Result):
            return NotImplemented
        return jnp.asarray(self.code) == jnp.asarray(other.code)

    def __ne__(self, other) -> Bool[Array, "..."]:  # pyright: ignore
        if not isinstance(other, Result):
            return NotImplemented
        return jnp.asarray(self.code) != jnp.asarray(other.code)

    def message(self) -> str:
        """The text of a concrete, unbatched result."""
        return RESULTS.messages[int(np.asarray(self.code))]

    @property
    def _value(self):
        # The integer code, under the name equinox's enumerations give it (diffrax's
        # RESULTS is one).
        return self.code


# Every outcome of a solve, as `(name, message)`, in the order of their integer codes:
# the one vocabulary of the loop, the solvers' steps and their root finders.
_OUTCOMES = (
    ("successful", ""),
    (
        "event_occurred",
        "Terminating differential equation solve because an event occurred.",
    ),
    (
        "max_steps_reached",
        "The maximum number of solver steps was reached. Try increasing "
        "`max_steps`, loosening the tolerances, or using a stiff solver.",
    ),
    (
        "dt_min_reached",
        "The minimum step size was reached in the differential equation solver: "
        "the step size fell below `dtmin`, or a step of one float spacing of `t` "
        "(the smallest that advances time) was rejected, as the tolerances are "
        "below what the error estimate resolves at this `t` in this precision "
        "(float32 times far from zero are coarse). Lower `dtmin`, loosen the "
        "tolerances, use a higher precision, or use "
        "`PIDController(..., force_dtmin=True)` to keep stepping at `dtmin`.",
    ),
    (
        "nonfinite",
        "Nonfinite (inf or nan) values detected during solve: the solution became "
        "non-finite. The problem may blow up, or "
        "the step size may be too large: try an adaptive step size controller or a "
        "smaller `dt0`.",
    ),
    ("internal_error", "An internal error occurred in solverkit; please report it."),
    (
        "implicit_divergence",
        "The nonlinear solve of an implicit solver diverged. With an adaptive "
        "step-size controller the step is retried with a smaller step; with a fixed "
        "step size, lower `dt0`, or pass a root finder that re-evaluates the "
        "Jacobian (e.g. `root_finder=optimistix.Newton(rtol=..., atol=...)`).",
    ),
    (
        "implicit_nonconvergence",
        "The nonlinear solve of an implicit solver did not converge within "
        "`root_find_max_steps` iterations. Lower `dt0` (with a fixed step size), "
        "raise `root_find_max_steps`, or loosen the root finder's tolerances.",
    ),
    (
        "max_events_reached",
        "An event fired more often than `Event(max_events=...)` records: raise "
        "`max_events`, or check that the event's effect does not make it fire again "
        "at once (a Zeno effect).",
    ),
    (
        "events_accumulated",
        "An event that continues fired again at the time of its previous occurrence: "
        "its occurrences accumulate there (a Zeno point, as of a bouncing ball whose "
        "bounces shrink to nothing, or an effect that makes the event fire again at "
        "once), and no solver can go past it. The solve stopped there: end it "
        "earlier (`t1`, `Event(terminal=k)`) or change the effect (e.g. to stop "
        "bouncing below a speed).",
    ),
    (
        "inconsistent_initial_values",
        "The initial values of a differential-algebraic equation (a singular "
        "`mass_matrix`) are inconsistent: the algebraic equations do not hold at "
        "`t0` (`f(t0, y0, args)` has a component outside the range of the mass "
        "matrix). Solve the algebraic equations for the algebraic components of "
        "`y0` first.",
    ),
    # diffrax's other names (from optimistix's and lineax's), which an ODE solve here
    # returns only for a singular iteration matrix (`singular`: Rodas4, Rodas5P and
    # BDF with a mass matrix) or never; kept so that scripts comparing against them
    # run.
    (
        "max_steps_rejected",
        "Maximum number of rejected steps was reached. Consider increasing "
        "`ClipStepSizeController(store_rejected_steps=...)`.",
    ),
    (
        "singular",
        "A linear solver returned non-finite (NaN or inf) output: the iteration "
        "matrix `M - γhJ` of a stiff solver is singular whatever the step size (an "
        "algebraic equation of a singular `mass_matrix` that does not determine its "
        "unknown, such as `0 = 0·y`). No step size helps, so the solve ended at "
        "once; its saved states hold no NaNs. Give every algebraic unknown an "
        "equation that determines it.",
    ),
    ("breakdown", "A form of iterative breakdown has occured in a linear solve."),
    ("stagnation", "A stagnation in an iterative linear solve has occurred."),
    ("conlim", "Condition number of A seems to be larger than `conlim`."),
    (
        "nonfinite_input",
        "A linear solver received non-finite (NaN or inf) input and cannot "
        "determine a solution.",
    ),
    # Last, so that the codes before keep their values.
    (
        "invalid_save_times",
        "The save times saveat.ts are not increasing (decreasing when t1 < t0), in "
        "the direction from t0 to t1, or lie outside [t0, t1]. They were traced (under "
        "`jit`, `vmap` or `grad`), so this was found during the solve, not before: "
        "sort them (`jnp.sort`, reversed for t1 < t0) and keep them within [t0, t1] "
        "(`jnp.clip`).",
    ),
)

# diffrax's names for the implicit solvers' failures (optimistix's), the same items.
_ALIASES = {
    "nonlinear_divergence": "implicit_divergence",
    "nonlinear_max_steps_reached": "implicit_nonconvergence",
}


class _Results:
    """Enumerates the outcomes of a solve.

    `successful`, `event_occurred` (a terminating event fired; also a success),
    `max_steps_reached`, `dt_min_reached`, `nonfinite`, `internal_error`,
    `implicit_divergence`, `implicit_nonconvergence` (an implicit solver's nonlinear
    solve failed; adaptive controllers reject the step and retry a smaller one; also
    under diffrax's names `nonlinear_divergence` and `nonlinear_max_steps_reached`),
    `max_events_reached` (a continuing event fired more often than it records),
    `events_accumulated` (its occurrences accumulate at one time: a Zeno point),
    `inconsistent_initial_values` (a differential-algebraic equation's `y0` does
    not satisfy its algebraic equations), `singular` (a stiff solver's iteration
    matrix `M - γhJ` is singular even as the step shrinks: `Rodas4`, `Rodas5P` and
    `BDF` with a singular mass matrix), `invalid_save_times` (traced `SaveAt(ts)`
    out of order or outside `[t0, t1]`, found at run time), and diffrax's names
    that an ODE
    solve here never returns (`max_steps_rejected`, `breakdown`, `stagnation`,
    `conlim`, `nonfinite_input`).
    Compare with `==`: `sol.result == sk.RESULTS.successful` is a boolean array.
    """

    # Set in `__init__`, one per outcome; declared here for type checkers.
    successful: Result
    event_occurred: Result
    max_steps_reached: Result
    dt_min_reached: Result
    nonfinite: Result
    internal_error: Result
    implicit_divergence: Result
    implicit_nonconvergence: Result
    max_events_reached: Result
    events_accumulated: Result
    inconsistent_initial_values: Result
    max_steps_rejected: Result
    singular: Result
    breakdown: Result
    stagnation: Result
    conlim: Result
    nonfinite_input: Result
    invalid_save_times: Result
    nonlinear_divergence: Result
    nonlinear_max_steps_reached: Result

    _names = tuple(name for name, _ in _OUTCOMES)
    messages = tuple(message for _, message in _OUTCOMES)

    def __init__(self):
        for code, name in enumerate(self._names):
            setattr(self, name, Result(np.int32(code)))
        for alias, name in _ALIASES.items():
            setattr(self, alias, getattr(self, name))

    @property
    def discrete_terminating_event_occurred(self) -> Result:
        """Deprecated (as in diffrax): `event_occurred`."""
        warnings.warn(
            "`RESULTS.discrete_terminating_event_occurred` is deprecated (as in "
            "diffrax): use `RESULTS.event_occurred`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.event_occurred

    def where(self, pred, a: Result, b: Result) -> Result:
        """`a` where `pred` else `b` (one `select`, not a nested `jit`)."""
        return Result(where(pred, a.code, b.code))

    def __iter__(self):
        return iter(getattr(self, name) for name in self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, key: "str | Result") -> "Result | str":
        """`RESULTS["name"]` is that result; `RESULTS[result]` is its message (of a
        concrete, unbatched result), as with diffrax."""
        if isinstance(key, Result):
            return key.message()
        return getattr(self, key)

    def __repr__(self):
        return f"RESULTS({', '.join(self._names)})"


RESULTS = _Results()
# The message of each result code, by code: what a failed solve raises.
MESSAGES = [r.message() or "successful" for r in RESULTS]
# The two codes of a solve that succeeded, as Python ints: the one definition the
# loop, the events, the kernel and the front ends compare result codes with.
SUCCESS = int(RESULTS.successful.code)
EVENT = int(RESULTS.event_occurred.code)
OK = (SUCCESS, EVENT)


def failure_code(result: Array) -> Array:
    """`result` (integer codes) where it is a failure, else 0 (failure codes are
    positive): one reduction (a maximum) of it then finds the worst failure."""
    return where((result != SUCCESS) & (result != EVENT), result, 0)


def is_okay(result: Result) -> Bool[Array, "..."]:
    """Whether a result is a success (including a terminating event)."""
    return (result == RESULTS.successful) | (result == RESULTS.event_occurred)


def is_successful(result: Result) -> Bool[Array, "..."]:
    """Whether a result is `RESULTS.successful`."""
    return result == RESULTS.successful


def is_event(result: Result) -> Bool[Array, "..."]:
    """Whether a terminating event occurred."""
    return result == RESULTS.event_occurred


class Solution(eqx.Module):
    """What [`solverkit.diffeqsolve`][] returns.

    **Attributes:**

    - `t0`, `t1`: the interval solved over (`t1` is the event time if an event fired).
    - `ts`: the times at which the solution was saved (padded with `inf`), or `None`.
    - `ys`: the saved values, one row per entry of `ts`, or `None`.
    - `stats`: `num_steps`, `num_accepted_steps`, `num_rejected_steps`, `max_steps`.
    - `result`: a [`solverkit.RESULTS`][] item.
    - `event_mask`: with an event, which of its conditions fired; else `None`.
    - `made_jump`, `solver_state`, `controller_state`: final internal states (`None`
        unless requested); kept for compatibility with diffrax.
    - `interpolation`: dense output, if `SaveAt(dense=True)`.
    - `events`: with an event that continues (`Event(effect=...)` or
        `Event(terminal=...)`), the occurrences: an [`solverkit.EventRecord`][];
        else `None`.
    """

    t0: Any
    t1: Any
    ts: Any
    ys: PyTree | None
    stats: dict[str, Any]
    result: Result
    event_mask: PyTree | None = None
    made_jump: Any = None
    solver_state: PyTree | None = None
    controller_state: PyTree | None = None
    interpolation: Any = None
    events: "EventRecord | None" = None

    def evaluate(self, t0, t1=None, left: bool = True) -> PyTree:
        """The dense solution at `t0`, or `y(t1) - y(t0)` when `t1` is given.

        **Arguments:**

        - `t0`: time to evaluate at.
        - `t1`: optional second time.
        - `left`: kept for diffrax compatibility (ODE solutions are continuous).

        **Returns:**

        A pytree with the structure of `y0`.
        """
        del left
        return self._dense("evaluate").evaluate(t0, t1)

    def derivative(self, t, left: bool = True) -> PyTree:
        """The time derivative of the dense solution at `t`.

        **Arguments:**

        - `t`: time to evaluate at.
        - `left`: kept for diffrax compatibility.

        **Returns:**

        A pytree with the structure of `y0`.
        """
        del left
        return self._dense("derivative").derivative(t)

    def _dense(self, method: str):
        if self.interpolation is None:
            raise ValueError(
                "Dense solution has not been saved; pass SaveAt(dense=True). "
                f"(Solution.{method} needs `saveat=SaveAt(dense=True)` in "
                "diffeqsolve.)"
            )
        return self.interpolation


class EventRecord(eqx.Module):
    """The occurrences of an event that continues, in time order.

    **Attributes:**

    - `ts`: the event times, padded with `inf` to `Event(max_events=...)` rows.
    - `ys`: the state just before each event (before its effect), padded likewise
        (with the state's final value).
    - `num`: how many occurred (at most `max_events`; a solve where more would have
        ends with `RESULTS.max_events_reached`).
    """

    ts: Any
    ys: PyTree
    num: Any


def event_record(direction: Array | None, occurrences) -> EventRecord | None:
    """`Solution.events`: a continuing event's `occurrences` (`(ts, ys, num)` in
    internal time, or `None` without such an event) in user time."""
    if occurrences is None:
        return None
    ts, ys, num = occurrences
    ts = flip_finite(direction, ts)
    return EventRecord(ts, ys, jnp.asarray(num).astype(jnp.result_type(int)))
