"""The formulas of `BDF` (`_bdf.py`), as functions of arrays: the NDF coefficients,
the choice of the next order and step size (Shampine & Reichelt 1997), the
simplified Newton iteration, the derivative of its solution by the implicit
function theorem, and the mass matrix's checks (the difference array's algebra is
in `_bdf_rows.py`). The functions that take `solver` read only its fields."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array

from .._linear._linear_solver import mass_matvec
from ._bdf_rows import pick, row


# The most Newton iterations' worth of step-size damping (Shampine & Reichelt's
# `(2m + 1) / (2m + iterations)`) and the factor after a failed Newton solve.
_NEWTON_FAIL_FACTOR = 0.5
# The controller's factor for "keep this step size" is below 1 and so clipped to 1.
_HOLD_FACTOR = 0.999
# NDF coefficients κ_k of Shampine & Reichelt (1997), Table 1 (orders 1 to 5; order 6
# is used only for the error estimate of order `k + 1`). With κ = 0, the BDFs.
KAPPA_NDF = (0.0, -0.1850, -1.0 / 9.0, -0.0823, -0.0415, 0.0, 0.0)


def coefficients(max_order: int, ndf: bool):
    """`(γ, α, E)` for orders `0..max_order + 1`: `γ_k = Σ_{i<=k} 1/i`, the leading
    coefficient `α_k = (1 - κ_k) γ_k`, and the error constant `E_k = κ_k γ_k +
    1/(k+1)`."""
    size = max_order + 2
    kappa = np.array(KAPPA_NDF[:size] if ndf else [0.0] * size)
    gamma = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, size))])
    alpha = (1 - kappa) * gamma
    error = kappa * gamma + 1 / (np.arange(size) + 1)
    return gamma, alpha, error


def correction(static, d, t1, c, y_pred, psi, dynamic):
    """`d`, the converged Newton correction, with the derivative of the exact
    solution of `G(d) = c f(t1, y_pred + d) - M (ψ + d) = 0` by the implicit function
    theorem: `d' = (M - c J)^{-1} ∂G/∂(t1, c, y_pred, ψ, field)`, with `J` the exact
    Jacobian at `y_pred + d` (the linear solver linearised there anew). `static` is
    the non-array part of `dynamic`'s `(terms, args, mass, linear_solver,
    unravel)`; the mass matrix is differentiated too (`∂G/∂M = -(ψ + d)`)."""
    fn = jax.custom_jvp(lambda d, t1, c, y_pred, psi, dynamic: d)

    def residual(d, t1, c, y_pred, psi, dynamic):
        terms, args, mass, _, unravel = eqx.combine(dynamic, static)
        f = flat_field(terms, args, unravel, t1, y_pred + d, d.dtype)
        return c * f - mass_matvec(mass, psi + d)

    @fn.defjvp
    def _jvp(primals, tangents):
        d, t1, c, y_pred, psi, dynamic = primals
        terms, args, mass, linear_solver, unravel = eqx.combine(dynamic, static)
        field = lambda x: flat_field(terms, args, unravel, t1, x, d.dtype)
        _, jac = linear_solver.linearise(field, y_pred + d)
        factor = linear_solver.factorise(jac, c, mass)
        _, dg = jax.jvp(lambda *p: residual(d, *p), primals[1:], tangents[1:])
        return d, linear_solver.solve_tangent(factor, dg, field)

    return fn(d, t1, c, y_pred, psi, dynamic)


def flat_field(terms, args, unravel, t, x, dtype) -> Array:
    out = terms.vf(t, unravel(x), args)
    return ravel_pytree(out)[0].astype(dtype)


def newton(solver, field, factor, c, y_pred, psi, size: Callable[[Array], Array]):
    """The simplified Newton iteration of `BDF` `solver` (no derivatives), `size`
    the norm of a scaled increment.

    **Returns:** `(d, converged, iterations, unsolved)`, `unsolved` when it failed
    because a linear solve of a finite right-hand side was not finite (`M - cJ`
    singular).
    """
    rtol, _ = solver._tols()
    mass = solver.mass_matrix
    eps = float(jnp.finfo(y_pred.dtype).eps)
    rtol = jnp.asarray(rtol, y_pred.dtype)
    tol = jnp.maximum(10 * eps / rtol, jnp.minimum(0.03, jnp.sqrt(rtol)))
    maxiter = solver.newton_max_steps

    def cond(carry):
        i, _, _, done, fail, _ = carry
        return (i < maxiter) & ~done & ~fail

    def body(carry):
        i, d, old, _, _, _ = carry
        f = field(y_pred + d)
        rhs = c * f - mass_matvec(mass, psi + d)
        dy = solver.linear_solver.solve(factor, rhs, field)
        dy_norm = size(dy).astype(old.dtype)
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


def check_mass(mass: Array | None, n: int) -> None:
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


def to_mass(mass) -> Array | None:
    return None if mass is None else jnp.asarray(mass)


def order_errors(solver, D_new, d, k, size: Callable[[Array], Array]):
    """The scaled error estimates of `BDF` `solver` of orders `k - 1`, `k` and
    `k + 1` (`inf` where that order does not exist), from `d` and the updated
    differences, `size` the norm of a scaled error."""
    K = solver.max_order
    error_const = coefficients(K, solver.ndf)[2]
    const = lambda i: pick(error_const, i, d.dtype)
    err = size(const(k) * d)
    big = jnp.asarray(jnp.inf, err.dtype)
    err_m = jnp.where(k > 1, size(const(k - 1) * row(D_new, k)), big)
    err_p = jnp.where(k < K, size(const(k + 1) * row(D_new, k + 2)), big)
    return err_m, err, err_p


def next_order(solver, state, errors, r, h, t1, iters, converged):
    """Shampine & Reichelt's choice of `BDF` `solver`'s next order and step-size
    factor, after a step from `state` (a `BDFState`).

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
    f_m, f, f_p = grow(err_m, kf), grow(err, kf + 1), grow(err_p, kf + 2)
    # The first largest (as `argmax`), by comparisons: no stack of scalars.
    first = (f_m >= f) & (f_m >= f_p)
    choice = jnp.where(first, 0, jnp.where(f >= f_p, 1, 2)).astype(jnp.int32)
    largest = jnp.maximum(jnp.maximum(f_m, f), f_p)
    m = solver.newton_max_steps
    damp = (2 * m + 1) / (2 * m + iters.astype(err.dtype))
    select = n_equal >= k + 1
    new_order = jnp.clip(jnp.where(select, k + choice - 1, k), 1, solver.max_order)
    hold = _HOLD_FACTOR / solver.safety
    grow_factor = jnp.where(select, damp * largest, hold)
    accepted = converged & (err <= 1)
    target = jnp.where(accepted, grow_factor, damp * grow(err, kf + 1))
    target = jnp.where(converged, target, _NEWTON_FAIL_FACTOR / solver.safety)
    # The controller's factor is `safety * target`, at least 1 on acceptance.
    target = jnp.where(accepted, jnp.maximum(target, hold), target)
    target = jnp.maximum(target, jnp.asarray(1e-10, target.dtype))
    controller_error = target ** (-solver.exponent)
    # On rejection, surely beyond the tolerance whatever the rounding.
    controller_error = jnp.where(
        accepted, controller_error, jnp.maximum(controller_error, 1.01)
    )
    return new_order, n_equal, controller_error
