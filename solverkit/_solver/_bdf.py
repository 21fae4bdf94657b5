"""`BDF`: variable-order (1 to 5), variable-step backward differentiation formulas,
in the numerical differentiation formula (NDF) form by default.

The method keeps the backward differences `D[0..k]` of the solution at equally spaced
past points, scaled for the current step `h` (the quasi-constant step-size form): a
step predicts `y_pred = Σ_{j<=k} D[j]`, then solves for the correction `d` in

    M (d + ψ) = c f(t1, y_pred + d),  ψ = (1/α_k) Σ_{1<=j<=k} γ_j D[j],  c = h/α_k,

with a simplified Newton iteration (the iteration matrix `M - cJ`), and updates the
differences from `d`. When the step size changes, the differences are rescaled to the
new step by a `(k+1, k+1)` matrix, the product of the two interpolation matrices of
Shampine & Reichelt (1997), section 2.3. The error estimate of order `k` is
`E_k d`; those of orders `k - 1` and `k + 1` come from `D[k]` and `D[k+2]`, and choose
the order of the next step.

**How the step size is chosen.** The solver chooses its next step size and order
itself, by the rules of Shampine & Reichelt (1997) (as SciPy's `BDF` does): a
rejected step shrinks by the error's factor; after a change of step size the step is
kept for `k + 1` steps; the Newton solve's iteration count damps the factor. The
chosen factor reaches the step-size controller through the error estimate: `y_error`
is scaled so that an I-controller (`PIDController` with `pcoeff = dcoeff = 0`, its
default) computes exactly that factor, with any `norm` (the error's entries are equal,
divided by the norm of a vector of ones), and accepts exactly when the step's own
error is within tolerance. Other adaptive controllers raise a `ValueError`.

**Jacobian and factorisation reuse** (the rules of CVODE, Hindmarsh et al. 2005): the
iteration matrix is refactorised when `γh` changed by more than 30% or after 20 steps,
and the Jacobian is computed anew after 50 steps, or when a Newton solve failed with an
old one (the step is then retried at once with the new Jacobian). All linear algebra
goes through the linear-solver protocol (`_linear/_linear_solver.py`).

**Derivatives.** The Newton solve runs on values without derivatives (its reused
Jacobian is not the Jacobian at the solution); its result is then given the derivative
of the exact solution by the implicit function theorem, with the linear solver
linearised anew at the solution (`_correction`). So forward and reverse mode
see the derivative of the discrete scheme, whatever Jacobian the solve reused.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from .._closure._unvmap import unvmap_any
from .._controller._base import AbstractAdaptiveStepSizeController
from .._controller._norm import rms_norm
from .._linear._krylov import KrylovLinearSolver
from .._linear._linear_solver import (
    AbstractLinearSolver,
    algebraic_residual,
    DenseLinearSolver,
    mass_matvec,
)
from .._select import where
from .._solution import RESULTS
from .._tree import nograd
from ._base import AbstractAdaptiveSolver


# NDF coefficients κ_k of Shampine & Reichelt (1997), Table 1 (orders 1 to 5; order 6
# is used only for the error estimate of order `k + 1`). With κ = 0, the BDFs.
_KAPPA_NDF = (0.0, -0.1850, -1.0 / 9.0, -0.0823, -0.0415, 0.0, 0.0)
# The most Newton iterations' worth of step-size damping (Shampine & Reichelt's
# `(2m + 1) / (2m + iterations)`) and the factor after a failed Newton solve.
_NEWTON_FAIL_FACTOR = 0.5
# The controller's factor for "keep this step size" is below 1 and so clipped to 1.
_HOLD_FACTOR = 0.999
# CVODE's reuse rules (Hindmarsh et al. 2005, section 2.1).
_REFACTOR_CHANGE = 0.3
_REFACTOR_STEPS = 20
_REJAC_STEPS = 50
# A failed linear solve is tried again at this fraction of `c = h/α` to tell a
# singular pencil `M - cJ` (singular for every `c`) from an unlucky `c` (a root of
# `det(M - cJ)`); not a simple ratio, which a structured problem might hit twice.
_PROBE_RATIO = 0.29


def _coefficients(max_order: int, ndf: bool):
    """`(γ, α, E)` for orders `0..max_order + 1`: `γ_k = Σ_{i<=k} 1/i`, the leading
    coefficient `α_k = (1 - κ_k) γ_k`, and the error constant `E_k = κ_k γ_k +
    1/(k+1)`."""
    size = max_order + 2
    kappa = np.array(_KAPPA_NDF[:size] if ndf else [0.0] * size)
    gamma = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, size))])
    alpha = (1 - kappa) * gamma
    error = kappa * gamma + 1 / (np.arange(size) + 1)
    return gamma, alpha, error


class BDFState(NamedTuple):
    """The solver's state between steps: arrays only."""

    D: Array  # (max_order + 3, n): backward differences, scaled for step `h`
    h: Array  # the step the differences are scaled for
    order: Array  # int32, the order of the next step
    n_equal: Array  # int32, steps taken since the step size last changed
    jac: Any  # the linear solver's Jacobian
    jac_age: Array  # int32, steps since `jac` was computed
    factor: Any  # the linear solver's factor of `M - c J`
    c_factor: Array  # the `c = h/α` it was made for (0: none yet)
    factor_age: Array  # int32, steps since `factor` was made
    consistent: Array  # bool: the initial values satisfy the algebraic equations


