"""`ClipStepSizeController`: an adaptive controller's steps, also ending at given times
(`step_ts`) or just before jumps (`jump_ts`), as diffrax's to the ulp when called by
hand; in the loop a step ends at the jump time itself.

Controllers work in the loop's internal time, which always increases (a backwards
solve is run forwards in `-t`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .._custom_types import Args, RealScalarLike, VF, Y
from .._select import where
from .._term import AbstractTerm
from .._time import flip
from .._tolerances import Tolerances
from ._base import AbstractAdaptiveStepSizeController, times_of


def _times(ts):
    if ts is None:
        return None
    ts = jnp.asarray(ts)
    if ts.ndim != 1:
        raise ValueError(
            f"ClipStepSizeController: times must be a 1-D array, got shape {ts.shape}."
        )
    return None if ts.shape[0] == 0 else ts


def _next_after(points, t: RealScalarLike):
    """The first of the sorted `points` strictly after `t` (`inf` if none)."""
    index = jnp.searchsorted(points, t, side="right")
    last = points.shape[0] - 1
    return where(index > last, jnp.inf, points[jnp.minimum(index, last)])


class ClipState(NamedTuple):
    inner: PyTree  # the wrapped controller's state
    jump: Array  # the next jump after the current time (`inf` if none)


class ClipStepSizeController(AbstractAdaptiveStepSizeController):
    """Wraps an adaptive controller so that steps also end exactly at given times.

    **Arguments:**

    - `controller`: the adaptive controller to wrap (e.g. a `PIDController`).
    - `step_ts`: times every solve steps to exactly (e.g. where the vector field
        changes behaviour).
    - `jump_ts`: times where the vector field jumps (is discontinuous in `t`): a step
        ends just before each, and the next starts at it with the vector field
        evaluated anew, so no step straddles the jump.
    - `store_rejected_steps`: accepted for diffrax compatibility; it has no effect
        (diffrax uses it to revisit rejected step ends, which matters to SDEs).
    """

    controller: AbstractAdaptiveStepSizeController
    step_ts: Any = eqx.field(default=None, converter=_times)
    jump_ts: Any = eqx.field(default=None, converter=_times)
    store_rejected_steps: int | None = eqx.field(default=None, static=True)

    def __check_init__(self):
        if not isinstance(self.controller, AbstractAdaptiveStepSizeController):
            raise ValueError(
                "Can only apply `ClipStepSizeController` to adaptive step size "
                "controllers (such as PIDController), but got "
                f"{self.controller!r}."
            )
        if self.store_rejected_steps is not None and not (
            isinstance(self.store_rejected_steps, (int, np.integer))
            and self.store_rejected_steps > 0
        ):
            raise ValueError(
                "`store_rejected_steps must either be `None` or a non-negative "
                f"integer (a positive one; got {self.store_rejected_steps!r})."
            )

    # The wrapped controller's tolerances (see `AbstractAdaptiveStepSizeController`).
    @property
    def rtol(self):
        return self.controller.rtol

    @property
    def atol(self):
        return self.controller.atol

    @property
    def norm(self):
        return self.controller.norm

    def check(
        self,
        error_order: float | None,
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        self.controller.check(error_order, t0, t1, dt0)

    def tolerances(self) -> Tolerances:
        return self.controller.tolerances()

    @property
    def has_jumps(self) -> bool:
        return self.jump_ts is not None or self.controller.has_jumps

    @property
    def one_grid(self) -> bool:
        return self.controller.one_grid

    def to_internal(self, direction: Array | None) -> "ClipStepSizeController":
        """Times mapped to internal time and sorted (they then increase)."""

        def move(ts):
            if ts is None:
                return None
            if direction is not None and ts.dtype != direction.dtype:
                ts = ts.astype(direction.dtype)  # integer times, strict promotion
            return jnp.sort(flip(direction, ts))

        inner = self.controller.to_internal(direction)
        steps, jumps = move(self.step_ts), move(self.jump_ts)
        # (the ignore: see `PIDController.to_internal`)
        return ClipStepSizeController(inner, steps, jumps, self.store_rejected_steps)  # pyright: ignore[reportArgumentType]

    def _clip(self, t0: Array, t1: Array):
        """The proposed step end `t1` clipped to the next time after `t0`, and the
        next jump after `t0` (`inf` if none)."""
        jump = jnp.asarray(jnp.inf, t1.dtype)
        if self.step_ts is not None:
            t1 = jnp.minimum(t1, _next_after(self.step_ts, t0).astype(t1.dtype))
        if self.jump_ts is not None:
            jump = _next_after(self.jump_ts, t0).astype(t1.dtype)
            t1 = jnp.minimum(t1, jump)
        return t1, jump

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
        """diffrax's: the first step ends at the next of `step_ts`, or one ulp before
        the next of `jump_ts`, if the wrapped controller's would pass it."""
        t0, t1 = times_of(t0, t1)
        tnext, inner = self.controller.init(
            terms, t0, t1, y0, dt0, args, func, error_order
        )
        return self._clip_before(t0, t0, jnp.asarray(tnext, t0.dtype), inner)

    def loop_init(self, *args):
        terms, t0, t1, y0, dt0, fn_args, func, error_order = args
        t0, t1 = times_of(t0, t1)
        tnext, inner = self.controller.loop_init(
            terms, t0, t1, y0, dt0, fn_args, func, error_order
        )
        tnext, jump = self._clip(t0, jnp.asarray(tnext, t0.dtype))
        return tnext, ClipState(inner, jump)

    def resume(self, controller_state: PyTree, fresh: PyTree) -> PyTree:
        # The wrapped controller's history; the next jump after this solve's `t0`.
        inner = self.controller.resume(controller_state.inner, fresh.inner)
        return ClipState(inner, fresh.jump)

    def ends_on_jump(self, controller_state: PyTree, t1: RealScalarLike) -> Array:
        inner, jump = controller_state
        return (t1 == jump) | self.controller.ends_on_jump(inner, t1)

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
        """diffrax's: a step ends one ulp before a jump, and the step after it starts
        one ulp after the jump (`made_jump`); a next start at or one ulp before a
        time of `step_ts` looks past it for the next end (so that nested
        controllers agree)."""
        t0, t1 = times_of(t0, t1)
        keep, next_t0, next_t1, made_jump, inner, result = (
            self.controller.adapt_step_size(
                t0, t1, y0, y1_candidate, args, y_error, error_order,
                controller_state.inner,
            )
        )  # fmt: skip
        next_t0 = jnp.asarray(next_t0, t0.dtype)
        next_t1 = jnp.asarray(next_t1, t0.dtype)
        past = next_t0
        if self.step_ts is not None:
            past, _ = _past_point(next_t0, self.step_ts.astype(t0.dtype))
        if self.jump_ts is not None:
            next_t0, jumped = _past_point(next_t0, self.jump_ts.astype(t0.dtype))
            made_jump = made_jump | jumped
            # Never an empty (or reversed) step after the start moved past a jump.
            next_t1 = jnp.maximum(next_t1, _ulp_after(next_t0))
        next_t1, state = self._clip_before(past, next_t0, next_t1, inner)
        return keep, next_t0, next_t1, made_jump, state, result

    def _clip_before(self, t_steps: Array, t_jumps: Array, t1: Array, inner: PyTree):
        """`t1` clipped to the next of `step_ts` after `t_steps` and to one ulp before
        the next of `jump_ts` after `t_jumps` (diffrax's convention), and the state."""
        jump = jnp.asarray(jnp.inf, t1.dtype)
        if self.step_ts is not None:
            t1 = jnp.minimum(t1, _next_after(self.step_ts, t_steps).astype(t1.dtype))
        if self.jump_ts is not None:
            jump = _next_after(self.jump_ts, t_jumps).astype(t1.dtype)
            t1 = jnp.minimum(t1, jnp.nextafter(jump, jnp.asarray(-jnp.inf, t1.dtype)))
        return t1, ClipState(inner, jump)

    def loop_adapt_step_size(self, *args, keep=None):
        t0, t1, y0, y1_candidate, fn_args, y_error, error_order, state = args
        inner, jump = state
        t0, t1 = times_of(t0, t1)
        keep, next_t0, next_t1, made_jump, inner, result = (
            self.controller.loop_adapt_step_size(
                t0, t1, y0, y1_candidate, fn_args, y_error, error_order, inner,
                **({} if keep is None else {"keep": keep}),
            )
        )  # fmt: skip
        made_jump = made_jump | (keep & (t1 == jump))
        next_t1, jump = self._clip(next_t0, jnp.asarray(next_t1))
        return keep, next_t0, next_t1, made_jump, ClipState(inner, jump), result


def _ulp_after(t: Array) -> Array:
    return jnp.nextafter(t, jnp.asarray(jnp.inf, t.dtype))


def _past_point(t: Array, points: Array) -> tuple[Array, Array]:
    """`t` moved to one ulp after a point of `points` that it is at or one ulp
    before (the end of a step that stopped short of a jump), and whether it moved."""
    up = _ulp_after(t)
    before = jnp.any(up == points)
    at = jnp.any(t == points)
    moved = where(at, up, where(before, _ulp_after(up), t))
    return moved, before | at


def _is_none(x) -> bool:
    return x is None
