"""Every matrix product the engine traces runs at `Precision.HIGHEST`.

On a TPU (and on GPUs with TF32), a float32 `dot_general` at the default precision
runs in bfloat16 (about 3 significant digits): a Runge-Kutta combination of stages or
an LU solve done so would cap every solve's accuracy near 1e-3 whatever `rtol` says.
These tests trace solves (forward and reverse mode, explicit, implicit, IMEX,
Rosenbrock and BDF solvers, each linear solver) on a vector field without products of
its own, and fail on any `dot_general` or convolution in the program whose precision
is not HIGHEST. They only trace (no compile), so they run on any backend.
"""

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ALL_SOLVERS, make_solver, make_terms, skip_unless_full_matrix

import solverkit as sk


_PRODUCTS = ("dot_general", "conv_general_dilated")
_HIGHEST = jax.lax.Precision.HIGHEST


def _is_highest(precision) -> bool:
    if isinstance(precision, tuple):
        return all(p == _HIGHEST for p in precision)
    return precision == _HIGHEST


def _sub_jaxprs(params: dict):
    for value in params.values():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, jex.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex.core.Jaxpr):
                yield v


def low_precision_products(jaxpr) -> list[str]:
    """Every product (`dot_general`, convolution) in `jaxpr` and its sub-jaxprs whose
    precision is not HIGHEST, as `"name precision=..."`."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _PRODUCTS:
            precision = eqn.params.get("precision")
            if not _is_highest(precision):
                found.append(f"{eqn.primitive.name} precision={precision}")
        for sub in _sub_jaxprs(eqn.params):
            found += low_precision_products(sub)
    return found


def test_scanner_sees_a_default_precision_product():
    # The scanner itself: a default-precision product inside a while_loop is found,
    # a HIGHEST one is not.
    def f(a, x):
        low = jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, a @ c[1]), (0, x)
        )
        high = jnp.matmul(a, x, precision="highest")
        return low[1] + high

    jaxpr = jax.make_jaxpr(f)(jnp.eye(3), jnp.ones(3)).jaxpr
    assert len(low_precision_products(jaxpr)) == 1


# A 3-dimensional, mildly stiff, nonlinear field written elementwise (no product of
# its own), closing over a float32 rate vector and an int32 exponent.
_RATES = jnp.array([1.0, 20.0, 5.0], jnp.float32)
_POWER = jnp.asarray(2, jnp.int32)


def _field(t, y, args):
    coupled = jnp.stack([y[1] - y[0], y[0] - y[1] ** _POWER, y[1] - y[2]])
    return _RATES * coupled + jnp.sin(t)


def _loss(scale, solver, adjoint, terms=None):
    # Dense output (its interpolation products) where the adjoint supports it.
    dense = isinstance(adjoint, sk.RecursiveCheckpointAdjoint)
    field = lambda t, y, args: scale * _field(t, y, args)  # noqa: E731
    terms = sk.ODETerm(field) if terms is None else terms(field)
    sol = sk.diffeqsolve(
        terms,
        solver,
        0.0,
        0.5,
        0.05,
        jnp.array([1.0, 0.5, 0.0], jnp.float32),
        stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-6),
        saveat=sk.SaveAt(t1=True, dense=dense),
        adjoint=adjoint,
        max_steps=64,
    )
    middle = jnp.sum(sol.evaluate(0.25)) if dense else 0.0
    return jnp.sum(sol.ys**2) + middle


def _check(solver, adjoint=sk.RecursiveCheckpointAdjoint(), terms=None, grad=True):
    scale = jnp.asarray(1.0, jnp.float32)
    for fn in (_loss, jax.grad(_loss)) if grad else (_loss,):
        jaxpr = jax.make_jaxpr(fn, static_argnums=(1, 2, 3))(
            scale, solver, adjoint, terms
        )
        low = low_precision_products(jaxpr.jaxpr)
        assert not low, f"{type(solver).__name__}: {low}"


# One solver of each step function and dense output, tableaux being data: Heun,
# Midpoint and Ralston are Bosh3's program (the explicit step, Hermite output),
# Kvaerno3/4 Kvaerno5's (ESDIRK), KenCarp3/4 KenCarp5's (IMEX), and Ros3P the
# Rosenbrock step of Rodas4/Rodas5P with the Hermite output of Bosh3.
_SAME_PROGRAM_AS_ANOTHER = (
    sk.Heun, sk.Midpoint, sk.Ralston, sk.Kvaerno3, sk.Kvaerno4, sk.KenCarp3,
    sk.KenCarp4, sk.Ros3P,
)  # fmt: skip


@pytest.mark.parametrize(
    "cls",
    [
        cls
        for cls, _, adaptive in ALL_SOLVERS
        if adaptive and cls not in _SAME_PROGRAM_AS_ANOTHER
    ],
    ids=lambda c: c.__name__,
)
# Quick loop: one solver of each family (ESDIRK:
# test_stiff_linear_solver_products_are_highest[Kvaerno5-krylov]).
@pytest.mark.quick_cases("Tsit5", "KenCarp5", "Rosenbrock23")
def test_every_solver_products_are_highest(cls):
    # IMEX solvers: half the field explicit, half implicit.
    half = lambda f: lambda t, y, a: 0.5 * f(t, y, a)  # noqa: E731
    terms = lambda f: make_terms(cls, f, (half(f), half(f)))  # noqa: E731
    _check(make_solver(cls, root_tol=None), terms=terms)


_LINEAR_SOLVERS = {
    "dense": sk.DenseLinearSolver(),
    "banded": sk.BandedLinearSolver(lower=1, upper=1),
    "sparse": sk.SparseLinearSolver(
        np.abs(np.subtract.outer(np.arange(3), np.arange(3))) <= 1
    ),
    "krylov": sk.KrylovLinearSolver(),
}


# Rodas5P and Kvaerno5 with the dense solver, their default, are
# test_every_solver_products_are_highest's (the same solver, equal as a Module).
_STIFF_CASES = [
    (cls, linear)
    for cls in (sk.Rodas5P, sk.BDF, sk.Kvaerno5)
    for linear in _LINEAR_SOLVERS
    if linear != "dense" or cls is sk.BDF
]


@pytest.mark.parametrize(
    "cls,linear", _STIFF_CASES, ids=[f"{c.__name__}-{n}" for c, n in _STIFF_CASES]
)
# The full suite; the quick loop's stiff solvers' products (their default linear
# solvers): test_every_solver_products_are_highest's quick cases.
@pytest.mark.slow
def test_stiff_linear_solver_products_are_highest(cls, linear):
    # Each linear solver's products are BDF's cases (every linear solver) and
    # Kvaerno5-krylov's (the quick loop); Rodas5P's and Kvaerno5's other linear
    # solvers, but Rodas5P-sparse (a second family through the sparse solver's
    # reverse mode), with `SOLVERKIT_FULL_MATRIX=1` only.
    if cls is not sk.BDF and (cls, linear) not in (
        (sk.Kvaerno5, "krylov"),
        (sk.Rodas5P, "sparse"),
    ):
        skip_unless_full_matrix(f"[BDF-{linear}] (the same linear solver)")
    # BDF + SparseLinearSolver has no reverse mode yet (JAX: "scatter transpose is
    # only implemented where unique_indices=True"): its forward solve only.
    grad = not (cls is sk.BDF and linear == "sparse")
    _check(cls(linear_solver=_LINEAR_SOLVERS[linear]), grad=grad)


@pytest.mark.parametrize("adjoint", [sk.BacksolveAdjoint(), sk.DirectAdjoint()])
def test_adjoint_products_are_highest(adjoint):
    _check(sk.Tsit5(), adjoint)
