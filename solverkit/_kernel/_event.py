"""A terminal `Event` inside the kernel, lane-wise: which lanes' condition fired over
a step, and, after the loop, where on its last step's dense output (the step is
recomputed from its start by the method's own step, the same arithmetic) each fired
real-valued condition crosses zero: the vmap path's search itself
(`_event._detect.bracketed_root`, with the tile-wise `where`: Newton's method kept
inside a shrinking bracket from the secant point), then one Newton step at the root
(as `_event._detect._earliest_crossing`), on tiles."""

from collections.abc import Callable

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .._event._detect import bracketed_root
from ._tile import where


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
    root = bracketed_root(g, a, b, g(a), ~event, where)
    root = where(event, root, tend)
    g_root, dg_dt = jax.jvp(g, (root,), (jnp.ones_like(root),))
    dg_dt = where(dg_dt == 0, 1, dg_dt)
    root = root - where(event, g_root / dg_dt, 0)
    root = jnp.clip(root, a, b)
    t_star = where(event, jnp.minimum(tend, root), tend)
    y_star = at(t_star)
    return t_star, [where(event, s, v) for s, v in zip(y_star, y)]
