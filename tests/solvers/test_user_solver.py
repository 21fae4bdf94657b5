"""A user's own solver reaches its own terms, as in diffrax: it gets each term
wrapped, with the user's term object as `.term`, and may call any of its methods; a
term whose `vf` returns `None` is fine when the solver never calls `vf`. What the
term closes over (differentiated floats, vmapped integer indices) is still
converted and passed as an operand: checked under `jit`, `vmap` and `grad`, against
diffrax running the same solver and against the exact solution."""

import diffrax
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest
from helpers import finite_difference, float64, FULL_MATRIX

import solverkit as sk


def _make(lib):
    """A term that only its own solver understands (a linear operator, `vf` is
    `None`) and an exponential-Euler solver that calls the term's own method."""

    class LinearTerm(lib.AbstractTerm):
        operator: object  # a callable () -> matrix: it may close over anything

        def matrix(self):
            return self.operator()

        def vf(self, t, y, args):
            return None  # not an ODE right-hand side this library could evaluate

        def contr(self, t0, t1, **kwargs):
            return t1 - t0

        def prod(self, vf, control):
            return None

    class ExponentialEuler(lib.AbstractSolver):
        term_structure = lib.AbstractTerm
        interpolation_cls = lib.LocalLinearInterpolation

        def order(self, terms):
            return 1

        def init(self, terms, t0, t1, y0, args):
            return None

        def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
            dt = terms.contr(t0, t1)
            y1 = jsl.expm(terms.term.matrix() * dt) @ y0
            return y1, None, dict(y0=y0, y1=y1), None, lib.RESULTS.successful

        def func(self, terms, t0, y0, args):
            return terms.term.matrix() @ y0

    return LinearTerm, ExponentialEuler


A = np.array([[-1.0, 2.0], [-2.0, -1.0]])
Y0 = np.array([1.0, 0.5])


def _solve(lib, operator, t1=1.0, adjoint=None, **kwargs):
    LinearTerm, ExponentialEuler = _make(lib)
    extra = {} if adjoint is None else dict(adjoint=adjoint)
    return lib.diffeqsolve(
        LinearTerm(operator),
        ExponentialEuler(),
        0.0,
        t1,
        0.25 if t1 > 0 else -0.25,
        jnp.asarray(Y0),
        **extra,
        **kwargs,
    )


@pytest.mark.parametrize("t1", [1.0, -1.0], ids=["forwards", "backwards"])
# Quick loop: test_protocol.py::test_crank_nicolson_solves_the_heat_equation.
@pytest.mark.slow
def test_solver_reaches_its_term_as_in_diffrax(t1):
    with float64():
        ours = _solve(sk, lambda: jnp.asarray(A), t1).ys
        theirs = _solve(diffrax, lambda: jnp.asarray(A), t1).ys
        np.testing.assert_allclose(ours, theirs, rtol=1e-13)
        exact = jsl.expm(A * t1) @ Y0  # exponential Euler is exact for y' = Ay
        np.testing.assert_allclose(ours[-1], exact, rtol=1e-12)


@pytest.mark.slow
def test_closed_over_values_are_operands_under_grad_vmap_jit():
    with float64():
        table = jnp.asarray(np.stack([A, 2 * A, A.T]))

        def final(theta, k, adjoint=sk.RecursiveCheckpointAdjoint()):
            # `theta` (differentiated) and `k` (a vmapped int) live only in a
            # closure inside the term, where only the user's solver reaches them.
            sol = _solve(sk, lambda: theta * table[k], adjoint=adjoint)
            return sol.ys[-1]

        ks = jnp.arange(3)
        batched = jax.jit(jax.vmap(final, in_axes=(None, 0)))(0.7, ks)
        for k in range(3):
            exact = jsl.expm(0.7 * np.asarray(table[k])) @ Y0
            np.testing.assert_allclose(batched[k], exact, rtol=1e-12)

        def loss(theta, adjoint=sk.RecursiveCheckpointAdjoint()):
            return jnp.sum(jax.vmap(lambda k: final(theta, k, adjoint))(ks) ** 2)

        # Jitted: each program compiled once (eagerly, every call converts new
        # closures and compiles again).
        fd = finite_difference(jax.jit(loss), 0.7)
        grad = jax.jit(jax.grad(loss))(0.7)
        np.testing.assert_allclose(grad, fd, rtol=1e-7)
        if FULL_MATRIX:
            # By default a user's solver under DirectAdjoint's gradient is
            # diffrax_compat/test_solver_protocol.py::
            # test_crank_nicolson_gradient_every_adjoint[DirectAdjoint]'s.
            direct = jax.jit(jax.grad(lambda th: loss(th, sk.DirectAdjoint())))(0.7)
            np.testing.assert_allclose(direct, grad, rtol=1e-12)


