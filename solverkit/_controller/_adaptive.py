"""Adaptive step-size controllers: `PIDController`, `ClipStepSizeController` (steps
that also end at given times, or just before jumps), and the first-step heuristic.

Controllers work in the loop's internal time, which always increases (a backwards
solve is run forwards in `-t`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple, TYPE_CHECKING

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from .._custom_types import Args, RealScalarLike, VF, Y
from .._errors import BadInputError, concrete
from .._select import where
from .._solution import RESULTS
from .._term import AbstractTerm
from .._time import flip
from ._base import (
    AbstractAdaptiveStepSizeController,
    AbstractStepSizeController,
    times_of,
)
from ._norm import rms_norm


if TYPE_CHECKING:  # annotations only: the solvers import the controllers
    from .._solver import AbstractSolver


def _initial_step(
    func: Callable[..., VF],
    t0: Array,
    y0: Y,
    args: Args,
    error_order: RealScalarLike,
    rtol,
    atol,
    norm,
):
    """Hairer, Norsett & Wanner (1993), II.4: a first step from two evaluations."""
    scale = jtu.tree_map(lambda y: atol + jnp.abs(y) * rtol, y0)
    div = lambda a, s: a / s.astype(a.dtype)
    f0 = func(t0, y0, args)
    d0 = norm(jtu.tree_map(div, y0, scale))
    d1 = norm(jtu.tree_map(div, f0, scale))
    small = (d0 < 1e-5) | (d1 < 1e-5)
    h0 = where(small, 1e-6, 0.01 * d0 / where(small, 1, d1)).astype(t0.dtype)
    y1 = jtu.tree_map(lambda y, f: y + jnp.asarray(h0, y.dtype) * f, y0, f0)
    f1 = func(t0 + h0, y1, args)
    d2 = norm(jtu.tree_map(lambda a, b, s: div(a - b, s), f1, f0, scale)) / h0
    max_d = jnp.maximum(d1, d2)
    h1 = where(
        max_d <= 1e-15,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / where(max_d <= 1e-15, 1, max_d)) ** (1 / error_order),
    )
    return lax.stop_gradient(jnp.minimum(100 * h0, h1).astype(t0.dtype))


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


class PIDState(NamedTuple):
    prev: Array  # inverse scaled error of the last accepted step
    prev_prev: Array  # ... and of the one before
    at_dtmin: Array  # whether the last step was clipped to `dtmin`


class PIDController(AbstractAdaptiveStepSizeController):
    """Adaptive steps from an embedded error estimate, by a PID controller on the
    logarithm of the error (an I-controller by default).

    **Arguments:**

    - `rtol`, `atol`: relative and absolute tolerance (positive).
    - `pcoeff`, `icoeff`, `dcoeff`: proportional, integral, derivative coefficients.
    - `dtmin`, `dtmax`: bounds on the step size.
    - `force_dtmin`: at `dtmin`, keep stepping (True) or stop with
        `RESULTS.dt_min_reached` (False).
    - `safety`, `factormin`, `factormax`: the step grows by at most `factormax`, shrinks
        by at most `factormin`, and aims at `safety` times the ideal size.
    - `norm`: norm of the scaled error (RMS by default).
    - `error_order`: override the solver's error order.

    - `step_ts`, `jump_ts`: diffrax's older spelling of
        `ClipStepSizeController(PIDController(...), step_ts, jump_ts)`, which is what
        the solve uses.
    """

    rtol: float
    atol: float
    pcoeff: float = 0
    icoeff: float = 1
    dcoeff: float = 0
    dtmin: float | None = None
    dtmax: float | None = None
    force_dtmin: bool = True
    safety: float = 0.9
    factormin: float = 0.2
    factormax: float = 10.0
    norm: Callable[[PyTree], Array] = rms_norm
    error_order: float | None = None
    step_ts: Any = eqx.field(default=None, converter=_times)
    jump_ts: Any = eqx.field(default=None, converter=_times)

    def __check_init__(self):
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if isinstance(value, (int, float, np.ndarray, np.generic)) and not (
                np.all(np.asarray(value) >= 0)
            ):
                raise ValueError(f"PIDController: `{name}` must be >= 0, got {value}.")
        rtol, atol = concrete(self.rtol), concrete(self.atol)
        if (
            rtol is not None
            and atol is not None
            and np.all(rtol == 0)
            and np.all(atol == 0)
        ):
            raise ValueError("PIDController: `rtol` and `atol` can't both be zero.")

    def _as_clip(self) -> "ClipStepSizeController | None":
        """With `step_ts` or `jump_ts`: the `ClipStepSizeController` this is."""
        if self.step_ts is None and self.jump_ts is None:
            return None
        plain = eqx.tree_at(
            lambda c: (c.step_ts, c.jump_ts), self, (None, None), is_leaf=_is_none
        )
        # pyright counts the abstract `rtol`, `atol`, `norm` (properties here) as
        # fields of `ClipStepSizeController.__init__`.
        return ClipStepSizeController(plain, self.step_ts, self.jump_ts)  # pyright: ignore[reportCallIssue]

    def to_internal(self, direction: Array | None) -> AbstractStepSizeController:
        clip = self._as_clip()
        return self if clip is None else clip.to_internal(direction)

    def check(
        self,
        solver: "AbstractSolver",
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        # No terms here to pass: the built-in solvers' error orders don't use them.
        if self.error_order is None and solver.error_order(None) is None:  # pyright: ignore[reportArgumentType]
            raise BadInputError(  # diffrax raises a RuntimeError
                "Cannot use adaptive step sizes with a solver that does not provide "
                f"error estimates: {type(solver).__name__} has no error estimate, so "
                "it can't be used "
                "with PIDController: use ConstantStepSize, or a solver with an "
                "embedded error estimate (Tsit5, Dopri5, Bosh3, Heun, ...)."
            )

    def _order(self, error_order: RealScalarLike | None) -> RealScalarLike:
        order = self.error_order if self.error_order is not None else error_order
        assert order is not None  # `check` raised otherwise
        return order

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
        clip = self._as_clip()  # called by hand: as diffrax's (a clip controller)
        if clip is not None:
            return clip.init(terms, t0, t1, y0, dt0, args, func, error_order)
        t0, t1 = times_of(t0, t1)
        if dt0 is None:
            dt0 = _initial_step(
                func,
                t0,
                y0,
                args,
                self._order(error_order),
                self.rtol,
                self.atol,
                self.norm,
            )
        # As diffrax does, a given `dt0` is clipped to `[dtmin, dtmax]` too.
        if self.dtmax is not None:
            dt0 = jnp.minimum(dt0, self.dtmax)
        if self.dtmin is not None:
            dt0 = jnp.maximum(dt0, self.dtmin)
        one = jnp.ones((), t0.dtype)
        return t0 + dt0, PIDState(one, one, jnp.asarray(False))

    def _bounded(self, dt, factor, at_dtmin):
        """`dt` within `[dtmin, dtmax]`, whether it is at `dtmin`, and the result."""
        result = RESULTS.successful
        if self.dtmax is not None:
            dt = jnp.minimum(dt, self.dtmax)
        if self.dtmin is not None:
            if not self.force_dtmin:
                result = RESULTS.where(
                    dt < self.dtmin, RESULTS.dt_min_reached, RESULTS.successful
                )
            dt = where(at_dtmin & (factor == 1), self.dtmin, dt)
            at_dtmin = dt <= self.dtmin
            dt = jnp.maximum(dt, self.dtmin)
        return dt, at_dtmin, result

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
        clip = self._as_clip()  # called by hand: as diffrax's (a clip controller)
        if clip is not None:
            return clip.adapt_step_size(
                t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
            )
        prev, prev_prev, at_dtmin = controller_state
        order = self._order(error_order)
        t0, t1 = times_of(t0, t1)

        def scale(e, a, b):
            b = where(jnp.isfinite(b), b, a)
            tol = self.atol + jnp.maximum(jnp.abs(a), jnp.abs(b)) * self.rtol
            return e / jnp.asarray(tol, dtype=jnp.abs(e).dtype)

        err = self.norm(jtu.tree_map(scale, y_error, y0, y1_candidate))
        err = lax.stop_gradient(where(jnp.isfinite(err), err, jnp.inf))
        keep = err < 1
        if self.dtmin is not None:
            keep = keep | at_dtmin
        inv = (1 / err).astype(t0.dtype)
        c1 = (self.icoeff + self.pcoeff + self.dcoeff) / order
        c2 = -(self.pcoeff + 2 * self.dcoeff) / order
        c3 = self.dcoeff / order
        factor = self.safety * inv**c1
        if c2 != 0:
            factor = factor * prev**c2
        if c3 != 0:
            factor = factor * prev_prev**c3
        factor = jnp.clip(
            factor,
            where(keep, 1, self.factormin),
            where(keep, self.factormax, self.safety),
        )
        factor = lax.stop_gradient(factor)
        inv = where((inv == 0) | jnp.isinf(inv), 1, inv)
        dt, at_dtmin, result = self._bounded((t1 - t0) * factor, factor, at_dtmin)
        next_t0 = where(keep, t1, t0)
        state = PIDState(
            where(keep, inv, prev),
            where(keep, prev, prev_prev),
            jnp.asarray(at_dtmin),
        )
        return keep, next_t0, next_t0 + dt, False, state, result


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
        solver: "AbstractSolver",
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        self.controller.check(solver, t0, t1, dt0)

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

    def loop_adapt_step_size(self, *args):
        t0, t1, y0, y1_candidate, fn_args, y_error, error_order, state = args
        inner, jump = state
        t0, t1 = times_of(t0, t1)
        keep, next_t0, next_t1, made_jump, inner, result = (
            self.controller.loop_adapt_step_size(
                t0, t1, y0, y1_candidate, fn_args, y_error, error_order, inner
            )
        )
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
