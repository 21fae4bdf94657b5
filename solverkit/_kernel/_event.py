"""A terminal `Event` inside the kernel, lane-wise: which lanes' condition fired over
a step, and, after the loop, where on its last step's dense output (the step is
recomputed from its start by the method's own step, the same arithmetic) each fired
real-valued condition crosses zero: the vmap path's search (`_event._root`,
`_event._earliest_crossing`: Newton's method kept inside a shrinking bracket from the
secant point, then one Newton step at the root), on tiles."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from . import _step
from ._tile import where


# The vmap path's bound on the root finder's steps (`_event._ROOT_MAX_STEPS`).
_ROOT_MAX_STEPS = 100


def fired(real: bool, direction: bool | None, before: Array, after: Array) -> Array:
    """Whether a condition fired over a step (`_event.fired`): a boolean one (held
    as 0/1) when it is true, a real one when its sign changes in its direction."""
    if not real:
        return after != 0
    sb, sa = jnp.sign(before), jnp.sign(after)
    if direction is None:
        return sb != sa
    if direction:
        return (sb <= 0) & (sa > 0)
    return (sb > 0) & (sa <= 0)


class _Bracket(NamedTuple):
    a: Array
    b: Array
    ga: Array
    x: Array
    done: Array  # 1 where converged (a float: no int32 selects on a TPU)
    count: Array  # scalar


def _root(g: Callable, a, b, ga, done):
    """`_event._root` on tiles (see there): a root of `g` in `[a, b]`."""
    gb = g(b)
    secant = (a * gb - b * ga) / (gb - ga)
    ok = _step.finite(secant) & (secant > a) & (secant < b)
    x = where(ok, secant, (a + b) / 2)

    def narrow(s: _Bracket) -> _Bracket:
        gx, slope = jax.jvp(g, (s.x,), (jnp.ones_like(s.x),))
        like_a = jnp.sign(gx) == jnp.sign(s.ga)
        a, b = where(like_a, s.x, s.a), where(like_a, s.b, s.x)
        newton = s.x - gx / slope
        inside = _step.finite(newton) & (newton > a) & (newton < b)
        x = where(inside, newton, (a + b) / 2)
        tol = 1000 * jnp.finfo(x.dtype).eps * jnp.maximum(jnp.abs(a), jnp.abs(b))
        small = _step.finite(newton) & (jnp.abs(newton - s.x) <= tol)
        converged = (gx == 0) | small
        done = converged | (jnp.abs(x - s.x) <= tol) | (b - a <= tol)
        x = where(converged, s.x, x)
        old = s.done != 0
        return _Bracket(
            where(old, s.a, a),
            where(old, s.b, b),
            s.ga,
            where(old, s.x, x),
            where(old, s.done, done.astype(s.done.dtype)),
            s.count + 1,
        )

    start = _Bracket(a, b, ga, where(done, a, x), done.astype(a.dtype), jnp.int32(0))
    end = lax.while_loop(
        lambda s: jnp.any(s.done < 0.5) & (s.count < _ROOT_MAX_STEPS),
        narrow,
        start,
    )
    return end.x


def locate(
    advance: Callable, interpolate: Callable, cond: Callable, last, tend, y, event
):
    """`(t_end, y_end)`: where `event`, the earliest crossing of the condition over
    the last accepted step `last = (t0, y0, f0)` ending at `tend`, and the dense
    output there; elsewhere `(tend, y)`. The step is recomputed by `advance(t0, h,
    y0, f0) -> info`, its dense output by `interpolate(y0, info, h, theta)`."""
    t0, y0, f0 = last
    h = tend - t0
    info = advance(t0, h, y0, f0)

    def at(tau):
        theta = (tau - t0) / where(h == 0, 1, h)
        return interpolate(y0, info, h, theta)

    g = lambda tau: cond(tau, at(tau))[0].astype(tau.dtype)  # noqa: E731
    a = lax.stop_gradient(where(event, t0, tend - 1))
    b = tend
    root = _root(g, a, b, g(a), ~event)
    root = where(event, root, tend)
    g_root, dg_dt = jax.jvp(g, (root,), (jnp.ones_like(root),))
    dg_dt = where(dg_dt == 0, 1, dg_dt)
    root = root - where(event, g_root / dg_dt, 0)
    root = jnp.clip(root, a, b)
    t_star = where(event, jnp.minimum(tend, root), tend)
    y_star = at(t_star)
    return t_star, [where(event, s, v) for s, v in zip(y_star, y)]
