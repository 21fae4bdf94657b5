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

**Jacobian and factorisation reuse** (the rules of CVODE, Hindmarsh et al. 2005, in
`_reuse.py`): the iteration matrix is refactorised when `h/α` changed by more than 30%
or after 20 steps, and the Jacobian is computed anew after 50 steps, or when a Newton
solve failed with an old one (the step is then retried at once with the new
Jacobian). A rejected step keeps them, as SciPy's BDF does. All linear algebra goes
through the linear-solver protocol (`_linear/_linear_solver.py`).

**Derivatives.** The Newton solve runs on values without derivatives (its reused
Jacobian is not the Jacobian at the solution); its result is then given the derivative
of the exact solution by the implicit function theorem, with the linear solver
linearised anew at the solution (`_bdf_formulas.correction`). So forward and reverse
mode see the derivative of the discrete scheme, whatever Jacobian the solve reused.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from .._controller._norm import rms_norm
from .._custom_types import RealScalarLike
from .._linear._krylov import KrylovLinearSolver
from .._linear._linear_solver import (
    AbstractLinearSolver,
    algebraic_residual,
    DenseLinearSolver,
)
from .._select import where
from .._solution import RESULTS
from .._tolerances import Tolerances
from .._tree import nograd, tree_where
from . import _bdf_rows as rows, _reuse as reuse
from ._base import AbstractAdaptiveSolver
from ._bdf_formulas import (
    check_mass,
    coefficients,
    correction,
    flat_field,
    newton as bdf_newton,
    next_order,
    order_errors,
    to_mass,
)
from ._local_interpolation import AbstractLocalInterpolation
from ._reuse import Cache


# A failed linear solve is tried again at this fraction of `c = h/α` to tell a
# singular pencil `M - cJ` (singular for every `c`) from an unlucky `c` (a root of
# `det(M - cJ)`); not a simple ratio, which a structured problem might hit twice.
_PROBE_RATIO = 0.29


class BDFState(NamedTuple):
    """The solver's state between steps: arrays only. A rejected step reverts all
    but the `cache`."""

    D: Array  # (max_order + 3, n): backward differences, scaled for step `h`
    h: Array  # the step the differences are scaled for
    order: Array  # int32, the order of the next step
    n_equal: Array  # int32, steps taken since the step size last changed
    consistent: Array  # bool: the initial values satisfy the algebraic equations
    # The Jacobian and the factor of `M - c J` (for `c = h/α`), kept by a rejected
    # step (`BDF.revert`).
    cache: Cache


class BDFDense(NamedTuple):
    """One step's dense output: the interpolating polynomial of order `order` through
    the step's end and the `order` points before it, `h` apart."""

    y1: PyTree
    D: Array  # (max_order, n): the differences D[1..max_order] after the step
    order: Array


class BDFInterpolation(AbstractLocalInterpolation):
    """BDF's dense output from its `step`'s `dense_info`: the interpolating
    polynomial of order `order` through the step's end and the `order` points before
    it, `h` apart (solverkit's; diffrax 0.7.2 has no BDF solver).

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y1`: the solution at its end.
    - `D`: `(max_order, n)` the differences after the step, on the ravelled state.
    - `order`: the order of the step.
    """

    y1: PyTree
    D: Array
    order: Array

    def at(self, t: RealScalarLike) -> PyTree:
        t0, t1 = jnp.asarray(self.t0), jnp.asarray(self.t1)
        return _bdf_at(self.y1, self.D, self.order, t0, t1, t)