def test_adjoints_that_need_the_vector_field_say_so():
    def loss(theta):
        sol = _solve(sk, lambda: theta * A, adjoint=sk.BacksolveAdjoint())
        return jnp.sum(sol.ys)

    with float64(), pytest.raises(ValueError, match="needs the vector field itself"):
        jax.grad(loss)(1.0)


# The full suite; the quick loop's user solver:
# test_protocol.py::test_crank_nicolson_solves_the_heat_equation.
@pytest.mark.slow
def test_wrapped_terms_of_a_multiterm_as_in_diffrax():
    """Each term of a `MultiTerm` is wrapped, as diffrax wraps them, under an
    adaptive controller."""

    def make(lib):
        LinearTerm, _ = _make(lib)

        class SplitEuler(lib.AbstractSolver):
            term_structure = lib.MultiTerm[tuple[lib.AbstractTerm, lib.AbstractTerm]]
            interpolation_cls = lib.LocalLinearInterpolation

            def order(self, terms):
                return 1

            def init(self, terms, t0, t1, y0, args):
                return None

            def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
                linear, other = terms.terms
                dt = linear.contr(t0, t1)
                y1 = jsl.expm(linear.term.matrix() * dt) @ y0
                y1 = y1 + other.vf_prod(t0, y0, args, other.contr(t0, t1))
                euler = y0 + dt * self.func(terms, t0, y0, args)
                return y1, y1 - euler, dict(y0=y0, y1=y1), None, lib.RESULTS.successful

            def func(self, terms, t0, y0, args):
                linear, other = terms.terms
                return linear.term.matrix() @ y0 + other.vf(t0, y0, args)

        terms = lib.MultiTerm(
            LinearTerm(lambda: jnp.asarray(A)),
            lib.ODETerm(lambda t, y, args: args * jnp.sin(t) * jnp.ones_like(y)),
        )
        return lib.diffeqsolve(
            terms,
            SplitEuler(),
            0.0,
            1.0,
            0.01,  # diffrax's first step whenever `dt0=None` (see docs/migrating.md)
            jnp.asarray(Y0),
            0.3,
            stepsize_controller=lib.PIDController(rtol=1e-4, atol=1e-6),
        )

    with float64():
        ours, theirs = make(sk), make(diffrax)
        np.testing.assert_allclose(ours.ys, theirs.ys, rtol=1e-12)
        assert int(ours.stats["num_steps"]) == int(theirs.stats["num_steps"])


# The full suite (a comparison with diffrax); the quick loop's user solver:
# diffrax_compat/test_solver_protocol.py::test_crank_nicolson_solves_the_heat_equation.
@pytest.mark.slow
def test_first_step_of_terms_that_are_not_an_ode_term_as_in_diffrax():
    """With `dt0=None` an adaptive controller takes 0.01 for terms that are not an
    `ODETerm`, as diffrax does, without calling the solver's `func` (here it
    returns `None`, as some user solvers' do)."""

    def make(lib):
        LinearTerm, ExponentialEuler = _make(lib)

        class NoFunc(ExponentialEuler):
            def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
                dt = terms.contr(t0, t1)
                y1 = jsl.expm(terms.term.matrix() * dt) @ y0
                half = jsl.expm(terms.term.matrix() * dt / 2)
                error = y1 - half @ (half @ y0)
                return y1, error, dict(y0=y0, y1=y1), None, lib.RESULTS.successful

            def func(self, terms, t0, y0, args):
                return None

        return lib.diffeqsolve(
            LinearTerm(lambda: jnp.asarray(A)),
            NoFunc(),
            0.0,
            1.0,
            None,
            jnp.asarray(Y0),
            stepsize_controller=lib.PIDController(rtol=1e-6, atol=1e-6),
            saveat=lib.SaveAt(steps=True),
        )

    with float64():
        ours, theirs = make(sk), make(diffrax)
        finite = np.isfinite(np.asarray(theirs.ts))
        np.testing.assert_allclose(ours.ts[finite], theirs.ts[finite], rtol=1e-12)
        np.testing.assert_allclose(ours.ys[finite], theirs.ys[finite], rtol=1e-12)
