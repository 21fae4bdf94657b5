"""One step of every lane of a block, on `(rows, 128)` tiles: the explicit
Runge–Kutta step of a tableau, the PID controller's decision (or `ConstantStepSize`'s
next step end), the first-step heuristic and the dense output. The arithmetic is that
of the `vmap` path (`_solver/_runge_kutta.py`, `_controller/_adaptive.py`,
`_controller/_base.py`), element by element, in the same order, so the two take the
same steps up to round-off.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._solver._tableau import ButcherTableau
from ._tile import where


Tiles = list  # one (rows, 128) array per state component
Field = Callable[[Array, Tiles], Tiles]  # (t, y) -> dy/dt, lane-wise


class Pid(NamedTuple):
    """The `PIDController`'s settings, as Python numbers (static in the kernel)."""

    rtol: float
    atol: float
    pcoeff: float
    icoeff: float
    dcoeff: float
    dtmin: float | None
    dtmax: float | None
    force_dtmin: bool
    safety: float
    factormin: float
    factormax: float
    order: float


def _combine(y: Tiles | None, h, pairs) -> Tiles:
    """`y + h Σ c_i k_i` per component (`axpy`'s order: zero weights skipped, the
    sum accumulated left to right, then scaled by `h` and added to `y`)."""
    pairs = [(float(c), k) for c, k in pairs if c != 0]
    out = []
    for j in range(len(pairs[0][1])):
        acc = None
        for c, k in pairs:
            term = c * k[j]
            acc = term if acc is None else acc + term
        out.append(h * acc if y is None else y[j] + h.astype(y[j].dtype) * acc)
    return out


def rk_step(
    tab: ButcherTableau, field: Field, t0, h, y: Tiles, f0: Tiles, estimate=True
):
    """The step from `t0` of size `h` (tiles): `(y1, y_error, ks)`, `ks[-1]` being
    the field at the end (the tableau is FSAL); `y_error` is `None` without
    `estimate` (fixed steps need none)."""
    ks = [f0]
    yi = y
    for i in range(1, len(tab.c)):
        yi = _combine(y, h, zip(tab.a[i, :i], ks))
        ks.append(field(t0 + float(tab.c[i]) * h, yi))
    if not estimate:
        return yi, None, ks
    assert tab.b_err is not None
    error = _combine(None, h, zip(tab.b_err, ks))
    return yi, error, ks


def dense(tab: ButcherTableau, y0: Tiles, ks: list[Tiles], h, theta) -> Tiles:
    """The step's dense output at the fraction `theta` (the solver's polynomial,
    each stage's weight by Horner's rule as `AbstractRungeKutta.interpolate`)."""
    assert tab.dense is not None  # (checked by `_field.check`)
    coeffs = np.asarray(tab.dense)
    out = []
    for j in range(len(y0)):
        dtype = y0[j].dtype
        th = theta.astype(dtype)
        acc = None
        for i in range(coeffs.shape[0]):
            w = jnp.asarray(coeffs[i, -1], dtype)
            for d in range(coeffs.shape[1] - 2, -1, -1):
                w = jnp.asarray(coeffs[i, d], dtype) + th * w
            term = (th * w) * ks[i][j]
            acc = term if acc is None else acc + term
        out.append(y0[j] + h.astype(dtype) * acc)
    return out


def finite(x):
    """`isfinite` as a comparison (NaN compares false), which every backend
    lowers."""
    return jnp.abs(x) < jnp.inf


def _rms(xs: Tiles):
    """Root mean square over the components, per lane (`rms_norm` of one lane)."""
    total = jnp.abs(xs[0]) ** 2
    for x in xs[1:]:
        total = total + jnp.abs(x) ** 2
    return jnp.sqrt(total / len(xs))


def initial_step(pid: Pid, field: Field, t0, y0: Tiles, f0: Tiles):
    """Hairer, Nørsett & Wanner's first step (`_adaptive._initial_step`)."""
    scale = [pid.atol + jnp.abs(y) * pid.rtol for y in y0]
    d0 = _rms([y / s for y, s in zip(y0, scale)])
    d1 = _rms([f / s for f, s in zip(f0, scale)])
    small = (d0 < 1e-5) | (d1 < 1e-5)
    h0 = where(small, 1e-6, 0.01 * d0 / where(small, 1, d1)).astype(t0.dtype)
    y1 = [y + h0.astype(y.dtype) * f for y, f in zip(y0, f0)]
    f1 = field(t0 + h0, y1)
    d2 = _rms([(a - b) / s for a, b, s in zip(f1, f0, scale)]) / h0
    max_d = jnp.maximum(d1, d2)
    tiny = max_d <= 1e-15
    h1 = where(
        tiny,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / where(tiny, 1, max_d)) ** (1 / pid.order),
    )
    return jnp.minimum(100 * h0, h1).astype(t0.dtype)


# `next_float`'s addend, in units of `eps |t|`: 0.7 to 1.4 spacings of `t`.
_NEXT = 0.7


