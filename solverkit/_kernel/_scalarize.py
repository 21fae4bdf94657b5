"""Evaluating a converted vector field's jaxpr lane-wise, on tiles.

Inside the kernel every trajectory is a lane of a `(rows, 128)` tile. The vector
field's jaxpr is written for one trajectory (a state of shape `(n,)`, say), so each of
its values is a small array. Here each such value is a NumPy object array of the
value's own shape whose elements are JAX values: a `(rows, 128)` tile (one number per
lane) or a 0-d array (one number shared by every lane). Element-wise primitives are
applied element by element; structural ones (slices, reshapes, concatenation,
broadcasts, small contractions with shared weights) only move elements; an index
that differs per trajectory into a small array (`table[k]`, a `dynamic_slice`) is
a chain of selects over the positions it can take. So the kernel
body holds nothing but element-wise operations on `(rows, 128)` tiles, the layout the
TPU (Mosaic) lowers well, with no transposes or gathers, which `jax.vmap` over the
lane axes would bring in.

A primitive outside the lists below raises `KernelUnsupported` naming it (the caller
falls back to the `vmap` path, or raises).
"""

import contextlib
import contextvars
import functools
import operator
from collections.abc import Callable, Sequence

import jax
import jax.core
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _tile


class KernelUnsupported(Exception):
    """What the kernel path can't do (a primitive, solver or option), in words."""


# A traced index (`dynamic_slice`) selects among at most this many places: each is
# a compare and a select per output element, on every evaluation of the field.
MAX_CHOICES = 64


# Primitives applied element by element (each output element from the same element
# of every input; scalar inputs broadcast).
_ELEMENTWISE = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp copy
    copy_p convert_element_type cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor
    ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg not or
    pow reduce_precision rem round rsqrt select_n sign sin sinh sqrt square
    sub tan tanh xor""".split()
)
# Element-wise primitives that Mosaic's own lowering turns into a form it fails to
# compile: not in the kernel (the vmap path solves such fields). `nextafter` (JAX
# 0.10) becomes selects mixing splat constants with real vectors, the form `_tile`
# works around; `benchmarks/mosaic_probe.py` has the pattern, to re-check on a TPU.
_NOT_ON_TPU = {
    "nextafter": "Mosaic lowers it to selects that mix splat constants with real "
    "vectors, which it fails to compile",
}
# Primitives whose parameters hold an inner jaxpr, evaluated in place.
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def _inner(params: dict, key: str):
    inner = params[key]
    if isinstance(inner, jex.ClosedJaxpr):
        return inner.jaxpr, list(inner.consts)
    return inner, []


def check(jaxpr: jex.Jaxpr) -> None:
    """Raise `KernelUnsupported` naming the first primitive of `jaxpr` (or of the
    jaxprs it calls) that `evaluate` can't evaluate on tiles."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS:
            check(_inner(eqn.params, _CALLS[name])[0])
        elif name in _NOT_ON_TPU:
            raise KernelUnsupported(
                f"the vector field uses the primitive `{name}`, which the kernel does "
                f"not evaluate: {_NOT_ON_TPU[name]}"
            )
        elif name == "dot_general" and eqn.params["dimension_numbers"][1] != ((), ()):
            raise KernelUnsupported(
                "the vector field uses `dot_general` with batch dimensions, which the "
                "kernel does not evaluate lane-wise"
            )
        elif name == "dynamic_slice" and choices(eqn) > MAX_CHOICES:
            raise KernelUnsupported(
                "the vector field indexes an array of shape "
                f"{_shape(eqn.invars[0])} at a traced position ({choices(eqn)} "
                f"places to choose from; the kernel selects among at most "
                f"{MAX_CHOICES})"
            )
        elif name not in _ELEMENTWISE and name not in _STRUCTURAL:
            raise KernelUnsupported(
                f"the vector field uses the primitive `{name}`, which the kernel does "
                "not evaluate lane-wise (dynamic indexing, gathers, loops and "
                "linear algebra are not supported inside the kernel)"
            )


def _shape(var) -> tuple[int, ...]:
    return tuple(getattr(var.aval, "shape", ()))


def choices(eqn) -> int:
    """The positions a `dynamic_slice` can take (its traced starts' ranges)."""
    shape, sizes = _shape(eqn.invars[0]), eqn.params["slice_sizes"]
    count = 1
    for start, dim, size in zip(eqn.invars[1:], shape, sizes):
        if not isinstance(start, jex.Literal):
            count *= dim - size + 1
    return count


