"""Linear algebra of the stiff solvers: the Jacobian of a vector field, and solves
with the iteration matrix `I - γh J`.

A state is any pytree; it is ravelled to one vector for the Jacobian and the solves,
and every solve returns a pytree of the state's structure again. One LU factorisation
of `I - γh J` serves every stage of a step (and every Newton iteration within it).
"""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax.flatten_util import ravel_pytree
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .. import _backend
from .._select import where


# Up to this many unknowns, inverses and matrix-vector products of the iteration
# matrix are written out entry by entry as element-wise operations (unrolled Gauss-
# Jordan elimination with partial pivoting by selects), instead of LU factorisations,
# triangular solves and dot products. Under `vmap` each entry is a vector along the
# batch, so a batch of small systems becomes wide element-wise work: on a TPU,
# batched LU and triangular solves of tiny matrices lower to custom calls and
# padded tiles, and a batched (n, n) product to a matrix unit pass per matrix.
# Kept at 3: the unrolled code grows like n^3, and XLA:CPU's compile time with it
# (a vmapped factorise + 8 solves: n = 3 as fast to compile as LU, n = 4 about 4x,
# n = 6 about 15x; a vmapped Rodas5P on HIRES, n = 8, over 10 minutes).
SMALL_MAX = 3

# Backends where the element-wise path stops earlier. On a CPU, LU from 3 unknowns:
# XLA:CPU compiles the unrolled elimination of 3 unknowns slower than LU (a vmapped
# Rodas5P on ROBER, N = 64: 1.16 s against 0.77 s, first call 0.76 -> 0.49 of
# diffrax's Kvaerno5, for a run of 3.6 ms against 2.8 ms, 0.03 of diffrax's), where
# the run gains little; `python -m benchmarks.first_call --peers solverkit --only
# stiff/rober` measures it.
_SMALL_MAX_ON = {"cpu": 2}


def small_max() -> int:
    """The most unknowns that take the element-wise path on this backend (at most
    `SMALL_MAX`, what [`small_inverse`][] is written for)."""
    return _SMALL_MAX_ON.get(_backend.platform(), SMALL_MAX)


# Where the small solves take entries by a slice each, not by one `unstack` (see
# `_entries`): on a TPU the unstacked form ran the vmapped Rodas5P about 7% slower
# (Van der Pol, N = 16,384, float32: `python -m benchmarks.stiff_ensemble --plan
# chip`), where run time counts more than the compile time it saves.
_SLICE_BACKENDS = ("tpu",)


def _sliced() -> bool:
    return _backend.platform() in _SLICE_BACKENDS


def _entries(matrix: Array) -> list[list[Array]]:
    """The entries of `(..., n, n)` `matrix` as `(...)` arrays, row by row, by one
    `unstack`: reverse mode stacks their cotangents back in one equation, where
    the transpose of a slice per entry is a padded copy of the matrix each (the
    solves of a Rodas5P step were a quarter of its gradient's program). A slice
    per entry on the backends of `_SLICE_BACKENDS`."""
    n = matrix.shape[-1]
    if _sliced():
        return [[matrix[..., i, j] for j in range(n)] for i in range(n)]
    flat = jnp.unstack(jnp.reshape(matrix, matrix.shape[:-2] + (n * n,)), axis=-1)
    return [list(flat[i * n : (i + 1) * n]) for i in range(n)]


def _mul(matrix, vector):
    """`matrix @ vector` in full float32 precision (a GPU may otherwise use
    TF32 for a large batched product); for small matrices, as element-wise
    products and sums (exact float32 on every device)."""
    n = matrix.shape[-1]
    if 0 < n <= small_max():
        if _sliced():
            entries = [vector[..., j] for j in range(n)]
        else:
            entries = jnp.unstack(vector, axis=-1)
        rows = [
            sum((row[j] * entries[j] for j in range(1, n)),
                start=row[0] * entries[0])
            for row in _entries(matrix)
        ]  # fmt: skip
        return jnp.stack(rows, axis=-1)
    return jnp.matmul(matrix, vector, precision=Precision.HIGHEST)


def _pivot(rows: list[list[Array]], k: int) -> list[list[Array]]:
    """The rows of the augmented matrix with the row of the largest `|entry|` in the
    pivot column (entry 0 of each row) among rows `k...` swapped into row `k`, by
    selects (entry-wise, so batched along any leading axes)."""
    best, size = rows[k], lax.abs(rows[k][0])
    which = jnp.full(size.shape, k, jnp.int32)
    for i in range(k + 1, len(rows)):
        size_i = lax.abs(rows[i][0])
        take = size_i > size  # strict: ties keep the upper row
        best = [lax.select(take, a, b) for a, b in zip(rows[i], best)]
        size, which = lax.select(take, size_i, size), where(take, i, which)
    swapped = [
        [lax.select(which == i, a, b) for a, b in zip(rows[k], rows[i])]
        for i in range(k + 1, len(rows))
    ]
    return rows[:k] + [best] + swapped


