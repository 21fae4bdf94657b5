"""`unvmap_any`: "is any batch element still running?" as an unbatched boolean.

A `lax.while_loop` whose predicate is batched makes JAX select every carried value
against its previous value on every iteration, including large save buffers written one
row at a time, which costs a copy of each buffer per step. Our loops instead use an
unbatched predicate (`unvmap_any` of the per-element one) and mask their own updates,
so a buffer write stays a one-row write under `vmap`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


unvmap_any_p = Primitive("solverkit_unvmap_any")


def _any(x):
    return jnp.any(x)


unvmap_any_p.def_impl(_any)
unvmap_any_p.def_abstract_eval(lambda x: jax.core.ShapedArray((), jnp.bool_))
mlir.register_lowering(unvmap_any_p, mlir.lower_fun(_any, multiple_results=False))


def _batch(args, dims):
    (x,), _ = args, dims
    return unvmap_any_p.bind(x), None  # None: not batched


def _jvp(primals, tangents):
    out = unvmap_any_p.bind(*primals)
    return out, np.zeros((), dtype=jax.dtypes.float0)


batching.primitive_batchers[unvmap_any_p] = _batch
ad.primitive_jvps[unvmap_any_p] = _jvp


def unvmap_any(x) -> jax.Array:
    """`jnp.any(x)` over `x` and over every `vmap` batch axis; never batched."""
    return unvmap_any_p.bind(jnp.asarray(x, jnp.bool_))


def while_loop(cond, body, state):
    """`lax.while_loop` that runs while `cond` holds for any batch element.

    `body(state, active)` must leave `state` unchanged where `active` is False.
    """
    return jax.lax.while_loop(
        lambda s: unvmap_any(cond(s)), lambda s: body(s, cond(s)), state
    )


unvmap_max_p = Primitive("solverkit_unvmap_max")


def _max(x):
    return jnp.max(x)


unvmap_max_p.def_impl(_max)
unvmap_max_p.def_abstract_eval(lambda x: jax.core.ShapedArray((), x.dtype))
mlir.register_lowering(unvmap_max_p, mlir.lower_fun(_max, multiple_results=False))
batching.primitive_batchers[unvmap_max_p] = lambda args, dims: (
    unvmap_max_p.bind(*args),
    None,
)
ad.primitive_jvps[unvmap_max_p] = lambda primals, tangents: (
    unvmap_max_p.bind(*primals),
    np.zeros((), dtype=jax.dtypes.float0),
)


def unvmap_max(x) -> jax.Array:
    """`jnp.max(x)` over `x` and over every `vmap` batch axis (integers); never
    batched, never differentiated."""
    return unvmap_max_p.bind(jnp.asarray(x))
