"""Local interpolations: the solution inside one step, from what the step returns as
`dense_info` (diffrax's `interpolation_cls` protocol).

A solver names one as `interpolation_cls`; the engine builds it per step as
`interpolation_cls(t0=t0, t1=t1, **dense_info)` and evaluates it at times in
`[t0, t1]`.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .._custom_types import RealScalarLike, Y
from .._select import where


def step_fraction(t0: Array, t1: Array, t: RealScalarLike) -> Array:
    """`θ = (t - t0) / (t1 - t0)`, the fraction of a step at `t`; 0 for an empty
    step, with zero derivatives (as diffrax's)."""
    empty = t0 == t1
    # A NumPy `t` defers to JAX (`__array_priority__`), which NumPy's stubs don't say.
    return where(empty, 0, t - t0) / where(empty, 1, t1 - t0)  # pyright: ignore


def dense_weights(dense: np.ndarray | None, theta, dtype) -> Array:
    """Each stage's weight in a Runge-Kutta dense output at `theta`: the polynomials
    `sum_j dense[i, j] theta^(j+1)` of the `(stages, degree)` table `dense`, by
    Horner's rule (multiplications only, no float `power`)."""
    assert dense is not None
    th = jnp.asarray(theta, dtype=dtype)
    column = lambda j: jnp.asarray(np.asarray(dense)[:, j], dtype=dtype)
    weights = column(-1)
    for j in range(dense.shape[1] - 2, -1, -1):
        weights = column(j) + th * weights
    return th * weights


def _leafwise(fn, *trees):
    # Python scalars among the leaves (diffrax accepts `y0=2.1`) become arrays.
    return jtu.tree_map(lambda *xs: fn(*map(jnp.asarray, xs)), *trees)


class AbstractLocalInterpolation(eqx.Module):
    """Base class of the local interpolations over one step `[t0, t1]`."""

    t0: RealScalarLike
    t1: RealScalarLike

    def evaluate(
        self, t0: RealScalarLike, t1: RealScalarLike | None = None, left: bool = True
    ) -> PyTree:
        """`y(t0)`, or `y(t1) - y(t0)` when `t1` is given."""
        del left
        if t1 is not None:
            return jtu.tree_map(lambda a, b: a - b, self.at(t1), self.at(t0))
        return self.at(t0)

    def derivative(self, t: RealScalarLike, left: bool = True) -> PyTree:
        """`dy/dt` at `t` (the derivative of `evaluate`, as diffrax's paths)."""
        del left
        t = jnp.asarray(t)
        return jax.jvp(self.at, (t,), (jnp.ones_like(t),))[1]

    def at(self, t: RealScalarLike) -> PyTree:
        """`y(t)`."""
        raise NotImplementedError

    def _theta(self, t: RealScalarLike) -> Array:
        t0, t1 = jnp.asarray(self.t0), jnp.asarray(self.t1)
        return step_fraction(t0, t1, t)


class LocalLinearInterpolation(AbstractLocalInterpolation):
    """Linear interpolation between the ends of a step (diffrax's, for Euler-type
    solvers).

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`, `y1`: the solution at its ends.
    """

    y0: PyTree
    y1: PyTree

    def at(self, t: RealScalarLike) -> PyTree:
        theta = self._theta(t)
        return _leafwise(
            lambda a, b: a + theta.astype(jnp.result_type(a, b)) * (b - a),
            self.y0,
            self.y1,
        )


class ThirdOrderHermitePolynomialInterpolation(AbstractLocalInterpolation):
    """Cubic Hermite interpolation from the solution and its slope at both ends of a
    step, constructed as diffrax's.

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`, `y1`: the solution at its ends.
    - `k0`, `k1`: the increments `h y'(t0)` and `h y'(t1)`, `h = t1 - t0`
        (diffrax's arguments); or, instead, `f0`, `f1`: the derivatives `y'` there.

    `from_k(t0=, t1=, y0=, y1=, k=)` builds it from diffrax's `dense_info`, whose `k`
    stacks the stage increments `h f_i` (the first and last are used).
    """

    y0: PyTree
    y1: PyTree
    k0: PyTree
    k1: PyTree

    def __init__(
        self, *, t0, t1, y0: Y, y1: Y, k0=None, k1=None, f0=None, f1=None
    ) -> None:
        if (k0 is None) == (f0 is None) or (k1 is None) == (f1 is None):
            raise ValueError(
                "ThirdOrderHermitePolynomialInterpolation takes `k0=, k1=` (the "
                "increments h y') or `f0=, f1=` (the derivatives y'), not both."
            )
        self.t0, self.t1, self.y0, self.y1 = t0, t1, y0, y1
        h = jnp.asarray(t1) - jnp.asarray(t0)
        scale = lambda f: _leafwise(lambda x: jnp.asarray(h, x.dtype) * x, f)
        self.k0 = scale(f0) if k0 is None else k0
        self.k1 = scale(f1) if k1 is None else k1

    @classmethod
    def from_k(
        cls, *, t0, t1, y0: Y, y1: Y, k
    ) -> "ThirdOrderHermitePolynomialInterpolation":
        first, last = (jtu.tree_map(lambda x: x[i], k) for i in (0, -1))
        return cls(t0=t0, t1=t1, y0=y0, y1=y1, k0=first, k1=last)

    def at(self, t: RealScalarLike) -> PyTree:
        theta = self._theta(t)

        def leaf(y0, y1, k0, k1):
            th = theta.astype(jnp.result_type(y0, y1, k0, k1))
            h00 = (1 + 2 * th) * (1 - th) ** 2
            h10 = th * (1 - th) ** 2
            h01 = th**2 * (3 - 2 * th)
            h11 = th**2 * (th - 1)
            return h00 * y0 + h10 * k0 + h01 * y1 + h11 * k1

        return _leafwise(leaf, self.y0, self.y1, self.k0, self.k1)


class FourthOrderPolynomialInterpolation(AbstractLocalInterpolation):
    """The quartic through `y0`, `y1` and a midpoint value, with the derivatives at
    both ends (Shampine, "Some practical Runge-Kutta formulas", Math. Comp. 46, 1986).

    A subclass sets the class variable `c_mid`, the weights that give the midpoint
    value `y0 + Σ_i c_mid[i] k_i` from the stage increments `k_i = h f_i`.

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`, `y1`: the solution at its ends.
    - `k`: the stage increments, stacked on a leading axis (first stage at `t0`, last
        at `t1`).
    """

    c_mid: ClassVar[Any]  # set by a subclass
    y0: PyTree
    y1: PyTree
    k: PyTree

    def at(self, t: RealScalarLike) -> PyTree:
        theta = self._theta(t)
        c_mid = type(self).c_mid

        def leaf(y0: Y, y1: Y, k):
            th = theta.astype(y0.dtype)
            weights = jnp.asarray(c_mid, y0.dtype)
            y_mid = y0 + jnp.tensordot(weights, k, axes=1, precision=Precision.HIGHEST)
            k0, k1 = k[0], k[-1]
            # The quartic a θ⁴ + b θ³ + c θ² + k0 θ + y0 through y0, y_mid, y1 with
            # slopes k0 (θ = 0) and k1 (θ = 1), per unit θ.
            a = 2 * (k1 - k0) - 8 * (y1 + y0) + 16 * y_mid
            b = 5 * k0 - 3 * k1 + 18 * y0 + 14 * y1 - 32 * y_mid
            c = k1 - 4 * k0 - 11 * y0 - 5 * y1 + 16 * y_mid
            return (((a * th + b) * th + c) * th + k0) * th + y0

        return _leafwise(leaf, self.y0, self.y1, self.k)
