"""The adaptive step-size controller `PIDController` and the first-step heuristic
(`ClipStepSizeController` is in `_clip.py`).

Controllers work in the loop's internal time, which always increases (a backwards
solve is run forwards in `-t`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from .._custom_types import Args, RealScalarLike, VF, Y
from .._errors import BadInputError, concrete
from .._remat import replayed
from .._select import where
from .._solution import RESULTS
from .._term import AbstractTerm
from .._tolerances import IControl, Tolerances
from ._base import (
    AbstractAdaptiveStepSizeController,
    AbstractStepSizeController,
    times_of,
)
from ._clip import _is_none, _times, ClipStepSizeController
from ._norm import rms_norm


def _initial_step(
    terms,
    func: Callable[..., VF],
    t0: Array,
    y0: Y,
    args: Args,
    error_order: RealScalarLike,
    rtol,
    atol,
    norm,
):
    """Hairer, Norsett & Wanner (1993), II.4: a first step from two evaluations
    of `func(terms, t, y, args)` (the solver's `func`, as diffrax calls it)."""
    scale = jtu.tree_map(lambda y: atol + jnp.abs(y) * rtol, y0)
    div = lambda a, s: a / s.astype(a.dtype)
    f0 = func(terms, t0, y0, args)
    d0 = norm(jtu.tree_map(div, y0, scale))
    d1 = norm(jtu.tree_map(div, f0, scale))
    small = (d0 < 1e-5) | (d1 < 1e-5)
    h0 = where(small, 1e-6, 0.01 * d0 / where(small, 1, d1)).astype(t0.dtype)
    y1 = jtu.tree_map(lambda y, f: y + jnp.asarray(h0, y.dtype) * f, y0, f0)
    f1 = func(terms, t0 + h0, y1, args)
    d2 = norm(jtu.tree_map(lambda a, b, s: div(a - b, s), f1, f0, scale)) / h0
    max_d = jnp.maximum(d1, d2)
    h1 = where(
        max_d <= 1e-15,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / where(max_d <= 1e-15, 1, max_d)) ** (1 / error_order),
    )
    return lax.stop_gradient(jnp.minimum(100 * h0, h1).astype(t0.dtype))


def _after(t: Array, t_next: Array) -> Array:
    """`t_next`, or the next float after `t` if `t_next` rounded to `t` (or below):
    the smallest step that advances time (as diffrax's `nextafter`)."""
    return jnp.maximum(t_next, _next_float(t))


def _next_float(t: Array) -> Array:
    """The next float after `t` (not differentiated: `nextafter` has no derivative)."""
    return jnp.nextafter(lax.stop_gradient(t), jnp.asarray(jnp.inf, t.dtype))


def _usable(inv: Array) -> Array:
    """The inverse scaled error `inv`, or 1 where it is 0 or infinite (`jnp.isinf`
    written out: no nested `jit`)."""
    return where((inv == 0) | (jnp.abs(inv) == jnp.inf), 1, inv)


def _advancing(t0: Array, t1: Array, keep, next_t0: Array, next_t1: Array, result):
    """The next step end made to advance time (`_after`), and the result: a rejected
    step that was already the smallest one (one float spacing, e.g. ~1.5e-5 at
    `t = 200` in float32) ends the solve with `dt_min_reached`, as the error estimate
    does not reach the tolerances in this precision (retrying it would spin until
    `max_steps`)."""
    smallest = t1 <= _next_float(t0)
    stuck = jnp.asarray(~keep & smallest)
    result = RESULTS.where(stuck, RESULTS.dt_min_reached, result)
    return _after(next_t0, next_t1), result


def _power(x: Array, c: RealScalarLike) -> Array | int:
    """`x ** c`, skipped (1) where `c` is known now to be zero; a traced `c` (an
    `error_order` or coefficient under `jit`) is always applied (`x ** 0 == 1`)."""
    known = concrete(c)
    return 1 if known is not None and np.all(known == 0) else x**c


class PIDState(NamedTuple):
    prev: Array  # inverse scaled error of the last accepted step
    prev_prev: Array  # ... and of the one before
    at_dtmin: Array  # whether the last step was clipped to `dtmin`


class _PIDMeta(type(eqx.Module)):
    # diffrax's older spelling `PIDController(..., step_ts=, jump_ts=)` makes the
    # `ClipStepSizeController` (as diffrax's metaclass does): `isinstance` says so.
    def __call__(cls, *args, **kwargs):
        pid = super().__call__(*args, **kwargs)
        clip = pid._as_clip()
        return pid if clip is None else clip


