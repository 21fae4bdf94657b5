"""Reductions over `vmap` batch axes that return an unbatched, undifferentiated value.

A `lax.while_loop` whose predicate is batched makes JAX select every carried value
against its previous value on every iteration, including large save buffers written one
row at a time, which costs a copy of each buffer per step. Our loops instead use an
unbatched predicate (`unvmap_any` of the per-element one) and mask their own updates,
so a buffer write stays a one-row write under `vmap`. `unvmap_max` serves error codes
and progress fractions the same way, and `error_if` raises once for a whole batch.
`batched_like` goes the other way: it batches a value wherever anything else is (the
outputs of a `custom_vjp`).
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray, Tracer
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ._vma_eval import union_of_axes, varying_axes


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


def error_if(x, failed, index, messages):
    """`equinox.branched_error_if(x, failed, index, messages)` (raise at run time the
    message `index`, under `vmap` if any element fails), which also works inside
    `shard_map(check_vma=True)`: there any device's failure fails all, and the check
    hangs on an invariant token that `x` then depends on (equinox's branches would
    otherwise differ in their varying axes)."""
    if not union_of_axes((x, failed, index)):
        return eqx.branched_error_if(x, failed, index, messages)
    code = jnp.where(failed, jnp.asarray(index, jnp.int32) + 1, 0)
    axes = tuple(sorted(varying_axes(code), key=str))
    if axes:
        code = jax.lax.pmax(code, axes)
    code = unvmap_max(code)
    token = eqx.branched_error_if(
        jnp.zeros((), jnp.int32), code > 0, jnp.maximum(code - 1, 0), messages
    )
    return jax.tree_util.tree_map(
        lambda a: a + token.astype(a.dtype) if eqx.is_inexact_array(a) else a, x
    )


def _at_top_level() -> bool:
    """Whether no JAX transformation is tracing now (False where JAX cannot say)."""
    try:
        from jax._src import core

        return bool(core.trace_state_clean())
    except Exception:  # a JAX without it: keep the check on the device
        return False


def transformed_in_jit() -> bool:
    """Whether a transformation (`vmap`, `grad`, ...) is tracing now inside a `jit` (or
    `scan`, `make_jaxpr`, ...) that stages the program (False where JAX cannot say).

    There a `jit` of our own would be traced to a jaxpr and then traced again by each
    transformation (batched, linearised, transposed), where calling its function
    directly traces it once through all of them.
    """
    try:
        from jax._src import core
        from jax._src.interpreters import partial_eval as pe

        return bool(core.unsafe_am_i_under_a_jit()) and not isinstance(
            core.trace_ctx.trace, pe.DynamicJaxprTrace
        )
    except Exception:  # a JAX without these: as if not
        return False


def eager(tree) -> bool:
    """Whether a call on `tree` runs eagerly: outside every `jit`/`vmap`/`grad` trace,
    with no tracer among its leaves, and with equinox's errors set to raise.

    Then a solve's failure can be checked on the host after it ran (`raise_failed`)
    instead of inside the program: a host callback costs about 2 ms a call on a TPU,
    and XLA's persistent compilation cache refuses programs that hold one.
    """
    if os.environ.get("EQX_ON_ERROR", "raise") != "raise" or not _at_top_level():
        return False
    leaves = jax.tree_util.tree_leaves(tree)
    return not any(isinstance(x, Tracer) for x in leaves)


def raise_failed(result, ok_codes, messages) -> None:
    """Raise, on the host, what `error_if` raises inside a program: the message of the
    largest result code that is not in `ok_codes`, as equinox's error type."""
    codes = np.asarray(result).ravel()
    failed = codes[~np.isin(codes, np.asarray(ok_codes))]
    if failed.size:
        error = getattr(eqx, "EquinoxRuntimeError", RuntimeError)
        raise error(messages[int(failed.max())])
