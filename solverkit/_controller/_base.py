"""Step-size controllers: the bases `AbstractStepSizeController` and
`AbstractAdaptiveStepSizeController`, and the fixed ones, `ConstantStepSize` and
`StepTo` (the adaptive ones are in `_adaptive.py`).

Controllers work in the loop's internal time, which always increases (a backwards
solve is run forwards in `-t`).
"""

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .._custom_types import Args, RealScalarLike, VF, Y
from .._errors import BadInputError, concrete
from .._select import where
from .._solution import Result, RESULTS
from .._term import AbstractTerm
from .._time import flip
from .._tolerances import Tolerances


class AbstractStepSizeController(eqx.Module):
    """Base class (diffrax's interface): chooses the first step, then accepts or
    rejects each step and sizes the next.

    The loop asks a controller only through these methods and properties, never
    which controller it is.
    """

    @abc.abstractmethod
    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        dt0: RealScalarLike | None,
        args: Args,
        func: Callable[..., VF],
        error_order: RealScalarLike | None,
    ) -> tuple[Any, Any]:
        """**Returns:** `(end of the first step, controller state)`."""

    @abc.abstractmethod
    def adapt_step_size(
        self,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        y1_candidate: Y,
        args: Args,
        y_error: Y | None,
        error_order: RealScalarLike | None,
        controller_state: PyTree,
    ) -> tuple[Any, Any, Any, Any, PyTree, Result]:
        """**Returns:** `(keep_step, next_t0, next_t1, made_jump, state, result)`."""

    def loop_init(self, *args) -> tuple[Any, Any]:
        """`init` as `diffeqsolve`'s loop takes it (the same arguments). A controller
        with jumps may end a step at a jump time itself there, where its `init`
        (diffrax's) ends it one ulp before (see `has_jumps`). Default: `init`."""
        return self.init(*args)

    def loop_adapt_step_size(
        self, *args, keep=None
    ) -> tuple[Any, Any, Any, Any, PyTree, Result]:
        """`adapt_step_size` as `diffeqsolve`'s loop takes it (the same arguments and
        outputs, with `loop_init`'s convention at jumps). `keep`, where given, is
        the decision to take instead of the controller's own: a backward pass
        replays the forward pass's (another compilation can round an error
        estimate to the other side of the tolerance), and the next step is then
        sized as after that decision. Default: `adapt_step_size`, which decides
        itself (the loop then overrides only the decision)."""
        del keep
        return self.adapt_step_size(*args)

    def resume(self, controller_state: PyTree, fresh: PyTree) -> PyTree:
        """The state to continue an earlier solve from: `controller_state`, which
        that solve returned (`SaveAt(controller_state=True)`), or `fresh`, this
        solve's own initial state. The default keeps the earlier state (an adaptive
        controller's error history); a controller whose state describes the
        interval itself takes `fresh`."""
        del fresh
        return controller_state

    @property
    def adaptive(self) -> bool:
        """Whether the steps depend on the state (through an error estimate)."""
        return True

    @property
    def has_jumps(self) -> bool:
        """Whether a step may end at a jump of the vector field in time. In the
        loop (`loop_init`, `loop_adapt_step_size`) such a step ends at the jump
        time itself; the loop steps the solver to one ulp before it and starts the
        next step from the field one ulp after it."""
        return False

    @property
    def one_grid(self) -> bool:
        """Whether the steps are given times, one grid from `t0` to `t1` (so it
        can't serve solves with other `t0`, `t1`)."""
        return False

    def ends_on_jump(
        self, controller_state: PyTree, t1: RealScalarLike
    ) -> Array | bool:
        """Whether a step ending at `t1` ends at a jump."""
        return False

    def to_internal(self, direction: Array | None) -> "AbstractStepSizeController":
        """This controller in the loop's internal time `direction * t` (its times
        mapped; `direction` is `-1` for a backwards solve, or `None`)."""
        return self

    def check(
        self,
        error_order: float | None,
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        """Raise a `ValueError` before tracing if the controller can't be used so
        (`error_order` the solver's, `None` for a solver without an error estimate;
        `t0`, `t1` NumPy values where known, else `None`; `dt0` as passed to
        `diffeqsolve`)."""

    def tolerances(self) -> Tolerances | None:
        """The tolerances a solver takes from this controller (bound by
        `solver.bind_controller_tols`), or `None` for a controller without them."""
        return None


class AbstractAdaptiveStepSizeController(AbstractStepSizeController):
    """Base class of the controllers that size steps from an error estimate, with
    tolerances that other parts of a solve may read: an implicit solver's root finder
    (`with_stepsize_controller_tols`) and `steady_state_event` take `rtol`, `atol`
    and `norm` from it (a solver through `tolerances()`)."""

    rtol: eqx.AbstractVar[Any]
    atol: eqx.AbstractVar[Any]
    norm: eqx.AbstractVar[Callable[[PyTree], Array]]

    def tolerances(self) -> Tolerances:
        return Tolerances(self.rtol, self.atol, self.norm)


def times_of(t0: RealScalarLike, t1: RealScalarLike):
    """`t0`, `t1` as arrays of one floating dtype (they may be Python floats)."""
    dtype = jnp.result_type(t0, t1, float)
    return jnp.asarray(t0, dtype), jnp.asarray(t1, dtype)


class ConstantState(NamedTuple):
    done: Array  # steps completed once the next one is taken
    n: Array  # steps in the interval (-1 for an infinite one)
    start: Array
    end: Array  # the end of the interval, or the step size when it is infinite


class ConstantStepSize(AbstractStepSizeController):
    """Steps of the constant size `dt0`.

    Step ends are computed as fractions of the interval, `t0 + (t1 - t0) * k / n` with
    `n = ceil((t1 - t0) / dt0)`, not by adding `dt0` up, so rounding errors do not
    accumulate into an extra sliver of a step (as diffrax does). With `t1 = inf` the
    steps are `dt0` apart.
    """

    @property
    def adaptive(self) -> bool:
        return False

    def resume(self, controller_state: PyTree, fresh: PyTree) -> PyTree:
        del controller_state  # the earlier interval's steps
        return fresh

    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        dt0: RealScalarLike | None,
        args: Args,
        func: Callable[..., VF],
        error_order: RealScalarLike | None,
    ):
        t0, t1 = times_of(t0, t1)
        dt0 = jnp.asarray(dt0, t0.dtype)
        finite = jnp.isfinite(t1)
        # `nextafter`: a `dt0` that divides the interval up to rounding gives `n`
        # steps, not `n + 1`. (`n`, an integer, has no derivative: `stop_gradient`
        # keeps a differentiated `dt0` away from `nextafter`, which has no rule.)
        n = jnp.ceil((t1 - t0) / jnp.nextafter(lax.stop_gradient(dt0), jnp.inf))
        n = where(finite, jnp.where(finite, n, 0).astype(jnp.int32), -1)
        end = where(finite, t1, dt0)  # the end, or with `t1 = inf` the step size
        return t0 + dt0, ConstantState(jnp.asarray(1, jnp.int32), n, t0, end)

    def adapt_step_size(
        self,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        y1_candidate: Y,
        args: Args,
        y_error: Y | None,
        error_order: RealScalarLike | None,
        controller_state: PyTree,
    ):
        done, n, start, end = controller_state
        done = done + 1  # steps completed once the next one is taken
        fraction = done.astype(start.dtype) / jnp.maximum(n, 1).astype(start.dtype)
        nxt = where(done >= n, end, start + (end - start) * fraction)
        nxt = where(n >= 0, nxt, t1 + end)
        state = ConstantState(done, n, start, end)
        return True, t1, nxt, False, state, RESULTS.successful

    def check(
        self,
        error_order: float | None,
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        if dt0 is None:
            raise ValueError(
                "Constant step size solvers cannot select step size automatically; "
                "please pass a value for `dt0`. (dt0=None chooses it automatically "
                "only with an adaptive controller such as PIDController.)"
            )


class StepTo(AbstractStepSizeController):
    """Steps exactly to the times `ts` (which must start at `t0` and end at `t1`).

    **Arguments:**

    - `ts`: increasing (or, for a backwards solve, decreasing) times.
    """

    ts: Any = eqx.field(converter=jnp.asarray)

    def __check_init__(self):
        if jnp.ndim(self.ts) != 1:
            raise ValueError(
                "`ts` must be one-dimensional: StepTo(ts) needs a 1-D array."
            )
        if self.ts.shape[0] < 2:
            raise ValueError(
                "`ts` must have length at least 2: StepTo(ts) needs a start and an end."
            )

    @property
    def one_grid(self) -> bool:
        return True

    @property
    def adaptive(self) -> bool:
        return False

    def resume(self, controller_state: PyTree, fresh: PyTree) -> PyTree:
        del controller_state  # the earlier interval's steps
        return fresh

    def to_internal(self, direction: Array | None) -> "StepTo":
        return self if direction is None else StepTo(flip(direction, self.ts))

    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        dt0: RealScalarLike | None,
        args: Args,
        func: Callable[..., VF],
        error_order: RealScalarLike | None,
    ):
        del dt0
        t0, _ = times_of(t0, t1)
        # The first time of `ts` after `t0`: `ts[1]` at the solve's start; after an
        # event's effect (a fresh start at the occurrence, within the grid) the next
        # grid time, not `ts[1]` again (the solve stepped back to it).
        ts = self.ts.astype(t0.dtype)
        index = jnp.clip(jnp.sum(ts <= t0, dtype=jnp.int32), 1, ts.shape[0] - 1)
        return ts[index], index + 1

    def adapt_step_size(
        self,
        t0: RealScalarLike,
        t1: Array,
        y0: Y,
        y1_candidate: Y,
        args: Args,
        y_error: Y | None,
        error_order: RealScalarLike | None,
        controller_state: PyTree,
    ):
        index = controller_state  # of the end of the step after this one
        nxt = self.ts[jnp.minimum(index, self.ts.shape[0] - 1)]
        return True, t1, nxt.astype(t1.dtype), False, index + 1, RESULTS.successful

    def check(
        self,
        error_order: float | None,
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        if dt0 is not None:
            raise ValueError(
                "`dt0` should be `None`. Step location is already determined by "
                "StepTo(ts=...)."
            )
        ts = concrete(self.ts)
        if ts is None:
            return
        d = np.diff(ts)
        if not (np.all(d > 0) or np.all(d < 0)):
            raise BadInputError(
                "`StepTo(ts=...)` must be strictly increasing (or strictly decreasing "
                "if t0 > t1): `ts` must be strictly monotonic."
            )
        if t0 is not None and t1 is not None and (ts[0] != t0 or ts[-1] != t1):
            raise BadInputError(
                "Must have `t0==ts[0]` and `t1==ts[-1]`: StepTo(ts) must start at t0 "
                "and end at t1."
            )
