"""Linear solvers of the stiff solvers: solves with the iteration matrix `A = M - γh J`.

A stiff solver works on the ravelled state `x` (a vector of `n` unknowns) and the
vector field as a function of it, `fn(x) = ravel(f(t, unravel(x)))`. The protocol has
three steps, kept apart so that a solver may reuse each result across steps and
stages (Jacobian reuse, factorisation reuse):

1. `linearise(fn, x) -> (fn(x), jac)`: the field's value and this linear solver's
   representation of the Jacobian `∂fn/∂x` at `x` (a dense matrix, bands, a
   compressed sparse Jacobian, or only the point `x` for a matrix-free solver).
2. `factorise(jac, gamma_h, mass) -> factor`: what solves with `M - γh J` need (an LU
   factorisation, an inverse, a preconditioner).
3. `solve(factor, rhs, fn) -> x`: `(M - γh J)^{-1} rhs`; `fn` is the field at the
   current time, used only by matrix-free solvers (for Jacobian-vector products at
   the linearisation point kept in `factor`).

Every result is a pytree of arrays, so it may be carried in a solver's state through
a `while_loop`. `mass` is `None` (the identity), a vector `(n,)` (a diagonal mass
matrix) or a matrix `(n, n)`.
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import lineax as lx
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from .._closure._convert import Closure, closure_convert
from .._closure._unvmap import error_if
from .._tree import nograd
from ._banded import (
    band_lu,
    band_lu_solve,
    band_matvec,
    BandLU,
    BlockedBandLU,
    dense_to_bands,
)
from ._bicgstab import bicgstab
from ._linalg import Inverse, inverse, lu_factorisation, value_and_jacobian
from ._sparsity import (
    bandwidths,
    colour_columns,
    components,
    coordinates,
    reverse_cuthill_mckee,
)


FlatFn = Callable[[Array], Array]

# Up to this many unknowns, the dense solver inverts the iteration matrix (each solve
# a matrix-vector product, with one step of refinement) instead of factorising it:
# for small systems, above all under vmap, several times faster (benchmarks/stiff.py).
_INVERSE_MAX = 32


def mass_matvec(mass: Array | None, v: Array) -> Array:
    """`M v` for a mass matrix given as `None` (identity), a vector (diagonal) or a
    matrix."""
    if mass is None:
        return v
    if mass.ndim == 1:
        return mass.astype(v.dtype) * v
    return jnp.matmul(mass.astype(v.dtype), v, precision="highest")


def iteration_matrix(jac: Array, gamma_h: Array, mass: Array | None) -> Array:
    """The dense `M - γh J`."""
    n = jac.shape[0]
    if mass is None:
        m = jnp.eye(n, dtype=jac.dtype)
    elif mass.ndim == 1:
        m = jnp.diag(mass.astype(jac.dtype))
    else:
        m = mass.astype(jac.dtype)
    return m - jnp.asarray(gamma_h, jac.dtype) * jac


def algebraic_residual(mass: Array | None, f: Array) -> Array:
    """The part of `f` outside the range of the mass matrix `M`: zero for a regular
    `M`; for a singular one, the residual of the algebraic equations of `M y' = f`
    (the initial values of a DAE are consistent when it vanishes at `t0`).

    **Arguments:**

    - `mass`: `None`, a vector (diagonal) or a matrix, as in the module docstring.
    - `f`: the ravelled vector field, `(n,)`.

    **Returns:**

    The residual, `(n,)` (for a diagonal `M`: `f` where `M` has a zero diagonal;
    for a matrix: `f` projected onto the left null space of `M`).
    """
    if mass is None:
        return jnp.zeros_like(f)
    if mass.ndim == 1:
        return jnp.where(mass == 0, f, 0)
    u, s, _ = jnp.linalg.svd(mass.astype(f.dtype))
    tol = jnp.max(s) * mass.shape[0] * jnp.finfo(s.dtype).eps
    coords = jnp.matmul(jnp.conj(u.T), f, precision="highest")
    return jnp.matmul(u, jnp.where(s <= tol, coords, 0), precision="highest")


class AbstractLinearSolver(eqx.Module):
    """How a stiff solver (`BDF`, the Rosenbrock and ESDIRK solvers) solves its linear
    systems `(M - γh J) x = b`. See the module docstring for the protocol."""

    @abc.abstractmethod
    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Any]:
        """The field and its Jacobian at `x`.

        **Arguments:**

        - `fn`: the vector field on the ravelled state, `(n,) -> (n,)`.
        - `x`: the point, `(n,)`.

        **Returns:**

        `(fn(x), jac)`, `jac` in this solver's representation.
        """

    @abc.abstractmethod
    def factorise(self, jac: Any, gamma_h: Array, mass: Array | None) -> Any:
        """Prepare solves with `M - gamma_h * J`.

        **Arguments:**

        - `jac`: from `linearise`.
        - `gamma_h`: the scalar `γh`.
        - `mass`: `None`, a vector or a matrix (see the module docstring).

        **Returns:**

        The factor, a pytree of arrays, for `solve`.
        """

    @abc.abstractmethod
    def solve(self, factor: Any, rhs: Array, fn: FlatFn) -> Array:
        """`(M - γh J)^{-1} rhs`.

        **Arguments:**

        - `factor`: from `factorise`.
        - `rhs`: the right-hand side, `(n,)`.
        - `fn`: the vector field on the ravelled state (for matrix-free solvers).

        **Returns:**

        The solution, `(n,)`, of `rhs`'s dtype.
        """

    def solve_tangent(self, factor: Any, rhs: Array, fn: FlatFn) -> Array:
        """`solve`, as a function that JAX can transpose in `rhs`: for a tangent (a
        stiff solver's implicit-function-theorem derivative), which reverse mode
        transposes. By default `solve` itself, which for a direct solver is such a
        function (a matrix-free one overrides it).

        **Arguments:** as `solve`.

        **Returns:** as `solve`.
        """
        return self.solve(factor, rhs, fn)

    def closure_converted(self, x: jax.ShapeDtypeStruct) -> "AbstractLinearSolver":
        """This solver with each user function it holds closure-converted (so that
        what the function closes over travels as pytree leaves, as the vector
        field's does); `diffeqsolve` calls it once, on entry. By default, `self`.

        **Arguments:**

        - `x`: the ravelled state, `(n,)`.

        **Returns:**

        The solver, of the same type.
        """
        del x
        return self


class DenseLinearSolver(AbstractLinearSolver):
    """Dense Jacobians (one forward-mode pass of `n` columns) and dense LU
    factorisations; for up to 32 unknowns, an explicit inverse with one step of
    iterative refinement per solve (up to 3, computed and applied entry by entry
    as element-wise operations, which batch under `vmap` into wide vector work,
    without LU custom calls, triangular solves or small dot products). The
    default, and the right choice up to a few hundred unknowns.
    """

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Array]:
        value, jac, _ = value_and_jacobian(lambda _, y: fn(y), jnp.zeros(()), x)
        return value, jac

    def factorise(self, jac: Array, gamma_h: Array, mass: Array | None):
        matrix = iteration_matrix(jac, gamma_h, mass)
        if matrix.shape[0] <= _INVERSE_MAX:
            return Inverse(inverse(matrix), matrix)
        return lu_factorisation(matrix)

    def solve(self, factor, rhs: Array, fn: FlatFn) -> Array:
        del fn
        return factor.solve(rhs)


def _check_point(fn: FlatFn, x: Array, name: str) -> None:
    """Static checks of `linearise`'s arguments: `x` a vector, `fn(x)` one like it."""
    if x.ndim != 1:
        raise ValueError(f"{name}.linearise: `x` must be a vector (n,), got {x.shape}")
    out = jax.eval_shape(fn, x)
    if out.shape != x.shape:
        raise ValueError(
            f"{name}.linearise: `fn(x)` must have the shape of `x`, {x.shape}; "
            f"got {out.shape}"
        )


def _check_mass(mass: Array | None, n: int, name: str) -> None:
    if mass is not None and mass.shape not in ((n,), (n, n)):
        raise ValueError(
            f"{name}.factorise: `mass` must be None, a vector ({n},) or a matrix "
            f"({n}, {n}); got shape {mass.shape}"
        )


def _probe_failed(
    jvp: FlatFn, product: Callable[[Array], tuple[Array, Array]], n: int, dtype
) -> Array:
    """Whether the Jacobian (by one JVP) and its compressed representation (by
    `product`) differ on a random probe vector by more than rounding: then the
    Jacobian has entries outside the structure the solver assumed."""
    v = jax.random.uniform(jax.random.key(0), (n,), dtype, 0.5, 1.5)
    exact = jvp(v)
    assumed, scale = product(v)
    tol = jnp.sqrt(jnp.finfo(dtype).eps)
    return jnp.any(jnp.abs(exact - assumed) > tol * (scale + jnp.abs(exact)))


class BandedLinearSolver(AbstractLinearSolver):
    """Banded Jacobians: `lower` sub-diagonals and `upper` super-diagonals.

    The Jacobian costs `lower + upper + 1` Jacobian-vector products (columns `c` with
    the same `c mod (lower + upper + 1)` share one: no row has two of them in its
    band), is stored as bands (`O(n·bw)` memory), and `M - γh J` is factorised by
    band Gaussian elimination with partial pivoting (`O(n·bw²)` work). For 1-D
    discretised PDEs and chains of reactions, and for any field whose unknowns can be
    ordered so that each couples only to near neighbours.

    **Arguments:**

    - `lower`, `upper`: the numbers of sub- and super-diagonals of `∂f/∂y` (of the
      ravelled state).
    - `check`: each `linearise` also compares one more Jacobian-vector product,
      with a random vector, against the banded product, and raises an error (at run
      time, also under `jit`) if the Jacobian has entries outside the bands.

    A mass matrix may be `None`, a vector, or a dense matrix with no entries outside
    the bands (checked at run time). An exactly singular `M - γh J` gives a NaN
    solution (a stiff solver rejects the step); no error is raised.
    """

    lower: int = eqx.field(static=True)
    upper: int = eqx.field(static=True)
    check: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        for name in ("lower", "upper"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"BandedLinearSolver: `{name}` must be an int >= 0, got {value!r}"
                )

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Array]:
        _check_point(fn, x, "BandedLinearSolver")
        n = x.shape[0]
        lower, width = self.lower, self.lower + self.upper + 1
        colours = min(width, n)
        seeds = jnp.arange(n)[None, :] % width == jnp.arange(colours)[:, None]
        value, jvp = jax.linearize(fn, x)
        compressed = jax.vmap(jvp)(seeds.astype(x.dtype))  # (colours, n)
        col = jnp.arange(n)[:, None] - lower + jnp.arange(width)[None, :]
        inside = (col >= 0) & (col < n)
        rows = jnp.broadcast_to(jnp.arange(n)[:, None], col.shape)
        bands = jnp.where(
            inside, compressed[jnp.where(inside, col, 0) % width, rows], 0
        )
        if self.check:
            failed = _probe_failed(
                jvp,
                lambda v: (
                    band_matvec(bands, lower, v),
                    band_matvec(jnp.abs(bands), lower, v),
                ),
                n,
                x.dtype,
            )
            bands = error_if(
                bands,
                failed,
                0,
                [
                    f"BandedLinearSolver(lower={self.lower}, upper={self.upper}): "
                    "the Jacobian has entries outside these bands; pass the right "
                    "bandwidths (or use SparseLinearSolver / DenseLinearSolver)"
                ],
            )
        return value, bands

    def factorise(
        self, jac: Array, gamma_h: Array, mass: Array | None
    ) -> BandLU | BlockedBandLU:
        n = jac.shape[0]
        _check_mass(mass, n, "BandedLinearSolver")
        matrix = -jnp.asarray(gamma_h, jac.dtype) * jac
        if mass is None:
            matrix = matrix.at[:, self.lower].add(1)
        elif mass.ndim == 1:
            matrix = matrix.at[:, self.lower].add(mass.astype(jac.dtype))
        else:
            banded = dense_to_bands(mass.astype(jac.dtype), self.lower, self.upper)
            offset = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]
            outside_band = (offset > self.upper) | (-offset > self.lower)
            outside = jnp.any(jnp.where(outside_band, mass, 0) != 0)
            banded = error_if(
                banded,
                outside,
                0,
                [
                    f"BandedLinearSolver(lower={self.lower}, upper={self.upper}): "
                    "the mass matrix has entries outside the bands"
                ],
            )
            matrix = matrix + banded
        return band_lu(matrix, self.lower)

    def solve(self, factor: BandLU | BlockedBandLU, rhs: Array, fn: FlatFn) -> Array:
        del fn
        return band_lu_solve(factor, rhs).astype(rhs.dtype)


