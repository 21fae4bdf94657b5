"""Banded matrices: row-wise band storage, products, and an LU factorisation with
partial pivoting that works on the band alone (O(n·bw²) work, O(n·bw) memory).

A matrix `A` (n, n) with `lower` sub-diagonals and `upper` super-diagonals is stored
as `bands` (n, lower + upper + 1), row by row: `bands[i, k] = A[i, i - lower + k]`,
zero where that column lies outside the matrix.

Gaussian elimination with partial pivoting keeps `L` within `lower` sub-diagonals and
lets `U` grow to `lower + upper` super-diagonals (the row interchanges bring rows with
up to `lower` more entries to the right of the diagonal).

??? cite "Reference"

    G. H. Golub, C. F. Van Loan, *Matrix Computations*, 4th ed., Johns Hopkins
    University Press, 2013: §4.3 (band Gaussian elimination; with partial pivoting,
    the upper bandwidth of `U` is at most `lower + upper`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def _columns(n: int, lower: int, width: int) -> tuple[Array, Array]:
    """The column of each band slot `(i, k)`, `i - lower + k`, and whether it lies
    inside the matrix."""
    col = jnp.arange(n)[:, None] - lower + jnp.arange(width)[None, :]
    return col, (col >= 0) & (col < n)


def band_matvec(bands: Float[Array, "n w"], lower: int, x: Float[Array, " n"]):
    """`A x` for `A` in band storage with `lower` sub-diagonals.

    **Arguments:**

    - `bands`: `(n, lower + upper + 1)`, as in the module docstring.
    - `lower`: the number of sub-diagonals.
    - `x`: the vector, `(n,)`.

    **Returns:**

    `A x`, `(n,)`.
    """
    n, width = bands.shape
    upper = width - 1 - lower
    padded = jnp.concatenate([jnp.zeros(lower, x.dtype), x, jnp.zeros(upper, x.dtype)])
    index = jnp.arange(n)[:, None] + jnp.arange(width)[None, :]
    return jnp.sum(bands * padded[index], axis=1)


def dense_to_bands(matrix: Float[Array, "n n"], lower: int, upper: int):
    """The bands of a dense `(n, n)` matrix (its entries outside them are dropped)."""
    n = matrix.shape[0]
    col, inside = _columns(n, lower, lower + upper + 1)
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], col.shape)
    return jnp.where(inside, matrix[rows, jnp.clip(col, 0, n - 1)], 0)


def bands_to_dense(bands: Float[Array, "n w"], lower: int) -> Float[Array, "n n"]:
    """The dense `(n, n)` matrix of `bands` (for tests and small systems)."""
    n, width = bands.shape
    col, inside = _columns(n, lower, width)
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], col.shape)
    dense = jnp.zeros((n, n + width), bands.dtype)
    # Slots outside the matrix go to the spare columns `n ...`, then are cut off.
    return dense.at[rows, jnp.where(inside, col, n)].add(bands)[:, :n]


class BandLU(eqx.Module):
    """`P A = L U` of a banded `A`, by rows of `U` and columns of `L`.

    - `u_rows[j]`: `U[j, j ... j + lower + upper]`;
    - `multipliers[j]`: `L[j + 1 ... j + lower, j]` (the unit diagonal implied);
    - `pivots[j]`: the row interchanged with row `j` at step `j`, as an offset
      `0 ... lower` from `j`.
    """

    u_rows: Float[Array, "n w"]
    multipliers: Float[Array, "n lower"]
    pivots: Int[Array, " n"]

    def singular(self) -> Bool[Array, ""]:
        """Whether a pivot vanished (`A` exactly singular)."""
        return jnp.any(self.u_rows[:, 0] == 0)


def _swap(k: Array, size: int) -> Array:
    """The index vector that interchanges entries `0` and `k` of a vector of `size`."""
    index = jnp.arange(size)
    return jnp.where(index == 0, k, jnp.where(index == k, 0, index))


def band_lu(bands: Float[Array, "n w"], lower: int) -> BandLU:
    """LU factorisation with partial pivoting of `A` in band storage.

    One step per column (a `lax.scan`): the step holds the `lower + 1` rows that may
    still hold a nonzero in the current column, over the `lower + upper + 1` columns
    from it, picks the largest entry of the column as pivot, and eliminates below it.

    **Arguments:**

    - `bands`: `(n, lower + upper + 1)`, as in the module docstring.
    - `lower`: the number of sub-diagonals.

    **Returns:**

    A `BandLU`; see `band_lu_solve`. An exactly singular `A` gives a zero pivot
    (`BandLU.singular`) and no division by it.
    """
    n, width = bands.shape
    # The window of step j: rows j ... j+lower, columns j ... j+lower+upper. Row i's
    # band covers columns i-lower ... i+upper, so a row enters the window (at step
    # i - lower - 1 + 1) with exactly its whole band.
    padded = jnp.concatenate([bands, jnp.zeros((lower + 1, width), bands.dtype)])
    r = jnp.arange(lower + 1)[:, None]
    slot = jnp.arange(width)[None, :] - r + lower  # band slot of column c in row r
    window0 = jnp.where(
        (slot >= 0) & (slot < width) & (r < n),
        padded[jnp.broadcast_to(r, slot.shape), jnp.clip(slot, 0, width - 1)],
        0,
    )
    incoming = padded[lower + 1 : lower + 1 + n]

    def step(window, new_row):
        k = jnp.argmax(jnp.abs(window[:, 0])).astype(jnp.int32)
        window = window[_swap(k, lower + 1)]
        pivot_row = window[0]
        pivot = pivot_row[0]
        safe = jnp.where(pivot == 0, jnp.ones_like(pivot), pivot)
        m = window[1:, 0] / safe
        rest = window[1:, 1:] - m[:, None] * pivot_row[None, 1:]
        rest = jnp.concatenate([rest, jnp.zeros((lower, 1), rest.dtype)], axis=1)
        return jnp.concatenate([rest, new_row[None]]), (pivot_row, m, k)

    _, (u_rows, multipliers, pivots) = jax.lax.scan(step, window0, incoming)
    return BandLU(u_rows, multipliers, pivots)


def band_lu_solve(lu: BandLU, rhs: Float[Array, " n"]) -> Float[Array, " n"]:
    """`A^{-1} rhs` from `A`'s `BandLU`: the row interchanges and `L` forwards, then
    `U` backwards, each one `lax.scan` over a window of the bandwidth.

    **Arguments:**

    - `lu`: from `band_lu`.
    - `rhs`: `(n,)`.

    **Returns:**

    The solution, `(n,)`; NaN everywhere if `A` is exactly singular.
    """
    n, width = lu.u_rows.shape
    lower = lu.multipliers.shape[1]
    upper_u = width - 1
    b = rhs.astype(lu.u_rows.dtype)
    padded = jnp.concatenate([b, jnp.zeros(lower + 1, b.dtype)])

    def forward(window, inputs):
        m, k, new = inputs
        window = window[_swap(k, lower + 1)]
        y = window[0]
        return jnp.concatenate([window[1:] - m * y, new[None]]), y

    _, y = jax.lax.scan(
        forward,
        padded[: lower + 1],
        (lu.multipliers, lu.pivots, padded[lower + 1 : lower + 1 + n]),
    )

    def backward(window, inputs):
        u_row, y_j = inputs
        diagonal = u_row[0]
        safe = jnp.where(diagonal == 0, jnp.ones_like(diagonal), diagonal)
        x_j = (y_j - jnp.sum(u_row[1:] * window)) / safe
        return jnp.concatenate([x_j[None], window])[:upper_u], x_j

    _, x = jax.lax.scan(
        backward, jnp.zeros(upper_u, b.dtype), (lu.u_rows, y), reverse=True
    )
    return jnp.where(lu.singular(), jnp.nan, x)