def small_inverse(matrix: Array) -> Array:
    """The inverse of a small square matrix (`n <= SMALL_MAX`; any leading batch
    axes), by Gauss-Jordan elimination with partial pivoting, unrolled entry by
    entry into element-wise operations. JAX differentiates it directly. A singular
    matrix gives non-finite entries (as an LU-based inverse does).

    **Arguments:**

    - `matrix`: `(..., n, n)`.

    **Returns:**

    The inverse, `(..., n, n)`, of `matrix`'s dtype.
    """
    n = matrix.shape[-1]
    if n == 0:  # an empty state (a leaf with a zero-length axis): nothing to invert
        return matrix
    zero, one = jnp.zeros_like(matrix[..., 0, 0]), jnp.ones_like(matrix[..., 0, 0])
    # Row i: the entries of columns k... of the matrix (columns before k are e_i
    # once eliminated, and dropped), then the n columns of the inverse being built.
    rows = [
        list(row) + [one if i == j else zero for j in range(n)]
        for i, row in enumerate(_entries(matrix))
    ]
    rows = gauss_jordan(rows, _pivot)
    return jnp.stack([jnp.stack(row, axis=-1) for row in rows], axis=-2)


def gauss_jordan(rows: list, pivot) -> list:
    """Gauss-Jordan elimination on `[A | I]` given as rows of entries (arrays of one
    shape, element-wise): column `k` eliminated after `pivot(rows, k)` puts its
    pivot row at `k`, each column dropped once eliminated; returns the rows of
    `A^{-1}`. Shared by `small_inverse` and the kernel's tiles
    (`_kernel/_rosenbrock.py`, with Mosaic's selects)."""
    for k in range(len(rows)):
        rows = pivot(rows, k)
        scale = 1 / rows[k][0]
        pivot_row = [x * scale for x in rows[k][1:]]
        rows = [
            pivot_row if i == k
            else [x - row[0] * p for x, p in zip(row[1:], pivot_row)]
            for i, row in enumerate(rows)
        ]  # fmt: skip
    return rows


def inverse(matrix: Array) -> Array:
    """The inverse of a square matrix: [`small_inverse`][] up to `small_max()`
    unknowns, else `jnp.linalg.inv` (LU)."""
    if matrix.shape[-1] <= small_max():
        return small_inverse(matrix)
    return jnp.linalg.inv(matrix)


def jacobian(
    vf: Callable[[Array, PyTree], PyTree], t: Array, y: PyTree
) -> tuple[Array, Callable[[Array], PyTree]]:
    """The Jacobian `∂vf/∂y` at `(t, y)`, as one `(n, n)` matrix of the ravelled state.

    **Arguments:**

    - `vf`: the vector field as a function of `(t, y)`.
    - `t`, `y`: where to evaluate it.

    **Returns:**

    `(J, unravel)`: the matrix, and the function that turns a ravelled vector back
    into a pytree of `y`'s structure.
    """
    _, jac, unravel = value_and_jacobian(vf, t, y)
    return jac, unravel


def value_and_jacobian(
    vf: Callable[[Array, PyTree], PyTree], t: Array, y: PyTree
) -> tuple[Array, Array, Callable[[Array], PyTree]]:
    """The vector field and its Jacobian at `(t, y)`, on the ravelled state, from one
    forward-mode pass (the value comes with the Jacobian at no extra cost).

    **Arguments:**

    - `vf`: the vector field as a function of `(t, y)`.
    - `t`, `y`: where to evaluate it.

    **Returns:**

    `(f, J, unravel)`: the ravelled value `(n,)`, the `(n, n)` matrix (both of the
    ravelled state's dtype), and the function that turns a ravelled vector back into
    a pytree of `y`'s structure.
    """
    flat, unravel = ravel_pytree(y)

    def fn(x):
        out = ravel_pytree(vf(t, unravel(x)))[0].astype(flat.dtype)
        return out, out

    holomorphic = jnp.issubdtype(flat.dtype, jnp.complexfloating)
    jac, value = jax.jacfwd(fn, has_aux=True, holomorphic=holomorphic)(flat)
    return value, jac, unravel