class BDFDense(NamedTuple):
    """One step's dense output: the interpolating polynomial of order `order` through
    the step's end and the `order` points before it, `h` apart."""

    y1: PyTree
    D: Array  # (max_order, n): the differences D[1..max_order] after the step
    order: Array


def _rescale(D: Array, order: Array, r: Array, max_order: int) -> Array:
    """The differences `D[0..order]` for a step `r` times the one they were made for
    (Shampine & Reichelt 1997, section 2.3); the rows above `order` unchanged."""
    size = max_order + 1
    i = np.arange(size)[:, None]
    j = np.arange(size)[None, :]
    inside = (i <= order) & (j <= order)

    def interp(rho):
        # R[i, j] = Π_{m=1..i} (m - 1 - ρ j) / m, and R[0, j] = 1.
        m = jnp.where(i == 0, 1.0, jnp.where(j == 0, 0.0, (i - 1 - rho * j) / i))
        return jnp.where(inside, jnp.cumprod(m.astype(D.dtype), axis=0), 0)

    ru = jnp.matmul(interp(r), interp(jnp.ones_like(r)), precision="highest")
    ru = jnp.where(inside, ru, jnp.eye(size, dtype=D.dtype))
    head = jnp.matmul(ru.T, D[:size], precision="highest")
    return jnp.concatenate([head, D[size:]])


def _update(D: Array, d: Array, order: Array) -> Array:
    """The differences after a step of order `k` with correction `d`: `D[k+2] = d -
    D[k+1]`, `D[k+1] = d`, and `D[i] += D[i+1]` for `i = k, ..., 0`."""
    rows = np.arange(D.shape[0])[:, None]
    d = d[None, :]
    below = jnp.where(rows <= order, D, 0)
    # D_new[i] = Σ_{i<=j<=k} D[j] + d for i <= k.
    tail = jnp.flip(jnp.cumsum(jnp.flip(below, 0), axis=0), 0) + d
    prev = jnp.sum(jnp.where(rows == order + 1, D, 0), axis=0)
    out = jnp.where(rows <= order, tail, D)
    out = jnp.where(rows == order + 1, d, out)
    return jnp.where(rows == order + 2, d - prev[None, :], out)


