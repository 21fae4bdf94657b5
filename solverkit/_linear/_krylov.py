"""`KrylovLinearSolver`: matrix-free Newton–Krylov (GMRES from lineax, BiCGStab
from `_bicgstab.py`), with an optional preconditioner (another linear solver, or a
user callable closure-converted on entry)."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import lineax as lx
from jaxtyping import Array

from .._closure._convert import Closure, closure_convert
from .._tree import nograd
from ._bicgstab import bicgstab
from ._linear_solver import (
    AbstractLinearSolver,
    check_mass,
    check_point,
    FlatFn,
    mass_matvec,
)


class _KrylovFactor(eqx.Module):
    point: Array
    gamma_h: Array
    mass: Array | None
    preconditioner: Any


class KrylovLinearSolver(AbstractLinearSolver):
    """Matrix-free Newton–Krylov: no Jacobian is formed; each product with
    `M - γh J` is one Jacobian-vector product of the field at the linearisation
    point, inside GMRES (lineax's) or BiCGStab (solverkit's, which stops at an
    exact half step and returns 0 for a zero right-hand side, where lineax's
    divides by zero).

    For large systems whose Jacobian is too wide to factorise (2-D and 3-D PDEs),
    ideally with a preconditioner. Derivatives of a solve (with respect to the
    right-hand side, the point and whatever the field closes over) are implicit,
    exact up to the tolerances (lineax's rule for GMRES's `solve`; otherwise the
    same iteration with the transposed operator and preconditioner), and never
    taken through the preconditioner.

    **Arguments:**

    - `method`: `"gmres"` (the robust default) or `"bicgstab"` (less memory, may
      break down: then NaN, see below).
    - `rtol`, `atol`: the stopping rule, `|r| <= atol + rtol |b|` in the max norm
      (lineax's GMRES also asks the last update to be as small relative to `x`).
    - `max_steps`: the most iterations.
    - `restart`: GMRES's restart length.
    - `preconditioner`: `None`; another linear solver (a
      [`BandedLinearSolver`][solverkit.BandedLinearSolver] or
      [`SparseLinearSolver`][solverkit.SparseLinearSolver] of an approximate
      pattern, with `check=False`), linearised and factorised along with this one and
      applied as `(M - γh J̃)^{-1}`; or a callable `p(v, point, gamma_h)` returning
      an approximation of `(M - γh J(point))^{-1} v`, linear in `v`. Like the
      vector field, the callable may close over anything (a differentiated or
      vmapped value): `diffeqsolve` closure-converts it on entry (for
      `BacksolveAdjoint`, pass the backward solve a solver of its own).

    A solve that does not converge within `max_steps` (or breaks down) returns NaN,
    so that a stiff solver rejects the step; no error is raised.
    """

    method: str = eqx.field(static=True, default="gmres")
    rtol: float = eqx.field(static=True, default=1e-7)
    atol: float = eqx.field(static=True, default=1e-10)
    max_steps: int = eqx.field(static=True, default=256)
    restart: int = eqx.field(static=True, default=20)
    preconditioner: AbstractLinearSolver | Callable | None = None

    def __check_init__(self):
        if self.method not in ("gmres", "bicgstab"):
            raise ValueError(
                "KrylovLinearSolver: `method` must be 'gmres' or 'bicgstab', got "
                f"{self.method!r}"
            )
        p = self.preconditioner
        if not (p is None or isinstance(p, AbstractLinearSolver) or callable(p)):
            raise ValueError(
                "KrylovLinearSolver: `preconditioner` must be None, a linear solver "
                f"or a callable; got {type(self.preconditioner).__name__}"
            )

    def closure_converted(self, x: jax.ShapeDtypeStruct) -> "KrylovLinearSolver":
        p = self.preconditioner
        if isinstance(p, AbstractLinearSolver):
            return dataclasses.replace(self, preconditioner=p.closure_converted(x))
        if p is None or isinstance(p, Closure):
            return self
        gamma_h = jax.ShapeDtypeStruct((), x.dtype)
        closed = closure_convert(p, x, x, gamma_h)
        out = closed.out_struct
        if not (
            isinstance(out, jax.ShapeDtypeStruct)
            and out.shape == x.shape
            and jnp.issubdtype(out.dtype, jnp.inexact)
        ):
            raise ValueError(
                "KrylovLinearSolver: `preconditioner(v, point, gamma_h)` must return "
                f"an array of the shape of `v`, {x.shape}, of floating dtype; got "
                f"{out}"
            )
        return dataclasses.replace(self, preconditioner=closed)

    def holds_converted_callable(self) -> bool:
        p = self.preconditioner
        if isinstance(p, AbstractLinearSolver):
            return p.holds_converted_callable()
        return isinstance(p, Closure)

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Any]:
        check_point(fn, x, "KrylovLinearSolver")
        if isinstance(self.preconditioner, AbstractLinearSolver):
            value, jac = self.preconditioner.linearise(fn, x)
            return value, (x, jac)
        return fn(x), (x, None)

    def factorise(self, jac: Any, gamma_h: Array, mass: Array | None):
        point, approximate = jac
        check_mass(mass, point.shape[0], "KrylovLinearSolver")
        gamma_h = jnp.asarray(gamma_h, point.dtype)
        factor = None
        if isinstance(self.preconditioner, AbstractLinearSolver):
            factor = self.preconditioner.factorise(approximate, gamma_h, mass)
        return _KrylovFactor(point, gamma_h, mass, factor)

    def solve(self, factor: _KrylovFactor, rhs: Array, fn: FlatFn) -> Array:
        if self.method == "bicgstab":
            return self.solve_tangent(factor, rhs, fn)
        b = rhs.astype(factor.point.dtype)
        matvec = self._matvec(factor, fn)
        x = self._lineax(matvec, self._preconditioner(factor, fn, b), b)
        return x.astype(rhs.dtype)

    def solve_tangent(self, factor: _KrylovFactor, rhs: Array, fn: FlatFn) -> Array:
        # The iteration (and its NaN on failure) as a black box, declared linear in
        # `rhs`: transposed by the same iteration with `(M - γh J)^T` and the
        # transposed preconditioner, differentiated only through the operator.
        b = rhs.astype(factor.point.dtype)
        precondition = self._preconditioner(factor, fn, b)
        transposed = None if precondition is None else precondition.transpose()
        x = lax.custom_linear_solve(
            self._matvec(factor, fn),
            b,
            lambda mv, v: self._iterate(mv, precondition, v),
            lambda vm, v: self._iterate(vm, transposed, v),
        )
        return x.astype(rhs.dtype)

    def _matvec(self, factor: _KrylovFactor, fn: FlatFn) -> FlatFn:
        """`v -> (M - γh J) v`, `J` at the factor's point."""
        point, gamma_h, mass = factor.point, factor.gamma_h, factor.mass
        _, jvp = jax.linearize(fn, point)
        return lambda v: mass_matvec(mass, v) - gamma_h * jvp(v)

    def _preconditioner(self, factor: _KrylovFactor, fn: FlatFn, b: Array):
        """The preconditioner as a lineax operator, or `None`. It changes how fast
        the iteration converges, not where to: no derivatives through it (lineax
        takes none through `options`; neither does `custom_linear_solve` through
        its solves)."""
        structure = jax.ShapeDtypeStruct(b.shape, b.dtype)
        if isinstance(self.preconditioner, AbstractLinearSolver):
            inner, pfactor = self.preconditioner, factor.preconditioner
            apply = lambda v: inner.solve(pfactor, v, fn)  # noqa: E731
        elif self.preconditioner is not None:
            p, point, gamma_h = self.preconditioner, factor.point, factor.gamma_h
            apply = lambda v: p(v, point, gamma_h)  # noqa: E731
        else:
            return None
        return nograd(lx.FunctionLinearOperator(apply, structure))

    def _iterate(self, matvec: FlatFn, preconditioner, b: Array) -> Array:
        """GMRES (lineax's) or BiCGStab (`_bicgstab.py`); NaN where it fails."""
        if self.method == "gmres":
            return self._lineax(matvec, preconditioner, b)
        apply = None if preconditioner is None else preconditioner.mv
        return bicgstab(matvec, apply, b, self.rtol, self.atol, self.max_steps)

    def _lineax(self, matvec: FlatFn, preconditioner, b: Array) -> Array:
        structure = jax.ShapeDtypeStruct(b.shape, b.dtype)
        operator = lx.FunctionLinearOperator(matvec, structure)
        options = {}
        if preconditioner is not None:
            options["preconditioner"] = preconditioner
        method = lx.GMRES(
            self.rtol, self.atol, max_steps=self.max_steps, restart=self.restart
        )
        solution = lx.linear_solve(operator, b, method, options=options, throw=False)
        converged = solution.result == lx.RESULTS.successful
        return jnp.where(converged, solution.value, jnp.nan)
