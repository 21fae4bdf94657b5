"""Selects on real tiles, for Mosaic (the TPU's Pallas compiler).

Mosaic fails to compile a `select_n` whose mask or operands mix a replicated layout (a
splat constant, a value broadcast from a scalar) with a real vector ("Invalid
relayout ... replicated in destination but not in source"). So every select in the
kernel goes through `where`, which first anchors its mask and operands to a zero tile
that the kernel loads from an input block (`-0.0` everywhere: `x + (-0.0)` is `x`,
bit for bit, signed zeros, infinities and NaNs included), making each of them a real
vector that the compiler cannot fold back into a constant.

The zero tile is set for the tracing of one kernel body by `anchored`; outside it,
`where` is `jnp.where`.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike


_ZERO: contextvars.ContextVar[Array | None] = contextvars.ContextVar(
    "solverkit_kernel_zero", default=None
)


@contextlib.contextmanager
def anchored(zero: Array) -> Iterator[None]:
    """Within the block, `where` anchors to `zero`.

    **Arguments:**

    - `zero`: a `(rows, 128)` tile of `-0.0`, loaded from a kernel input.
    """
    token = _ZERO.set(zero)
    try:
        yield
    finally:
        _ZERO.reset(token)


def anchor(x: ArrayLike, dtype=None) -> Array:
    """`x` (a tile or a scalar) as a real tile of `dtype` (default: its own), the
    same values; `x` itself (cast) outside `anchored`."""
    x = jnp.asarray(x) if dtype is None else jnp.asarray(x, dtype)
    zero = _ZERO.get()
    return x if zero is None else _anchor_to(x, zero)


def _anchor_to(x, zero):
    if x.dtype == jnp.bool_:
        return x | (zero != 0)
    return x + zero.astype(x.dtype)


@jax.custom_jvp
def _select(which, zero, *cases):
    return lax.select_n(_anchor_to(which, zero), *[_anchor_to(c, zero) for c in cases])


@_select.defjvp
def _select_jvp(primals, tangents) -> tuple[Array, Any]:
    # The tangent select anchored too: JAX's own rule would select between the
    # tangents with a splat of zeros where an operand is a constant.
    which, zero, *cases = primals
    out = _select(which, zero, *cases)
    if not jnp.issubdtype(out.dtype, jnp.inexact):
        return out, np.zeros(out.shape, jax.dtypes.float0)
    return out, _select(which, zero, *tangents[2:])


def select_n(which: ArrayLike, *cases: ArrayLike) -> Array:
    """`lax.select_n(which, *cases)` (cases of one shape and dtype) on real tiles:
    anchored to the zero tile within `anchored`, its tangent too."""
    zero = _ZERO.get()
    if zero is None:
        return lax.select_n(which, *cases)
    which = jnp.asarray(which)
    cases = tuple(jnp.broadcast_to(c, zero.shape) for c in cases)
    return _select(jnp.broadcast_to(which, zero.shape), zero, *cases)


def where(mask: ArrayLike, a: ArrayLike, b: ArrayLike) -> Array:
    """`jnp.where(mask, a, b)` with the mask and both operands anchored to the zero
    tile (see the module docstring), its tangent too; the result's dtype is
    `jnp.where`'s."""
    dtype = jnp.result_type(a, b)
    if _ZERO.get() is None:
        return jnp.where(mask, a, b)
    mask = jnp.asarray(mask, bool)
    return select_n(mask, jnp.asarray(b, dtype), jnp.asarray(a, dtype))
