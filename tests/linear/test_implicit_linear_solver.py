"""The ESDIRK and IMEX solvers' `linear_solver`: a user's linear solver (through the
protocol of `solverkit.AbstractLinearSolver`) gives the default's solution, and
gradients through it (by the implicit function theorem at each stage's root) match
central differences in float64; `vmap` over a closed-over integer index."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import grad_and_central_difference

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

RATES = np.array([0.04, 3e7, 1e4])


class _LUSolver(sk.AbstractLinearSolver):
    """Always an LU factorisation (the dense default inverts small systems)."""

    def linearise(self, fn, x):
        return fn(x), jax.jacfwd(fn)(x)

    def factorise(self, jac, gamma_h, mass):
        assert mass is None
        return jax.scipy.linalg.lu_factor(jnp.eye(jac.shape[0]) - gamma_h * jac)

    def solve(self, factor, rhs, fn):
        return jax.scipy.linalg.lu_solve(factor, rhs)


def _field(scale, index):
    rates = jnp.asarray(RATES)  # closed over: a float array and an int index

    def f(t, y, args):
        k = rates.at[index].multiply(scale)
        return jnp.stack(
            [
                -k[0] * y[0] + k[2] * y[1] * y[2],
                k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
                k[1] * y[1] ** 2,
            ]
        )

    return f


def _solve(scale, index, solver):
    return sk.diffeqsolve(
        sk.ODETerm(_field(scale, index)),
        solver,
        0.0,
        10.0,
        1e-6,
        jnp.array([1.0, 0.0, 0.0]),
        stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-12),
    )


@jax.jit
def _both(scale, index):
    a = _solve(scale, index, sk.Kvaerno5())
    b = _solve(scale, index, sk.Kvaerno5(linear_solver=_LUSolver()))
    return a.ys, b.ys, a.stats["num_steps"], b.stats["num_steps"]


def test_user_linear_solver_matches_default():
    a, b, na, nb = _both(jnp.asarray(1.0), jnp.asarray(0))
    np.testing.assert_allclose(a, b, rtol=1e-7)
    assert abs(int(na) - int(nb)) <= 2


@pytest.mark.slow
def test_vmap_over_closed_over_int_index():
    out = jax.jit(jax.vmap(lambda i: _both(jnp.asarray(1.0), i)[:2]))(jnp.arange(3))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-7)


@pytest.mark.slow
def test_grad_with_user_linear_solver_matches_fd():
    solver = sk.Kvaerno5(linear_solver=_LUSolver())

    def loss(scale):
        return _solve(scale, 0, solver).ys[-1, 0]

    grad, fd = grad_and_central_difference(loss, 1.0, 1e-6)
    np.testing.assert_allclose(grad, fd, rtol=1e-5)


@pytest.mark.slow
def test_imex_user_linear_solver():
    def explicit(t, y, args):
        return jnp.sin(t) * jnp.ones_like(y)

    def implicit(t, y, args):
        return jnp.array([[-100.0, 1.0], [0.0, -2.0]]) @ y

    def run(solver):
        return sk.diffeqsolve(
            sk.MultiTerm(sk.ODETerm(explicit), sk.ODETerm(implicit)),
            solver,
            0.0,
            2.0,
            0.01,
            jnp.array([1.0, 1.0]),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-10),
        ).ys

    a = run(sk.KenCarp4())
    b = run(sk.KenCarp4(linear_solver=_LUSolver()))
    np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12)


def test_bad_linear_solver():
    with pytest.raises(TypeError, match="linear_solver"):
        sk.Kvaerno5(linear_solver="dense")  # type: ignore[arg-type]


# --- Jacobian and factorisation reuse across steps (`reuse_jacobian=True`) ---------


@jax.jit
def _reuse_pair(scale):
    def run(reuse):
        sol = sk.diffeqsolve(
            sk.ODETerm(_field(scale, 0)),
            sk.Kvaerno5(reuse_jacobian=reuse),
            0.0,
            10.0,
            1e-6,
            jnp.array([1.0, 0.0, 0.0]),
            saveat=sk.SaveAt(t1=True, solver_state=True),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-12),
        )
        return sol.ys, sol.solver_state, sol.stats["num_steps"]

    return run(False), run(True)


# Quick loop: test_user_linear_solver_matches_default.
@pytest.mark.slow
def test_reuse_matches_and_reuses():
    (a, _, na), (b, state, nb) = _reuse_pair(jnp.asarray(1.0))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)
    assert abs(int(na) - int(nb)) <= max(5, int(na) // 10)
    # The last Jacobian is older than the last step: it was reused.
    assert int(state.cache.jac_age) > 0 or int(state.cache.factor_age) > 1


@pytest.mark.slow
def test_grad_with_reuse_matches_fd():
    # The stages' derivatives come from the exact Jacobian at each root, never the
    # reused one: the gradient must match central differences tightly.
    def loss(scale, reuse):
        solver = sk.Kvaerno5(reuse_jacobian=reuse)
        return _solve(scale, 0, solver).ys[-1, 0]

    grad, fd = grad_and_central_difference(lambda s: loss(s, True), 1.0, 1e-6)
    grad_off = jax.jit(jax.grad(lambda s: loss(s, False)))(jnp.asarray(1.0))
    np.testing.assert_allclose(grad, fd, rtol=1e-5)
    np.testing.assert_allclose(grad, grad_off, rtol=1e-5)


@pytest.mark.slow
def test_reuse_vmap_over_closed_over_int_index():
    def final(index):
        return _solve(jnp.asarray(1.0), index, sk.Kvaerno5(reuse_jacobian=True)).ys

    out = jax.jit(jax.vmap(final))(jnp.arange(3))
    ref = jax.jit(jax.vmap(lambda i: _both(jnp.asarray(1.0), i)[0]))(jnp.arange(3))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-12)
