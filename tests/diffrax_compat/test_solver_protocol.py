"""The public solver and term protocols, used as a diffrax user uses them: a
Crank-Nicolson solver written in this file on `AbstractSolver` (as diffrax's heat
equation example writes one), a custom `AbstractTerm`, and `MultiTerm`; each under
`jit`, `vmap` and `grad` with every adjoint."""

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
import scipy.linalg
from helpers import finite_difference, float64

import solverkit as sk


class CrankNicolson(sk.AbstractSolver):
    """y1 = y0 + h/2 (f(t0, y0) + f(t1, y1)), by a fixed number of fixed-point
    iterations (so that reverse mode goes through it), with the Euler step as the
    embedded method. Written for any pytree state (`BacksolveAdjoint` steps the
    tuple of the state and its adjoint)."""

    term_structure = sk.ODETerm
    interpolation_cls = sk.LocalLinearInterpolation
    iterations: int = 30

    def order(self, terms):
        return 2

    def init(self, terms, t0, t1, y0, args):
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        dt = t1 - t0
        f0 = terms.vf(t0, y0, args)

        def iterate(_, y1):
            f1 = terms.vf(t1, y1, args)
            return jtu.tree_map(lambda y, a, b: y + 0.5 * dt * (a + b), y0, f0, f1)

        euler = jtu.tree_map(lambda y, f: y + dt * f, y0, f0)
        y1 = lax.fori_loop(0, self.iterations, iterate, euler)
        y_error = jtu.tree_map(lambda a, b: a - b, y1, euler)
        dense_info = dict(y0=y0, y1=y1)
        return y1, y_error, dense_info, None, sk.RESULTS.successful

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


N = 8  # grid points of the 1-D heat equation on (0, 1), zero at both ends
DX = 1.0 / (N + 1)
OFF = np.ones(N - 1)
LAPLACIAN = (np.diag(-2.0 * np.ones(N)) + np.diag(OFF, 1) + np.diag(OFF, -1)) / DX**2
X = np.linspace(DX, 1 - DX, N)
T1 = 0.5


def heat_solve(diffusivity, y0, adjoint, controller=None, dt0=0.02):
    def vf(t, y, args):
        # Closes over the differentiated diffusivity; the Laplacian as a stencil.
        padded = jnp.concatenate([jnp.zeros(1), y, jnp.zeros(1)])
        return diffusivity * (padded[2:] - 2 * y + padded[:-2]) / DX**2

    sol = sk.diffeqsolve(
        sk.ODETerm(vf),
        CrankNicolson(),
        0.0,
        T1,
        dt0,
        y0,
        stepsize_controller=controller or sk.ConstantStepSize(),
        adjoint=adjoint,
    )
    return sol.ys[-1]


def exact(diffusivity, y0):
    return scipy.linalg.expm(diffusivity * T1 * LAPLACIAN) @ np.asarray(y0)


ADJOINTS = [
    sk.RecursiveCheckpointAdjoint(),
    sk.DirectAdjoint(),
    sk.BacksolveAdjoint(),
]


@pytest.fixture(scope="module")
def heat():
    with float64():
        y0 = jnp.asarray(np.sin(np.pi * X) + 0.5 * np.sin(3 * np.pi * X))
        yield y0


def test_crank_nicolson_solves_the_heat_equation(heat):
    with float64():
        y1 = jax.jit(heat_solve, static_argnums=2)(0.05, heat, ADJOINTS[0])
        np.testing.assert_allclose(y1, exact(0.05, heat), atol=2e-4)
        # Adaptive steps from the user's own error estimate.
        pid = sk.PIDController(rtol=1e-6, atol=1e-8)
        y1 = heat_solve(0.05, heat, ADJOINTS[0], pid, dt0=None)
        np.testing.assert_allclose(y1, exact(0.05, heat), atol=1e-5)


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(a, marks=[] if i == 0 else [pytest.mark.slow])
        for i, a in enumerate(ADJOINTS)
    ],
    ids=lambda a: type(a).__name__,
)
def test_crank_nicolson_gradient_every_adjoint(heat, adjoint):
    with float64():
        loss = lambda d: jnp.sum(heat_solve(d, heat, adjoint) ** 2)
        grad = jax.jit(jax.grad(loss))(0.05)
        fd = finite_difference(lambda d: jnp.sum(exact(float(d), heat) ** 2), 0.05)
        tol = 2e-3 if isinstance(adjoint, sk.BacksolveAdjoint) else 1e-3
        np.testing.assert_allclose(grad, fd, rtol=tol)


def test_crank_nicolson_vmap_over_closed_over_index(heat):
    with float64():
        rates = jnp.array([0.02, 0.05, 0.1])

        def solve(k):
            return heat_solve(rates[k], heat, ADJOINTS[0])

        out = jax.jit(jax.vmap(solve))(jnp.arange(3))
        for k in range(3):
            np.testing.assert_allclose(out[k], exact(float(rates[k]), heat), atol=3e-4)


