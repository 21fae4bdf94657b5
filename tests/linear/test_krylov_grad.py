"""Gradients through the stiff solvers with `KrylovLinearSolver`: BDF (whose
implicit-function-theorem derivative solves for a tangent) and Rodas5P, with and
without a callable preconditioner that closes over the differentiated parameter
and a vmapped int index; against the dense linear solver and central finite
differences in float64, under `jit` and `vmap`, through each adjoint.

A 1-D heat equation with a nonlinear sink at a closed-over index `k`:
`y' = α Δy - y² [i = k]`; the loss is the sum of squares of two saved states.
Compiles are few: each jitted gradient is shared by the tests that use it.
"""

import functools
import os

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles, FULL_MATRIX, full_matrix_only

import solverkit as sk
from solverkit._errors import UnsupportedError


pytestmark = pytest.mark.usefixtures("x64")

_N = 8
_DX = 1.0 / (_N + 1)
_ALPHAS = (0.5, 0.9)
_KS = (1, 5)


def _y0():
    x = jnp.linspace(_DX, 1 - _DX, _N)
    return jnp.sin(jnp.pi * x) + 0.3 * x


def _field(alpha, k):
    def f(t, y, args):
        up = jnp.concatenate([y[1:], jnp.zeros(1)])
        down = jnp.concatenate([jnp.zeros(1), y[:-1]])
        return alpha * (up - 2 * y + down) / _DX**2 - y**2 * (jnp.arange(_N) == k)

    return f


def _jacobi(alpha, k):
    """The inverse of the diagonal of `I - γh J`: closes over `alpha` and `k`."""

    def p(v, point, gamma_h):
        sink = 2 * point * (jnp.arange(_N) == k)
        return v / (1 + gamma_h * (2 * alpha / _DX**2 + sink))

    return p


def _solver(name: str, alpha, k):
    """BiCGStab's Krylov solvers: GMRES's reverse mode compiles about twice as long,
    and its gradient through BDF is linear/test_linear_solver_grad.py's
    BDF-gmres-sparse."""
    method, linear = name.split("-")
    krylov = functools.partial(
        sk.KrylovLinearSolver, "bicgstab", rtol=1e-12, atol=1e-14
    )
    if linear == "dense":
        ls = sk.DenseLinearSolver()
    elif linear == "banded":  # preconditioned by a linear solver
        ls = krylov(preconditioner=sk.BandedLinearSolver(1, 1, check=False))
    else:
        ls = krylov(preconditioner=_jacobi(alpha, k) if linear == "pre" else None)
    return sk.BDF(linear_solver=ls) if method == "bdf" else sk.Rodas5P(linear_solver=ls)


def _loss(alpha, k, name, adjoint=sk.RecursiveCheckpointAdjoint(), rtol=1e-8):
    sol = sk.diffeqsolve(
        sk.ODETerm(_field(alpha, k)),
        _solver(name, alpha, k),
        0.0,
        0.1,
        1e-3,
        _y0(),
        saveat=sk.SaveAt(ts=jnp.array([0.05, 0.1])),
        stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol * 1e-3),
        adjoint=adjoint,
    )
    assert sol.ys is not None
    return jnp.sum(sol.ys**2)


@functools.partial(jax.jit, static_argnames=("name", "adjoint"))
def _batched_grad(alphas, ks, name, adjoint=sk.RecursiveCheckpointAdjoint()):
    grad = jax.grad(lambda a, k: _loss(a, k, name, adjoint))
    return jax.vmap(grad)(alphas, ks)


@functools.cache
def _grads(name: str, adjoint=sk.RecursiveCheckpointAdjoint()) -> np.ndarray:
    """The gradient at each `(alpha, k)`, vmapped: the Krylov solvers' cases."""
    alphas, ks = jnp.array(_ALPHAS), jnp.array(_KS, jnp.int32)
    return np.asarray(_batched_grad(alphas, ks, name, adjoint))


_one_grad = jax.jit(jax.grad(_loss), static_argnames=("name", "adjoint"))


@functools.cache
def _unbatched(name: str, adjoint=sk.RecursiveCheckpointAdjoint()) -> np.ndarray:
    """The gradient at each `(alpha, k)` from one unbatched jitted program, called
    once a pair: the dense references (a vmapped BDF gradient costs ~1.4x the
    unbatched one to trace and compile), and the unbatched cases."""
    return np.stack(
        [
            _one_grad(jnp.asarray(a), jnp.int32(k), name, adjoint)
            for a, k in zip(_ALPHAS, _KS)
        ]
    )


@functools.cache
def _finite_differences() -> np.ndarray:
    """Central differences of the dense BDF solve at a tight tolerance."""
    loss = jax.jit(jax.vmap(lambda a, k: _loss(a, k, "bdf-dense", rtol=1e-11)))
    alphas, ks = jnp.array(_ALPHAS), jnp.array(_KS, jnp.int32)
    eps = 1e-5
    return np.asarray((loss(alphas + eps, ks) - loss(alphas - eps, ks)) / (2 * eps))


