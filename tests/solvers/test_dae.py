"""Mass matrices and differential-algebraic equations with the Rosenbrock solvers.

`M y' = f(t, y)` with `M` None, diagonal, dense, regular or singular (index 1),
against the equivalent ODE `y' = M⁻¹ f` and against exact solutions; `jit`, `vmap`
over a closed-over integer index, `grad` with respect to a closed-over float checked
against central differences; inconsistent initial values, bad mass matrices and a
singular iteration matrix. Everything runs in float64; the solves are shared jitted
functions.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from helpers import (
    FULL_MATRIX,
    full_matrix_only,
    grad_and_central_difference,
    quick_params,
    skip_unless_full_matrix,
)

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

RTOL, ATOL = 1e-9, 1e-11
TS = np.linspace(0.0, 3.0, 7)
FORMS = ["diagonal", "dense"]


def _controller():
    return sk.PIDController(rtol=RTOL, atol=ATOL)


# --- A regular dense M: M y' = A y, exactly y(t) = expm(t M⁻¹A) y0 -----------------

M_REG = np.array([[2.0, 1.0], [1.0, 3.0]])
A_REG = np.array([[-1.0, 2.0], [-3.0, -2.0]])
Y0_REG = np.array([1.0, 0.5])


def _linear(t, y, args):
    return jnp.asarray(A_REG) @ y


# Dense output, one program (op by op: ~15 compiles a call).
_evaluate = eqx.filter_jit(lambda sol, t: sol.evaluate(t))


@pytest.mark.parametrize(
    "name, form",
    quick_params(
        [(n, f) for n in ("Rosenbrock23", "Ros3P", "Rodas4", "Rodas5P") for f in FORMS],
        quick=[("Rodas5P", "dense")],
    ),
)
# Quick loop: test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense].
@pytest.mark.slow
def test_regular_mass_matches_exact(name, form):
    if name != "Rodas5P":
        # `SOLVERKIT_FULL_MATRIX=1` only: one Rosenbrock stage solve with a mass
        # matrix for the family (its tableaux differ), checked by [Rodas5P-*].
        skip_unless_full_matrix("[Rodas5P-*] (the family's stage solves)")
    mass = M_REG if form == "dense" else np.diag(M_REG)
    full = M_REG if form == "dense" else np.diag(np.diag(M_REG))
    solver = getattr(sk, name)(mass_matrix=jnp.asarray(mass))
    sol = sk.diffeqsolve(
        sk.ODETerm(_linear),
        solver,
        0.0,
        3.0,
        0.01,
        jnp.asarray(Y0_REG),
        saveat=sk.SaveAt(ts=TS, dense=True),
        # Ros3P's error estimate vanishes on a linear problem: bound its steps.
        stepsize_controller=sk.PIDController(rtol=RTOL, atol=ATOL, dtmax=0.01),
    )
    b = np.linalg.solve(full, A_REG)
    exact = np.stack([scipy.linalg.expm(t * b) @ Y0_REG for t in TS])
    tol = {"Rosenbrock23": 1e-5, "Ros3P": 1e-6}.get(name, 1e-7)
    np.testing.assert_allclose(sol.ys, exact, rtol=0, atol=tol)
    # Dense output between the steps (Ros3P's Hermite slopes need M⁻¹f).
    t = 1.2345
    np.testing.assert_allclose(
        _evaluate(sol, t), scipy.linalg.expm(t * b) @ Y0_REG, rtol=0, atol=10 * tol
    )


# --- ROBER as a DAE: y3 = 1 - y1 - y2 algebraic ----------------------------------


def _rober_ode(t, y, k):
    y1, y2, y3 = y[0], y[1], y[2]
    return jnp.stack(
        [
            -k[0] * y1 + k[2] * y2 * y3,
            k[0] * y1 - k[1] * y2**2 - k[2] * y2 * y3,
            k[1] * y2**2,
        ]
    )


def _rober_dae(t, y, k):
    f = _rober_ode(t, y, k)
    return f.at[2].set(y[0] + y[1] + y[2] - 1)


K = np.array([0.04, 3e7, 1e4])


@jax.jit
def _rober(k, mass_diag, mass_dense):
    def run(term, solver):
        return sk.diffeqsolve(
            sk.ODETerm(term),
            solver,
            0.0,
            40.0,
            1e-6,
            jnp.array([1.0, 0.0, 0.0]),
            k,
            saveat=sk.SaveAt(ts=jnp.array([0.4, 4.0, 40.0])),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-12),
        ).ys

    out = {}
    # Rodas4 with `SOLVERKIT_FULL_MATRIX=1` (half the program): its singular mass
    # matrices are test_singular_mass_matches_exact[Rodas4-*]'s.
    for name in ("Rodas4", "Rodas5P") if FULL_MATRIX else ("Rodas5P",):
        cls = getattr(sk, name)
        out[name] = (
            run(_rober_ode, cls()),
            run(_rober_dae, cls(mass_matrix=mass_diag)),
            run(_rober_dae, cls(mass_matrix=mass_dense)),
        )
    return out


@pytest.mark.slow
def test_rober_dae_matches_ode():
    diag = jnp.array([1.0, 1.0, 0.0])
    out = _rober(K, diag, jnp.diag(diag))
    for name, (ode, dae_diag, dae_dense) in out.items():
        for dae in (dae_diag, dae_dense):
            np.testing.assert_allclose(dae, ode, rtol=1e-6, atol=1e-12, err_msg=name)
            # The algebraic equation holds along the solution.
            np.testing.assert_allclose(jnp.sum(dae, axis=1), 1.0, atol=1e-12)


# --- A linear non-autonomous index-1 DAE with an exact solution --------------------
# y1' = -y1 + y2, 0 = y2 - cos(w t): y1 = (cos wt + w sin wt)/(1 + w²) + c e^{-t}.
# Written with a dense singular M (multiplied by T from the left) and a closed-over
# integer index that picks w, and w scaled by a closed-over float.

T_MIX = np.array([[1.0, 2.0], [3.0, 4.0]])
# NumPy constants (float64): JAX arrays made at import would be float32.
M_SING = {"diagonal": np.array([1.0, 0.0]), "dense": T_MIX @ np.diag([1.0, 0.0])}
OMEGAS = np.array([1.0, 2.0, 0.5])


def _exact(w, t, y10=1.0):
    c = y10 - 1 / (1 + w**2)
    y1 = (jnp.cos(w * t) + w * jnp.sin(w * t)) / (1 + w**2) + c * jnp.exp(-t)
    return jnp.stack([y1, jnp.cos(w * t)], axis=-1)


def _field(scale, index, form):
    table = jnp.asarray(OMEGAS)  # a closed-over float array, a closed-over int index

    def f(t, y, args):
        w = scale * table[index]
        out = jnp.stack([-y[0] + y[1], y[1] - jnp.cos(w * t)])
        return jnp.asarray(T_MIX) @ out if form == "dense" else out

    return f


def _solve_sing(scale, index, form, name, y0=None, throw=True):
    solver = getattr(sk, name)(mass_matrix=jnp.asarray(M_SING[form]))
    return sk.diffeqsolve(
        sk.ODETerm(_field(scale, index, form)),
        solver,
        0.0,
        3.0,
        0.01,
        jnp.array([1.0, 1.0]) if y0 is None else y0,
        saveat=sk.SaveAt(ts=jnp.asarray(TS), dense=True),
        stepsize_controller=_controller(),
        throw=throw,
    )


_solve_sing_jit = jax.jit(_solve_sing, static_argnames=("form", "name", "throw"))


@pytest.mark.parametrize(
    "name, form",
    quick_params(
        [(n, f) for n in ("Rodas4", "Rodas5P") for f in FORMS],
        # The full suite; the quick loop solves this DAE against its exact solution
        # in test_vmap_over_closed_over_int_index (dense output with a mass matrix:
        # test_regular_mass_matches_exact).
        quick=[],
    ),
)
def test_singular_mass_matches_exact(name, form):
    if name == "Rodas4":
        # `SOLVERKIT_FULL_MATRIX=1` only: the Rosenbrock family's singular mass matrix
        # (an index-1 DAE) is [Rodas5P-*]'s.
        skip_unless_full_matrix("[Rodas5P-*] (the same stage solves)")
    if (name, form) == ("Rodas5P", "diagonal"):
        # `SOLVERKIT_FULL_MATRIX=1` only: this DAE in the diagonal form against its
        # exact solution is test_vmap_over_closed_over_int_index's (the quick loop);
        # the dense output with a singular mass matrix [Rodas5P-dense]'s.
        skip_unless_full_matrix(
            "test_vmap_over_closed_over_int_index and [Rodas5P-dense]"
        )
    sol = _solve_sing_jit(jnp.asarray(1.0), jnp.asarray(1), form, name)
    w = 2.0
    np.testing.assert_allclose(sol.ys, _exact(w, jnp.asarray(TS)), rtol=0, atol=1e-7)
    t = 1.2345
    np.testing.assert_allclose(_evaluate(sol, t), _exact(w, t), rtol=0, atol=1e-6)


def test_vmap_over_closed_over_int_index():
    @jax.jit
    @jax.vmap
    def final(index):
        return _solve_sing(jnp.asarray(1.0), index, "diagonal", "Rodas5P").ys[-1]

    out = final(jnp.arange(3))
    exact = jnp.stack([_exact(w, 3.0) for w in OMEGAS])
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-7)


# The full suite (9 CPU s); the quick loop differentiates a DAE in
# test_grad_wrt_mass_matrix_matches_fd.
# [dense] with `SOLVERKIT_FULL_MATRIX=1` only: the dense form under `grad` is
# test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense].
@pytest.mark.slow
@pytest.mark.parametrize(
    "form",
    [
        pytest.param(
            f,
            marks=[]
            if f == "diagonal"
            else full_matrix_only(
                "test_grad_wrt_closed_over_float_matches_fd[diagonal] (the closed-over "
                "float) and test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense] (the "
                "dense form under grad)"
            ),
        )
        for f in FORMS
    ],
)
def test_grad_wrt_closed_over_float_matches_fd(form):
    def loss(scale):
        ys = _solve_sing(scale, jnp.asarray(1), form, "Rodas5P").ys
        return jnp.sum(ys[:, 0] ** 2)

    grad, fd = grad_and_central_difference(loss, 0.7, 1e-5)

    def exact_loss(scale):
        return jnp.sum(_exact(2.0 * scale, jnp.asarray(TS))[:, 0] ** 2)

    np.testing.assert_allclose(grad, fd, rtol=1e-6)
    exact = jax.jit(jax.grad(exact_loss))(0.7)  # one program (op by op: ~35)
    np.testing.assert_allclose(grad, exact, rtol=1e-5)


@pytest.mark.parametrize(
    "name, form",
    quick_params(
        [(n, f) for n in ("Rodas5P", "BDF") for f in FORMS],
        # BDF's cases in the full suite (12 CPU s each); the quick loop's BDF
        # gradient: solvers/test_bdf.py::test_grad_rober.
        quick=[("Rodas5P", "dense")],
    ),
)
def test_grad_wrt_mass_matrix_matches_fd(name, form):
    if (name, form) in (("Rodas5P", "diagonal"), ("BDF", "dense")):
        skip_unless_full_matrix(
            "test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense] and [BDF-diagonal] "
            "(each solver and each form of the mass matrix under grad)"
        )

    # The mass matrix is an ordinary (differentiable) field of the solver. (BDF's
    # gradient with respect to it was once silently ~0: its Newton correction's
    # implicit derivative left the mass out.)
    def loss(m00):
        # The first column scaled: the algebraic part (left null space) is kept.
        column = jnp.stack([m00, jnp.asarray(1.0)])
        mass = jnp.asarray(M_SING[form]) * (
            column if form == "diagonal" else column[None]
        )
        solver = getattr(sk, name)(mass_matrix=mass)
        sol = sk.diffeqsolve(
            sk.ODETerm(_field(jnp.asarray(1.0), 1, form)),
            solver,
            0.0,
            2.0,
            0.01,
            jnp.array([1.0, 1.0]),
            stepsize_controller=_controller(),
        )
        return sol.ys[-1, 0]

    grad, fd = grad_and_central_difference(loss, 1.3, 1e-5)
    np.testing.assert_allclose(grad, fd, rtol=1e-6)


# --- Errors -------------------------------------------------------------------------


# Quick loop: test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense].
@pytest.mark.slow
def test_inconsistent_initial_values():
    y0 = jnp.array([1.0, 0.5])  # y2(0) must be cos(0) = 1
    sol = _solve_sing_jit(
        jnp.asarray(1.0), jnp.asarray(1), "dense", "Rodas5P", y0, False
    )
    assert sol.result == sk.RESULTS.inconsistent_initial_values
    assert np.all(np.isfinite(sol.ys) | np.isinf(sol.ys))
    with pytest.raises(RuntimeError, match="mass_matrix"):
        _solve_sing(jnp.asarray(1.0), jnp.asarray(1), "diagonal", "Rodas4", y0)


@pytest.mark.parametrize(
    "mass, match",
    [
        (np.ones((2, 2, 2)), "vector `\\(n,\\)`"),
        (np.ones((2, 3)), "square"),
        (np.ones(2, np.complex64), "real"),
        (np.ones(3), "has 2 entries"),
        (np.ones((3, 3)), "has 2 entries"),
    ],
)
def test_bad_mass_matrix(mass, match):
    with pytest.raises(ValueError, match=match):
        sk.diffeqsolve(
            sk.ODETerm(_linear),
            sk.Rodas5P(mass_matrix=mass),
            0.0,
            1.0,
            0.1,
            jnp.asarray(Y0_REG),
        )


@pytest.mark.parametrize("name", ["Rosenbrock23", "Ros3P"])
@pytest.mark.parametrize("mass", [np.array([1.0, 0.0]), T_MIX @ np.diag([1.0, 0.0])])
def test_singular_mass_needs_stiffly_accurate_method(name, mass):
    with pytest.raises(ValueError, match="Rodas5P"):
        getattr(sk, name)(mass_matrix=mass)


def test_bad_linear_solver():
    with pytest.raises(TypeError, match="linear_solver"):
        sk.Rodas5P(linear_solver="dense")  # type: ignore[arg-type]


# Quick loop: test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense].
@pytest.mark.slow
def test_singular_iteration_matrix():
    # The algebraic equation `0 = 0` leaves y2 undetermined: M - γhJ is singular
    # for every step size.
    def f(t, y, args):
        return jnp.stack([-y[0], 0 * y[1]])

    sol = sk.diffeqsolve(
        sk.ODETerm(f),
        sk.Rodas5P(mass_matrix=jnp.array([1.0, 0.0])),
        0.0,
        1.0,
        0.1,
        jnp.array([1.0, 0.0]),
        stepsize_controller=_controller(),
        throw=False,
    )
    assert sol.result == sk.RESULTS.singular
    assert not np.any(np.isnan(sol.ys))


# --- The linear-solver protocol -----------------------------------------------------


class _LUSolver(sk.AbstractLinearSolver):
    """Always an LU factorisation (never the small-system inverse)."""

    def linearise(self, fn, x):
        return fn(x), jax.jacfwd(fn)(x)

    def factorise(self, jac, gamma_h, mass):
        m = jnp.eye(jac.shape[0]) if mass is None else jnp.diag(mass)
        return jax.scipy.linalg.lu_factor(m - gamma_h * jac)

    def solve(self, factor, rhs, fn):
        return jax.scipy.linalg.lu_solve(factor, rhs)


# Quick loop:
# linear/test_implicit_linear_solver.py::test_user_linear_solver_matches_default.
@pytest.mark.slow
def test_user_linear_solver():
    def run(linear_solver):
        return sk.diffeqsolve(
            sk.ODETerm(_field(jnp.asarray(1.0), 1, "diagonal")),
            sk.Rodas4(linear_solver=linear_solver, mass_matrix=M_SING["diagonal"]),
            0.0,
            3.0,
            0.01,
            jnp.array([1.0, 1.0]),
            stepsize_controller=_controller(),
        )

    a, b = run(sk.DenseLinearSolver()), run(_LUSolver())
    np.testing.assert_allclose(a.ys, b.ys, rtol=1e-10)
    assert a.stats["num_steps"] == b.stats["num_steps"]


# Quick loop: test_grad_wrt_mass_matrix_matches_fd[Rodas5P-dense].
@pytest.mark.slow
def test_pytree_state_ravelled_order():
    # `mass_matrix` is in the order of `ravel_pytree(y0)`: here (y1, y2) as a tuple.
    def f(t, y, args):
        y1, y2 = y
        return (-y1 + y2, y2 - jnp.cos(2.0 * t))

    sol = sk.diffeqsolve(
        sk.ODETerm(f),
        sk.Rodas5P(mass_matrix=jnp.array([1.0, 0.0])),
        0.0,
        3.0,
        0.01,
        (jnp.asarray(1.0), jnp.asarray(1.0)),
        stepsize_controller=_controller(),
    )
    np.testing.assert_allclose(
        jnp.stack([sol.ys[0][-1], sol.ys[1][-1]]), _exact(2.0, 3.0), atol=1e-7
    )
