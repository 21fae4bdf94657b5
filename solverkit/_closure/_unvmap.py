"""Unbatching: reductions over `vmap` batch axes that return an unbatched,
undifferentiated value, and `batched_like`, the other way.

`unvmap_any` makes a loop's predicate unbatched (`_loops.py`); `unvmap_max` serves
error codes and progress fractions the same way (`_raising.py`); `unvmap_first` reads
back a value that is the same for every element. `batched_like` batches a value
wherever anything else is (the outputs of a `custom_vjp`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def _primitive(name: str, reduce, out_dtype):
    """A primitive computing `reduce(x)` over all of `x`, batch axes included."""
    prim = Primitive(name)
    prim.def_impl(reduce)
    prim.def_abstract_eval(lambda x: ShapedArray((), out_dtype or x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(reduce, multiple_results=False))
    # Batched in, unbatched out (`None`: not mapped).
    batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), None)
    # Never differentiated: a zero (float0) tangent.
    ad.primitive_jvps[prim] = lambda primals, tangents: (
        prim.bind(*primals),
        np.zeros((), dtype=jax.dtypes.float0),
    )
    return prim


unvmap_any_p = _primitive("solverkit_unvmap_any", jnp.any, jnp.bool_)
unvmap_max_p = _primitive("solverkit_unvmap_max", jnp.max, None)


def _scalar(x):
    return jnp.reshape(x, ())


def _first_rule(args, dims):
    (x,), (d,) = args, dims
    return unvmap_first_p.bind(jax.lax.index_in_dim(x, 0, d, keepdims=False)), None


# A scalar that is the same for every batch element, unbatched: under `vmap` the
# first element's (a slice, which XLA fuses into its users, where `unvmap_max` is a
# reduction of its own). Never differentiated.
unvmap_first_p = Primitive("solverkit_unvmap_first")
unvmap_first_p.def_impl(_scalar)
# (`x` is a scalar: its type as it is, with the manual axes it varies over inside
# `shard_map`, so a loop's counter keeps its type.)
unvmap_first_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(unvmap_first_p, lambda ctx, x: [x])
batching.primitive_batchers[unvmap_first_p] = _first_rule
ad.primitive_jvps[unvmap_first_p] = lambda primals, tangents: (
    unvmap_first_p.bind(*primals),
    np.zeros((), dtype=jax.dtypes.float0),
)


def _batched_like_rule(args, dims, *, count: int):
    """Every one of the first `count` operands batched (along axis 0 where it was
    not) when any operand is."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    outs, out_dims = [], []
    for x, d in zip(args[:count], dims[:count]):
        if d is None:
            x, d = jnp.broadcast_to(x, (size, *jnp.shape(x))), 0
        outs.append(x)
        out_dims.append(d)
    return outs, out_dims


# The identity on its first `count` operands, whose results are batched under `vmap`
# wherever any operand (those and the rest, `like`) is. It lowers to nothing.
batched_like_p = Primitive("solverkit_batched_like")
batched_like_p.multiple_results = True
batched_like_p.def_impl(lambda *args, count: list(args[:count]))
batched_like_p.def_abstract_eval(lambda *avals, count: list(avals[:count]))
mlir.register_lowering(batched_like_p, lambda ctx, *args, count: list(args[:count]))
batching.primitive_batchers[batched_like_p] = _batched_like_rule
# The identity on tangents: per batch element it is the identity.
ad.primitive_jvps[batched_like_p] = lambda primals, tangents, *, count: (
    batched_like_p.bind(*primals, count=count),
    list(tangents[:count]),
)


def batched_like(tree, like):
    """`tree`, each of its array leaves batched under every `vmap` that batches any
    array leaf of `tree` or of `like` (broadcast: per batch element it is unchanged).

    The outputs of a `custom_vjp` go through it: an output shared by the batch (say a
    fixed step grid, under a `vmap` of a closed-over value only) gets one cotangent
    for the whole batch, and the batched backward pass, run once per element, would
    count it once per element (JAX >= 0.12 raises there, older JAX sums). Batched,
    each element's output gets its own cotangent.

    **Arguments:**

    - `tree`: a pytree.
    - `like`: a pytree whose array leaves decide where `tree` is batched.

    **Returns:**

    `tree`, unchanged in value.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    refs = [x for x in jax.tree_util.tree_leaves(like) if eqx.is_array(x)]
    if not arrays:
        return tree
    outs = batched_like_p.bind(*(leaves[i] for i in arrays), *refs, count=len(arrays))
    for i, x in zip(arrays, outs):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def unvmap_any(x) -> jax.Array:
    """`jnp.any(x)` over `x` and over every `vmap` batch axis; never batched."""
    return unvmap_any_p.bind(jnp.asarray(x, jnp.bool_))


def unvmap_max(x) -> jax.Array:
    """`jnp.max(x)` over `x` and over every `vmap` batch axis; never batched, never
    differentiated."""
    return unvmap_max_p.bind(jnp.asarray(x))


def unvmap_first(x) -> jax.Array:
    """An int scalar `x` that is the same for every `vmap` batch element, unbatched
    (the first element's value). Never differentiated."""
    x = jnp.asarray(x)
    if x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"unvmap_first takes an int scalar, got {x.dtype}{x.shape}.")
    return unvmap_first_p.bind(x)
