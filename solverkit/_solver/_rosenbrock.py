"""Rosenbrock (linearly implicit) solvers: one generic step reading a tableau.

Each step computes the Jacobian `J = ∂f/∂y` at the step's start by forward-mode
autodiff (with the vector field's value from the same pass) and `∂f/∂t` (which XLA
drops for an autonomous field), factorises `I - γhJ` once, and solves once per
stage with that factorisation. Every operation is a plain JAX operation, so steps
differentiate in forward and reverse mode like any other.
"""

from typing import ClassVar, NamedTuple, TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .._linalg import factorise, invert, time_derivative, value_and_jacobian
from .._select import where
from ._base import AbstractAdaptiveSolver, axpy, successful
from ._rosenbrock_tableau import (
    RODAS4,
    RODAS5P,
    ROS3P,
    ROSENBROCK23,
    RosenbrockTableau,
)


if TYPE_CHECKING:  # pyright reads `eqx.AbstractClassVar` as an instance field
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


# Up to this many unknowns, each stage solves by products with the explicit inverse
# of `I - γhJ` (with one refinement step) instead of LAPACK triangular solves: for
# small systems, and above all for vmapped ensembles of them, several times faster
# (benchmarks/stiff.py).
_INVERSE_MAX = 32


class RosenbrockDense(NamedTuple):
    """One step's dense output: `y(t0 + θh) = y0 + Σ_p θ^(p+1) coeffs[p]`, with
    `coeffs` on the ravelled state."""

    y0: PyTree
    coeffs: Array  # (p, n)


class AbstractRosenbrock(AbstractAdaptiveSolver):
    """A Rosenbrock method defined by its `tableau` (see `_rosenbrock_tableau.py`).

    The solver state is `None`: the vector field at the step's start comes with the
    Jacobian.
    """

    tableau: AbstractClassVar[RosenbrockTableau]

    def order(self, terms) -> int:
        return self.tableau.order

    def error_order(self, terms) -> float:
        return min(self.tableau.order, self.tableau.embedded_order) + 1

    def init(self, terms, t0, t1, y0, args) -> None:
        del terms, t0, t1, y0, args
        return None

    def step(
        self, terms, t0: Array, t1: Array, y0, args, solver_state, made_jump=False
    ):
        del solver_state, made_jump
        tab = self.tableau

        def vf(t, y):
            return terms.vf(t, y, args)

        f0, jac, unravel = value_and_jacobian(vf, t0, y0)
        flat0, _ = ravel_pytree(y0)
        dtype = flat0.dtype
        h = t1 - t0
        hd = jnp.asarray(h, dtype)
        gamma = tab.gamma
        f_t = ravel_pytree(time_derivative(vf, t0, y0))[0].astype(dtype)
        if jac.shape[0] <= _INVERSE_MAX:
            lu = invert(jac, gamma * hd, refine=True)
        else:
            lu = factorise(jac, gamma * hd)
        us = []
        for i in range(tab.num_stages):
            if i == 0:
                fi = f0
            else:
                yi = axpy(flat0, None, zip(tab.a[i, :i], us))
                ti = t0 + jnp.asarray(tab.c[i], h.dtype) * h
                fi = ravel_pytree(vf(ti, unravel(yi)))[0].astype(dtype)
            rhs = (gamma * hd) * fi
            rhs = axpy(rhs, None, zip(gamma * tab.C[i, :i], us))
            if tab.d[i] != 0:
                rhs = rhs + (gamma * float(tab.d[i]) * hd**2) * f_t
            us.append(lu.solve(rhs))
        y1 = axpy(flat0, None, zip(tab.m, us))
        error = axpy(jnp.zeros_like(flat0), None, zip(tab.m_err, us))
        if tab.dense is None:
            f1 = ravel_pytree(vf(t1, unravel(y1)))[0].astype(dtype)
            coeffs = _hermite_coeffs(y1 - flat0, hd * f0, hd * f1)
        else:
            coeffs = jnp.matmul(
                jnp.asarray(tab.dense.T, dtype),
                jnp.stack(us),
                precision=Precision.HIGHEST,
            )
        dense = RosenbrockDense(y0=y0, coeffs=coeffs)
        return unravel(y1), unravel(error), dense, None, successful

    def interpolate(
        self, dense_info: RosenbrockDense, t0: Array, t1: Array, t
    ) -> PyTree:
        h = t1 - t0
        theta = (t - t0) / where(h == 0, 1, h)
        flat0, unravel = ravel_pytree(dense_info.y0)
        coeffs = dense_info.coeffs
        powers = np.arange(1, coeffs.shape[0] + 1)
        weights = jnp.asarray(theta, coeffs.real.dtype) ** powers
        weights = weights.astype(coeffs.dtype)
        return unravel(flat0 + jnp.matmul(weights, coeffs, precision=Precision.HIGHEST))


def _hermite_coeffs(delta, hf0, hf1) -> Array:
    """Cubic Hermite interpolation from `y1 - y0`, `h f0`, `h f1`, in powers of θ."""
    return jnp.stack(
        [hf0, 3 * delta - 2 * hf0 - hf1, -2 * delta + hf0 + hf1],
    )


class Rosenbrock23(AbstractRosenbrock):
    """Shampine & Reichelt's Rosenbrock 2(3), the method of MATLAB's `ode23s`:
    second order, L-stable, with a third-order error estimate and its own
    second-order dense output. Three stages, one LU factorisation per step. Good
    at loose tolerances.

    ??? cite "Reference"

        L. F. Shampine and M. W. Reichelt, The MATLAB ODE suite, SIAM J. Sci.
        Comput. 18(1):1-22, 1997.
    """

    tableau: ClassVar[RosenbrockTableau] = ROSENBROCK23


class Ros3P(AbstractRosenbrock):
    """Lang & Verwer's ROS3P: third order, A-stable, without order reduction on
    parabolic problems; second-order error estimate, cubic Hermite dense output.

    !!! note

        Its embedded method has the same stability function as the method itself,
        so on a linear constant-coefficient problem the error estimate vanishes
        and the controller takes steps as long as `dtmax` allows.

    ??? cite "Reference"

        J. Lang and J. Verwer, ROS3P - an accurate third-order Rosenbrock solver
        designed for parabolic problems, BIT 41(4):731-738, 2001.
    """

    tableau: ClassVar[RosenbrockTableau] = ROS3P


class Rodas4(AbstractRosenbrock):
    """Hairer & Wanner's RODAS: fourth order, stiffly accurate and L-stable, six
    stages, third-order error estimate and third-order dense output.

    ??? cite "Reference"

        E. Hairer and G. Wanner, Solving Ordinary Differential Equations II, 2nd
        ed., Springer, 1996, section IV.7.
    """

    tableau: ClassVar[RosenbrockTableau] = RODAS4


class Rodas5P(AbstractRosenbrock):
    """Steinebach's Rodas5P: fifth order, stiffly accurate and L-stable, eight
    stages, fourth-order error estimate and fourth-order dense output. A good
    default for stiff problems at moderate to tight tolerances.

    ??? cite "Reference"

        G. Steinebach, Construction of Rosenbrock-Wanner method Rodas5P and
        numerical benchmarks within the Julia Differential Equations package, BIT
        Numer. Math. 63:27, 2023.
    """

    tableau: ClassVar[RosenbrockTableau] = RODAS5P
