"""Loops that stay cheap under `vmap`.

A `lax.while_loop` whose predicate is batched makes JAX select every carried value
against its previous value on every iteration, including large save buffers written one
row at a time, which costs a copy of each buffer per step. These loops instead use an
unbatched predicate (`unvmap_any` of the per-element one) and the body masks its own
updates, so a buffer write stays a one-row write under `vmap`.
"""

import jax
import jax.numpy as jnp

from ._unvmap import batched_like, unvmap_any, unvmap_first


def while_loop(cond, body, state):
    """`lax.while_loop` that runs while `cond` holds for any batch element.

    `body(state, active)` must leave `state` unchanged where `active` is False.
    """
    return jax.lax.while_loop(
        lambda s: unvmap_any(cond(s)), lambda s: body(s, cond(s)), state
    )


def counted_loop(lower, upper, body, init, like):
    """`lax.fori_loop(lower, upper, body, init)` for int32 bounds that are the same
    for every batch element, whose counter `vmap` batches wherever `like` is.

    `lax.while_loop`'s batching rule batches its body twice when any part of the
    carry stays unbatched (a fixed-point round, then the body it binds), but once
    when every part is batched; a loop inside it is batched again on each of those
    passes. So the counter is carried batched (`batched_like`) and read back
    unbatched (`unvmap_first`: the same for every element), and the index arithmetic
    and row reads and writes of `body` stay unbatched. `init` should be batched
    wherever `like` is (see `batched_like`).

    **Arguments:**

    - `lower`, `upper`: the loop runs `body(k, x)` for `k = lower, ..., upper - 1`.
    - `body`: `(k, x) -> x`, `k` an unbatched int32 scalar.
    - `init`: the initial `x`.
    - `like`: a pytree whose array leaves decide where the counter is batched.

    **Returns:**

    The final `x`.
    """
    upper = jnp.asarray(upper, jnp.int32)

    def step(state):
        i, x = state
        k = unvmap_first(i)
        return i + 1, body(k, x)

    (i,) = batched_like((jnp.asarray(lower, jnp.int32),), like)
    cond = lambda s: unvmap_first(s[0]) < upper  # noqa: E731
    return jax.lax.while_loop(cond, step, (i, init))[1]