def _correction(static, d, t1, c, y_pred, psi, dynamic):
    """`d`, the converged Newton correction, with the derivative of the exact
    solution of `G(d) = c f(t1, y_pred + d) - M (ψ + d) = 0` by the implicit function
    theorem: `d' = (M - c J)^{-1} ∂G/∂(t1, c, y_pred, ψ, field)`, with `J` the exact
    Jacobian at `y_pred + d` (the linear solver linearised there anew). `static` is
    the non-array part of `dynamic`'s `(terms, args, mass, linear_solver,
    unravel)`; the mass matrix is differentiated too (`∂G/∂M = -(ψ + d)`)."""
    fn = jax.custom_jvp(lambda d, t1, c, y_pred, psi, dynamic: d)

    def residual(d, t1, c, y_pred, psi, dynamic):
        terms, args, mass, _, unravel = eqx.combine(dynamic, static)
        f = _flat_field(terms, args, unravel, t1, y_pred + d, d.dtype)
        return c * f - mass_matvec(mass, psi + d)

    @fn.defjvp
    def _jvp(primals, tangents):
        d, t1, c, y_pred, psi, dynamic = primals
        terms, args, mass, linear_solver, unravel = eqx.combine(dynamic, static)
        field = lambda x: _flat_field(terms, args, unravel, t1, x, d.dtype)
        _, jac = linear_solver.linearise(field, y_pred + d)
        factor = linear_solver.factorise(jac, c, mass)
        _, dg = jax.jvp(lambda *p: residual(d, *p), primals[1:], tangents[1:])
        return d, linear_solver.solve_tangent(factor, dg, field)

    return fn(d, t1, c, y_pred, psi, dynamic)


def _flat_field(terms, args, unravel, t, x, dtype) -> Array:
    out = terms.vf(t, unravel(x), args)
    return ravel_pytree(out)[0].astype(dtype)


def _check_mass(mass: Array | None, n: int) -> None:
    if mass is None:
        return
    if mass.ndim == 1 and mass.shape == (n,):
        return
    if mass.ndim == 2 and mass.shape == (n, n):
        return
    raise ValueError(
        f"BDF: `mass_matrix` must be a vector of shape ({n},) (a diagonal mass "
        f"matrix) or a matrix of shape ({n}, {n}) for a state of {n} unknowns, got "
        f"shape {mass.shape}. (With BacksolveAdjoint, the backward solve's state is "
        "larger: pass `BacksolveAdjoint(solver=...)` a solver without a mass matrix, "
        "or use RecursiveCheckpointAdjoint.)"
    )


def _to_mass(mass) -> Array | None:
    return None if mass is None else jnp.asarray(mass)


def _maybe(pred, make: Callable, old):
    """`make()` where `pred`, else `old`; computed only if some batch element needs
    it."""
    return lax.cond(
        unvmap_any(pred),
        lambda: jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), make(), old),
        lambda: old,
    )


