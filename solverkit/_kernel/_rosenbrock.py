"""A Rosenbrock step (`Rodas5P`, `Rodas4`, `Rosenbrock23`) on the kernel's tiles.

Every trajectory is a lane of a `(rows, 128)` tile, and a state of `n` components is
`n` tiles, so the step's small dense linear algebra is unrolled entry by entry into
element-wise work on tiles (no matrix unit, no gathers, no custom calls): an `n x n`
matrix is `n²` tiles. The arithmetic is `_solver/_rosenbrock.py`'s with its default
`DenseLinearSolver` (`_linear/_linalg.py`), in the same order, so the kernel and the
`vmap` path take the same steps up to round-off (for `n <= 3` the same operations;
above, the `vmap` path inverts by LU, this by Gauss-Jordan). One step from `(t0, y0)`
of size `h`:

1. `J = ∂f/∂y` at `(t0, y0)`: column `j` is the field's JVP along the unit vector
   `e_j`, its primal output `f0` (`jacfwd`'s arithmetic, zero tangents included).
   The JVP is taken of the field's jaxpr once, before the kernel is traced
   (`_field.tangent_program`), and evaluated lane-wise by `_scalarize` like the
   field: so `_scalarize.check` names any primitive of it the kernel can't
   evaluate, and its selects (the JVP rules of `max`, `abs`, `pow` select between
   constants) are anchored to real tiles as Mosaic needs (`_tile`); `jax.jvp` of
   the tile-level evaluation would bind those rules' splat selects directly. A
   non-autonomous field (its jaxpr reads `t`) also gets `∂f/∂t`, the JVP along
   `t` (the `vmap` path's `time_derivative`); for an autonomous one it is zero and
   skipped (the `vmap` path adds a zero there: the same values).
2. `W = I - γhJ` (`iteration_matrix`), then its inverse by Gauss-Jordan elimination
   with partial pivoting (`small_inverse`: the largest `|entry|` of the pivot
   column, ties to the upper row, chosen by selects on tiles, `_tile.where`, with
   the pivot's row number carried as a float: Mosaic selects no int32 vectors).
   Each solve is `x = W⁻¹ b` refined once, `x + W⁻¹ (b - W x)` (`Inverse.solve`),
   the products as sums of element-wise products left to right (`_linalg._mul`).
3. The stages in transformed form (`_rosenbrock_tableau.py`):
   `W u_i = γh f(t0 + c_i h, y0 + Σ a_ij u_j) + Σ γ C_ij u_j + γ d_i h² ∂f/∂t`,
   `y1 = y0 + Σ m_i u_i`, the error `Σ m_err_i u_i` (`axpy`'s order: zero weights
   skipped, terms added left to right).
4. The controller is the RK kernel's (`_step.adapt`: the PID decision with the
   solver's error order, `min(order, embedded order) + 1`, set by the `Problem`).
5. The dense output is the method's own interpolant (`tab.dense`):
   `y(t0 + θh) = y0 + Σ_p θ^(p+1) Σ_i dense[i, p] u_i`; only a `SaveAt(ts)` row
   that a step crosses evaluates it.

No FSAL: the field at the step's start comes with the Jacobian, so the kernel
carries no stage between steps for this method. Up to `MAX_STATE` components (the
unrolled inverse grows like `n³` in the kernel's code). Not supported: a mass matrix
and linear solvers other than `DenseLinearSolver` (`check` says so). Reverse mode
runs the lane loop's backward pass (`_backward.directions_of` gives none here).
"""

import jax.numpy as jnp

from .._linear._linalg import gauss_jordan
from .._linear._linear_solver import DenseLinearSolver
from .._solver._rosenbrock import AbstractRosenbrock
from .._solver._rosenbrock_tableau import RosenbrockTableau
from ._scalarize import KernelUnsupported
from ._tile import where


Tiles = list  # one (rows, 128) array per state component
Matrix = list  # rows of tiles: `m[i][j]`
# The largest state the kernel steps with a Rosenbrock method: its inverse is
# unrolled into about n³ element-wise operations per step.
MAX_STATE = 8


def check(solver: AbstractRosenbrock, n: int) -> None:
    """Raise `KernelUnsupported` naming what the kernel can't do with `solver` on a
    state of `n` components."""
    name = type(solver).__name__
    if solver.mass_matrix is not None:
        raise KernelUnsupported(f"{name} with a mass matrix")
    if type(solver.linear_solver) is not DenseLinearSolver:
        raise KernelUnsupported(
            f"{name} with linear_solver={type(solver.linear_solver).__name__} (the "
            "kernel solves with DenseLinearSolver's arithmetic only)"
        )
    if solver.tableau.dense is None:
        raise KernelUnsupported(
            f"{name}, whose dense output is cubic Hermite (the kernel supports "
            "Rosenbrock methods with their own interpolant: Rodas5P, Rodas4, "
            "Rosenbrock23)"
        )
    if n > MAX_STATE:
        raise KernelUnsupported(
            f"{name} on a state of {n} components (the kernel's Rosenbrock step "
            f"takes at most {MAX_STATE}: its inverse is unrolled entry by entry)"
        )


def _linearise(field, t0, y: Tiles) -> tuple[Tiles, Matrix]:
    """`(f(t0, y), J)`, `J[i][j] = ∂f_i/∂y_j`: column `j` the field's JVP along the
    unit vector `e_j` (`field.jvp`, its tangents 0-d zeros and a one)."""
    n = len(y)
    zero, one = jnp.zeros((), y[0].dtype), jnp.ones((), y[0].dtype)
    columns, f0 = [], None
    for j in range(n):
        unit = [one if i == j else zero for i in range(n)]
        value, column = field.jvp(t0, y, jnp.zeros((), t0.dtype), unit)
        f0 = value if f0 is None else f0
        columns.append(column)
    assert f0 is not None  # (a state has a component)
    return f0, [[columns[j][i] for j in range(n)] for i in range(n)]


