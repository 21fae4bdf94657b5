"""Rosenbrock (linearly implicit) solvers: one generic step reading a tableau.

Each step linearises the vector field at the step's start (its value and Jacobian
`J = ∂f/∂y`, through the solver's `linear_solver`), takes `∂f/∂t` (which XLA drops
for an autonomous field), factorises the iteration matrix `M - γhJ` once, and solves
once per stage with that factorisation. Every operation is a plain JAX operation, so
steps differentiate in forward and reverse mode like any other.

With a constant mass matrix `M` (`M y' = f(t, y)`), stage `i` of the method in the
form of Hairer & Wanner (II, §VI.4, eq. (4.11) multiplied by `γh`) reads

    (M - γhJ) u_i = γh f(t0 + c_i h, y0 + Σ_j a_ij u_j) + M Σ_j γ C_ij u_j
                    + γ d_i h² ∂f/∂t,

with `y1 = y0 + Σ m_i u_i`: only the coupling of the stages is multiplied by `M`.
For a singular `M` (an index-1 DAE) the method must be stiffly accurate (`Rodas4`,
`Rodas5P`), and `y0` must satisfy the algebraic equations at `t0`.
"""

from typing import Any, ClassVar, NamedTuple, TYPE_CHECKING

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .._custom_types import RealScalarLike
from .._linear._linalg import time_derivative
from .._linear._linear_solver import (
    AbstractLinearSolver,
    algebraic_residual,
    DenseLinearSolver,
    mass_matvec,
)
from .._select import where
from .._solution import RESULTS
from ._base import AbstractAdaptiveSolver, axpy, successful
from ._local_interpolation import AbstractLocalInterpolation
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


class RosenbrockDense(NamedTuple):
    """One step's dense output: `y(t0 + θh) = y0 + Σ_p θ^(p+1) coeffs[p]`, with
    `coeffs` on the ravelled state."""

    y0: PyTree
    coeffs: Array  # (p, n)


def _check_mass(mass: Any, name: str, singular_ok: bool) -> Array | None:
    """`mass` as an array, after checking its rank and dtype (and, when concrete and
    the method cannot take one, that it is not singular); a `ValueError` otherwise."""
    if mass is None:
        return None
    if not hasattr(mass, "ndim"):
        mass = np.asarray(mass)
    if mass.ndim not in (1, 2) or (mass.ndim == 2 and mass.shape[0] != mass.shape[1]):
        raise ValueError(
            f"{name}(mass_matrix=...) must be None, a vector `(n,)` (a diagonal mass "
            "matrix) or a square matrix `(n, n)`, in the order of the ravelled state "
            f"(`jax.flatten_util.ravel_pytree(y0)`); got shape {tuple(mass.shape)}."
        )
    dtype = np.dtype(mass.dtype)
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
        raise ValueError(
            f"{name}(mass_matrix=...) must be a real (floating or integer) array; got "
            f"dtype {dtype}."
        )
    if not singular_ok:
        try:
            m = np.asarray(mass, np.float64)
        except jax.errors.TracerArrayConversionError:
            return mass  # traced (under `jit`): not checked
        singular = (
            np.any(m == 0)
            if m.ndim == 1
            else np.linalg.matrix_rank(m) < m.shape[0]
            if m.size
            else False
        )
        if singular:
            raise ValueError(
                f"{name}(mass_matrix=...) is singular (a differential-algebraic "
                f"equation), which {name} cannot solve: it is not stiffly accurate. "
                "Use `Rodas4` or `Rodas5P`."
            )
    return mass


class RosenbrockInterpolation(AbstractLocalInterpolation):
    """A Rosenbrock solver's dense output from its `step`'s `dense_info`:
    `y(t0 + θh) = y0 + Σ_p θ^(p+1) coeffs[p]` (solverkit's; diffrax 0.7.2 has no
    Rosenbrock solver).

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`: the solution at its start.
    - `coeffs`: `(p, n)` coefficients on the ravelled state.
    """

    y0: PyTree
    coeffs: Array

    def at(self, t: RealScalarLike) -> PyTree:
        t0, t1 = jnp.asarray(self.t0), jnp.asarray(self.t1)
        return _rosenbrock_at(self.y0, self.coeffs, t0, t1, t)


