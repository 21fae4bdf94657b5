"""`where`: `jnp.where` as one `lax.select`, without a nested `jit`.

`jnp.where` is itself jitted, so every call with new shapes costs a trace of its own;
the step loop calls it dozens of times, which showed up as a large share of trace time.
"""

import jax.lax as lax
import jax.numpy as jnp


def _broadcast(x, shape):
    if x.shape == shape:
        return x
    return lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


def where(pred, x, y):
    """`x` where `pred` else `y`, elementwise with broadcasting (as `jnp.where`)."""
    pred, x, y = jnp.asarray(pred), jnp.asarray(x), jnp.asarray(y)
    if x.dtype != y.dtype or pred.dtype != jnp.bool_:
        return jnp.where(pred, x, y)
    shape = jnp.broadcast_shapes(pred.shape, x.shape, y.shape)
    return lax.select(
        _broadcast(pred, shape), _broadcast(x, shape), _broadcast(y, shape)
    )