def time_derivative(vf: Callable[[Array, PyTree], PyTree], t: Array, y: PyTree):
    """`∂vf/∂t` at `(t, y)`, a pytree of `y`'s structure (for non-autonomous fields)."""
    _, dt = jax.jvp(lambda s: vf(s, y), (t,), (jnp.ones_like(t),))
    return dt


class Factorisation(eqx.Module):
    """The LU factorisation of `I - γh J`, ready for solves with any right-hand side
    of the state's structure."""

    lu: Array
    pivots: Array

    def solve(self, rhs: PyTree) -> PyTree:
        """`(I - γh J)^{-1} rhs`, with `rhs` a pytree of the state's structure (the
        result has its structure and dtypes)."""
        flat, unravel = ravel_pytree(rhs)
        x = jsl.lu_solve((self.lu, self.pivots), flat.astype(self.lu.dtype))
        return unravel(x.astype(flat.dtype))


def _iteration_matrix(jac: Array, gamma_h: Array) -> Array:
    n = jac.shape[0]
    return jnp.eye(n, dtype=jac.dtype) - jnp.asarray(gamma_h, jac.dtype) * jac


def factorise(jac: Array, gamma_h: Array) -> Factorisation:
    """Factorise `I - gamma_h * jac` once, for every solve of a step.

    **Arguments:**

    - `jac`: the `(n, n)` Jacobian from [`jacobian`][].
    - `gamma_h`: the scalar `γh`.

    **Returns:**

    A `Factorisation`, whose `solve` takes any pytree of the state's structure.
    """
    return lu_factorisation(_iteration_matrix(jac, gamma_h))


def lu_factorisation(matrix: Array) -> Factorisation:
    """The LU factorisation of a square `matrix` (of the ravelled state), for solves
    with right-hand sides of the state's structure."""
    lu, pivots = jsl.lu_factor(matrix)
    return Factorisation(lu, pivots)


class Inverse(eqx.Module):
    """The explicit inverse of `I - γh J`: each solve is a matrix-vector product,
    which batches well under `vmap` and compiles small (for small systems several
    times faster than LAPACK's per-matrix triangular solves). With the matrix kept
    (`refine`), each solve takes one step of iterative refinement (two more
    products), which restores the accuracy of an LU solve; without, the rounding of
    the inverse only slows a chord iteration's contraction a little (its residual is
    always evaluated exactly). A refined solve is differentiated as a solve with the
    matrix (`_refined_solve`): the inverse's own derivative is not used."""

    inverse: Array
    matrix: Array | None = None  # `I - γh J`, when solves are refined

    def solve(self, rhs: PyTree) -> PyTree:
        """`(I - γh J)^{-1} rhs`, with `rhs` a pytree of the state's structure."""
        flat, unravel = ravel_pytree(rhs)
        b = flat.astype(self.inverse.dtype)
        if self.matrix is None:
            x = _mul(self.inverse, b)
        else:
            x = _refined_solve(self.inverse, self.matrix, b)
        return unravel(x.astype(flat.dtype))


def _refined(inverse: Array, matrix: Array, b: Array) -> Array:
    x = _mul(inverse, b)
    return x + _mul(inverse, b - _mul(matrix, x))


@jax.custom_jvp
def _refined_solve(inverse: Array, matrix: Array, b: Array) -> Array:
    """`matrix^{-1} b` from `inverse`, refined once. Its derivative is that of the
    solve, `matrix^{-1} (db - d(matrix) x)`: the inverse is not differentiated, nor
    are the refinement's three products (differentiated, they were most of a
    Rodas5P step's reverse mode)."""
    return _refined(inverse, matrix, b)


@functools.partial(_refined_solve.defjvp, symbolic_zeros=True)
def _refined_solve_jvp(primals, tangents):
    inverse, matrix, b = primals
    _, d_matrix, d_b = tangents
    x = _refined(inverse, matrix, b)
    zero = lambda t: type(t) is jax.custom_derivatives.SymbolicZero  # noqa: E731
    rhs = jnp.zeros_like(x) if zero(d_b) else d_b
    if not zero(d_matrix):
        rhs = rhs - _mul(d_matrix, x)
    return x, _mul(inverse, rhs)


def invert(jac: Array, gamma_h: Array, refine: bool = False) -> Inverse:
    """Invert `I - gamma_h * jac` once, for every solve of a step.

    **Arguments:**

    - `jac`: the `(n, n)` Jacobian from [`jacobian`][].
    - `gamma_h`: the scalar `γh`.
    - `refine`: refine each solve once (see `Inverse`).

    **Returns:**

    An `Inverse`.
    """
    matrix = _iteration_matrix(jac, gamma_h)
    return Inverse(inverse(matrix), matrix if refine else None)