def _rosenbrock_at(y0: PyTree, coeffs: Array, t0: Array, t1: Array, t) -> PyTree:
    h = t1 - t0
    theta = (t - t0) / where(h == 0, 1, h)
    flat0, unravel = ravel_pytree(y0)
    powers = np.arange(1, coeffs.shape[0] + 1)
    weights = jnp.asarray(theta, coeffs.real.dtype) ** powers
    weights = weights.astype(coeffs.dtype)
    return unravel(flat0 + jnp.matmul(weights, coeffs, precision=Precision.HIGHEST))


class AbstractRosenbrock(AbstractAdaptiveSolver):
    """A Rosenbrock method defined by its `tableau` (see `_rosenbrock_tableau.py`).

    The solver state is `None`; with a mass matrix, a flag that the initial values
    are still to be checked for consistency.
    """

    tableau: AbstractClassVar[RosenbrockTableau]
    interpolation_cls: ClassVar[Any] = RosenbrockInterpolation
    # Whether a singular mass matrix (an index-1 DAE) is allowed: for the stiffly
    # accurate methods (`y1` is the last stage's value), Hairer & Wanner II, §VI.4.
    singular_mass: ClassVar[bool] = False
    linear_solver: AbstractLinearSolver = DenseLinearSolver()
    mass_matrix: Array | np.ndarray | None = None

    def __check_init__(self) -> None:
        if not isinstance(self.linear_solver, AbstractLinearSolver):
            raise TypeError(
                f"{type(self).__name__}(linear_solver=...) must be a solverkit "
                f"`AbstractLinearSolver`, got {self.linear_solver!r}."
            )
        _check_mass(self.mass_matrix, type(self).__name__, self.singular_mass)

    def order(self, terms) -> int:
        return self.tableau.order

    def error_order(self, terms) -> float:
        return min(self.tableau.order, self.tableau.embedded_order) + 1

    def _mass(self, n: int) -> Array | None:
        """The mass matrix, checked against the state's size `n`."""
        mass = self.mass_matrix
        if mass is not None and mass.shape[0] != n:
            raise ValueError(
                f"{type(self).__name__}(mass_matrix=...) has shape "
                f"{tuple(mass.shape)}, but the ravelled state `y0` has {n} entries: "
                f"pass a vector `({n},)` or a matrix `({n}, {n})`."
            )
        return None if mass is None else jnp.asarray(mass)

    def init(self, terms, t0, t1, y0, args) -> Array | None:
        del terms, t0, t1, args
        if self.mass_matrix is None:
            return None
        self._mass(ravel_pytree(y0)[0].shape[0])
        return jnp.asarray(True)  # the initial values are still to be checked

    def _stages(self, fn_at, t0, h, flat0, f0, f_t, factor, fn0, mass) -> list:
        """The stage increments `u_i`, each one solve with the factorised
        `M - γhJ`, in the form of the module docstring."""
        tab = self.tableau
        gamma = tab.gamma
        hd = jnp.asarray(h, flat0.dtype)
        us = []
        for i in range(tab.num_stages):
            if i == 0:
                fi = f0
            else:
                yi = axpy(flat0, None, zip(tab.a[i, :i], us))
                ti = t0 + jnp.asarray(tab.c[i], h.dtype) * h
                fi = fn_at(ti)(yi)
            rhs = (gamma * hd) * fi
            if mass is None:
                rhs = axpy(rhs, None, zip(gamma * tab.C[i, :i], us))
            elif i > 0:
                coupling = zip(gamma * tab.C[i, :i], us)
                rhs = rhs + mass_matvec(mass, axpy(jnp.zeros_like(rhs), None, coupling))
            if tab.d[i] != 0:
                rhs = rhs + (gamma * float(tab.d[i]) * hd**2) * f_t
            us.append(self.linear_solver.solve(factor, rhs, fn0))
        return us

    def _dense_coeffs(self, fn1, flat0, y1, f0, us, hd, mass) -> Array:
        """The dense output's coefficients: the method's own interpolant, else
        cubic Hermite from the end slopes (`fn1` the field at `t1`)."""
        tab = self.tableau
        if tab.dense is None:
            return _hermite_coeffs(
                y1 - flat0, hd * _solve_mass(mass, f0), hd * _solve_mass(mass, fn1(y1))
            )
        return jnp.matmul(
            jnp.asarray(tab.dense.T, flat0.dtype),
            jnp.stack(us),
            precision=Precision.HIGHEST,
        )

    def _mass_result(self, mass, jac, factor, first, f0, flat0):
        """`(solver_state, result)`: with a mass matrix, a singular iteration matrix
        (a non-finite factorisation of a finite Jacobian: no step size helps; fatal,
        see `_loop.step`) and, on the first step (`first`), inconsistent initial
        values are reported; the state is then `False` (no longer the first)."""
        if mass is None:
            return None, successful
        singular = _all_finite(jac) & ~_all_finite(factor)
        result = RESULTS.where(singular, RESULTS.singular, successful)
        result = RESULTS.where(
            first & ~_consistent(mass, f0, flat0),
            RESULTS.inconsistent_initial_values,
            result,
        )
        return jnp.asarray(False), result

    def step(
        self, terms, t0: Array, t1: Array, y0, args, solver_state, made_jump=False
    ):
        """One step; `dense_info` is `dict(y0=, coeffs=)`, as
        `interpolation_cls(t0=, t1=, **dense_info)` takes it."""
        y1, error, dense, state, result = self.loop_step(
            terms, t0, t1, y0, args, solver_state, made_jump
        )
        return y1, error, dense._asdict(), state, result

    def loop_step(
        self, terms, t0: Array, t1: Array, y0, args, solver_state, made_jump=False
    ):
        """`step` as the loop takes it, `dense_info` a `RosenbrockDense`."""
        del made_jump
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        tab = self.tableau
        flat0, unravel = ravel_pytree(y0)
        dtype = flat0.dtype
        mass = self._mass(flat0.shape[0])

        def fn_at(t):
            def fn(x):
                return ravel_pytree(terms.vf(t, unravel(x), args))[0].astype(dtype)

            return fn

        fn0 = fn_at(t0)
        f0, jac = self.linear_solver.linearise(fn0, flat0)
        h = t1 - t0
        hd = jnp.asarray(h, dtype)
        gamma = tab.gamma
        f_t = ravel_pytree(time_derivative(lambda t, y: terms.vf(t, y, args), t0, y0))[
            0
        ].astype(dtype)
        factor = self.linear_solver.factorise(jac, gamma * hd, mass)
        us = self._stages(fn_at, t0, h, flat0, f0, f_t, factor, fn0, mass)
        y1 = axpy(flat0, None, zip(tab.m, us))
        error = axpy(jnp.zeros_like(flat0), None, zip(tab.m_err, us))
        coeffs = self._dense_coeffs(fn_at(t1), flat0, y1, f0, us, hd, mass)
        dense = RosenbrockDense(y0=y0, coeffs=coeffs)
        state, result = self._mass_result(mass, jac, factor, solver_state, f0, flat0)
        return unravel(y1), unravel(error), dense, state, result

    def interpolate(self, dense_info, t0: Array, t1: Array, t) -> PyTree:
        """The dense output at `t`, from `step`'s or `loop_step`'s `dense_info`."""
        info = dense_info if isinstance(dense_info, dict) else dense_info._asdict()
        return _rosenbrock_at(info["y0"], info["coeffs"], t0, t1, t)


