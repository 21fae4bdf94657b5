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
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._banded import band_lu, band_lu_solve, band_matvec, BandLU, dense_to_bands
from ._linalg import Inverse, lu_factorisation, value_and_jacobian
from ._unvmap import error_if


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


class DenseLinearSolver(AbstractLinearSolver):
    """Dense Jacobians (one forward-mode pass of `n` columns) and dense LU
    factorisations; for up to 32 unknowns, an explicit inverse with one step of
    iterative refinement per solve. The default, and the right choice up to a few
    hundred unknowns.
    """

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Array]:
        value, jac, _ = value_and_jacobian(lambda _, y: fn(y), jnp.zeros(()), x)
        return value, jac

    def factorise(self, jac: Array, gamma_h: Array, mass: Array | None):
        matrix = iteration_matrix(jac, gamma_h, mass)
        if matrix.shape[0] <= _INVERSE_MAX:
            return Inverse(jnp.linalg.inv(matrix), matrix)
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

    def factorise(self, jac: Array, gamma_h: Array, mass: Array | None) -> BandLU:
        n = jac.shape[0]
        _check_mass(mass, n, "BandedLinearSolver")
        matrix = -jnp.asarray(gamma_h, jac.dtype) * jac
        if mass is None:
            matrix = matrix.at[:, self.lower].add(1)
        elif mass.ndim == 1:
            matrix = matrix.at[:, self.lower].add(mass.astype(jac.dtype))
        else:
            banded = dense_to_bands(mass.astype(jac.dtype), self.lower, self.upper)
            outside = jnp.sum(jnp.abs(mass)) > jnp.sum(jnp.abs(banded))
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

    def solve(self, factor: BandLU, rhs: Array, fn: FlatFn) -> Array:
        del fn
        return band_lu_solve(factor, rhs).astype(rhs.dtype)