def _blocks_lu_solve(lu: Array, permutation: Array, rhs: Array) -> Array:
    """Solve with many small LU factors at once, `(nb, b, b)` packed as
    `lax.linalg.lu` returns them (with its `permutation`, `(nb, b)`), for
    right-hand sides `(nb, b)`: forward and back substitution column by column,
    each step one vectorised operation over all the blocks (`b <= _BLOCK_MAX`). On
    XLA:CPU about 8× faster than a batched `lu_solve` (3,334 blocks of 3: 0.10 ms
    against 0.79 ms), which runs a triangular solve per block."""
    b = lu.shape[-1]
    rows = jnp.arange(b)
    x = jnp.take_along_axis(rhs, permutation, axis=1)
    for k in range(b - 1):  # L, unit diagonal
        x = x - jnp.where(rows > k, lu[:, :, k] * x[:, k : k + 1], 0)
    for k in reversed(range(b)):  # U
        xk = x[:, k] / lu[:, k, k]
        x = x.at[:, k].set(xk)
        if k:
            x = x - jnp.where(rows < k, lu[:, :, k] * xk[:, None], 0)
    return x


# SparseLinearSolver: connected components up to this size are factorised as dense
# blocks (batched LU); above this many unknowns a pattern is never factorised densely.
_BLOCK_MAX = 32
_DENSE_MAX = 4096