def _dynamic_slice(x: np.ndarray, starts: Sequence, params: dict) -> np.ndarray:
    """`lax.dynamic_slice` on elements: along each axis whose start is traced (per
    trajectory, a tile), a chain of selects (`start >= s`: XLA's clamped start)
    over the `dim - size + 1` places; a known start is a slice."""
    for axis, (start, size) in enumerate(zip(starts, params["slice_sizes"])):
        last = x.shape[axis] - size
        value = start[()]
        if not isinstance(value, jax.core.Tracer):
            first = min(max(int(value), 0), last)
            x = np.take(x, range(first, first + size), axis=axis)
            continue
        place = lambda s: np.take(x, range(s, s + size), axis=axis)  # noqa: E731
        out = place(0)
        for s in range(1, last + 1):
            at = as_elements(np.asarray(s, jnp.result_type(value)))
            past = _elementwise(jax.lax.ge_p, {}, [start, at])
            out = _elementwise(jax.lax.select_n_p, {}, [past, out, place(s)])
        x = out
    return x


def _match(xs: Sequence, shape: tuple[int, ...] | None):
    """Every element as a JAX value, 0-d ones broadcast to the tile `shape` when any
    input is a tile (`shape` not None)."""
    out = []
    for x in xs:
        x = jnp.asarray(x)
        if shape is not None and x.shape != shape:
            x = jnp.broadcast_to(x, shape)
        out.append(x)
    return out


def _tile_shape(xs: Sequence) -> tuple[int, ...] | None:
    for x in xs:
        if np.ndim(x) > 0:
            return tuple(np.shape(x))
    return None


# Inside `reverse_mode_nans()`: a select's tangent carries `0 *` its unselected
# cases' tangents, as reverse mode's cotangents do.
_REVERSE_NANS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "reverse_mode_nans", default=False
)


@contextlib.contextmanager
def reverse_mode_nans():
    """Forward-mode tangents of the field traced inside give NaN where reverse mode
    does: a `where` whose unselected branch has a NaN or infinite derivative (`jnp.
    where(y > 0, jnp.sqrt(y), 0)` at `y < 0`) gives `0 * NaN` in reverse mode, and
    a plain tangent a finite number. Measured by tests/kernel/test_vmap_route.py::
    test_nan_gradients_are_reverse_modes."""
    token = _REVERSE_NANS.set(True)
    try:
        yield
    finally:
        _REVERSE_NANS.reset(token)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _select_keeping_nans(select: Callable, which, *cases):
    return select(which, *cases)


@_select_keeping_nans.defjvp
def _select_keeping_nans_jvp(select, primals, tangents):
    which, *cases = primals
    _, *dcases = tangents
    nans = functools.reduce(operator.add, [0 * d for d in dcases])
    return select(which, *cases), select(which, *dcases) + nans


def _select(tile, xs: list):
    select = _tile.select_n if tile is not None else lax.select_n
    if _REVERSE_NANS.get() and jnp.issubdtype(xs[1].dtype, jnp.inexact):
        return _select_keeping_nans(select, *xs)
    return select(*xs)


def _elementwise(prim, params: dict, args: list[np.ndarray]) -> np.ndarray:
    arrays = np.broadcast_arrays(*args)
    shape = arrays[0].shape if arrays else ()
    out = np.empty(shape, dtype=object)
    for index in np.ndindex(shape):
        xs = [a[index] for a in arrays]
        tile = _tile_shape(xs)
        xs = _match(xs, tile)
        if prim.name == "select_n":  # on tiles, real ones for Mosaic (`_tile`)
            out[index] = _select(tile, xs)
        else:
            out[index] = prim.bind(*xs, **params)
    return out