# The full suite (14 CPU s, the quick loop's costliest test); the quick loop's BDF
# gradient is solvers/test_bdf.py::test_grad_rober, its Krylov gradients are
# linear/test_linear_solver.py's.
@pytest.mark.slow
def test_bdf_krylov_gradient():
    """Reverse mode through BDF with a Krylov solver (its implicit derivative solves
    for a tangent, which is then transposed) whose preconditioner closes over the
    differentiated `alpha` and the vmapped int `k`: finite differences."""
    np.testing.assert_allclose(_grads("bdf-pre"), _finite_differences(), rtol=1e-6)


# `SOLVERKIT_FULL_MATRIX=1` only (the dense solve's gradient, 3 CPU s): the same
# preconditioned gradient is test_bdf_krylov_gradient's against finite differences,
# and a Krylov solver's BDF gradient against the dense one's
# tests/test_linear_solver_grad.py::test_gradient[BDF-gmres-sparse-recursive].
@pytest.mark.slow
@full_matrix_only("test_bdf_krylov_gradient and test_linear_solver_grad.py")
def test_bdf_krylov_gradient_against_dense():
    """The dense solver's gradient (it does not depend on the linear solver or the
    preconditioner). (BiCGStab without a preconditioner is left to
    `SOLVERKIT_FULL_MATRIX=1`: its transposed iteration is
    tests/linear/test_linear_solver.py::test_solve_tangent_transposes[*-bicgstab-blocks],
    and BiCGStab through BDF's gradient the preconditioned case here and
    test_other_adjoints' backsolve. GMRES through BDF's gradient:
    tests/linear/test_linear_solver_grad.py's BDF-gmres-sparse.)"""
    dense = _unbatched("bdf-dense")
    np.testing.assert_allclose(_grads("bdf-pre"), dense, rtol=1e-9)
    if FULL_MATRIX:
        np.testing.assert_allclose(_grads("bdf-krylov"), dense, rtol=1e-9)


@pytest.mark.slow
def test_rosenbrock_preconditioner_closing_over_parameters():
    pre = _grads("rodas-pre")
    np.testing.assert_allclose(pre, _unbatched("rodas-dense"), rtol=1e-9)
    np.testing.assert_allclose(pre, _finite_differences(), rtol=1e-6)


# Left to `SOLVERKIT_FULL_MATRIX=1` (a 20 CPU-second compile), as checked by other
# cases: BDF's GMRES gradient preconditioned by a linear solver is
# tests/linear/test_linear_solver_grad.py::test_gradient[BDF-gmres-sparse-recursive],
# and a banded solver's transposed solve test_linear_solver.py::
# test_solve_tangent_transposes[*-banded].
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SOLVERKIT_FULL_MATRIX"),
    reason="SOLVERKIT_FULL_MATRIX only: covered by test_solve_tangent_transposes"
    "[*-bicgstab-blocks] and [*-banded]",
)
def test_banded_preconditioner():
    """Also through the transposed iteration preconditioned by a banded solver."""
    np.testing.assert_allclose(_grads("bdf-banded"), _grads("bdf-dense"), rtol=1e-9)


# `SOLVERKIT_FULL_MATRIX=1` only (a regression check, 2.6 CPU s): a Krylov solver's
# forward solves are linear/test_linear_solver.py::test_krylov_matches_dense (the
# quick loop) and this file's gradients' forward passes.
@pytest.mark.slow
@full_matrix_only("test_linear_solver.py::test_krylov_matches_dense")
def test_forward_solve_of_a_field_with_a_while_loop():
    """A forward solve traces no transposition: a field JAX can't transpose (a
    `while_loop` on the state) still solves."""

    def f(t, y, args):
        def body(carry):
            i, z = carry
            return i + 1, 0.5 * (z - y)

        return lax.while_loop(lambda c: c[0] < 40, body, (0, y))[1]  # -y

    ls = sk.KrylovLinearSolver(rtol=1e-12, atol=1e-14)
    for solver in (sk.BDF(linear_solver=ls), sk.Rodas5P(linear_solver=ls)):
        sol = sk.diffeqsolve(
            sk.ODETerm(f),
            solver,
            0.0,
            1.0,
            0.01,
            jnp.ones(3),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-11),
        )
        assert sol.ys is not None
        np.testing.assert_allclose(sol.ys, jnp.exp(-1.0), rtol=1e-5)


# `SOLVERKIT_FULL_MATRIX=1` only (four gradient programs, 12 CPU s): the adjoints
# are compared with each other on other problems (adjoint/test_adjoint.py::
# test_gradients_agree_across_adjoints_and_finite_differences, the closure matrix's
# backsolve cells), a Krylov solver's BDF gradient is test_bdf_krylov_gradient, and
# BacksolveAdjoint through a linear solver other than the dense one
# linear/test_linear_solver_grad.py::test_gradient[BDF-sparse-blocks-backsolve].
@pytest.mark.slow
@full_matrix_only(
    "test_bdf_krylov_gradient, "
    "test_linear_solver_grad.py::test_gradient[BDF-sparse-blocks-backsolve]"
)
def test_other_adjoints():
    """DirectAdjoint: the same gradient. BacksolveAdjoint: the dense solver's
    gradient without a preconditioner. Unbatched under `jit` (vmapped gradients
    through a Krylov solver: test_bdf_krylov_gradient, test_rosenbrock_...; a
    vmapped BacksolveAdjoint gradient: linear/test_linear_solver_grad.py's
    BDF-...-backsolve)."""
    direct = sk.DirectAdjoint()
    np.testing.assert_allclose(
        _unbatched("bdf-pre", direct), _unbatched("bdf-dense"), rtol=1e-9
    )
    back = sk.BacksolveAdjoint()
    krylov = _unbatched("bdf-krylov", back)
    np.testing.assert_allclose(krylov, _unbatched("bdf-dense", back), rtol=1e-8)
    np.testing.assert_allclose(krylov, _finite_differences(), rtol=1e-5)