class _HostArrays:
    """Named numpy int32 arrays, read-only, hashed and compared by value (so that a
    solver holding them may be a static argument and its indices constants)."""

    def __init__(self, **arrays: np.ndarray):
        self._arrays = {}
        for name, array in arrays.items():
            array = np.array(array, np.int32)
            array.flags.writeable = False
            self._arrays[name] = array
        self._hash = hash(
            tuple((k, a.shape, a.tobytes()) for k, a in self._arrays.items())
        )

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _HostArrays) and (
            self is other
            or (
                self._hash == other._hash
                and self._arrays.keys() == other._arrays.keys()
                and all(
                    np.array_equal(a, other._arrays[k]) for k, a in self._arrays.items()
                )
            )
        )


class SparseLinearSolver(AbstractLinearSolver):
    """Jacobians with a known sparsity pattern.

    At construction (on the host, with numpy) the columns are coloured so that no row
    has two nonzeros of one colour: the Jacobian then costs one Jacobian-vector
    product per colour (3 for a tridiagonal pattern, 5 for a 2-D 5-point stencil,
    the block size for independent blocks), stored as its nonzeros only. The
    factorisation of `M - γh J` follows the pattern's shape:

    - independent blocks of at most 32 unknowns (the pattern's connected
      components, e.g. many copies of a small reaction network): a batched dense LU
      of the blocks;
    - otherwise, reordered by reverse Cuthill–McKee to a small bandwidth: the band LU
      of [`BandedLinearSolver`][solverkit.BandedLinearSolver] when the bandwidth is
      at most half of `n` (or `n > 4096`);
    - otherwise a dense LU, for up to 4096 unknowns (above, a `ValueError`: use
      [`KrylovLinearSolver`][solverkit.KrylovLinearSolver]).

    **Arguments:**

    - `pattern`: the nonzeros of `∂f/∂y` (of the ravelled state): a boolean `(n, n)`
      array-like, or a scipy.sparse matrix (its stored entries). The diagonal is
      always added.
    - `check`: each `linearise` also compares one more Jacobian-vector product, with
      a random vector, against the sparse product, and raises an error (at run time,
      also under `jit`) if the Jacobian has entries outside the pattern.

    A mass matrix may be `None`, a vector, or a dense matrix with no entries outside
    the pattern (checked at run time). An exactly singular `M - γh J` gives a NaN
    solution (a stiff solver rejects the step); no error is raised.
    """

    n: int = eqx.field(static=True)
    n_colours: int = eqx.field(static=True)
    kind: str = eqx.field(static=True)  # "blocks", "banded" or "dense"
    lower: int = eqx.field(static=True)  # banded: the bandwidths after reordering
    block: int = eqx.field(static=True)  # blocks: the block size
    size: int = eqx.field(static=True)  # length of the (padded, reordered) vector
    check: bool = eqx.field(static=True)
    # Host index arrays (static: the solver is hashable, its indices constants):
    # the nonzeros (with the diagonal), sorted by row; the colour of each column;
    # the index of each (i, i) among the nonzeros; the flat index of each nonzero in
    # the factorised matrix; the diagonal of the padding (blocks); the index of each
    # unknown in the (padded, reordered) vector, and its inverse (`spread`).
    _indices: _HostArrays = eqx.field(static=True)

    @property
    def rows(self) -> np.ndarray:
        return self._indices["rows"]

    @property
    def cols(self) -> np.ndarray:
        return self._indices["cols"]

    @property
    def colour(self) -> np.ndarray:
        return self._indices["colour"]

    def __init__(self, pattern, check: bool = True):
        n, rows, cols = coordinates(pattern)
        self.n, self.check = n, check
        colour = colour_columns(n, rows, cols)
        self.n_colours = int(colour.max()) + 1
        self.lower, self.block = 0, 0
        label = components(n, rows, cols)
        sizes = np.bincount(label)
        pads = np.zeros(0, np.int64)
        if len(sizes) > 1 and sizes.max() <= _BLOCK_MAX:
            self.kind, b = "blocks", int(sizes.max())
            order = np.argsort(label, kind="stable")
            local = np.empty(n, np.int64)
            local[order] = np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)
            places = label * b + local
            slots = label[rows] * b * b + local[rows] * b + local[cols]
            self.block, self.size = b, len(sizes) * b
            unused = np.setdiff1d(np.arange(self.size), places)
            pads = (unused // b) * b * b + (unused % b) * (b + 1)
        else:
            order = reverse_cuthill_mckee(n, rows, cols)
            places = np.empty(n, np.int64)
            places[order] = np.arange(n)
            lower, upper = bandwidths(rows, cols, places)
            width = lower + upper + 1
            if 2 * width <= n or n > _DENSE_MAX:
                if 2 * width > n:
                    raise ValueError(
                        f"SparseLinearSolver: {n} unknowns whose pattern has "
                        f"bandwidth {width} even after reordering: too large for a "
                        "direct solve; use KrylovLinearSolver"
                    )
                self.kind, self.lower = "banded", lower
                slots = places[rows] * width + (places[cols] - places[rows] + lower)
            else:
                self.kind, places = "dense", np.arange(n)
                slots = rows.astype(np.int64) * n + cols
            self.size, self.block = n, width
        # The inverse of `places`: the unknown at each place, `n` (a zero) where
        # none. Solves move the right-hand side in by this gather, not by a scatter
        # to `places`, so that JAX can transpose them (reverse mode through a
        # tangent solve: BDF's implicit derivative, a Krylov preconditioner).
        spread = np.full(self.size, n, np.int64)
        spread[places] = np.arange(n)
        self._indices = _HostArrays(
            rows=rows,
            cols=cols,
            colour=colour,
            diagonal=np.flatnonzero(rows == cols),
            slots=slots,
            pads=pads,
            places=places,
            spread=spread,
        )

    def _product(self, values: Array, v: Array) -> Array:
        return jax.ops.segment_sum(
            values * v[self.cols], self.rows, self.n, indices_are_sorted=True
        )

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Array]:
        _check_point(fn, x, "SparseLinearSolver")
        if x.shape[0] != self.n:
            raise ValueError(
                f"SparseLinearSolver.linearise: `x` must have shape ({self.n},) (the "
                f"pattern's), got {x.shape}. (With BacksolveAdjoint, the backward "
                "solve's state is larger: pass `BacksolveAdjoint(solver=...)` a "
                "solver with another linear solver, or use "
                "RecursiveCheckpointAdjoint.)"
            )
        seeds = self.colour[None, :] == np.arange(self.n_colours)[:, None]
        value, jvp = jax.linearize(fn, x)
        compressed = jax.vmap(jvp)(jnp.asarray(seeds, x.dtype))
        values = compressed[self.colour[self.cols], self.rows]
        if self.check:
            failed = _probe_failed(
                jvp,
                lambda v: (self._product(values, v), self._product(jnp.abs(values), v)),
                self.n,
                x.dtype,
            )
            values = error_if(
                values,
                failed,
                0,
                [
                    "SparseLinearSolver: the Jacobian has entries outside the "
                    "sparsity pattern; pass a pattern holding every nonzero (or "
                    "use DenseLinearSolver)"
                ],
            )
        return value, values

    def factorise(self, jac: Array, gamma_h: Array, mass: Array | None):
        _check_mass(mass, self.n, "SparseLinearSolver")
        values = -jnp.asarray(gamma_h, jac.dtype) * jac
        if mass is None:
            values = values.at[self._indices["diagonal"]].add(1)
        elif mass.ndim == 1:
            values = values.at[self._indices["diagonal"]].add(mass.astype(jac.dtype))
        else:
            inside = mass[self.rows, self.cols].astype(jac.dtype)
            outside = jnp.any(mass.at[self.rows, self.cols].set(0) != 0)
            inside = error_if(
                inside,
                outside,
                0,
                ["SparseLinearSolver: the mass matrix has entries outside the pattern"],
            )
            values = values + inside
        if self.kind == "banded":
            buffer = (
                jnp.zeros(self.n * self.block, jac.dtype)
                .at[self._indices["slots"]]
                .add(values)
            )
            return band_lu(buffer.reshape(self.n, self.block), self.lower)
        if self.kind == "blocks":
            b = self.block
            buffer = (
                jnp.zeros(self.size * b, jac.dtype)
                .at[self._indices["slots"]]
                .add(values)
            )
            matrix = buffer.at[self._indices["pads"]].set(1).reshape(-1, b, b)
        else:
            buffer = (
                jnp.zeros(self.n * self.n, jac.dtype)
                .at[self._indices["slots"]]
                .add(values)
            )
            matrix = buffer.reshape(self.n, self.n)
        lu, pivots, permutation = jax.lax.linalg.lu(matrix)
        return lu, permutation if self.kind == "blocks" else pivots

    def _spread(self, rhs: Array, dtype) -> Array:
        """`rhs` moved to the (padded, reordered) places of the factorised matrix,
        zeros elsewhere: one gather (transposable, unlike a scatter of `set`)."""
        padded = jnp.concatenate([rhs.astype(dtype), jnp.zeros(1, dtype)])
        return padded[self._indices["spread"]]

    def solve(self, factor, rhs: Array, fn: FlatFn) -> Array:
        del fn
        if self.kind == "banded":
            b = self._spread(rhs, factor.dtype)
            return band_lu_solve(factor, b)[self._indices["places"]].astype(rhs.dtype)
        lu, pivots = factor
        b = self._spread(rhs, lu.dtype)
        if self.kind == "blocks":
            x = _blocks_lu_solve(lu, pivots, b.reshape(-1, self.block)).reshape(-1)
        else:
            x = jsl.lu_solve((lu, pivots), b)
        singular = jnp.any(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)
        return jnp.where(singular, jnp.nan, x[self._indices["places"]]).astype(
            rhs.dtype
        )


