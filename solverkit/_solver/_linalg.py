"""Linear algebra of the stiff solvers: the Jacobian of a vector field, and solves
with the iteration matrix `I - γh J`.

A state is any pytree; it is ravelled to one vector for the Jacobian and the solves,
and every solve returns a pytree of the state's structure again. One LU factorisation
of `I - γh J` serves every stage of a step (and every Newton iteration within it).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree


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
    flat, unravel = ravel_pytree(y)
    jac = jax.jacfwd(lambda x: ravel_pytree(vf(t, unravel(x)))[0])(flat)
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


class InverseFactorisation(eqx.Module):
    """`I - γh J` and its explicit inverse: each solve is a matrix-vector product
    plus one step of iterative refinement (two more products), which restores the
    accuracy of an LU solve. For small systems under `vmap` this is several times
    faster than LAPACK's per-matrix triangular solves."""

    matrix: Array
    inverse: Array

    def solve(self, rhs: PyTree) -> PyTree:
        """`(I - γh J)^{-1} rhs`, as `Factorisation.solve`."""
        flat, unravel = ravel_pytree(rhs)
        b = flat.astype(self.inverse.dtype)
        x = self.inverse @ b
        x = x + self.inverse @ (b - self.matrix @ x)
        return unravel(x.astype(flat.dtype))


def factorise(
    jac: Array, gamma_h: Array, explicit_inverse: bool = False
) -> Factorisation | InverseFactorisation:
    """Factorise `I - gamma_h * jac` once, for every solve of a step.

    **Arguments:**

    - `jac`: the `(n, n)` Jacobian from [`jacobian`][].
    - `gamma_h`: the scalar `γh`.
    - `explicit_inverse`: form the inverse once (from the LU factorisation) and
        solve by products with iterative refinement: faster for small systems,
        especially under `vmap`.

    **Returns:**

    A `Factorisation` (or an `InverseFactorisation`), whose `solve` takes any
    pytree of the state's structure.
    """
    n = jac.shape[0]
    matrix = jnp.eye(n, dtype=jac.dtype) - jnp.asarray(gamma_h, jac.dtype) * jac
    if explicit_inverse:
        return InverseFactorisation(matrix, jnp.linalg.inv(matrix))
    lu, pivots = jsl.lu_factor(matrix)
    return Factorisation(lu, pivots)