def _reduce(op: Callable, x: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    keep = [d for d in range(x.ndim) if d not in axes]
    moved = np.transpose(x, keep + list(axes))
    flat = moved.reshape(moved.shape[: len(keep)] + (-1,))
    out = np.empty(flat.shape[:-1], dtype=object)
    for index in np.ndindex(out.shape):
        out[index] = functools.reduce(op, list(flat[index]))
    return out


def _dot_general(lhs: np.ndarray, rhs: np.ndarray, params: dict) -> np.ndarray:
    (lc, rc), _ = params["dimension_numbers"]
    out = np.tensordot(lhs, rhs, axes=(tuple(lc), tuple(rc)))
    dtype = params.get("preferred_element_type")
    if dtype is None:
        return np.asarray(out, dtype=object)
    cast = np.empty(np.shape(out), dtype=object)
    for index in np.ndindex(cast.shape):
        cast[index] = jnp.asarray(np.asarray(out, dtype=object)[index]).astype(dtype)
    return cast


def _broadcast_in_dim(x: np.ndarray, params: dict) -> np.ndarray:
    shape = tuple(params["shape"])
    expanded = [1] * len(shape)
    for axis, dim in zip(params["broadcast_dimensions"], x.shape):
        expanded[axis] = dim
    return np.broadcast_to(x.reshape(expanded), shape)


def _slice(x: np.ndarray, params: dict) -> np.ndarray:
    strides = params["strides"] or (1,) * x.ndim
    index = tuple(
        slice(s, e, st)
        for s, e, st in zip(params["start_indices"], params["limit_indices"], strides)
    )
    return x[index]


def _iota(params: dict) -> np.ndarray:
    shape, dim = tuple(params["shape"]), params["dimension"]
    values = np.arange(shape[dim]).reshape(
        [-1 if d == dim else 1 for d in range(len(shape))]
    )
    out = np.empty(shape, dtype=object)
    for index in np.ndindex(shape):
        out[index] = jnp.asarray(np.broadcast_to(values, shape)[index], params["dtype"])
    return out


_STRUCTURAL: dict[str, Callable] = {
    "broadcast_in_dim": lambda x, p: _broadcast_in_dim(x, p),
    "reshape": lambda x, p: x.reshape(tuple(p["new_sizes"])),
    "squeeze": lambda x, p: np.squeeze(x, axis=tuple(p["dimensions"])),
    "expand_dims": lambda x, p: np.expand_dims(x, tuple(p["dimensions"])),
    "slice": lambda x, p: _slice(x, p),
    "transpose": lambda x, p: np.transpose(x, p["permutation"]),
    "rev": lambda x, p: np.flip(x, tuple(p["dimensions"])),
    "concatenate": lambda *xs, p: np.concatenate(xs, axis=p["dimension"]),
    "stack": lambda *xs, p: np.stack(xs, axis=p["axis"]),
    "split": lambda x, p: tuple(
        np.split(x, np.cumsum(p["sizes"])[:-1], axis=p["axis"])
    ),
    # Newer JAX (0.12) traces the unpacking of an array (`a, b, c = y`) to `unstack`.
    "unstack": lambda x, p: tuple(
        np.squeeze(part, p["axis"])  # object arrays still, 0-d ones included
        for part in np.split(x, x.shape[p["axis"]], axis=p["axis"])
    ),
    "reduce_sum": lambda x, p: _reduce(operator.add, x, p["axes"]),
    "reduce_max": lambda x, p: _reduce(jnp.maximum, x, p["axes"]),
    "reduce_min": lambda x, p: _reduce(jnp.minimum, x, p["axes"]),
    "reduce_prod": lambda x, p: _reduce(operator.mul, x, p["axes"]),
    "dot_general": lambda x, y, p: _dot_general(x, y, p),
    "iota": lambda p: _iota(p),
    "dynamic_slice": lambda x, *rest: _dynamic_slice(x, rest[:-1], rest[-1]),
}
_VARIADIC = frozenset({"concatenate", "stack"})


def as_elements(x) -> np.ndarray:
    """A literal or array as an object array of 0-d elements."""
    x = np.asarray(x)
    out = np.empty(x.shape, dtype=object)
    for index in np.ndindex(x.shape):
        out[index] = jnp.asarray(x[index], x.dtype)
    return out


def evaluate(
    jaxpr: jex.Jaxpr, consts: Sequence[np.ndarray], args: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """The outputs of `jaxpr` on element arrays (see the module docstring).

    **Arguments:**

    - `jaxpr`: the program of one trajectory (checked by `check`).
    - `consts`, `args`: one object array per `constvar` / `invar`, of its shape.

    **Returns:**

    One object array per output, of the output's shape.
    """
    env: dict = {}
    read = lambda v: as_elements(v.val) if isinstance(v, jex.Literal) else env[v]  # noqa: E731
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, dict(eqn.params)
        xs = [read(v) for v in eqn.invars]
        if name in _CALLS:
            inner, inner_consts = _inner(params, _CALLS[name])
            inner_consts = [as_elements(c) for c in inner_consts]
            outs = evaluate(inner, inner_consts, xs)
        elif name in _ELEMENTWISE:
            outs = [_elementwise(eqn.primitive, params, xs)]
        elif name in _VARIADIC:
            outs = [_STRUCTURAL[name](*xs, p=params)]
        else:
            result = _STRUCTURAL[name](*xs, params)
            outs = list(result) if eqn.primitive.multiple_results else [result]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]
