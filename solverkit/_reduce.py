"""Reductions over all elements of a small array, as chains of elementwise ops.

Under `vmap` a per-element `jnp.sum(x)` is a reduction over the minor axes of a
`(batch, n)` array. Above a few thousand elements XLA:CPU hands such a reduction to
its thread pool, which costs far more than the arithmetic: a `(1024, 4)` sum of
squares took 15-20 µs, the same sum as three adds about 1.5 µs. The step loop does
several per step (error norm, finiteness), so arrays of 4 to 8 elements are reduced
by adding (or `&`-ing) their elements one by one: the gradient of the Lotka-Volterra
benchmark through `BacksolveAdjoint` (adjoint state of 8 numbers, 4 of them one leaf)
ran 2x faster. For up to 3 elements the ordinary reduction was faster (Lorenz, 3
numbers: 15% slower unrolled), and larger arrays use it too.
"""

import functools
import operator

import jax.numpy as jnp
from jaxtyping import Array


_UNROLL = range(4, 9)  # sizes reduced element by element


def _fold(op, x: Array, reduce) -> Array:
    if x.size not in _UNROLL:
        return reduce(x)
    flat = jnp.reshape(x, (-1,))
    return functools.reduce(op, [flat[i] for i in range(flat.shape[0])])


def sum_all(x: Array) -> Array:
    """`jnp.sum(x)` over every element of `x`."""
    return _fold(operator.add, x, jnp.sum)


def all_true(x: Array) -> Array:
    """`jnp.all(x)` over every element of the boolean array `x`."""
    return _fold(operator.and_, x, jnp.all)


def and_all(preds: list) -> Array:
    """Logical and of a list of boolean scalars (True if empty)."""
    if not preds:
        return jnp.asarray(True)
    return functools.reduce(operator.and_, preds)


def or_all(preds: list) -> Array:
    """Logical or of a list of boolean scalars (False if empty)."""
    if not preds:
        return jnp.asarray(False)
    return functools.reduce(operator.or_, preds)