def _time_derivative(field, t0, y: Tiles) -> Tiles:
    """`∂f/∂t` at `(t0, y)` (`_linalg.time_derivative`): the JVP along `t`."""
    zero = jnp.zeros((), y[0].dtype)
    return field.jvp(t0, y, jnp.ones((), t0.dtype), [zero] * len(y))[1]


def _pivot(rows: Matrix, k: int) -> Matrix:
    """`_linalg._pivot` on tiles: the row of the largest `|entry 0|` among rows
    `k...` (ties: the upper) swapped into row `k`."""
    best, size = rows[k], jnp.abs(rows[k][0])
    which = jnp.full(size.shape, k, size.dtype)  # a float: no int32 selects
    for i in range(k + 1, len(rows)):
        size_i = jnp.abs(rows[i][0])
        take = size_i > size
        best = [where(take, a, b) for a, b in zip(rows[i], best)]
        size, which = where(take, size_i, size), where(take, float(i), which)
    swapped = [
        [where(which == i, a, b) for a, b in zip(rows[k], rows[i])]
        for i in range(k + 1, len(rows))
    ]
    return rows[:k] + [best] + swapped


def _inverse(matrix: Matrix) -> Matrix:
    """`_linalg.small_inverse` on tiles: Gauss-Jordan with partial pivoting."""
    n = len(matrix)
    zero, one = jnp.zeros_like(matrix[0][0]), jnp.ones_like(matrix[0][0])
    rows = [
        list(matrix[i]) + [one if i == j else zero for j in range(n)] for i in range(n)
    ]
    return gauss_jordan(rows, _pivot)


def _mul(matrix: Matrix, v: Tiles) -> Tiles:
    """`matrix @ v`, each row's products summed left to right (`_linalg._mul`)."""
    out = []
    for row in matrix:
        acc = row[0] * v[0]
        for m, x in zip(row[1:], v[1:]):
            acc = acc + m * x
        out.append(acc)
    return out


def _solve(inverse: Matrix, matrix: Matrix, b: Tiles) -> Tiles:
    """`W⁻¹ b` with one step of refinement (`Inverse.solve`)."""
    x = _mul(inverse, b)
    residual = [bi - wi for bi, wi in zip(b, _mul(matrix, x))]
    return [xi + ci for xi, ci in zip(x, _mul(inverse, residual))]


def _axpy(start: Tiles | None, pairs) -> Tiles:
    """`start + Σ c_i u_i` (`axpy` with `h=None`; `start=None`: the sum alone),
    zero weights skipped, added left to right."""
    pairs = [(float(c), u) for c, u in pairs if c != 0]
    out = []
    n = len(start) if start is not None else len(pairs[0][1])
    for j in range(n):
        acc = None if start is None else start[j]
        for c, u in pairs:
            term = c * u[j]
            acc = term if acc is None else acc + term
        out.append(acc)
    return out


def step(tab: RosenbrockTableau, field, t0, h, y):
    """One step (see the module docstring).

    **Arguments:**

    - `tab`: the method; `field`: `(t, y tiles) -> dy/dt tiles`, lane-wise, with
        `field.jvp(t, y, dt, dy) -> (f, df)` and `field.autonomous` (whether it
        ignores `t`: then no `∂f/∂t`).
    - `t0`, `h`: the step's start and size (tiles of time's dtype); `y`: the state.

    **Returns:**

    `(y1, error, us)`: the state at the end, the error estimate and the stage
    increments (the dense output's input, `dense`).
    """
    dtype = y[0].dtype
    hd = h.astype(dtype)
    f0, jac = _linearise(field, t0, y)
    f_t = None if field.autonomous else _time_derivative(field, t0, y)
    gamma_h = tab.gamma * hd
    n = len(y)
    matrix = [
        [(1.0 if i == j else 0.0) - gamma_h * jac[i][j] for j in range(n)]
        for i in range(n)
    ]
    inverse = _inverse(matrix)
    us: list[Tiles] = []
    for i in range(tab.num_stages):
        if i == 0:
            fi = f0
        else:
            yi = _axpy(y, zip(tab.a[i, :i], us))
            fi = field(t0 + float(tab.c[i]) * h, yi)
        rhs = [gamma_h * f for f in fi]
        rhs = _axpy(rhs, zip(tab.gamma * tab.C[i, :i], us))
        if tab.d[i] != 0 and f_t is not None:
            weight = (tab.gamma * float(tab.d[i])) * hd**2
            rhs = [r + weight * ft for r, ft in zip(rhs, f_t)]
        us.append(_solve(inverse, matrix, rhs))
    y1 = _axpy(y, zip(tab.m, us))
    error = _axpy(None, zip(tab.m_err, us))
    return y1, error, us


def dense(tab: RosenbrockTableau, y0: Tiles, us: list[Tiles], theta) -> Tiles:
    """The dense output at the fraction `theta` of the step:
    `y0 + Σ_p θ^(p+1) Σ_i dense[i, p] u_i` (a zero column of `dense` skipped)."""
    assert tab.dense is not None  # (checked by `check`)
    columns = [tab.dense[:, p] for p in range(tab.dense.shape[1])]
    coeffs = [_axpy(None, zip(c, us)) if c.any() else None for c in columns]
    th = theta.astype(y0[0].dtype)
    out = []
    for j in range(len(y0)):
        power, acc = th, None
        for coeff in coeffs:
            if coeff is not None:
                term = power * coeff[j]
                acc = term if acc is None else acc + term
            power = power * th
        out.append(y0[j] if acc is None else y0[j] + acc)
    return out
