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
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from ._linalg import Inverse, inverse, lu_factorisation, value_and_jacobian


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

    def holds_converted_callable(self) -> bool:
        """Whether this solver holds a user function closure-converted (by
        `closure_converted`) for one state shape, which another state (a
        `BacksolveAdjoint`'s backward one) cannot use. By default `False`.

        **Returns:**

        A Python bool.
        """
        return False


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
            # A refined solve is differentiated through `matrix` alone (`Inverse`):
            # the inverse's derivative would be computed and never used.
            return Inverse(inverse(jax.lax.stop_gradient(matrix)), matrix)
        return lu_factorisation(matrix)

    def solve(self, factor, rhs: Array, fn: FlatFn) -> Array:
        del fn
        return factor.solve(rhs)


def check_point(fn: FlatFn, x: Array, name: str) -> None:
    """Static checks of `linearise`'s arguments: `x` a vector, `fn(x)` one like it."""
    if x.ndim != 1:
        raise ValueError(f"{name}.linearise: `x` must be a vector (n,), got {x.shape}")
    out = jax.eval_shape(fn, x)
    if out.shape != x.shape:
        raise ValueError(
            f"{name}.linearise: `fn(x)` must have the shape of `x`, {x.shape}; "
            f"got {out.shape}"
        )


def check_mass(mass: Array | None, n: int, name: str) -> None:
    """Static check of `factorise`'s `mass`: `None`, `(n,)` or `(n, n)`."""
    if mass is not None and mass.shape not in ((n,), (n, n)):
        raise ValueError(
            f"{name}.factorise: `mass` must be None, a vector ({n},) or a matrix "
            f"({n}, {n}); got shape {mass.shape}"
        )


def probe_failed(
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
    `convert_linear_solvers`) for one state shape (a `KrylovLinearSolver`'s
    callable preconditioner)."""
    return any(
        s.holds_converted_callable()
        for s in jax.tree_util.tree_leaves(solver, is_leaf=_is_linear_solver)
        if _is_linear_solver(s)
    )
