"""Reductions over `vmap` batch axes that return an unbatched, undifferentiated value.

A `lax.while_loop` whose predicate is batched makes JAX select every carried value
against its previous value on every iteration, including large save buffers written one
row at a time, which costs a copy of each buffer per step. Our loops instead use an
unbatched predicate (`unvmap_any` of the per-element one) and mask their own updates,
so a buffer write stays a one-row write under `vmap`. `unvmap_max` serves error codes
and progress fractions the same way. `write_row` is such a one-row write.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def _primitive(name: str, reduce, out_dtype):
    """A primitive computing `reduce(x)` over all of `x`, batch axes included."""
    prim = Primitive(name)
    prim.def_impl(reduce)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray((), out_dtype or x.dtype))
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


def unvmap_any(x) -> jax.Array:
    """`jnp.any(x)` over `x` and over every `vmap` batch axis; never batched."""
    return unvmap_any_p.bind(jnp.asarray(x, jnp.bool_))


def unvmap_max(x) -> jax.Array:
    """`jnp.max(x)` over `x` and over every `vmap` batch axis; never batched, never
    differentiated."""
    return unvmap_max_p.bind(jnp.asarray(x))


def while_loop(cond, body, state):
    """`lax.while_loop` that runs while `cond` holds for any batch element.

    `body(state, active)` must leave `state` unchanged where `active` is False.
    """
    return jax.lax.while_loop(
        lambda s: unvmap_any(cond(s)), lambda s: body(s, cond(s)), state
    )


def _write(stack, row, index, *, axis: int):
    return lax.dynamic_update_index_in_dim(stack, row, index, axis)


write_row_p = Primitive("solverkit_write_row")
write_row_p.def_impl(_write)
write_row_p.def_abstract_eval(lambda stack, row, index, *, axis: stack)
mlir.register_lowering(write_row_p, mlir.lower_fun(_write, multiple_results=False))


def _write_row_batched(args, dims, *, axis: int):
    stack, row, index = args
    stack_dim, row_dim, index_dim = dims
    if index_dim is not None:  # a scatter, as JAX batches `dynamic_update_slice`
        write = functools.partial(_write, axis=axis)
        return jax.vmap(write, in_axes=dims)(stack, row, index), 0
    size = stack.shape[stack_dim] if stack_dim is not None else row.shape[row_dim]

    def front(x, dim):  # the batch axis first
        if dim is None:
            return jnp.broadcast_to(x, (size,) + x.shape)
        return jnp.moveaxis(x, dim, 0)

    stack, row = front(stack, stack_dim), front(row, row_dim)
    return write_row_p.bind(stack, row, index, axis=axis + 1), 0


def _write_row_jvp(primals, tangents, *, axis: int):
    stack, row, index = primals
    d_stack, d_row, _ = tangents
    d_stack = ad.instantiate_zeros(d_stack)
    d_row = ad.instantiate_zeros(d_row)
    out = write_row_p.bind(stack, row, index, axis=axis)
    return out, write_row_p.bind(d_stack, d_row, index, axis=axis)


def _write_row_transpose(ct, stack, row, index, *, axis: int):
    assert not ad.is_undefined_primal(index)
    if type(ct) is ad.Zero:
        return None, None, None
    ct_stack = ct_row = None
    if ad.is_undefined_primal(row):
        ct_row = lax.dynamic_index_in_dim(ct, index, axis, keepdims=False)
    if ad.is_undefined_primal(stack):
        zero = jnp.zeros(row.aval.shape, row.aval.dtype)
        ct_stack = write_row_p.bind(ct, zero, index, axis=axis)
    return ct_stack, ct_row, None


batching.primitive_batchers[write_row_p] = _write_row_batched
ad.primitive_jvps[write_row_p] = _write_row_jvp
ad.primitive_transposes[write_row_p] = _write_row_transpose


def write_row(stack, row, index) -> jax.Array:
    """`stack` with `row` written at `index` of its leading axis.

    As `lax.dynamic_update_index_in_dim`, except under `vmap` with an unbatched
    `index`: JAX batches that as a scatter, which XLA compiles into a bounds check,
    a read of the old row and a select (three more kernels to compile per write);
    this stays a plain write of the batched row. An out-of-range `index` is clamped.
    """
    row = jnp.asarray(row, stack.dtype)
    return write_row_p.bind(stack, row, jnp.asarray(index, jnp.int32), axis=0)
