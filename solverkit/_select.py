"""`where`: `jnp.where` as one `lax.select`, without a nested `jit`.

`jnp.where` is itself jitted, so every call with new shapes costs a trace of its own;
the step loop calls it dozens of times, which showed up as a large share of trace time.
A Python number against an array (`where(keep, row, 0)`) takes the array's dtype, as
`jnp.where` promotes it, in the same one `select`: through `jnp.where` each such call
was a nested `jit` of its own in the traced program, hundreds in a stiff solver's
gradient (BDF's, ROBER: 551 of its 10,093 equations were those calls, each lowered to
a function call).
"""

import jax.lax as lax
import jax.numpy as jnp


def _broadcast(x, shape):
    if x.shape == shape:
        return x
    return lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


def _promote_weak(x, y):
    """`(x, y)` with a weakly typed one (a Python number) cast to the other's dtype
    where `jnp.where` would promote both to that dtype; else unchanged."""
    weak_x, weak_y = bool(x.weak_type), bool(y.weak_type)
    if weak_x == weak_y:
        return x, y
    strong = y if weak_x else x
    if jnp.result_type(x, y) != strong.dtype:
        return x, y
    if weak_x:
        return lax.convert_element_type(x, strong.dtype), y
    return x, lax.convert_element_type(y, strong.dtype)


def where(pred, x, y):
    """`x` where `pred` else `y`, elementwise with broadcasting (as `jnp.where`)."""
    pred, x, y = jnp.asarray(pred), jnp.asarray(x), jnp.asarray(y)
    if x.dtype != y.dtype:
        x, y = _promote_weak(x, y)
    if x.dtype != y.dtype or pred.dtype != jnp.bool_:
        return jnp.where(pred, x, y)
    shape = jnp.broadcast_shapes(pred.shape, x.shape, y.shape)
    return lax.select(
        _broadcast(pred, shape), _broadcast(x, shape), _broadcast(y, shape)
    )