@pytest.mark.slow
def test_backsolve_with_a_callable_preconditioner_says_so():
    """BacksolveAdjoint with a callable preconditioner (written for the forward
    state, not the backward one): a clear error."""
    with pytest.raises(UnsupportedError, match="preconditioner"):
        jax.grad(_loss)(0.5, 1, "bdf-pre", sk.BacksolveAdjoint())


# `SOLVERKIT_FULL_MATRIX=1` only (1.9 CPU s): a callable preconditioner is
# test_bdf_krylov_gradient's (closing over traced values, against finite
# differences) and test_linear_solver.py::test_krylov_matches_dense's [*-callable-*];
# a second call that compiles nothing test_integrate.py's.
@pytest.mark.slow
@full_matrix_only("test_bdf_krylov_gradient, test_krylov_matches_dense[*-callable-*]")
def test_preconditioner_closing_over_constants():
    """A preconditioner closing over nothing traced: the unpreconditioned solution,
    and a second solve with a new `y0` compiles nothing."""
    scale = jnp.full(_N, 1.0)
    field = _field(0.5, 1)

    def pre(v, point, gamma_h):
        return v * scale / (1 + 2 * gamma_h * 0.5 / _DX**2)

    def solve(y0, p) -> jax.Array:
        ls = sk.KrylovLinearSolver(rtol=1e-12, atol=1e-14, preconditioner=p)
        return sk.diffeqsolve(  # pyright: ignore[reportReturnType]
            sk.ODETerm(field),
            sk.BDF(linear_solver=ls),
            0.0,
            0.1,
            1e-3,
            y0,
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-11),
        ).ys

    y0, y0_new = _y0(), 2 * _y0()
    with_pre = solve(y0, pre)
    np.testing.assert_allclose(with_pre, solve(y0, None), rtol=1e-7, atol=1e-10)
    with count_compiles() as counter:
        solve(y0_new, pre)
    assert counter.count == 0


def test_preconditioner_bad_output():
    ls = sk.KrylovLinearSolver(preconditioner=lambda v, point, gamma_h: v[:2])
    with pytest.raises(ValueError, match="preconditioner"):
        sk.diffeqsolve(
            sk.ODETerm(_field(0.5, 1)),
            sk.BDF(linear_solver=ls),
            0.0,
            0.1,
            1e-3,
            _y0(),
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-9),
        )


# `SOLVERKIT_FULL_MATRIX=1` only (5 CPU s a case): BiCGStab's breakdown on a zero
# right-hand side, and the gradient through it, is
# linear/test_linear_solver.py::test_bicgstab_gradient_with_zero_vectors (its zero
# cases, solve and transposed solve); a Krylov solver's whole-solve gradient
# test_bdf_krylov_gradient and test_rosenbrock_preconditioner_closing_over_parameters.
@pytest.mark.slow
@full_matrix_only(
    "test_linear_solver.py::test_bicgstab_gradient_with_zero_vectors "
    "and test_bdf_krylov_gradient"
)
@pytest.mark.parametrize("method", ["BDF", "Rodas5P"])
def test_start_at_equilibrium(method):
    """`y0` at the field's equilibrium: the first Newton (BDF) or stage (Rodas5P)
    right-hand side is exactly zero, where BiCGStab breaks down. The solve succeeds
    in a few steps, and its gradient wrt the equilibrium `theta` equals the dense
    linear solver's (the same discrete solution)."""
    rates = jnp.arange(1.0, 5.0)

    def loss(theta, linear_solver):
        field = lambda t, y, args: -(y - theta) * rates  # noqa: E731
        sol = sk.diffeqsolve(
            sk.ODETerm(field),
            getattr(sk, method)(linear_solver=linear_solver),
            0.0,
            1.0,
            0.1,
            jnp.ones(4),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-10),
        )
        assert sol.ys is not None
        return jnp.sum(sol.ys[-1]), sol.stats["num_steps"]

    krylov = sk.KrylovLinearSolver("bicgstab", rtol=1e-10, atol=1e-12)
    (value, steps), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(1.0, krylov)
    assert value == pytest.approx(4.0)
    assert steps < 10
    dense = jax.jit(jax.grad(lambda t: loss(t, sk.DenseLinearSolver())[0]))(1.0)
    assert np.isfinite(grad)
    np.testing.assert_allclose(grad, dense, rtol=1e-8)
