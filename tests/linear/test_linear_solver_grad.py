"""Reverse mode through every stiff solver with every linear solver, through each
adjoint: the gradient equals the one with `DenseLinearSolver` and central finite
differences, under `jit` and `vmap` (over a closed-over int), in float64.

The field is three independent stiff pairs, `u' = -20 p u + v`,
`v' = w u - 2 v - v² [pair = k]`, closing over a differentiated float `p`, an int
`k` and a float32 `w`; its Jacobian fits every structure tested (blocks of 2, a
tridiagonal band, a full pattern). The loss is the sum of squares of two saved
states; the parameters are `p` and the scale of `y0`. In the full suite, one case by
default (the others with `SOLVERKIT_FULL_MATRIX=1`, named below with what covers
them): `tests/linear/test_linear_solver.py` checks every linear solver's transposed
solve cheaply. BacksolveAdjoint is tested where the docs support it: with a backward
solver of its own (the backward state is larger than a fixed pattern).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finite_difference

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

_N = 6
_KS = jnp.array([0, 2], jnp.int32)
_TRI = np.abs(np.subtract.outer(np.arange(_N), np.arange(_N))) <= 1
_PAIRS = np.kron(np.eye(_N // 2), np.ones((2, 2))).astype(bool)


def _field(p, k):
    w = jnp.asarray(1.5, jnp.float32)

    def f(t, y, args):
        u, v = y[0::2], y[1::2]
        sink = jnp.where(jnp.arange(_N // 2) == k, v**2, 0)
        du = -20 * p * u + v
        dv = w * u - 2 * v - sink
        return jnp.stack([du, dv], axis=1).reshape(-1)

    return f


def _zero(t, y, args):
    return jnp.zeros_like(y)


def _linear_solver(name: str) -> sk.AbstractLinearSolver:
    krylov = functools.partial(sk.KrylovLinearSolver, rtol=1e-12, atol=1e-14)
    return {
        "dense": lambda: sk.DenseLinearSolver(),
        "banded": lambda: sk.BandedLinearSolver(1, 1),
        "sparse-blocks": lambda: sk.SparseLinearSolver(_PAIRS),
        "sparse-banded": lambda: sk.SparseLinearSolver(_TRI),
        "sparse-dense": lambda: sk.SparseLinearSolver(np.ones((_N, _N), bool)),
        "gmres": lambda: krylov(),
        "gmres-sparse": lambda: krylov(
            preconditioner=sk.SparseLinearSolver(_PAIRS, check=False)
        ),
        "bicgstab-banded": lambda: krylov(
            "bicgstab", preconditioner=sk.BandedLinearSolver(1, 1, check=False)
        ),
    }[name]()


_STIFF = {
    "BDF": sk.BDF,
    "Rodas5P": sk.Rodas5P,
    "Rodas4": sk.Rodas4,
    "Ros3P": sk.Ros3P,
    "Rosenbrock23": sk.Rosenbrock23,
    # ImplicitEuler is left out: of order 1, it needs more than `max_steps` steps
    # at this rtol 1e-8 (max_steps_reached; not a derivative failure).
    "Kvaerno3": sk.Kvaerno3,
    "Kvaerno4": sk.Kvaerno4,
    "Kvaerno5": sk.Kvaerno5,
    "KenCarp3": sk.KenCarp3,
    "KenCarp4": sk.KenCarp4,
    "KenCarp5": sk.KenCarp5,
}
_IMEX = ("KenCarp3", "KenCarp4", "KenCarp5")


def _adjoint(name: str, stiff: str):
    if name == "recursive":
        return sk.RecursiveCheckpointAdjoint()
    if name == "direct":
        return sk.DirectAdjoint()
    # The backward state (y, its adjoint, the parameters') is larger than the
    # forward one: the backward solve gets a solver with a dense linear solver.
    return sk.BacksolveAdjoint(solver=_STIFF[stiff]())


@functools.cache
def _loss(stiff: str, linear: str, adjoint: str):
    """The loss of `params = (p, scale of y0)` for a closed-over int `k`, jitted."""
    solver = _STIFF[stiff](linear_solver=_linear_solver(linear))

    def loss(params, k):
        f = _field(params[0], k)
        terms = (
            sk.MultiTerm(sk.ODETerm(_zero), sk.ODETerm(f))
            if stiff in _IMEX
            else sk.ODETerm(f)
        )
        y0 = params[1] * jnp.linspace(0.2, 1.0, _N)
        sol = sk.diffeqsolve(
            terms,
            solver,
            0.0,
            0.2,
            0.01,
            y0,
            saveat=sk.SaveAt(ts=jnp.array([0.1, 0.2])),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-10),
            adjoint=_adjoint(adjoint, stiff),
        )
        return jnp.sum(sol.ys**2)

    return jax.jit(loss)


@functools.cache
def _grad(stiff: str, linear: str, adjoint: str):
    return jax.jit(jax.vmap(jax.grad(_loss(stiff, linear, adjoint)), (None, 0)))


# numpy: float64 when the `x64` fixture is on (a jnp array made at import is
# float32, and so would be the gradient).
_PARAMS = np.array([1.0, 1.0])
_LINEARS = (
    "banded",
    "sparse-blocks",
    "sparse-banded",
    "sparse-dense",
    "gmres",
    "gmres-sparse",
    "bicgstab-banded",
)
# Each case compiles four programs (about 10-20 CPU s): the whole file is in the full
# suite. The quick loop checks every linear solver's transposed solve and the sparse
# solver's gradient (`tests/linear/test_linear_solver.py`, BiCGStab's NaN gradients
# there too), BDF's gradient through a Krylov solver
# (`tests/linear/test_krylov_grad.py`) and
# through the dense one (`tests/solvers/test_bdf.py`).
_QUICK: set[tuple[str, str, str]] = set()


# The slow tier: BDF-sparse-blocks-backsolve (below) only; about 5-10 s a case on a
# quiet CPU. `SOLVERKIT_FULL_MATRIX=1` runs every stiff solver x linear solver x
# adjoint instead (about 150 cases).
#
# Left to `SOLVERKIT_FULL_MATRIX=1`, as checked by another case:
# - BDF with "gmres" and Rodas5P with "gmres-sparse" (tests/linear/test_krylov_grad.py:
# BDF's and Rodas5P's Krylov (BiCGStab) gradients against the dense solver's, with and
#   without a preconditioner; GMRES's BDF-gmres-sparse-recursive here), and
#   BDF-sparse-banded-recursive (BDF-sparse-banded-direct here:
#   the same transposed solves under the other checkpointing);
# - Rodas5P-gmres-direct: a Rosenbrock method's Krylov gradient is
#   linear/test_krylov_grad.py::test_rosenbrock_preconditioner_closing_over_parameters
#   (BiCGStab), the DirectAdjoint through a Krylov solve linear/test_krylov_grad.py::
#   test_other_adjoints;
# - Rodas5P-bicgstab-banded-recursive: BiCGStab's transposed iteration preconditioned
#   by a linear solver is linear/test_linear_solver.py::
#   test_solve_tangent_transposes[*-bicgstab-blocks], a Rosenbrock method's BiCGStab
#   gradient the linear/test_krylov_grad.py test above;
# - BDF-sparse-dense-recursive: the full-pattern layout of SparseLinearSolver differs
#   from the others in its factorisation, whose solve and transposed solve
#   tests/linear/test_linear_solver.py checks (test_sparse_matches_dense[*-dense],
#   test_solve_tangent_transposes[sparse-dense-*]); BDF's gradient through a
#   SparseLinearSolver is the other sparse cases here.
# - Rodas5P-sparse-banded-recursive (13 CPU s): a Rosenbrock method's whole-solve
#   gradient through a linear solver other than the dense one is
# tests/linear/test_krylov_grad.py::
# test_rosenbrock_preconditioner_closing_over_parameters,
# the sparse-banded solver's VJP BDF-sparse-banded-direct here and
# tests/linear/test_linear_solver.py::
# test_sparse_grad_against_dense_and_finite_differences.
# - Kvaerno3-sparse-blocks-recursive (7 CPU s): an ESDIRK method's gradient through a
#   linear solver of the protocol is tests/linear/test_implicit_linear_solver.py::
#   test_grad_with_user_linear_solver_matches_fd, the sparse solver's VJP
#   BDF-sparse-banded-direct here and linear/test_linear_solver.py's sparse gradient.
# - BDF-sparse-blocks-recursive (8.5 CPU s): SparseLinearSolver's
#   transposed solve through BDF's gradient is BDF-sparse-banded-direct here (the
#   same solver, another pattern), the blocks layout's transposed solve
#   tests/linear/test_linear_solver.py::test_solve_tangent_transposes[*-sparse-blocks],
# and the blocks solver under BDF BDF-sparse-blocks-backsolve's forward pass here.
# - BDF-bicgstab-banded-recursive (11.8 CPU s): BiCGStab through BDF's gradient is
#   tests/linear/test_krylov_grad.py::test_bdf_krylov_gradient (preconditioned by a
# callable closing over the differentiated parameter and a vmapped int), a linear solver
# as
#   a Krylov preconditioner BDF-gmres-sparse-recursive here, BiCGStab's transposed
#   iteration preconditioned by a linear solver linear/test_linear_solver.py::
#   test_solve_tangent_transposes[*-bicgstab-blocks], and the banded solver's
#   transposed solve test_solve_tangent_transposes[*-banded] there.
# - BDF-gmres-sparse-recursive (7 CPU s): a Krylov solver's BDF gradient is
#   tests/linear/test_krylov_grad.py::test_bdf_krylov_gradient (BiCGStab), GMRES's
#   transposed solve and a Krylov solver preconditioned by a linear solver
#   tests/linear/test_linear_solver.py::test_solve_tangent_transposes[*-gmres],
#   [*-bicgstab-blocks].
# - BDF-sparse-banded-direct (5 CPU s): DirectAdjoint is compared with the
#   checkpointed adjoint on other problems (tests/adjoint/test_adjoint.py::
#   test_gradients_agree_across_adjoints_and_finite_differences, the closure
#   matrix's direct cells), SparseLinearSolver's transposed solve through BDF's
#   gradient is BDF-sparse-blocks-backsolve here, the banded pattern's VJP
#   tests/linear/test_linear_solver.py::
#   test_sparse_grad_against_dense_and_finite_differences.
# - BDF-banded-recursive (8.7 CPU s): BDF's gradient through a linear solver's
#   transposed solve is tests/linear/test_krylov_grad.py::test_bdf_krylov_gradient
#   (against finite differences), the banded solver's transposed solve
#   tests/linear/test_linear_solver.py::test_solve_tangent_transposes[*-banded] and its
#   VJP tests/linear/test_banded.py::test_grad_matches_dense_and_finite_differences;
#   a non-dense linear solver under BDF's gradient BDF-sparse-blocks-backsolve here.
_SLOW = {
    *(("BDF", linear, "recursive") for linear in _LINEARS),
} - {
    ("BDF", "banded", "recursive"),
    ("BDF", "gmres", "recursive"),
    ("BDF", "gmres-sparse", "recursive"),
    ("BDF", "sparse-banded", "recursive"),
    ("BDF", "sparse-dense", "recursive"),
    ("BDF", "sparse-blocks", "recursive"),
    ("BDF", "bicgstab-banded", "recursive"),
}


def _cases():
    cases = [
        (stiff, linear, adjoint)
        for stiff in _STIFF
        for linear in _LINEARS
        for adjoint in ("recursive", "direct")
    ]
    if not os.environ.get("SOLVERKIT_FULL_MATRIX"):
        cases = [c for c in cases if c in _QUICK or c in _SLOW]
    # Backwards, the stiff decay is unstable (docs/api/solvers.md): Kvaerno3's
    # backward solve fails; BDF's passes.
    cases += [("BDF", "sparse-blocks", "backsolve")]
    return [pytest.param(*c, marks=_marks(c)) for c in cases]


def _marks(case) -> list:
    return [] if case in _QUICK else [pytest.mark.slow]


@pytest.mark.parametrize("stiff,linear,adjoint", _cases())
def test_gradient(stiff, linear, adjoint):
    got = _grad(stiff, linear, adjoint)(_PARAMS, _KS)
    # DirectAdjoint differentiates the same discrete solve as the checkpointed
    # adjoint (the gradients agree to rounding): its reference is that one's, one
    # program fewer (8 CPU s).
    want = _grad(stiff, "dense", "recursive" if adjoint == "direct" else adjoint)(
        _PARAMS, _KS
    )
    # The linear solves agree to 1e-12 (rounding; Krylov's rtol): the step sequences
    # agree and the gradients to far better than this.
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-10)
    # Finite differences see the derivative of the continuous solution (to the
    # controller's rtol 1e-8 amplified by the few dozen steps); the backsolve
    # gradient is that of the continuous adjoint, to the same order. Finite
    # differences also see how the adaptive step sizes move with the parameters,
    # which reverse mode holds fixed (with fixed steps the two agree to 1e-9).
    # KenCarp5 is the one where that is large: its embedded pair's order-5 defects
    # are small (1e-4 to 1e-8 against KenCarp4's 1e-3 to 1e-2 at its order), so its
    # error estimate undershoots here (12 steps; the loss 2.4e-7 off at rtol 1e-8)
    # and the loss moves with the steps: 4.2e-5 relative between the two.
    fd_rtol = 1e-4 if stiff == "KenCarp5" else 1e-5
    for i, k in enumerate(_KS):
        fd = finite_difference(
            lambda q: _loss(stiff, "dense", "recursive")(q, k), _PARAMS
        )
        np.testing.assert_allclose(got[i], fd, rtol=fd_rtol, atol=1e-8)


# The full suite (an error message, 6 CPU s).
@pytest.mark.slow
def test_backsolve_with_a_fixed_pattern_says_what_to_do():
    """The backward state is larger than a sparse pattern: the error says so."""
    solver = sk.BDF(linear_solver=_linear_solver("sparse-blocks"))

    def loss(p):
        sol = sk.diffeqsolve(
            sk.ODETerm(_field(p, 0)),
            solver,
            0.0,
            0.2,
            0.01,
            jnp.ones(_N),
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-8),
            adjoint=sk.BacksolveAdjoint(),
        )
        return jnp.sum(sol.ys)

    with pytest.raises(ValueError, match=r"BacksolveAdjoint\(solver=\.\.\.\)"):
        jax.grad(loss)(1.0)
