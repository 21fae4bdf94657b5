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


_MIN_BLOCK = 16
# For bandwidths `_BLOCKED_FROM ... _BLOCKED_TO`, `band_lu` factorises by panels
# (measured on a CPU: at bandwidth 64 about as fast as by rows, its solves 1.7x
# faster; at 128 both 1.0-1.2x faster; at 256 the solves 0.6x as fast); otherwise by
# rows.
_BLOCKED_FROM = 32
_BLOCKED_TO = 128


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

    @property
    def dtype(self):
        return self.u_rows.dtype

    def singular(self) -> Bool[Array, ""]:
        """Whether a pivot vanished (`A` exactly singular)."""
        return jnp.any(self.u_rows[:, 0] == 0)


def _swap(k: Array, size: int) -> Array:
    """The index vector that interchanges entries `0` and `k` of a vector of `size`."""
    index = jnp.arange(size)
    return jnp.where(index == 0, k, jnp.where(index == k, 0, index))


def _row_band_lu(bands: Float[Array, "n w"], lower: int) -> BandLU:
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


def _row_band_lu_solve(lu: BandLU, rhs: Float[Array, " n"]) -> Float[Array, " n"]:
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


class BlockedBandLU(eqx.Module):
    """`P A = L U` of a banded `A` (padded to `nblocks` blocks of `nb` rows), by
    panels of `nb` columns.

    Panel `k` holds the factors of the window of block rows `k, k + 1` over block
    columns `k, k + 1, k + 2`:

    - `panels[k]`: `(2 nb, nb)`, the LU of the panel (block column `k`) after the
      window's rows were permuted by `perms[k]`: `L₁₁` (unit, strictly lower) and
      `U₁₁` (upper) in its top `nb` rows, `L₂₁` in its bottom `nb` rows;
    - `u12[k]`: `(nb, 2 nb)`, `U` in block row `k`, block columns `k + 1, k + 2`;
    - `perms[k]`: `(2 nb,)`, the row permutation of the window.
    """

    panels: Float[Array, "blocks nb2 nb"]
    u12: Float[Array, "blocks nb nb2"]
    perms: Int[Array, "blocks nb2"]
    l11_inv: Float[Array, "blocks nb nb"]
    u11_inv: Float[Array, "blocks nb nb"]
    n: int = eqx.field(static=True)

    @property
    def dtype(self):
        return self.panels.dtype

    def singular(self) -> Bool[Array, ""]:
        """Whether a pivot vanished (`A` exactly singular)."""
        nb = self.panels.shape[-1]
        diagonal = jnp.diagonal(self.panels[..., :nb, :], axis1=-2, axis2=-1)
        return jnp.any(diagonal == 0)


def _triangular_inverse(t: Array, lower: bool, unit: bool) -> Array:
    """The inverse of the lower (upper) triangle of `t` `(nb, nb)`, `nb` a power of
    two, by doubling: the inverses of the diagonal blocks of size `s` give those of
    size `2s`, `[[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]]` (and transposed),
    all matrix products (XLA's CPU triangular solve is slow for small blocks). A
    zero diagonal entry is inverted as one (`BlockedBandLU.singular` reports it)."""
    nb = t.shape[-1]
    if unit:
        inverse = jnp.ones((nb, 1, 1), t.dtype)
    else:
        d = jnp.diagonal(t)
        inverse = (1 / jnp.where(d == 0, jnp.ones_like(d), d))[:, None, None]
    s = 1
    while s < nb:
        m = nb // (2 * s)
        pairs = inverse.reshape(m, 2, s, s)
        a, d = pairs[:, 0], pairs[:, 1]
        diagonal = jnp.arange(m)
        blocks = t.reshape(m, 2 * s, m, 2 * s)[diagonal, :, diagonal, :]
        zero = jnp.zeros((m, s, s), t.dtype)
        if lower:
            off = -d @ blocks[:, s:, :s] @ a
            top, bottom = [a, zero], [off, d]
        else:
            off = -a @ blocks[:, :s, s:] @ d
            top, bottom = [a, off], [zero, d]
        inverse = jnp.concatenate(
            [jnp.concatenate(top, axis=2), jnp.concatenate(bottom, axis=2)], axis=1
        )
        s *= 2
    return inverse[0]


def _block_size(lower: int, upper: int) -> int:
    """The panel width of `band_lu`: at least both bandwidths (so that each block row
    couples only to its neighbours), and at least `_MIN_BLOCK` (so that narrow bands
    take a few larger steps rather than many tiny ones)."""
    return max(_MIN_BLOCK, 1 << (max(lower, upper, 1) - 1).bit_length())


