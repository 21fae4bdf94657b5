"""BiCGStab, right-preconditioned, for `KrylovLinearSolver(method="bicgstab")`.

Written here rather than taken from lineax because of two cases that lineax's
iteration (0.1) turns into NaN, both of which a stiff solver's reverse mode meets:

- the half step already solves the system, `s = 0` (an exact preconditioner, such as
  a banded one for a field whose Jacobian lies in its bands, on a cotangent that
  excites one block): lineax then forms `ω = (t·s)/(t·t) = 0/0`;
- the right-hand side is zero (a zero cotangent, a state at equilibrium):
  `α = 0/0`.

Here the half step's residual is tested first (and the iteration stops there), a
zero right-hand side gives `x = 0` without an iteration, and every quotient is
guarded: a true breakdown (`ρ = 0`, `r̂·v = 0` or `ω = 0` before convergence) is
reported as a failure, never computed through.

??? cite "Reference"

    H. A. van der Vorst, "Bi-CGSTAB: a fast and smoothly converging variant of
    Bi-CG for the solution of nonsymmetric linear systems", *SIAM J. Sci. Stat.
    Comput.* 13(2), 1992, pp. 631-644.
"""

from collections.abc import Callable

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


_RUNNING, _CONVERGED, _FAILED = 0, 1, 2


class _State(eqx.Module):
    x: Float[Array, " n"]
    r: Float[Array, " n"]
    p: Float[Array, " n"]
    v: Float[Array, " n"]
    rho: Float[Array, ""]
    alpha: Float[Array, ""]
    omega: Float[Array, ""]
    step: Int[Array, ""]
    status: Int[Array, ""]


def _dot(a: Array, b: Array) -> Array:
    return jnp.vdot(a, b, precision=lax.Precision.HIGHEST)


def _quotient(num: Array, den: Array) -> Array:
    """`num / den`, and 0 where `den == 0` (never a NaN, even unselected)."""
    return num / jnp.where(den == 0, jnp.ones_like(den), den)


def bicgstab(
    matvec: Callable[[Array], Array],
    precondition: Callable[[Array], Array] | None,
    b: Float[Array, " n"],
    rtol: float,
    atol: float,
    max_steps: int,
) -> Float[Array, " n"]:
    """`A^{-1} b` by BiCGStab with right preconditioning (`A K y = b`, `x = K y`),
    from `x = 0`, until `|r_i| <= atol + rtol |b_i|` for every `i`.

    **Arguments:**

    - `matvec`: `v -> A v`.
    - `precondition`: `v -> K v`, `K ≈ A^{-1}` linear; or `None` (the identity).
    - `b`: the right-hand side, `(n,)`.
    - `rtol`, `atol`: the stopping rule above (on the recursively updated residual).
    - `max_steps`: the most iterations.

    **Returns:**

    The solution, `(n,)`: exactly 0 for `b = 0`, NaN everywhere if the iteration
    breaks down or does not converge within `max_steps`.
    """
    apply = (lambda v: v) if precondition is None else precondition
    scale = atol + rtol * jnp.abs(b)

    def small(r: Array) -> Bool[Array, ""]:
        return jnp.all(jnp.abs(r) <= scale)

    def body(s: _State) -> _State:
        rho = _dot(b, s.r)  # the shadow residual is the first one, b
        beta = _quotient(rho, s.rho) * _quotient(s.alpha, s.omega)
        p = s.r + beta * (s.p - s.omega * s.v)
        p_hat = apply(p)
        v = matvec(p_hat)
        bv = _dot(b, v)
        alpha = _quotient(rho, bv)
        x_half = s.x + alpha * p_hat
        r_half = s.r - alpha * v
        half_done = small(r_half)
        s_hat = apply(r_half)
        t = matvec(s_hat)
        omega = jnp.where(half_done, 1, _quotient(_dot(t, r_half), _dot(t, t)))
        x = jnp.where(half_done, x_half, x_half + omega * s_hat)
        r = jnp.where(half_done, r_half, r_half - omega * t)
        broke = (rho == 0) | (bv == 0) | (omega == 0)
        status = jnp.where(
            half_done | small(r), _CONVERGED, jnp.where(broke, _FAILED, _RUNNING)
        )
        return _State(x, r, p, v, rho, alpha, omega, s.step + 1, status)

    def cond(s: _State) -> Bool[Array, ""]:
        return (s.status == _RUNNING) & (s.step < max_steps)

    zero = jnp.zeros_like(b)
    one = jnp.ones((), b.dtype)
    status = jnp.where(small(b), _CONVERGED, _RUNNING)
    init = _State(zero, b, zero, zero, one, one, one, jnp.array(0), status)
    final = lax.while_loop(cond, body, init)
    return jnp.where(final.status == _CONVERGED, final.x, jnp.nan)