def next_float(t):
    """The next float after `t`, `nextafter(t, inf)`, as a multiply, an add and a
    max (Mosaic may not lower `nextafter`): `t + max(0.7 eps |t|, tiny)`.

    With `t = ±m 2^e`, `m` in `[1, 2)`, the spacing of `t` is `eps 2^e`, and the
    addend `0.7 m eps 2^e` is 0.7 to 1.4 spacings: rounded to nearest, the sum is
    `t` plus one spacing (for `t = -2^e` the spacing above is half, the addend 1.4
    of those halves: one too). So it is exact for every `t` with `eps |t|` normal
    (`|t| >= 2^-103` in float32), with or without a fused multiply-add (one
    rounding either way). Nearer zero it adds the smallest normal float instead of a
    subnormal (which the TPU flushes to zero): still a step forward."""
    info = jnp.finfo(t.dtype)
    spacing = jnp.abs(t) * jnp.asarray(_NEXT * float(info.eps), t.dtype)
    return t + jnp.maximum(spacing, jnp.asarray(info.tiny, t.dtype))


def clip_dt0(pid: Pid, dt0):
    if pid.dtmax is not None:
        dt0 = jnp.minimum(dt0, pid.dtmax)
    if pid.dtmin is not None:
        dt0 = jnp.maximum(dt0, pid.dtmin)
    return dt0


class Decision(NamedTuple):
    keep: Array
    next_t0: Array
    next_t1: Array
    prev: Array
    prev_prev: Array
    at_dtmin: Array  # 0 or 1, in time's dtype
    too_small: Array  # dt fell below dtmin (with force_dtmin=False)


def adapt(pid: Pid, t0, t1, y0: Tiles, y1: Tiles, error: Tiles, state) -> Decision:
    """`PIDController.adapt_step_size`, lane-wise, with the RMS norm."""
    prev, prev_prev, at_dtmin = state
    # Carried as 0/1 in time's dtype (no boolean or int32 selects in the loop).
    at_dtmin = at_dtmin != 0
    scaled = []
    for e, a, b in zip(error, y0, y1):
        b = where(finite(b), b, a)
        tol = pid.atol + jnp.maximum(jnp.abs(a), jnp.abs(b)) * pid.rtol
        scaled.append(e / tol.astype(jnp.abs(e).dtype))
    err = _rms(scaled)
    err = where(finite(err), err, jnp.inf)
    keep = err < 1
    if pid.dtmin is not None:
        keep = keep | at_dtmin
    inv = (1 / err).astype(t0.dtype)
    c1 = (pid.icoeff + pid.pcoeff + pid.dcoeff) / pid.order
    c2 = -(pid.pcoeff + 2 * pid.dcoeff) / pid.order
    c3 = pid.dcoeff / pid.order
    factor = pid.safety * inv**c1
    if c2 != 0:
        factor = factor * prev**c2
    if c3 != 0:
        factor = factor * prev_prev**c3
    factor = jnp.clip(
        factor,
        where(keep, 1, pid.factormin).astype(factor.dtype),
        where(keep, pid.factormax, pid.safety).astype(factor.dtype),
    )
    inv = where((inv == 0) | jnp.isinf(inv), 1, inv).astype(inv.dtype)
    dt = (t1 - t0) * factor
    too_small = jnp.zeros(dt.shape, bool)
    if pid.dtmax is not None:
        dt = jnp.minimum(dt, pid.dtmax)
    if pid.dtmin is not None:
        if not pid.force_dtmin:
            too_small = dt < pid.dtmin
        dt = where(at_dtmin & (factor == 1), pid.dtmin, dt).astype(dt.dtype)
        at_dtmin = dt <= pid.dtmin
        dt = jnp.maximum(dt, pid.dtmin)
    at_dtmin = at_dtmin.astype(t0.dtype)
    next_t0 = where(keep, t1, t0)
    # As `_adaptive._advancing`: the next step end is at least the next float after
    # its start (a zero-length step has zero error and would be accepted forever),
    # and a rejected step of one spacing ends the solve with `dt_min_reached`.
    too_small = too_small | (~keep & (t1 <= next_float(t0)))
    return Decision(
        keep,
        next_t0,
        jnp.maximum(next_t0 + dt, next_float(next_t0)),
        where(keep, inv, prev),
        where(keep, prev, prev_prev),
        at_dtmin,
        too_small,
    )


def fixed_next(steps, t_end, times: "FixedTimes"):
    """`ConstantStepSize.adapt_step_size`'s next step end, lane-wise, after a lane's
    step number `steps + 1` (`steps` counted before it, an int32 tile) that ended at
    `t_end`: `t0 + (t1 - t0) k / n` with `k = steps + 2` (the steps done once the
    next is taken), `t1` from `k = n` on, and `t_end + dt0` for an infinite `t1`
    (`n = -1`). `k` and `n` are compared as floats: exact below 2^24 steps in
    float32."""
    done = (steps + 2).astype(t_end.dtype)
    fraction = done / times.n_or_1
    nxt = where(done >= times.n, times.t1, times.t0 + times.span * fraction)
    return where(times.n >= 0, nxt, t_end + times.dt0)


class FixedTimes(NamedTuple):
    """`ConstantStepSize`'s grid, as scalars (`ConstantState`, each computed
    outside the kernel as the controller computes it): the interval `[t0, t1]`, its
    length `span = t1 - t0`, the steps `n` in it (a float; `-1` for an infinite
    `t1`), `max(n, 1)`, and `dt0`."""

    t0: Array
    t1: Array
    span: Array
    n: Array
    n_or_1: Array
    dt0: Array
