"""`SparseLinearSolver`: Jacobians with a known sparsity pattern, compressed by
column colouring; `M - γh J` factorised by one of three layouts chosen from the
pattern on the host: independent dense blocks, a reordered band, or dense."""

import abc
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array

from .._closure._raising import error_if
from ._banded import band_lu, band_lu_solve, BandLU, BlockedBandLU
from ._linear_solver import (
    AbstractLinearSolver,
    check_mass,
    check_point,
    FlatFn,
    probe_failed,
)
from ._sparsity import (
    bandwidths,
    colour_columns,
    components,
    coordinates,
    reverse_cuthill_mckee,
)


# Connected components up to this size are factorised as dense blocks (batched LU);
# above this many unknowns a pattern is never factorised densely.
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


class AbstractSparseLinearSolver(AbstractLinearSolver):
    """What the three layouts of `SparseLinearSolver` share: the coloured, compressed
    Jacobian (`linearise`), the values of `M - γh J` at the nonzeros and their
    places in the factorised matrix. Build one with `SparseLinearSolver`.

    Host index arrays (static: the solver is hashable, its indices constants), in
    `indices`: the nonzeros (with the diagonal), sorted by row (`rows`, `cols`); the
    colour of each column; the index of each `(i, i)` among the nonzeros
    (`diagonal`); the flat index of each nonzero in the factorised matrix
    (`slots`); the diagonal of the padding (`pads`, blocks); the index of each
    unknown in the (padded, reordered) vector (`places`), and its inverse
    (`spread`).
    """

    n: eqx.AbstractVar[int]
    n_colours: eqx.AbstractVar[int]
    size: eqx.AbstractVar[int]  # length of the (padded, reordered) vector
    check: eqx.AbstractVar[bool]
    indices: eqx.AbstractVar[_HostArrays]

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """The layout: `"blocks"`, `"banded"` or `"dense"`."""

    @property
    def rows(self) -> np.ndarray:
        return self.indices["rows"]

    @property
    def cols(self) -> np.ndarray:
        return self.indices["cols"]

    @property
    def colour(self) -> np.ndarray:
        return self.indices["colour"]

    def _product(self, values: Array, v: Array) -> Array:
        return jax.ops.segment_sum(
            values * v[self.cols], self.rows, self.n, indices_are_sorted=True
        )

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Array]:
        check_point(fn, x, "SparseLinearSolver")
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
            failed = probe_failed(
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

    def _matrix_values(self, jac: Array, gamma_h: Array, mass: Array | None):
        """`M - γh J` at the nonzeros (checking that `M` has none outside)."""
        check_mass(mass, self.n, "SparseLinearSolver")
        values = -jnp.asarray(gamma_h, jac.dtype) * jac
        if mass is None:
            return values.at[self.indices["diagonal"]].add(1)
        if mass.ndim == 1:
            return values.at[self.indices["diagonal"]].add(mass.astype(jac.dtype))
        inside = mass[self.rows, self.cols].astype(jac.dtype)
        outside = jnp.any(mass.at[self.rows, self.cols].set(0) != 0)
        inside = error_if(
            inside,
            outside,
            0,
            ["SparseLinearSolver: the mass matrix has entries outside the pattern"],
        )
        return values + inside

    def _scatter(self, values: Array, length: int) -> Array:
        """The values at their slots of a flat zero buffer of `length`."""
        zeros = jnp.zeros(length, values.dtype)
        return zeros.at[self.indices["slots"]].add(values)

    def _spread(self, rhs: Array, dtype) -> Array:
        """`rhs` moved to the (padded, reordered) places of the factorised matrix,
        zeros elsewhere: one gather (transposable, unlike a scatter of `set`, so
        that reverse mode through a tangent solve, BDF's implicit derivative or a
        Krylov preconditioner, works)."""
        padded = jnp.concatenate([rhs.astype(dtype), jnp.zeros(1, dtype)])
        return padded[self.indices["spread"]]

    def _gather(self, x: Array, singular: Array, dtype) -> Array:
        """The solution at the unknowns' places; NaN if `singular`."""
        return jnp.where(singular, jnp.nan, x[self.indices["places"]]).astype(dtype)


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


class _BlockSparse(AbstractSparseLinearSolver):
    """Independent blocks of at most `_BLOCK_MAX` unknowns: batched dense LU."""

    n: int = eqx.field(static=True)
    n_colours: int = eqx.field(static=True)
    size: int = eqx.field(static=True)
    check: bool = eqx.field(static=True)
    indices: _HostArrays = eqx.field(static=True)
    block: int = eqx.field(static=True)  # the block size

    @property
    def kind(self) -> str:
        return "blocks"

    def factorise(self, jac: Array, gamma_h: Array, mass: Array | None):
        values = self._matrix_values(jac, gamma_h, mass)
        buffer = self._scatter(values, self.size * self.block)
        matrix = buffer.at[self.indices["pads"]].set(1)
        b = self.block
        lu, _, permutation = jax.lax.linalg.lu(matrix.reshape(-1, b, b))
        return lu, permutation

    def solve(self, factor, rhs: Array, fn: FlatFn) -> Array:
        del fn
        lu, permutation = factor
        b = self._spread(rhs, lu.dtype).reshape(-1, self.block)
        x = _blocks_lu_solve(lu, permutation, b).reshape(-1)
        singular = jnp.any(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)
        return self._gather(x, singular, rhs.dtype)


class _BandSparse(AbstractSparseLinearSolver):
    """Reordered (reverse Cuthill–McKee) to a band: band LU."""

    n: int = eqx.field(static=True)
    n_colours: int = eqx.field(static=True)
    size: int = eqx.field(static=True)
    check: bool = eqx.field(static=True)
    indices: _HostArrays = eqx.field(static=True)
    lower: int = eqx.field(static=True)  # the bandwidths after reordering
    width: int = eqx.field(static=True)

    @property
    def kind(self) -> str:
        return "banded"

    def factorise(
        self, jac: Array, gamma_h: Array, mass: Array | None
    ) -> BandLU | BlockedBandLU:
        values = self._matrix_values(jac, gamma_h, mass)
        buffer = self._scatter(values, self.n * self.width)
        return band_lu(buffer.reshape(self.n, self.width), self.lower)

    def solve(self, factor: BandLU | BlockedBandLU, rhs: Array, fn: FlatFn) -> Array:
        del fn
        x = band_lu_solve(factor, self._spread(rhs, factor.dtype))  # NaN if singular
        return x[self.indices["places"]].astype(rhs.dtype)


class _DenseSparse(AbstractSparseLinearSolver):
    """A pattern with no small bandwidth, up to `_DENSE_MAX` unknowns: dense LU."""

    n: int = eqx.field(static=True)
    n_colours: int = eqx.field(static=True)
    size: int = eqx.field(static=True)
    check: bool = eqx.field(static=True)
    indices: _HostArrays = eqx.field(static=True)

    @property
    def kind(self) -> str:
        return "dense"

    def factorise(self, jac: Array, gamma_h: Array, mass: Array | None):
        values = self._matrix_values(jac, gamma_h, mass)
        matrix = self._scatter(values, self.n * self.n).reshape(self.n, self.n)
        lu, pivots, _ = jax.lax.linalg.lu(matrix)
        return lu, pivots

    def solve(self, factor, rhs: Array, fn: FlatFn) -> Array:
        del fn
        lu, pivots = factor
        x = jsl.lu_solve((lu, pivots), self._spread(rhs, lu.dtype))
        singular = jnp.any(jnp.diagonal(lu) == 0)
        return self._gather(x, singular, rhs.dtype)


def _block_layout(n: int, rows, cols, label, sizes) -> dict[str, Any]:
    """Places and slots of independent blocks (the connected components), each
    padded to the largest with identity rows."""
    b = int(sizes.max())
    order = np.argsort(label, kind="stable")
    local = np.empty(n, np.int64)
    local[order] = np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    places = label * b + local
    size = len(sizes) * b
    unused = np.setdiff1d(np.arange(size), places)
    return dict(
        places=places,
        slots=label[rows] * b * b + local[rows] * b + local[cols],
        pads=(unused // b) * b * b + (unused % b) * (b + 1),
        size=size,
        block=b,
    )


def _band_or_dense_layout(n: int, rows, cols) -> dict[str, Any]:
    """Places and slots after reverse Cuthill–McKee: banded if the bandwidth is at
    most half of `n` (always above `_DENSE_MAX` unknowns), else dense."""
    order = reverse_cuthill_mckee(n, rows, cols)
    places = np.empty(n, np.int64)
    places[order] = np.arange(n)
    lower, upper = bandwidths(rows, cols, places)
    width = lower + upper + 1
    if 2 * width > n and n <= _DENSE_MAX:
        slots = rows.astype(np.int64) * n + cols
        return dict(places=np.arange(n), slots=slots, size=n)
    if 2 * width > n:
        raise ValueError(
            f"SparseLinearSolver: {n} unknowns whose pattern has bandwidth {width} "
            "even after reordering: too large for a direct solve; use "
            "KrylovLinearSolver"
        )
    slots = places[rows] * width + (places[cols] - places[rows] + lower)
    return dict(places=places, slots=slots, size=n, lower=lower, width=width)


def SparseLinearSolver(pattern, check: bool = True) -> AbstractSparseLinearSolver:
    """Jacobians with a known sparsity pattern (a linear solver for the stiff
    solvers, built from the pattern on the host).

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

    **Returns:**

    A linear solver (an `AbstractSparseLinearSolver` of the layout chosen; its
    `kind` says which: `"blocks"`, `"banded"` or `"dense"`).

    A mass matrix may be `None`, a vector, or a dense matrix with no entries outside
    the pattern (checked at run time). An exactly singular `M - γh J` gives a NaN
    solution (a stiff solver rejects the step); no error is raised.
    """
    n, rows, cols = coordinates(pattern)
    colour = colour_columns(n, rows, cols)
    label = components(n, rows, cols)
    sizes = np.bincount(label)
    if len(sizes) > 1 and sizes.max() <= _BLOCK_MAX:
        layout = _block_layout(n, rows, cols, label, sizes)
    else:
        layout = _band_or_dense_layout(n, rows, cols)
    places, size = layout.pop("places"), layout.pop("size")
    # The inverse of `places`: the unknown at each place, `n` (a zero) where none.
    spread = np.full(size, n, np.int64)
    spread[places] = np.arange(n)
    indices = _HostArrays(
        rows=rows,
        cols=cols,
        colour=colour,
        diagonal=np.flatnonzero(rows == cols),
        slots=layout.pop("slots"),
        pads=layout.pop("pads", np.zeros(0, np.int64)),
        places=places,
        spread=spread,
    )
    fields = (n, int(colour.max()) + 1, size, check, indices)
    if "block" in layout:
        return _BlockSparse(*fields, block=layout["block"])
    if "lower" in layout:
        return _BandSparse(*fields, lower=layout["lower"], width=layout["width"])
    return _DenseSparse(*fields)