# Given to `class` by keyword, so that pyright still sees a dataclass (as diffrax).
_PID_META = dict(metaclass=_PIDMeta)


class PIDController(AbstractAdaptiveStepSizeController, **_PID_META):
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
        the constructor then returns (as diffrax's does).
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
        error_order: float | None,
        t0: RealScalarLike,
        t1: RealScalarLike,
        dt0: RealScalarLike | None,
    ) -> None:
        if self.error_order is None and error_order is None:
            raise BadInputError(  # diffrax raises a RuntimeError
                "Cannot use adaptive step sizes with a solver that does not provide "
                "error estimates: the solver has no error estimate (its `error_order` "
                "is None), so it can't be used with PIDController: use "
                "ConstantStepSize, or a solver with an embedded error estimate (Tsit5, "
                "Dopri5, Bosh3, Heun, ...)."
            )

    def tolerances(self) -> Tolerances:
        # An I-controller (no proportional or derivative part) tells a solver how it
        # sizes steps, so that one choosing its own (`BDF`) can reproduce it.
        # Coefficients traced under `jit` are not known to be zero: no I-controller.
        i_control = None
        pcoeff, dcoeff = concrete(self.pcoeff), concrete(self.dcoeff)
        if pcoeff is not None and dcoeff is not None and pcoeff == 0 and dcoeff == 0:
            i_control = IControl(self.safety, self.icoeff, self.error_order)
        return Tolerances(self.rtol, self.atol, self.norm, i_control)

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
        if dt0 is None and not terms.first_step_from_func:
            dt0 = jnp.asarray(0.01, jnp.result_type(t0))  # diffrax: not an ODETerm
        elif dt0 is None:
            dt0 = _initial_step(
                terms,
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
        return _after(t0, t0 + dt0), PIDState(one, one, jnp.asarray(False))

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
        return self.loop_adapt_step_size(
            t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
        )

    def _limited(self, keep, factor):
        """`factor` within `[1, factormax]` after an accepted step, `[factormin,
        safety]` after a rejected one: `jnp.clip`, written out (as a nested `jit`
        it was traced, batched and lowered as a call of its own at every use; `1.0`:
        `where` of two floats is one `select`, of an int and a float a call of
        `jnp.where`)."""
        low = where(keep, 1.0, self.factormin)
        high = where(keep, self.factormax, self.safety)
        return jnp.minimum(high, jnp.maximum(low, factor))

    def loop_adapt_step_size(self, *args, keep=None):
        t0, t1, y0, y1_candidate, _, y_error, error_order, controller_state = args
        prev, prev_prev, at_dtmin = controller_state
        order = self._order(error_order)
        t0, t1 = times_of(t0, t1)

        def scale(e, a, b):
            b = where(jnp.isfinite(b), b, a)
            tol = self.atol + jnp.maximum(jnp.abs(a), jnp.abs(b)) * self.rtol
            return e / jnp.asarray(tol, dtype=jnp.abs(e).dtype)

        err = self.norm(jtu.tree_map(scale, y_error, y0, y1_candidate))
        err = lax.stop_gradient(where(jnp.isfinite(err), err, jnp.inf))
        own = err < 1
        if self.dtmin is not None:
            own = own | at_dtmin
        # A replayed `keep`, written as this decision wherever the two agree (the
        # same value): XLA then fuses a pullback of the step around the error
        # estimate, as when it decides, not around the replayed input (vmapped
        # Lorenz gradient's backward pass: 16.6 -> 11.4 ms; see `_loop._decision`).
        keep = own if keep is None else where(own != keep, keep, own)
        keep = replayed(jnp.asarray(keep))  # (a recomputation takes the same)
        inv = (1 / err).astype(t0.dtype)
        c1 = (self.icoeff + self.pcoeff + self.dcoeff) / order
        c2 = -(self.pcoeff + 2 * self.dcoeff) / order
        c3 = self.dcoeff / order
        factor = self.safety * _power(inv, c1) * _power(prev, c2)
        factor = factor * _power(prev_prev, c3)
        factor = lax.stop_gradient(self._limited(keep, factor))
        inv = _usable(inv)
        dt, at_dtmin, result = self._bounded((t1 - t0) * factor, factor, at_dtmin)
        next_t0 = where(keep, t1, t0)
        next_t1, result = _advancing(t0, t1, keep, next_t0, next_t0 + dt, result)
        state = PIDState(
            where(keep, inv, prev),
            where(keep, prev, prev_prev),
            jnp.asarray(at_dtmin),
        )
        return keep, next_t0, next_t1, False, state, result