class _KrylovFactor(eqx.Module):
    point: Array
    gamma_h: Array
    mass: Array | None
    preconditioner: Any


class KrylovLinearSolver(AbstractLinearSolver):
    """Matrix-free Newton–Krylov: no Jacobian is formed; each product with
    `M - γh J` is one Jacobian-vector product of the field at the linearisation
    point, inside GMRES (lineax's) or BiCGStab (solverkit's, which stops at an
    exact half step and returns 0 for a zero right-hand side, where lineax's
    divides by zero).

    For large systems whose Jacobian is too wide to factorise (2-D and 3-D PDEs),
    ideally with a preconditioner. Derivatives of a solve (with respect to the
    right-hand side, the point and whatever the field closes over) are implicit,
    exact up to the tolerances (lineax's rule for GMRES's `solve`; otherwise the
    same iteration with the transposed operator and preconditioner), and never
    taken through the preconditioner.

    **Arguments:**

    - `method`: `"gmres"` (the robust default) or `"bicgstab"` (less memory, may
      break down: then NaN, see below).
    - `rtol`, `atol`: the stopping rule, `|r| <= atol + rtol |b|` in the max norm
      (lineax's GMRES also asks the last update to be as small relative to `x`).
    - `max_steps`: the most iterations.
    - `restart`: GMRES's restart length.
    - `preconditioner`: `None`; another linear solver (a
      [`BandedLinearSolver`][solverkit.BandedLinearSolver] or
      [`SparseLinearSolver`][solverkit.SparseLinearSolver] of an approximate
      pattern, with `check=False`), linearised and factorised along with this one and
      applied as `(M - γh J̃)^{-1}`; or a callable `p(v, point, gamma_h)` returning
      an approximation of `(M - γh J(point))^{-1} v`, linear in `v`. Like the
      vector field, the callable may close over anything (a differentiated or
      vmapped value): `diffeqsolve` closure-converts it on entry (for
      `BacksolveAdjoint`, pass the backward solve a solver of its own).

    A solve that does not converge within `max_steps` (or breaks down) returns NaN,
    so that a stiff solver rejects the step; no error is raised.
    """

    method: str = eqx.field(static=True, default="gmres")
    rtol: float = eqx.field(static=True, default=1e-7)
    atol: float = eqx.field(static=True, default=1e-10)
    max_steps: int = eqx.field(static=True, default=256)
    restart: int = eqx.field(static=True, default=20)
    preconditioner: AbstractLinearSolver | Callable | None = None

    def __check_init__(self):
        if self.method not in ("gmres", "bicgstab"):
            raise ValueError(
                "KrylovLinearSolver: `method` must be 'gmres' or 'bicgstab', got "
                f"{self.method!r}"
            )
        p = self.preconditioner
        if not (p is None or isinstance(p, AbstractLinearSolver) or callable(p)):
            raise ValueError(
                "KrylovLinearSolver: `preconditioner` must be None, a linear solver "
                f"or a callable; got {type(self.preconditioner).__name__}"
            )

    def closure_converted(self, x: jax.ShapeDtypeStruct) -> "KrylovLinearSolver":
        p = self.preconditioner
        if isinstance(p, AbstractLinearSolver):
            return dataclasses.replace(self, preconditioner=p.closure_converted(x))
        if p is None or isinstance(p, Closure):
            return self
        gamma_h = jax.ShapeDtypeStruct((), x.dtype)
        closed = closure_convert(p, x, x, gamma_h)
        out = closed.out_struct
        if not (
            isinstance(out, jax.ShapeDtypeStruct)
            and out.shape == x.shape
            and jnp.issubdtype(out.dtype, jnp.inexact)
        ):
            raise ValueError(
                "KrylovLinearSolver: `preconditioner(v, point, gamma_h)` must return "
                f"an array of the shape of `v`, {x.shape}, of floating dtype; got "
                f"{out}"
            )
        return dataclasses.replace(self, preconditioner=closed)

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Any]:
        _check_point(fn, x, "KrylovLinearSolver")
        if isinstance(self.preconditioner, AbstractLinearSolver):
            value, jac = self.preconditioner.linearise(fn, x)
            return value, (x, jac)
        return fn(x), (x, None)

    def factorise(self, jac: Any, gamma_h: Array, mass: Array | None):
        point, approximate = jac
        _check_mass(mass, point.shape[0], "KrylovLinearSolver")
        gamma_h = jnp.asarray(gamma_h, point.dtype)
        factor = None
        if isinstance(self.preconditioner, AbstractLinearSolver):
            factor = self.preconditioner.factorise(approximate, gamma_h, mass)
        return _KrylovFactor(point, gamma_h, mass, factor)

    def solve(self, factor: _KrylovFactor, rhs: Array, fn: FlatFn) -> Array:
        if self.method == "bicgstab":
            return self.solve_tangent(factor, rhs, fn)
        b = rhs.astype(factor.point.dtype)
        matvec = self._matvec(factor, fn)
        x = self._lineax(matvec, self._preconditioner(factor, fn, b), b)
        return x.astype(rhs.dtype)

    def solve_tangent(self, factor: _KrylovFactor, rhs: Array, fn: FlatFn) -> Array:
        # The iteration (and its NaN on failure) as a black box, declared linear in
        # `rhs`: transposed by the same iteration with `(M - γh J)^T` and the
        # transposed preconditioner, differentiated only through the operator.
        b = rhs.astype(factor.point.dtype)
        precondition = self._preconditioner(factor, fn, b)
        transposed = None if precondition is None else precondition.transpose()
        x = lax.custom_linear_solve(
            self._matvec(factor, fn),
            b,
            lambda mv, v: self._iterate(mv, precondition, v),
            lambda vm, v: self._iterate(vm, transposed, v),
        )
        return x.astype(rhs.dtype)

    def _matvec(self, factor: _KrylovFactor, fn: FlatFn) -> FlatFn:
        """`v -> (M - γh J) v`, `J` at the factor's point."""
        point, gamma_h, mass = factor.point, factor.gamma_h, factor.mass
        _, jvp = jax.linearize(fn, point)
        return lambda v: mass_matvec(mass, v) - gamma_h * jvp(v)

    def _preconditioner(self, factor: _KrylovFactor, fn: FlatFn, b: Array):
        """The preconditioner as a lineax operator, or `None`. It changes how fast
        the iteration converges, not where to: no derivatives through it (lineax
        takes none through `options`; neither does `custom_linear_solve` through
        its solves)."""
        structure = jax.ShapeDtypeStruct(b.shape, b.dtype)
        if isinstance(self.preconditioner, AbstractLinearSolver):
            inner, pfactor = self.preconditioner, factor.preconditioner
            apply = lambda v: inner.solve(pfactor, v, fn)  # noqa: E731
        elif self.preconditioner is not None:
            p, point, gamma_h = self.preconditioner, factor.point, factor.gamma_h
            apply = lambda v: p(v, point, gamma_h)  # noqa: E731
        else:
            return None
        return nograd(lx.FunctionLinearOperator(apply, structure))

    def _iterate(self, matvec: FlatFn, preconditioner, b: Array) -> Array:
        """GMRES (lineax's) or BiCGStab (`_bicgstab.py`); NaN where it fails."""
        if self.method == "gmres":
            return self._lineax(matvec, preconditioner, b)
        apply = None if preconditioner is None else preconditioner.mv
        return bicgstab(matvec, apply, b, self.rtol, self.atol, self.max_steps)

    def _lineax(self, matvec: FlatFn, preconditioner, b: Array) -> Array:
        structure = jax.ShapeDtypeStruct(b.shape, b.dtype)
        operator = lx.FunctionLinearOperator(matvec, structure)
        options = {}
        if preconditioner is not None:
            options["preconditioner"] = preconditioner
        method = lx.GMRES(
            self.rtol, self.atol, max_steps=self.max_steps, restart=self.restart
        )
        solution = lx.linear_solve(operator, b, method, options=options, throw=False)
        converged = solution.result == lx.RESULTS.successful
        return jnp.where(converged, solution.value, jnp.nan)


def _is_linear_solver(x) -> bool:
    return isinstance(x, AbstractLinearSolver)


def convert_linear_solvers(solver: PyTree, y0: PyTree) -> PyTree:
    """`solver` with each linear solver in it `closure_converted` for the ravelled
    state of `y0`.

    **Arguments:**

    - `solver`: a solver (any pytree).
    - `y0`: the initial state, a pytree of arrays (or `ShapeDtypeStruct`s).

    **Returns:**

    `solver`, its linear solvers replaced.
    """
    x = jax.eval_shape(lambda y: ravel_pytree(y)[0], y0)
    return jax.tree_util.tree_map(
        lambda s: s.closure_converted(x) if _is_linear_solver(s) else s,
        solver,
        is_leaf=_is_linear_solver,
    )


def has_converted_callable(solver: PyTree) -> bool:
    """Whether a linear solver in `solver` holds a user function converted (by
    `convert_linear_solvers`) for one state shape: a `KrylovLinearSolver`'s callable
    preconditioner."""
    for s in jax.tree_util.tree_leaves(solver, is_leaf=_is_linear_solver):
        if isinstance(s, KrylovLinearSolver):
            p = s.preconditioner
            if isinstance(p, Closure) or has_converted_callable(p):
                return True
    return False