class ScaledTimeTerm(sk.AbstractTerm):
    """dy = f(t, y) d(scale * t): a term whose control is not the time step."""

    vector_field: object
    scale: jax.Array

    def vf(self, t, y, args):
        return self.vector_field(t, y, args)

    def contr(self, t0, t1, **kwargs):
        return self.scale * (t1 - t0)

    def prod(self, vf, control):
        return jax.tree_util.tree_map(lambda v: v * control, vf)


@pytest.mark.slow
def test_custom_term_and_multiterm_under_grad_and_vmap():
    with float64():

        def solve(rate, scale):
            decay = sk.ODETerm(lambda t, y, args: -rate * y)
            extra = ScaledTimeTerm(lambda t, y, args: -y, scale)
            zero = sk.ODETerm(lambda t, y, args: 0)  # a scalar: broadcast, as diffrax
            sol = sk.diffeqsolve(
                sk.MultiTerm(decay, extra, zero),
                sk.Tsit5(),
                0.0,
                1.0,
                0.1,
                jnp.array([1.0, 2.0]),
                stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
            )
            return sol.ys[-1]

        y1 = jax.jit(solve)(0.5, jnp.asarray(2.0))
        np.testing.assert_allclose(y1, np.array([1.0, 2.0]) * np.exp(-2.5), rtol=1e-8)
        grad = jax.grad(lambda s: solve(0.5, s).sum())(jnp.asarray(2.0))
        np.testing.assert_allclose(grad, -3 * np.exp(-2.5), rtol=1e-7)
        batched = jax.vmap(solve, in_axes=(0, None))(jnp.array([0.0, 1.0]), 1.0)
        np.testing.assert_allclose(batched[:, 0], np.exp([-1.0, -2.0]), rtol=1e-8)


def test_integer_vector_field_output_is_cast():
    # diffrax accepts a vector field returning integers for a float state.
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.array([1, 1])),
        sk.Euler(),
        0.0,
        1.0,
        0.25,
        jnp.array([0.0, 1.0]),
    )
    np.testing.assert_allclose(sol.ys[-1], [1.0, 2.0])


def test_complex_output_for_real_state_is_an_error():
    with pytest.raises(TypeError, match="complex"):
        sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: y * 1j),
            sk.Euler(),
            0.0,
            1.0,
            0.25,
            jnp.array([1.0]),
        )


def test_multiterm_errors():
    with pytest.raises(ValueError, match="at least one"):
        sk.MultiTerm()
    with pytest.raises(TypeError, match="AbstractTerm"):
        sk.MultiTerm(lambda t, y, args: y)


def test_user_solver_without_error_estimate_under_pid_is_an_error():
    class NoError(CrankNicolson):
        def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
            y1, _, info, state, result = super().step(
                terms, t0, t1, y0, args, solver_state, made_jump
            )
            return y1, None, info, state, result

    with pytest.raises(ValueError, match="no error estimate"):
        sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -y),
            NoError(),
            0.0,
            1.0,
            0.1,
            jnp.array([1.0]),
            stepsize_controller=sk.PIDController(rtol=1e-3, atol=1e-3),
        )


def test_local_interpolations_agree_with_their_definitions():
    t0, t1 = jnp.asarray(1.0), jnp.asarray(3.0)
    y0, y1 = jnp.array([1.0, 0.0]), jnp.array([3.0, 4.0])
    lin = sk.LocalLinearInterpolation(t0=t0, t1=t1, y0=y0, y1=y1)
    np.testing.assert_allclose(lin.evaluate(2.0), [2.0, 2.0])
    np.testing.assert_allclose(lin.evaluate(1.0, 3.0), [2.0, 4.0])
    # A cubic is reproduced exactly by the Hermite interpolation.
    p = lambda t: t**3 - 2 * t
    dp = lambda t: 3 * t**2 - 2
    herm = sk.ThirdOrderHermitePolynomialInterpolation(
        t0=t0, t1=t1, y0=p(t0), y1=p(t1), f0=dp(t0), f1=dp(t1)
    )
    np.testing.assert_allclose(herm.evaluate(2.5), p(2.5), rtol=1e-6)

    class Quartic(sk.FourthOrderPolynomialInterpolation):
        c_mid = np.array([0.0, 0.125])  # y(1/2) = y0 + c_mid . k

    # y = t² on [0, 1]: stage increments k = h y' = [0, 2] at both ends; a quadratic
    # is reproduced exactly.
    quad = Quartic(
        t0=jnp.asarray(0.0),
        t1=jnp.asarray(1.0),
        y0=jnp.asarray(0.0),
        y1=jnp.asarray(1.0),
        k=jnp.array([0.0, 2.0]),
    )
    np.testing.assert_allclose(quad.evaluate(0.3), 0.09, rtol=1e-6)