def _bdf_at(y1: PyTree, D: Array, order: Array, t0: Array, t1: Array, t) -> PyTree:
    flat1, unravel = ravel_pytree(y1)
    dtype = flat1.dtype
    h = jnp.asarray(t1 - t0)
    x = ((t - t1) / where(h == 0, 1, h)).astype(dtype)
    weights = rows.interpolation_weights(x, order, D.shape[0])
    return unravel(flat1 + rows.masked_sum(D, weights, [True] * D.shape[0]))


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
        `ConstantStepSize` or `StepTo`. The Newton solve stops at an increment of
        `max(10 eps / rtol, min(0.03, sqrt(rtol)))` in the error's units (`eps` of
        the state's dtype): in float32 at `rtol = 1e-7` that is about 12, two
        iterations a step (Van der Pol, measured), so steps do not collapse there.

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
    mass_matrix: Array | None = eqx.field(default=None, converter=to_mass)
    interpolation_cls: ClassVar[Any] = BDFInterpolation
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

    def bind_controller_tols(self, tolerances: Tolerances | None) -> "BDF":
        if tolerances is None:  # a fixed controller: the order still adapts
            if self.rtol is None or self.atol is None:
                raise ValueError(
                    "BDF takes the tolerances of its Newton solve from the step-size "
                    "controller, but this one has none: pass them, e.g. "
                    "`BDF(rtol=1e-6, atol=1e-6)`, or use "
                    "`PIDController(rtol=..., atol=...)`."
                )
            return dataclasses.replace(self, adaptive=False)
        control = tolerances.i_control
        if control is None:
            raise ValueError(
                "BDF chooses its own step sizes and orders and passes them to the "
                "controller through its error estimate, which only an I-controller "
                "reproduces: use `PIDController(rtol=..., atol=...)` with `pcoeff=0` "
                "and `dcoeff=0` (the defaults), optionally inside a "
                "`ClipStepSizeController`, or `ConstantStepSize`/`StepTo`."
            )
        order = 2.0 if control.error_order is None else control.error_order
        return dataclasses.replace(
            self,
            rtol=tolerances.rtol,
            atol=tolerances.atol,
            norm=tolerances.norm,
            safety=control.safety,
            exponent=order / control.icoeff,
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
        check_mass(mass, n)
        rtol, atol = self._tols()
        n_terms, n_args, n_t0 = nograd((terms, args, t0))
        field = lambda x: flat_field(n_terms, n_args, unravel, n_t0, x, dtype)
        _, jac = self.linear_solver.linearise(field, nograd(flat0))
        f0 = flat_field(terms, args, unravel, t0, flat0, dtype)
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
        return BDFState(
            D=D,
            h=jnp.ones((), dtype),
            order=jnp.asarray(1, jnp.int32),
            n_equal=jnp.asarray(0, jnp.int32),
            consistent=jnp.asarray(consistent),
            cache=reuse.start(
                jax.tree_util.tree_map(lax.stop_gradient, jac), factor, c0
            ),
        )

    def revert(self, accepted, new_state: BDFState, old_state: BDFState) -> BDFState:
        # A rejected step keeps its Jacobian and factor (SciPy's BDF does too).
        return tree_where(accepted, new_state, old_state)._replace(
            cache=new_state.cache
        )

    def _predict(self, state: BDFState, h: Array, dtype):
        """`(D, y_pred, psi, c)`: the differences rescaled to the step `h`, the
        predictor `Σ_{j<=k} D[j]`, `ψ` and `c = h/α_k`."""
        K = self.max_order
        gamma, alpha, _ = coefficients(K, self.ndf)
        k = state.order
        D = rows.rescale(state.D, k, h / state.h, K)
        y_pred, psi = rows.predict(D, k, gamma, alpha)
        return D, y_pred, psi, h / rows.pick(alpha, k, dtype)

    def _solve_reusing(self, field, state: BDFState, c, y_pred, psi, scale, unravel):
        """The Newton solve (no derivatives) with CVODE's reuse rules (`_reuse.py`).

        **Returns:** `(d, converged, iterations, singular, cache)`, `cache` the
        state's new one (ages not yet advanced), `singular` whether `M - cJ` is
        singular whatever the step size (`_singular`).
        """
        linear_solver = self.linear_solver
        new_jac = lambda: nograd(linear_solver.linearise(field, y_pred)[1])
        new_factor = lambda jac, c: nograd(
            linear_solver.factorise(jac, c, self.mass_matrix)
        )
        size = lambda x: self._scaled_norm(x, scale, unravel)
        newton = lambda factor: bdf_newton(self, field, factor, c, y_pred, psi, size)
        cache, refactored = reuse.refresh(state.cache, c, new_jac, new_factor)
        out = newton(cache.factor)

        def again(factor):
            d, converged, iters, unsolved = newton(factor)
            return d, converged, out[2] + iters, unsolved

        cache, out, _ = reuse.retry(
            cache, refactored, ~out[1], c, new_jac, new_factor, again, out
        )
        d, converged, iters, unsolved = out
        singular = self._singular(field, unsolved, cache.jac, c)
        return d, converged, iters, singular, cache

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

        return reuse.maybe(unsolved, lambda: nograd(probe()), jnp.zeros_like(unsolved))

    def _report(self, state: BDFState, d, scaled_error, converged):
        """`(y_error, result)` for the step-size controller (flat, unravelled by
        the caller): the scaled controller error when adaptive, else the local error
        estimate `E_k d` and a failed Newton solve as an error."""
        if self.adaptive:
            y_error = lax.stop_gradient(scaled_error)
            result = RESULTS.successful
        else:
            error_const = coefficients(self.max_order, self.ndf)[2]
            y_error = rows.pick(error_const, state.order, d.dtype) * d
            result = RESULTS.where(
                converged, RESULTS.successful, RESULTS.implicit_nonconvergence
            )
        result = RESULTS.where(
            state.consistent, result, RESULTS.inconsistent_initial_values
        )
        return y_error, result

    def step(self, terms, t0, t1, y0, args, solver_state: BDFState, made_jump=False):
        """One step; `dense_info` is `dict(y1=, D=, order=)`, as
        `interpolation_cls(t0=, t1=, **dense_info)` takes it."""
        y1, error, dense, state, result = self.loop_step(
            terms, t0, t1, y0, args, solver_state, made_jump
        )
        return y1, error, dense._asdict(), state, result

    def loop_step(
        self, terms, t0, t1, y0, args, solver_state: BDFState, made_jump=False
    ):
        """`step` as the loop takes it, `dense_info` a `BDFDense`."""
        del made_jump
        state = solver_state
        rtol, atol = self._tols()
        flat0, unravel = ravel_pytree(y0)
        dtype = flat0.dtype
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = (t1 - t0).astype(dtype)
        k = state.order
        D, y_pred, psi, c = self._predict(state, h, dtype)
        predicted = (t1, c, y_pred, psi)
        d, converged, iters, singular, cache = self._correct(
            terms, args, predicted, state, unravel, dtype
        )
        y1 = y_pred + d
        D_new = rows.update(D, d, k)

        # Error estimate and the next step's order and size.
        err_scale = atol + rtol * jnp.maximum(jnp.abs(flat0), jnp.abs(y1))
        err_scale = lax.stop_gradient(err_scale)
        size = lambda x: self._scaled_norm(x, err_scale, unravel)
        errors = order_errors(
            self, lax.stop_gradient(D_new), lax.stop_gradient(d), k, size
        )
        new_order, n_equal, controller_error = next_order(
            self, state, errors, h / state.h, h, t1, iters, converged
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
        new_state = BDFState(
            D=D_new,
            h=h,
            order=new_order.astype(jnp.int32),
            n_equal=jnp.where(new_order != k, 0, n_equal).astype(jnp.int32),
            consistent=state.consistent,
            cache=reuse.advance(cache),
        )
        dense = BDFDense(y1=unravel(y1), D=D_new[1 : self.max_order + 1], order=k)
        return unravel(y1), unravel(y_error), dense, new_state, result

    def _correct(self, terms, args, predicted, state: BDFState, unravel, dtype):
        """`loop_step`'s corrector: the Newton solve for the correction `d` to the
        prediction `predicted = (t1, c, y_pred, psi)`, without derivatives, then
        the derivative of the exact solution (implicit function theorem). Returns
        `(d, converged, iters, singular, cache)`."""
        t1, c, y_pred, psi = predicted
        rtol, atol = self._tols()
        n_terms, n_args, n_t1, n_c, n_y_pred, n_psi = nograd(
            (terms, args, t1, c, y_pred, psi)
        )
        field = lambda x: flat_field(n_terms, n_args, unravel, n_t1, x, dtype)
        scale = atol + rtol * jnp.abs(n_y_pred)
        d, converged, iters, singular, cache = self._solve_reusing(
            field, state, n_c, n_y_pred, n_psi, scale, unravel
        )
        dynamic, static = eqx.partition(
            (terms, args, self.mass_matrix, self.linear_solver, unravel), eqx.is_array
        )
        d = correction(static, lax.stop_gradient(d), t1, c, y_pred, psi, dynamic)
        return d, converged, iters, singular, cache

    def interpolate(self, dense_info, t0: Array, t1: Array, t) -> PyTree:
        """The dense output at `t`, from `step`'s or `loop_step`'s `dense_info`."""
        info = dense_info if isinstance(dense_info, dict) else dense_info._asdict()
        return _bdf_at(info["y1"], info["D"], info["order"], t0, t1, t)