class BDF(AbstractAdaptiveSolver):
    """Variable-order (1 to 5), variable-step BDF for stiff problems, in the NDF form of
    MATLAB's `ode15s` by default, for `M y' = f(t, y)` with an optional constant mass
    matrix `M` (singular allowed: index-1 DAEs).

    Each step costs a few evaluations of the vector field (a simplified Newton
    iteration); the Jacobian and the factorisation of `M - γhJ` are reused across
    steps (see the module docstring), so on large stiff problems it takes many more
    but much cheaper steps than `Rodas5P` or `Kvaerno5`.

    **Arguments:**

    - `linear_solver`: how the systems with `M - γhJ` are solved (an
        `AbstractLinearSolver`; default `DenseLinearSolver()`).
    - `mass_matrix`: `None` (the identity), a vector (a diagonal `M`) or a matrix, on
        the ravelled state. Initial values must satisfy the algebraic equations
        where `M` is singular; otherwise the solve ends with
        `RESULTS.inconsistent_initial_values`. An algebraic equation that leaves
        its unknown undetermined (`M - γhJ` singular for every step size) ends it
        with `RESULTS.singular`. Differentiable, like the field.
    - `max_order`: the highest order, 1 to 5.
    - `ndf`: the numerical differentiation formulas (True) or the classical BDFs.
    - `newton_max_steps`: Newton iterations per step before it counts as failed.
    - `rtol`, `atol`: tolerances of the Newton solve and of the error estimate. Taken
        from the step-size controller (`PIDController`) when it has them; needed with
        `ConstantStepSize` or `StepTo`.

    The step-size controller must be a `PIDController` with `pcoeff = dcoeff = 0`
    (its default, an I-controller; optionally in a `ClipStepSizeController`), or a
    fixed one (`ConstantStepSize`, `StepTo`; the order still adapts). The solver's
    state carries the Jacobian and factor: the dense output is the BDF's
    interpolating polynomial.

    ??? cite "References"

        L. F. Shampine and M. W. Reichelt, The MATLAB ODE suite, SIAM J. Sci. Comput.
        18(1):1-22, 1997 (the NDFs, the quasi-constant step formulation, the order
        and step-size selection).

        A. C. Hindmarsh et al., SUNDIALS: Suite of nonlinear and differential/algebraic
        equation solvers, ACM Trans. Math. Softw. 31(3):363-396, 2005 (the Jacobian
        and factorisation reuse rules).
    """

    linear_solver: AbstractLinearSolver = DenseLinearSolver()
    mass_matrix: Array | None = eqx.field(default=None, converter=_to_mass)
    max_order: int = eqx.field(default=5, static=True)
    ndf: bool = eqx.field(default=True, static=True)
    newton_max_steps: int = eqx.field(default=4, static=True)
    rtol: float | None = None
    atol: float | None = None
    # Bound from the step-size controller by `bind_controller_tols`.
    norm: Callable[[PyTree], Array] = eqx.field(default=rms_norm, static=True)
    safety: float = 0.9
    exponent: float = 2.0  # the controller's `error_order / icoeff`
    adaptive: bool = eqx.field(default=False, static=True)

    def __check_init__(self):
        if not isinstance(self.max_order, int) or not 1 <= self.max_order <= 5:
            raise ValueError(
                f"BDF: `max_order` must be an integer from 1 to 5, got "
                f"{self.max_order!r}."
            )
        if not isinstance(self.newton_max_steps, int) or self.newton_max_steps < 1:
            raise ValueError(
                "BDF: `newton_max_steps` must be a positive integer, got "
                f"{self.newton_max_steps!r}."
            )
        if not isinstance(self.linear_solver, AbstractLinearSolver):
            raise ValueError(
                "BDF: `linear_solver` must be an `AbstractLinearSolver` (e.g. "
                f"`DenseLinearSolver()`), got {type(self.linear_solver).__name__}."
            )
        mass = self.mass_matrix
        if mass is not None and (
            mass.ndim not in (1, 2)
            or (mass.ndim == 2 and mass.shape[0] != mass.shape[1])
            or not jnp.issubdtype(mass.dtype, jnp.number)
        ):
            raise ValueError(
                "BDF: `mass_matrix` must be None, a vector (a diagonal mass matrix) "
                f"or a square matrix of numbers, got shape {mass.shape} and dtype "
                f"{mass.dtype}."
            )

    def order(self, terms) -> int:
        return self.max_order

    def error_order(self, terms) -> float:
        # The first step is of order 1 (the controller's initial step uses this).
        return 2.0

    def bind_controller_tols(self, stepsize_controller) -> "BDF":
        controller = stepsize_controller
        while hasattr(controller, "controller"):  # `ClipStepSizeController`
            controller = controller.controller
        if not isinstance(controller, AbstractAdaptiveStepSizeController):
            if self.rtol is None or self.atol is None:
                raise ValueError(
                    "BDF takes the tolerances of its Newton solve from the step-size "
                    f"controller, but {type(controller).__name__} has none: pass "
                    "them, e.g. `BDF(rtol=1e-6, atol=1e-6)`, or use "
                    "`PIDController(rtol=..., atol=...)`."
                )
            return dataclasses.replace(self, adaptive=False)
        names = ("rtol", "atol", "safety", "icoeff", "pcoeff", "dcoeff", "norm")
        if not all(hasattr(controller, n) for n in names) or (
            controller.pcoeff != 0 or controller.dcoeff != 0  # pyright: ignore
        ):
            raise ValueError(
                "BDF chooses its own step sizes and orders and passes them to the "
                "controller through its error estimate, which only an I-controller "
                "reproduces: use `PIDController(rtol=..., atol=...)` with `pcoeff=0` "
                "and `dcoeff=0` (the defaults), optionally inside a "
                "`ClipStepSizeController`, or `ConstantStepSize`/`StepTo`; got "
                f"{type(stepsize_controller).__name__}."
            )
        c: Any = controller
        order = c.error_order if c.error_order is not None else 2.0
        return dataclasses.replace(
            self,
            rtol=c.rtol,
            atol=c.atol,
            norm=c.norm,
            safety=c.safety,
            exponent=order / c.icoeff,
            adaptive=True,
        )

    def _tols(self):
        if self.rtol is None or self.atol is None:
            raise ValueError(
                "BDF has no tolerances: pass `BDF(rtol=..., atol=...)` or solve with "
                "`diffeqsolve`, which takes them from the step-size controller."
            )
        return self.rtol, self.atol

    def _scaled_norm(self, x: Array, scale: Array, unravel) -> Array:
        return self.norm(unravel(x / scale))

    def init(self, terms, t0, t1, y0, args) -> BDFState:
        del t1
        flat0, unravel = ravel_pytree(y0)
        if not jnp.issubdtype(flat0.dtype, jnp.floating):
            raise ValueError(
                f"BDF: the state must be real floating point, got {flat0.dtype}."
            )
        dtype = flat0.dtype
        n = flat0.shape[0]
        mass = self.mass_matrix
        _check_mass(mass, n)
        rtol, atol = self._tols()
        n_terms, n_args, n_t0 = nograd((terms, args, t0))
        field = lambda x: _flat_field(n_terms, n_args, unravel, n_t0, x, dtype)
        _, jac = self.linear_solver.linearise(field, nograd(flat0))
        f0 = _flat_field(terms, args, unravel, t0, flat0, dtype)
        # y'(t0): M y' = f, with the algebraic components' derivatives unknown (0).
        if mass is None:
            yp0 = f0
        elif mass.ndim == 1:
            m = mass.astype(dtype)
            yp0 = jnp.where(m == 0, 0, f0 / jnp.where(m == 0, 1, m))
        else:
            pinv = jnp.linalg.pinv(mass.astype(dtype))
            yp0 = jnp.matmul(pinv, f0, precision="highest")
        scale = atol + rtol * jnp.abs(flat0)
        residual = algebraic_residual(mass, f0)
        consistent = self._scaled_norm(residual, scale, unravel) <= 1
        size = self.max_order + 3
        D = jnp.zeros((size, n), dtype).at[0].set(flat0).at[1].set(yp0)
        c0 = jnp.zeros((), dtype)
        shapes = jax.eval_shape(self.linear_solver.factorise, jac, c0, mass)
        factor = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        zero = jnp.asarray(0, jnp.int32)
        return BDFState(
            D=D,
            h=jnp.ones((), dtype),
            order=jnp.asarray(1, jnp.int32),
            n_equal=zero,
            jac=jax.tree_util.tree_map(lax.stop_gradient, jac),
            jac_age=zero,
            factor=factor,
            c_factor=c0,
            factor_age=zero,
            consistent=jnp.asarray(consistent),
        )

    def _newton(self, field, factor, c, y_pred, psi, scale, unravel):
        """The simplified Newton iteration (no derivatives): `(d, converged,
        iterations, unsolved)`, `unsolved` when it failed because a linear solve
        of a finite right-hand side was not finite (`M - cJ` singular)."""
        rtol, _ = self._tols()
        mass = self.mass_matrix
        eps = float(jnp.finfo(y_pred.dtype).eps)
        rtol = jnp.asarray(rtol, y_pred.dtype)
        tol = jnp.maximum(10 * eps / rtol, jnp.minimum(0.03, jnp.sqrt(rtol)))
        maxiter = self.newton_max_steps

        def cond(carry):
            i, _, _, done, fail, _ = carry
            return (i < maxiter) & ~done & ~fail

        def body(carry):
            i, d, old, _, _, _ = carry
            f = field(y_pred + d)
            rhs = c * f - mass_matvec(mass, psi + d)
            dy = self.linear_solver.solve(factor, rhs, field)
            dy_norm = self._scaled_norm(dy, scale, unravel).astype(old.dtype)
            have_rate = old >= 0
            rate = dy_norm / jnp.where(have_rate & (old > 0), old, 1)
            unsolved = jnp.all(jnp.isfinite(rhs)) & ~jnp.all(jnp.isfinite(dy))
            bad = ~jnp.all(jnp.isfinite(f)) | ~jnp.all(jnp.isfinite(dy))
            slow = rate ** (maxiter - i) / jnp.where(rate < 1, 1 - rate, 1) * dy_norm
            bad = bad | (have_rate & ((rate >= 1) | (slow > tol)))
            done = (dy_norm == 0) | (
                have_rate & (rate / jnp.where(rate < 1, 1 - rate, 1) * dy_norm < tol)
            )
            done = done & ~bad
            d = jnp.where(bad, d, d + dy)
            return i + 1, d, dy_norm, done, bad, unsolved

        real = jnp.zeros((), jnp.abs(y_pred).dtype)
        init = (
            jnp.asarray(0, jnp.int32),
            jnp.zeros_like(y_pred),
            real - 1,
            jnp.asarray(False),
            jnp.asarray(False),
            jnp.asarray(False),
        )
        i, d, _, done, _, unsolved = lax.while_loop(cond, body, init)
        return d, done, i, unsolved & ~done

    def _predict(self, state: BDFState, h: Array, dtype):
        """`(D, y_pred, psi, c)`: the differences rescaled to the step `h`, the
        predictor `Σ_{j<=k} D[j]`, `ψ` and `c = h/α_k`."""
        K = self.max_order
        gamma, alpha, _ = (jnp.asarray(a, dtype) for a in _coefficients(K, self.ndf))
        k = state.order
        D = _rescale(state.D, k, h / state.h, K)
        index = np.arange(K + 3)
        y_pred = jnp.sum(jnp.where(index[:, None] <= k, D, 0), axis=0)
        gammas = jnp.concatenate([gamma, jnp.zeros(1, dtype)])
        weights = jnp.where((index >= 1) & (index <= k), gammas, 0)
        psi = jnp.matmul(weights, D, precision="highest") / alpha[k]
        return D, y_pred, psi, h / alpha[k]

    def _solve_reusing(self, field, state: BDFState, c, y_pred, psi, scale, unravel):
        """The Newton solve (no derivatives) with CVODE's reuse rules: a new
        Jacobian when stale, a new factorisation when `c` changed or is old, and
        one retry with a new Jacobian after a failure with an old one.

        **Returns:** `(d, converged, iterations, singular, reuse)`, `reuse` the
        state's new `(jac, jac_age, factor, c_factor, factor_age)` (ages not yet
        advanced), `singular` whether `M - cJ` is singular whatever the step size
        (`_singular`).
        """
        linear_solver = self.linear_solver
        new_jac = lambda: nograd(linear_solver.linearise(field, y_pred)[1])
        new_factor = lambda jac: nograd(
            linear_solver.factorise(jac, c, self.mass_matrix)
        )
        stale = state.jac_age >= _REJAC_STEPS
        jac = _maybe(stale, new_jac, state.jac)
        jac_age = jnp.where(stale, 0, state.jac_age)
        c_old = state.c_factor
        change = jnp.abs(c - c_old) > _REFACTOR_CHANGE * jnp.abs(c_old)
        refactor = stale | (c_old == 0) | change | (state.factor_age >= _REFACTOR_STEPS)
        factor = _maybe(refactor, lambda: new_factor(jac), state.factor)
        factor_age = jnp.where(refactor, 0, state.factor_age)
        d, converged, iters, unsolved = self._newton(
            field, factor, c, y_pred, psi, scale, unravel
        )
        # A failed solve with an old Jacobian: a new Jacobian, at once.
        retry = ~converged & (jac_age > 0)

        def again():
            jac2 = new_jac()
            factor2 = new_factor(jac2)
            d2, conv2, it2, unsolved2 = self._newton(
                field, factor2, c, y_pred, psi, scale, unravel
            )
            return jac2, factor2, d2, conv2, iters + it2, unsolved2

        jac, factor, d, converged, iters, unsolved = _maybe(
            retry, again, (jac, factor, d, converged, iters, unsolved)
        )
        singular = self._singular(field, unsolved, jac, c)
        reuse = (
            jac,
            jnp.where(retry, 0, jac_age),
            factor,
            jnp.where(refactor | retry, c, c_old),
            jnp.where(retry, 0, factor_age),
        )
        return d, converged, iters, singular, reuse

    def _singular(self, field, unsolved: Array, jac, c: Array) -> Array:
        """Whether `M - cJ` is singular for every step size: with a singular mass
        matrix, a linear solve that failed at `c` (`unsolved`) fails again at
        `_PROBE_RATIO c` (a regular pencil is singular at finitely many `c`; with
        `M = I` never as `c` shrinks, nor is a Krylov solver's failure evidence of
        singularity). Then no step size helps: the solve ends with
        `RESULTS.singular` at once instead of shrinking the step to `max_steps`."""
        mass = self.mass_matrix
        if mass is None or isinstance(self.linear_solver, KrylovLinearSolver):
            return jnp.zeros_like(unsolved)

        def probe():
            ls = self.linear_solver
            factor = ls.factorise(jac, _PROBE_RATIO * c, mass)
            out = ls.solve(factor, jnp.ones(mass.shape[0], c.dtype), field)
            return ~jnp.all(jnp.isfinite(out))

        return _maybe(unsolved, lambda: nograd(probe()), jnp.zeros_like(unsolved))

    def _order_errors(self, D_new, d, k, err_scale, unravel):
        """The scaled error estimates of orders `k - 1`, `k` and `k + 1` (`inf`
        where that order does not exist), from `d` and the updated differences."""
        K = self.max_order
        error_const = jnp.asarray(_coefficients(K, self.ndf)[2], d.dtype)
        err = self._scaled_norm(error_const[k] * d, err_scale, unravel)
        rows = np.arange(K + 3)[:, None]
        pick = lambda i: jnp.sum(jnp.where(rows == i, D_new, 0), axis=0)
        big = jnp.asarray(jnp.inf, err.dtype)
        err_m = jnp.where(
            k > 1,
            self._scaled_norm(error_const[k - 1] * pick(k), err_scale, unravel),
            big,
        )
        err_p = jnp.where(
            k < K,
            self._scaled_norm(
                error_const[jnp.minimum(k + 1, K + 1)] * pick(k + 2),
                err_scale,
                unravel,
            ),
            big,
        )
        return err_m, err, err_p

    def _next_order(self, state: BDFState, errors, r, h, t1, iters, converged):
        """Shampine & Reichelt's choice of the next order and step-size factor.

        **Returns:** `(new_order, n_equal, controller_error)`, the last the error an
        I-controller turns into exactly the chosen factor.
        """
        err_m, err, err_p = errors
        dtype = h.dtype
        k = state.order
        same = jnp.abs(r - 1) <= 1e-6 + 64 * jnp.finfo(dtype).eps * jnp.abs(
            t1.astype(dtype)
        ) / jnp.abs(jnp.where(h == 0, 1, h))
        n_equal = jnp.where(same, state.n_equal + 1, 1)

        def grow(e, p):
            return jnp.where(e == 0, jnp.asarray(1e10, e.dtype), e ** (-1.0 / p))

        kf = k.astype(err.dtype)
        factors = jnp.stack([grow(err_m, kf), grow(err, kf + 1), grow(err_p, kf + 2)])
        choice = jnp.argmax(factors).astype(jnp.int32)
        m = self.newton_max_steps
        damp = (2 * m + 1) / (2 * m + iters.astype(err.dtype))
        select = n_equal >= k + 1
        new_order = jnp.clip(jnp.where(select, k + choice - 1, k), 1, self.max_order)
        hold = _HOLD_FACTOR / self.safety
        grow_factor = jnp.where(select, damp * jnp.max(factors), hold)
        accepted = converged & (err <= 1)
        target = jnp.where(accepted, grow_factor, damp * grow(err, kf + 1))
        target = jnp.where(converged, target, _NEWTON_FAIL_FACTOR / self.safety)
        # The controller's factor is `safety * target`, at least 1 on acceptance.
        target = jnp.where(accepted, jnp.maximum(target, hold), target)
        target = jnp.maximum(target, jnp.asarray(1e-10, target.dtype))
        controller_error = target ** (-self.exponent)
        # On rejection, surely beyond the tolerance whatever the rounding.
        controller_error = jnp.where(
            accepted, controller_error, jnp.maximum(controller_error, 1.01)
        )
        return new_order, n_equal, controller_error

    def _report(self, state: BDFState, d, scaled_error, converged):
        """`(y_error, result)` for the step-size controller (flat, unravelled by
        the caller): the scaled controller error when adaptive, else the local error
        estimate `E_k d` and a failed Newton solve as an error."""
        if self.adaptive:
            y_error = lax.stop_gradient(scaled_error)
            result = RESULTS.successful
        else:
            error_const = _coefficients(self.max_order, self.ndf)[2]
            y_error = jnp.asarray(error_const, d.dtype)[state.order] * d
            result = RESULTS.where(
                converged, RESULTS.successful, RESULTS.implicit_nonconvergence
            )
        result = RESULTS.where(
            state.consistent, result, RESULTS.inconsistent_initial_values
        )
        return y_error, result

    def step(self, terms, t0, t1, y0, args, solver_state: BDFState, made_jump=False):
        del made_jump
        state = solver_state
        rtol, atol = self._tols()
        flat0, unravel = ravel_pytree(y0)
        dtype = flat0.dtype
        mass = self.mass_matrix
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = (t1 - t0).astype(dtype)
        k = state.order
        D, y_pred, psi, c = self._predict(state, h, dtype)

        # The Newton solve, without derivatives, then the derivative of the exact
        # solution (implicit function theorem).
        n_terms, n_args, n_t1, n_c, n_y_pred, n_psi = nograd(
            (terms, args, t1, c, y_pred, psi)
        )
        field = lambda x: _flat_field(n_terms, n_args, unravel, n_t1, x, dtype)
        scale = atol + rtol * jnp.abs(n_y_pred)
        d, converged, iters, singular, reuse = self._solve_reusing(
            field, state, n_c, n_y_pred, n_psi, scale, unravel
        )
        dynamic, static = eqx.partition(
            (terms, args, mass, self.linear_solver, unravel), eqx.is_array
        )
        d = _correction(static, lax.stop_gradient(d), t1, c, y_pred, psi, dynamic)
        y1 = y_pred + d
        D_new = _update(D, d, k)

        # Error estimate and the next step's order and size.
        err_scale = atol + rtol * jnp.maximum(jnp.abs(flat0), jnp.abs(y1))
        err_scale = lax.stop_gradient(err_scale)
        errors = self._order_errors(
            lax.stop_gradient(D_new), lax.stop_gradient(d), k, err_scale, unravel
        )
        new_order, n_equal, controller_error = self._next_order(
            state, errors, h / state.h, h, t1, iters, converged
        )
        # The controller measures `norm(y_error / err_scale)`; for a vector of
        # equal entries `e` any norm gives `e · norm(ones)` (`√n e` for the 2-norm),
        # so that is divided out: the controller sees `controller_error` exactly.
        unit = self.norm(unravel(jnp.ones_like(flat0))).astype(dtype)
        unit = jnp.where(unit > 0, unit, 1)
        y_error, result = self._report(
            state,
            lax.stop_gradient(d),
            controller_error / unit * err_scale,
            converged,
        )
        result = RESULTS.where(singular, RESULTS.singular, result)
        jac, jac_age, factor, c_factor, factor_age = reuse
        new_state = BDFState(
            D=D_new,
            h=h,
            order=new_order.astype(jnp.int32),
            n_equal=jnp.where(new_order != k, 0, n_equal).astype(jnp.int32),
            jac=jac,
            jac_age=(jac_age + 1).astype(jnp.int32),
            factor=factor,
            c_factor=c_factor,
            factor_age=(factor_age + 1).astype(jnp.int32),
            consistent=state.consistent,
        )
        dense = BDFDense(y1=unravel(y1), D=D_new[1 : self.max_order + 1], order=k)
        return unravel(y1), unravel(y_error), dense, new_state, result

    def interpolate(self, dense_info: BDFDense, t0: Array, t1: Array, t) -> PyTree:
        flat1, unravel = ravel_pytree(dense_info.y1)
        dtype = flat1.dtype
        h = jnp.asarray(t1 - t0)
        x = ((t - t1) / where(h == 0, 1, h)).astype(dtype)
        K = dense_info.D.shape[0]
        j = np.arange(K)
        # Π_{i<j'} (x + i)/(i + 1) for j' = j + 1 = 1..K.
        weights = jnp.cumprod((x + j) / (j + 1))
        weights = jnp.where(j + 1 <= dense_info.order, weights, 0).astype(dtype)
        return unravel(flat1 + jnp.matmul(weights, dense_info.D, precision="highest"))
