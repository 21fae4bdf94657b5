"""`BDF`'s difference array, row by row: the rescaling to a new step, the update
after a step, the predictor, and lookups in the small coefficient tables by the
(traced) order.

Everything here is unrolled over the rows of the `(max_order + 3, n)` difference
array into element-wise arithmetic and selects on rows `(n,)` and scalars. Under
`vmap` over an ensemble of trajectories that is wide element-wise work: no batched
dot product of `(6, 6)` matrices, no cumulative product or sum along a short axis,
no gather by a batched index. On a TPU each of those runs on tiles padded from a
few elements to `(8, 128)`, one trajectory at a time (the vmapped BDF on 16,384
Van der Pol trajectories did not finish in 40 s, where Rosenbrock steps written
element-wise took 0.08 s); on the CPU they are small calls with fixed costs.
"""

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._select import where


def pick(table, index: Array, dtype) -> Array:
    """`table[index]` for a short static table and a traced integer `index` (scalar
    per trajectory), as a chain of selects; 0 outside the table.

    **Arguments:**

    - `table`: a sequence of Python or NumPy numbers.
    - `index`: an integer scalar.
    - `dtype`: the result's dtype.

    **Returns:** a scalar of `dtype`.
    """
    out = jnp.zeros((), dtype)
    for i, value in enumerate(np.asarray(table)):
        out = where(index == i, jnp.asarray(value, dtype), out)
    return out


def _unstack(D: Array) -> tuple[list[Array], Array]:
    """`(rows, zero)`: the rows of `D` (one `unstack`, reverse mode's cotangents
    stacked back in one equation; a slice per use, each transposed to a padded
    copy of `D`, made this module most of BDF's gradient program) and a row of
    zeros."""
    rows = list(jnp.unstack(D))
    return rows, jnp.zeros_like(rows[0])


def row(D: Array, index: Array) -> Array:
    """`D[index]` for a traced integer `index`, 0 outside `D`'s rows."""
    rows, zero = _unstack(D)
    out = None
    for i, r in enumerate(rows):
        take = where(index == i, r, zero)
        out = take if out is None else out + take
    assert out is not None
    return out


def _static(x) -> bool:
    return isinstance(x, (int, float))


def _sum(terms: list) -> Any:
    """`Σ w x` over `(w, x)` pairs (in order), each a static number or an array: a
    term with a static 0 is left out and a static 1 not multiplied (either is exact,
    up to the sign of a zero sum); 0.0 if none is left."""
    out = None
    for w, x in terms:
        if (_static(w) and w == 0) or (_static(x) and x == 0):
            continue
        term = x if _static(w) and w == 1 else w * x
        out = term if out is None else out + term
    return 0.0 if out is None else out


def masked_sum(D: Array, weights, mask) -> Array:
    """`Σ_i weights[i] D[i]` over the rows `i` where `mask[i]` (a list of boolean
    scalars, or Python booleans); `weights` static numbers or None for ones."""
    rows, zero = _unstack(D)
    kept = [r if keep is True else where(keep, r, zero) for r, keep in zip(rows, mask)]
    weights = [1] * len(kept) if weights is None else weights
    return _sum(
        [(w, r) for w, r, keep in zip(weights, kept, mask) if keep is not False]
    )


def _interp(rho, max_order: int) -> list[list]:
    """`R[i][j] = Π_{m=1..i} (m - 1 - ρ j) / m`, `R[0][j] = 1`, for `i, j <=
    max_order` (Shampine & Reichelt 1997, section 2.3); entries are scalars (or
    numbers for a Python `rho`). `R[i][0] = 0` for `i >= 1`."""
    size = max_order + 1
    R = [[1.0] * size]
    rho_j = [0.0] + [rho * j for j in range(1, size)]
    for i in range(1, size):
        new = [0.0]
        for j in range(1, size):
            factor = (i - 1) - rho_j[j]
            factor = factor if i == 1 else factor / i
            new.append(factor if i == 1 else R[i - 1][j] * factor)
        R.append(new)
    return R


def rescale(D: Array, order: Array, r: Array, max_order: int) -> Array:
    """The differences `D[0..order]` for a step `r` times the one they were made for:
    `D[j] <- Σ_{i<=order} (R(r) U)[i, j] D[i]` for `j <= order` (`U = R(1)`, upper
    triangular); the rows above `order` unchanged.

    **Arguments:**

    - `D`: `(max_order + 3, n)` the differences.
    - `order`: the current order (integer scalar).
    - `r`: the ratio of the new step to the old one (scalar of `D`'s dtype).
    - `max_order`: the solver's highest order (static).

    **Returns:** the rescaled differences, like `D`.
    """
    size = max_order + 1
    R = _interp(r.astype(D.dtype), max_order)
    U = np.asarray(_interp(1.0, max_order))  # U[m][j] = 0 for m > j
    rows, zero = _unstack(D)
    inside = [order >= i for i in range(size)]
    kept = [rows[0]] + [where(inside[i], rows[i], zero) for i in range(1, size)]
    new_rows = []
    for j in range(size):
        # (R U)[i, j] = Σ_{m<=j} R[i][m] U[m][j]: within the order when j is.
        ru = [
            _sum([(float(U[m, j]), R[i][m]) for m in range(j + 1)]) for i in range(size)
        ]
        new = _sum(list(zip(ru, kept)))
        new_rows.append(where(inside[j], new, rows[j]))
    return jnp.stack(new_rows + rows[size:])


def update(D: Array, d: Array, order: Array) -> Array:
    """The differences after a step of order `k` with correction `d`: `D[k+2] = d -
    D[k+1]`, `D[k+1] = d`, and `D[i] = d + Σ_{i<=j<=k} D[j]` for `i <= k`."""
    size = D.shape[0]
    rows, zero = _unstack(D)
    tails = [d]  # tails[m] = d + Σ_{size-m <= j <= k} D[j]
    for i in reversed(range(size)):
        tails.append(tails[-1] + where(i <= order, rows[i], zero))
    tails = tails[:0:-1]  # tails[i] = d + Σ_{i <= j <= k} D[j]
    prev = row(D, order + 1)
    out_rows = []
    for i in range(size):
        out = where(i <= order, tails[i], rows[i])
        out = where(i == order + 1, d, out)
        out_rows.append(where(i == order + 2, d - prev, out))
    return jnp.stack(out_rows)


def predict(D: Array, order: Array, gamma, alpha) -> tuple[Array, Array]:
    """`(y_pred, ψ)`: the predictor `Σ_{j<=k} D[j]` and `ψ = Σ_{1<=j<=k} γ_j D[j] /
    α_k` for order `k`, from the static coefficient tables `gamma`, `alpha`."""
    rows, zero = _unstack(D)
    kept = [r if j == 0 else where(j <= order, r, zero) for j, r in enumerate(rows)]
    y_pred = _sum([(1, r) for r in kept])
    weights = [float(gamma[j]) if j < len(gamma) else 0.0 for j in range(len(rows))]
    psi = _sum(list(zip(weights, kept)))
    return y_pred, psi / pick(alpha, order, D.dtype)


def interpolation_weights(x: Array, order: Array, count: int) -> list:
    """`Π_{i<j} (x + i)/(i + 1)` for `j = 1..count`, 0 where `j > order`: the
    weights of the differences `D[1..count]` in the interpolating polynomial at
    `x = (t - t1) / h`."""
    weights, w = [], None
    for i in range(count):
        factor = (x + i) / (i + 1)
        w = factor if w is None else w * factor
        weights.append(where(i + 1 <= order, w, 0))
    return weights