def _block_rows(bands: Array, lower: int, nb: int, count: int) -> Array:
    """`count` dense block rows `(count, nb, 3 nb)`: block row `b` over the columns
    `(b - 1) nb ... (b + 2) nb - 1`; rows `n ... ` up to a whole block are identity
    rows, the rest zero."""
    n, width = bands.shape
    b = jnp.arange(count)[:, None, None]
    r = jnp.arange(nb)[None, :, None]
    c = jnp.arange(3 * nb)[None, None, :]
    row = b * nb + r
    col = row - lower + (c - r - nb + lower)  # = b nb + c - nb
    slot = c - r - nb + lower
    inside = (slot >= 0) & (slot < width) & (row < n) & (col >= 0) & (col < n)
    values = bands[jnp.clip(row, 0, n - 1), jnp.clip(slot, 0, width - 1)]
    blocks = jnp.where(inside, values, 0)
    padding = (row >= n) & (row < -(-n // nb) * nb) & (col == row)
    return jnp.where(padding, jnp.ones_like(blocks), blocks)


def _blocked_band_lu(bands: Float[Array, "n w"], lower: int) -> "BlockedBandLU":
    """LU factorisation with partial pivoting of `A` in band storage, blocked (for
    wide bands; `band_lu` chooses).

    With panels of `nb >= max(lower, upper)` columns, `A` is block tridiagonal, and
    the candidate pivots of block column `k` lie in block rows `k, k + 1`; with the
    row interchanges `U` reaches block column `k + 2` at most (its upper bandwidth
    grows to `lower + upper`, as in LAPACK's `gbtrf`). One step per panel (a
    `lax.scan` over `⌈n / nb⌉` steps): a dense LU with partial pivoting of the
    `2 nb x nb` panel, a triangular solve for `U₁₂` and a dense update of block row
    `k + 1`, all level-3 operations. The pivots are those of partial pivoting on the
    whole matrix.

    **Arguments:**

    - `bands`: `(n, lower + upper + 1)`, as in the module docstring.
    - `lower`: the number of sub-diagonals.

    **Returns:**

    A `BlockedBandLU`; see `band_lu_solve`. An exactly singular `A` gives a zero pivot
    (`BlockedBandLU.singular`).
    """
    n, width = bands.shape
    nb = _block_size(lower, width - 1 - lower)
    nblocks = -(-n // nb)
    rows = _block_rows(bands, lower, nb, nblocks + 2)
    zeros = jnp.zeros((nb, nb), bands.dtype)
    window0 = jnp.concatenate(
        [jnp.concatenate([rows[0, :, nb:], zeros], axis=1), rows[1]]
    )

    def step(window, new_rows):
        panel, _, perm = jax.lax.linalg.lu(window[:, :nb])
        window = window[perm]
        l11_inv = _triangular_inverse(panel[:nb], lower=True, unit=True)
        u11_inv = _triangular_inverse(panel[:nb], lower=False, unit=False)
        u12 = l11_inv @ window[:nb, nb:]
        schur = window[nb:, nb:] - panel[nb:] @ u12
        top = jnp.concatenate([schur, zeros], axis=1)
        out = (panel, u12, perm.astype(jnp.int32), l11_inv, u11_inv)
        return jnp.concatenate([top, new_rows]), out

    _, factors = jax.lax.scan(step, window0, rows[2:])
    return BlockedBandLU(*factors, n)


def _blocked_band_lu_solve(lu: BlockedBandLU, rhs: Array) -> Array:
    """`A^{-1} rhs` from `A`'s `BlockedBandLU`: the row interchanges and `L`
    forwards, then `U` backwards, each one `lax.scan` over the blocks, with the
    inverses of the `nb x nb` diagonal blocks.

    **Arguments:**

    - `lu`: from `_blocked_band_lu`.
    - `rhs`: `(n,)`.

    **Returns:**

    The solution, `(n,)`; NaN everywhere if `A` is exactly singular.
    """
    nblocks, _, nb = lu.panels.shape
    b = rhs.astype(lu.dtype)
    b = jnp.concatenate([b, jnp.zeros((nblocks + 2) * nb - lu.n, b.dtype)])
    b = b.reshape(nblocks + 2, nb)

    def forward(window, inputs):
        panel, perm, l11_inv, new = inputs
        window = window[perm]
        y = l11_inv @ window[:nb]
        return jnp.concatenate([window[nb:] - panel[nb:] @ y, new]), y

    _, y = jax.lax.scan(
        forward, jnp.concatenate([b[0], b[1]]), (lu.panels, lu.perms, lu.l11_inv, b[2:])
    )

    def backward(after, inputs):
        u11_inv, u12, y_k = inputs
        x = u11_inv @ (y_k - u12 @ after)
        return jnp.concatenate([x, after[:nb]]), x

    _, x = jax.lax.scan(
        backward,
        jnp.zeros(2 * nb, b.dtype),
        (lu.u11_inv, lu.u12, y),
        reverse=True,
    )
    return jnp.where(lu.singular(), jnp.nan, x.reshape(-1)[: lu.n])


def band_lu(bands: Float[Array, "n w"], lower: int) -> "BandLU | BlockedBandLU":
    """LU factorisation with partial pivoting of `A` in band storage: by rows
    (`_row_band_lu`, one `lax.scan` step per row) for narrow bands, by panels of
    columns (`_blocked_band_lu`) for bandwidths from 32 to 128.

    **Arguments:**

    - `bands`: `(n, lower + upper + 1)`, as in the module docstring.
    - `lower`: the number of sub-diagonals.

    **Returns:**

    A `BandLU` or `BlockedBandLU`, for `band_lu_solve`. An exactly singular `A`
    gives a zero pivot (its `singular()`).
    """
    if _BLOCKED_FROM <= max(lower, bands.shape[1] - 1 - lower) <= _BLOCKED_TO:
        return _blocked_band_lu(bands, lower)
    return _row_band_lu(bands, lower)


def band_lu_solve(
    lu: "BandLU | BlockedBandLU", rhs: Float[Array, " n"]
) -> Float[Array, " n"]:
    """`A^{-1} rhs` from `band_lu(A)`.

    **Arguments:**

    - `lu`: from `band_lu`.
    - `rhs`: `(n,)`.

    **Returns:**

    The solution, `(n,)`; NaN everywhere if `A` is exactly singular.
    """
    if isinstance(lu, BlockedBandLU):
        return _blocked_band_lu_solve(lu, rhs)
    return _row_band_lu_solve(lu, rhs)