def _all_finite(tree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jtu.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _consistent(mass: Array, f0: Array, flat0: Array) -> Array:
    """Whether `y0` satisfies the algebraic equations of `M y' = f` at `t0`, to a
    relative `√eps` of the state and field."""
    residual = algebraic_residual(mass, f0)
    real = jnp.finfo(f0.dtype).dtype
    scale = 1 + jnp.maximum(jnp.max(jnp.abs(flat0)), jnp.max(jnp.abs(f0)))
    tol = jnp.sqrt(jnp.finfo(real).eps) * scale
    return jnp.max(jnp.abs(residual)) <= tol


def _solve_mass(mass: Array | None, v: Array) -> Array:
    """`M^{-1} v` (a regular mass matrix), for the Hermite interpolant's slopes."""
    if mass is None:
        return v
    if mass.ndim == 1:
        return v / mass.astype(v.dtype)
    return jnp.linalg.solve(mass.astype(v.dtype), v)


def _hermite_coeffs(delta, hf0, hf1) -> Array:
    """Cubic Hermite interpolation from `y1 - y0`, `h f0`, `h f1`, in powers of θ."""
    return jnp.stack(
        [hf0, 3 * delta - 2 * hf0 - hf1, -2 * delta + hf0 + hf1],
    )


_ARGUMENTS = """

    **Arguments:**

    - `linear_solver`: solves with the iteration matrix `M - γhJ`; a
        `solverkit.AbstractLinearSolver` (default: `DenseLinearSolver()`).
    - `mass_matrix`: `None` (the identity), a vector `(n,)` (a diagonal mass matrix)
        or a matrix `(n, n)`, constant, in the order of the ravelled state
        (`jax.flatten_util.ravel_pytree(y0)`): solves `M y' = f(t, y)`.{singular}
    """
_REGULAR = (
    " It must be regular (a `ValueError` when it is concrete and singular): for a "
    "DAE use `Rodas4` or `Rodas5P`."
)
_SINGULAR = (
    " It may be singular (an index-1 differential-algebraic equation); `y0` must "
    "then satisfy the algebraic equations at `t0` (else "
    "`RESULTS.inconsistent_initial_values`)."
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

    __doc__ = (__doc__ or "") + _ARGUMENTS.format(singular=_REGULAR)

    tableau: ClassVar[RosenbrockTableau] = ROSENBROCK23


class Ros3P(AbstractRosenbrock):
    """Lang & Verwer's ROS3P: third order, A-stable, without order reduction on
    parabolic problems; second-order error estimate, cubic Hermite dense output.

    !!! warning

        Its error estimate is blind to the linear part of the local error. In the
        standard form `α21 + γ21 = 0`, so for an `f` affine in `(t, y)`, such as
        `Ay + bt + c` (with the exact Jacobian), the first two stages are equal and
        the estimate is `(k1 - k2)/3 = 0`: the embedded method has the method's
        stability function. On other problems the estimate sees only the part of
        the local error that comes from `f`'s second and higher derivatives. This
        is the published pair, not a coefficient error, and no other choice helps:
        on these stages (`β2 = α21 + γ21 = 0`) every second-order embedded method
        has error weights proportional to `(1, -1, 0)`. On `y' = Ay` (2x2,
        eigenvalues -1 and -100, `t1 = 10`, rtol 1e-6) it takes 5 steps and is off
        by 0.15. Bound the step (`PIDController(dtmax=...)`) or use `Rodas5P` on
        problems that are linear or nearly so.

    ??? cite "Reference"

        J. Lang and J. Verwer, ROS3P - an accurate third-order Rosenbrock solver
        designed for parabolic problems, BIT 41(4):731-738, 2001.
    """

    __doc__ = (__doc__ or "") + _ARGUMENTS.format(singular=_REGULAR)

    tableau: ClassVar[RosenbrockTableau] = ROS3P


class Rodas4(AbstractRosenbrock):
    """Hairer & Wanner's RODAS: fourth order, stiffly accurate and L-stable, six
    stages, third-order error estimate and third-order dense output.

    ??? cite "Reference"

        E. Hairer and G. Wanner, Solving Ordinary Differential Equations II, 2nd
        ed., Springer, 1996, section IV.7.
    """

    __doc__ = (__doc__ or "") + _ARGUMENTS.format(singular=_SINGULAR)

    tableau: ClassVar[RosenbrockTableau] = RODAS4
    singular_mass: ClassVar[bool] = True


class Rodas5P(AbstractRosenbrock):
    """Steinebach's Rodas5P: fifth order, stiffly accurate and L-stable, eight
    stages, fourth-order error estimate and fourth-order dense output. A good
    default for stiff problems at moderate to tight tolerances.

    ??? cite "Reference"

        G. Steinebach, Construction of Rosenbrock-Wanner method Rodas5P and
        numerical benchmarks within the Julia Differential Equations package, BIT
        Numer. Math. 63:27, 2023.
    """

    __doc__ = (__doc__ or "") + _ARGUMENTS.format(singular=_SINGULAR)

    tableau: ClassVar[RosenbrockTableau] = RODAS5P
    singular_mass: ClassVar[bool] = True
