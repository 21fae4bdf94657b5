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


def row(D: Array, index: Array) -> Array:
    """`D[index]` for a traced integer `index`, 0 outside `D`'s rows."""
    out = None
    for i in range(D.shape[0]):
        take = where(index == i, D[i], 0)
        out = take if out is None else out + take
    assert out is not None
    return out


def masked_sum(D: Array, weights, mask) -> Array:
    """`Σ_i weights[i] D[i]` over the rows `i` where `mask[i]` (a list of boolean
    scalars); `weights` static numbers or None for ones."""
    out = None
    for i, keep in enumerate(mask):
        term = D[i] if weights is None else weights[i] * D[i]
        term = where(keep, term, 0)
        out = term if out is None else out + term
    assert out is not None
    return out


def _interp(rho, max_order: int) -> list[list]:
    """`R[i][j] = Π_{m=1..i} (m - 1 - ρ j) / m`, `R[0][j] = 1`, for `i, j <=
    max_order` (Shampine & Reichelt 1997, section 2.3); entries are scalars (or
    numbers for a Python `rho`)."""
    size = max_order + 1
    R = [[1.0] * size]
    for i in range(1, size):
        R.append([R[i - 1][j] * ((i - 1 - rho * j) / i) for j in range(size)])
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
    inside = [order >= i for i in range(size)]
    rows = []
    for j in range(size):
        # (R U)[i, j] = Σ_{m<=j} R[i][m] U[m][j]: within the order when j is.
        ru = [sum(R[i][m] * float(U[m, j]) for m in range(j + 1)) for i in range(size)]
        new = masked_sum(D, ru, inside)
        rows.append(where(inside[j], new, D[j]))
    return jnp.stack(rows + [D[i] for i in range(size, D.shape[0])])


def update(D: Array, d: Array, order: Array) -> Array:
    """The differences after a step of order `k` with correction `d`: `D[k+2] = d -
    D[k+1]`, `D[k+1] = d`, and `D[i] = d + Σ_{i<=j<=k} D[j]` for `i <= k`."""
    size = D.shape[0]
    tails = [d]  # tails[m] = d + Σ_{size-m <= j <= k} D[j]
    for i in reversed(range(size)):
        tails.append(tails[-1] + where(i <= order, D[i], 0))
    tails = tails[:0:-1]  # tails[i] = d + Σ_{i <= j <= k} D[j]
    prev = row(D, order + 1)
    rows = []
    for i in range(size):
        out = where(i <= order, tails[i], D[i])
        out = where(i == order + 1, d, out)
        rows.append(where(i == order + 2, d - prev, out))
    return _stack(rows)


def predict(D: Array, order: Array, gamma, alpha) -> tuple[Array, Array]:
    """`(y_pred, ψ)`: the predictor `Σ_{j<=k} D[j]` and `ψ = Σ_{1<=j<=k} γ_j D[j] /
    α_k` for order `k`, from the static coefficient tables `gamma`, `alpha`."""
    rows = range(D.shape[0])
    y_pred = masked_sum(D, None, [j <= order for j in rows])
    weights = [float(gamma[j]) if j < len(gamma) else 0.0 for j in rows]
    psi = masked_sum(D, weights, [(j >= 1) & (j <= order) for j in rows])
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


def _stack(rows: list) -> Array:
    import jax.numpy as jnp

    return jnp.stack(rows)
