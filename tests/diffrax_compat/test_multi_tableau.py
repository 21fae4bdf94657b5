"""A user's Runge-Kutta solver on a `MultiButcherTableau` (diffrax's: one tableau a
term, stages interleaved), explicit and with one diagonally implicit tableau; a
built-in Runge-Kutta `step` called on a `MultiTerm`; the structure checks. Against
the same solver written for diffrax 0.7.2, the built-in solver on the summed field,
and the exact solution; under `jit`, `vmap` and `grad` with closed-over values of
several dtypes."""

from typing import ClassVar

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finite_difference, full_matrix_only

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


def _double(lib, second="Dopri5", root_finder=None):
    never, second_stage = (
        lib.CalculateJacobian.never,
        lib.CalculateJacobian.second_stage,
    )
    """`Dopri5` on the first term and `second`'s tableau on the second, written as
    diffrax's tests write it (linear dense output)."""
    namespace = dict(
        tableau=lib.MultiButcherTableau(
            lib.Dopri5.tableau, getattr(lib, second).tableau
        ),
        calculate_jacobian=never if root_finder is None else second_stage,
        interpolation_cls=staticmethod(
            lambda *, k, **kwargs: lib.LocalLinearInterpolation(**kwargs)
        ),
        order=lambda self, terms: 5,
        __annotations__={"tableau": ClassVar},
    )
    if root_finder is not None:
        namespace["__annotations__"] = dict(
            tableau=ClassVar, root_finder=object, root_find_max_steps=int
        )
        namespace.update(root_finder=root_finder, root_find_max_steps=10)
    return type("Double", (lib.AbstractRungeKutta,), namespace)()


def _terms(lib, k1, k2, index):
    """Two linear terms: rates closed over as a float64 scalar and an entry of a
    float32 vector picked by an int32 index."""
    f1 = lib.ODETerm(lambda t, y, args: -k1 * y)
    f2 = lib.ODETerm(lambda t, y, args: -k2[index].astype(y.dtype) * y)
    return lib.MultiTerm(f1, f2)


def _solve(lib, solver, terms, controller, y0=None, t1=1.0):
    y0 = jnp.array([1.0, 2.0]) if y0 is None else y0
    return lib.diffeqsolve(
        terms,
        solver,
        0.0,
        t1,
        0.05,
        y0,
        stepsize_controller=controller,
        saveat=lib.SaveAt(ts=jnp.linspace(0.0, t1, 6)),
    )


K2 = jnp.array([0.5, 0.7], jnp.float32)


# The full suite; the quick loop's user tableau: test_diffrax_form_explicit_tableau.
@pytest.mark.slow
@pytest.mark.parametrize(
    "adaptive",
    [pytest.param(False, marks=full_matrix_only("[True] (the same pair)")), True],
)
def test_explicit_pair_is_the_summed_method(adaptive):
    # Dopri5 on both terms is Dopri5 on their sum: the same steps and values, up to
    # the order of additions (a few ulps a step, 1e-12 over ~20 steps).
    def controller(lib):
        if adaptive:
            return lib.PIDController(rtol=1e-6, atol=1e-9)
        return lib.ConstantStepSize()

    k1, index = jnp.array(0.3), jnp.array(1, jnp.int32)
    ours = _solve(sk, _double(sk), _terms(sk, k1, K2, index), controller(sk))
    theirs = _solve(
        diffrax, _double(diffrax), _terms(diffrax, k1, K2, index), controller(diffrax)
    )
    summed = sk.ODETerm(lambda t, y, a: -(k1 + K2[index].astype(y.dtype)) * y)
    ref = _solve(sk, sk.Dopri5(), summed, controller(sk))
    assert int(ours.stats["num_steps"]) == int(theirs.stats["num_steps"])
    assert int(ours.stats["num_steps"]) == int(ref.stats["num_steps"])
    # Saves between step ends (adaptive) go through the interpolant, whose
    # arithmetic differs from diffrax's by ulps of y amplified by 1 / dt (JAX 0.12 with
    # a newer diffrax: 1.8e-11), hence 1e-10.
    np.testing.assert_allclose(ours.ys, theirs.ys, rtol=1e-10)
    # `ref` saves through Dopri5's own dense output, `ours` through the linear
    # interpolation of the user's class: equal at the steps (the 6 save times of the
    # fixed 0.05 grid; t0 and t1 for the adaptive one).
    rows = slice(None) if not adaptive else np.array([0, -1])
    np.testing.assert_allclose(ours.ys[rows], ref.ys[rows], rtol=1e-12)  # pyright: ignore


# The full suite; the quick loop's user tableau: test_diffrax_form_explicit_tableau.
@pytest.mark.slow
def test_implicit_pair():
    # Dopri5 on the first term, Kvaerno5's ESDIRK tableau on the second (its stages
    # solved by VeryChord), y' = -(0.3 + 0.7) y. The pair's nodes differ, so its
    # stage values agree only to first order and the pair is of low order whatever
    # the tolerance: diffrax's test allows it 1e-4. Against the same solver in
    # diffrax, which makes the same steps (its Kvaerno5 coefficients printed to
    # ~1e-10, its stage solves to the 1e-10 asked): to 1e-8.
    k1, index = jnp.array(0.3), jnp.array(1, jnp.int32)
    pid = lambda lib: lib.PIDController(rtol=1e-8, atol=1e-10)
    chord = lambda lib: lib.VeryChord(rtol=1e-10, atol=1e-10)

    # The solve and its reverse mode (through the stage solves: optimistix's
    # implicit derivative inside the converted step) in one program a library.
    def final(lib, k1):
        terms = _terms(lib, k1, K2, index)
        solver = _double(lib, "Kvaerno5", chord(lib))
        sol = _solve(lib, solver, terms, pid(lib))
        return sol.ys[-1, 0], sol  # pyright: ignore

    def solve_and_grad(lib):
        fn = jax.value_and_grad(lambda k: final(lib, k), has_aux=True)
        (_, sol), grad = jax.jit(fn)(k1)
        return sol, grad

    (ours, g), (theirs, g_theirs) = solve_and_grad(sk), solve_and_grad(diffrax)
    assert ours.ts is not None and ours.ys is not None
    assert int(ours.stats["num_steps"]) == int(theirs.stats["num_steps"])
    np.testing.assert_allclose(ours.ys, theirs.ys, rtol=1e-8)
    exact = jnp.outer(jnp.exp(-(0.3 + float(K2[1])) * ours.ts), jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(ours.ys[-1], exact[-1], rtol=1e-3)
    # Reverse mode as diffrax's, to the stage solves' 1e-10.
    np.testing.assert_allclose(g, g_theirs, rtol=1e-8)


def test_single_step_matches_the_builtin_on_a_multiterm():
    # diffrax's test_multiple_tableau_single_step, with our own tolerance: a
    # built-in solver's `step` on a MultiTerm steps the sum; the pair's `k` is a
    # tuple whose sum is the built-in's.
    terms = _terms(sk, jnp.array(0.3), K2, jnp.array(0, jnp.int32))
    y0 = jnp.array([1.0, 2.0])
    for expensive in (False, True):
        if expensive:
            object.__setattr__(terms, "is_vf_expensive", lambda *a: True)
        outs = []
        for solver in (sk.Dopri5(), _double(sk)):
            state = solver.init(terms, 0.3, 0.7, y0, None)
            assert (state is None) == expensive
            outs.append(solver.step(terms, 0.3, 0.7, y0, None, state, False))
        (y1, err1, dense1, state1, _), (y2, err2, dense2, state2, _) = outs
        np.testing.assert_allclose(y1, y2, rtol=1e-14)
        np.testing.assert_allclose(err1, err2, rtol=1e-10, atol=1e-16)
        np.testing.assert_allclose(dense1["k"], sum(dense2["k"]), rtol=1e-14)
        assert (state1 is None) == (state2 is None) == expensive
        # One Dopri5 step: local error ~ (k h)^6 / 6! relative, k h = 0.32.
        kh = (0.3 + float(K2[0])) * 0.4
        np.testing.assert_allclose(y1, jnp.exp(-kh) * y0, rtol=kh**6 / 720)


# Quick loop: test_diffrax_form_explicit_tableau[True].
@pytest.mark.slow
def test_jit_vmap_grad():
    index = jnp.array(1, jnp.int32)

    def final(lib, k1, index):
        pid = lib.PIDController(rtol=1e-8, atol=1e-10)
        sol = _solve(lib, _double(lib), _terms(lib, k1, K2, index), pid)
        return sol.ys[-1, 0]  # pyright: ignore

    ours = jax.jit(lambda k1, i: final(sk, k1, i))
    theirs = jax.jit(lambda k1, i: final(diffrax, k1, i))
    k1 = jnp.array(0.3)
    idx = jnp.array([0, 1], jnp.int32)
    # Each index against diffrax (one program each, the index an operand); `vmap`
    # over the index against those (so against diffrax) without a batched diffrax
    # program.
    singles = [ours(k1, i) for i in idx]
    for i, single in zip(idx, singles):
        np.testing.assert_allclose(single, theirs(k1, i), rtol=1e-12)
    np.testing.assert_allclose(
        jax.vmap(ours, in_axes=(None, 0))(k1, idx), np.stack(singles), rtol=1e-12
    )
    g = jax.jit(jax.grad(ours))(k1, index)
    np.testing.assert_allclose(g, jax.jit(jax.grad(theirs))(k1, index), rtol=1e-9)
    # d/dk1 exp(-(k1 + k2)) = -exp(-(k1 + k2)), to the solve's tolerance (1e-8).
    np.testing.assert_allclose(g, -np.exp(-(0.3 + float(K2[1]))), rtol=1e-6)
    fd = finite_difference(lambda k: ours(k, index), k1, eps=1e-5)
    np.testing.assert_allclose(g, fd, rtol=1e-6)


def test_structure_errors():
    with pytest.raises(ValueError, match="same number of stages"):
        sk.MultiButcherTableau(sk.Dopri5.tableau, sk.Bosh3.tableau)
    with pytest.raises(ValueError, match="at most one implicit"):
        sk.MultiButcherTableau(sk.Kvaerno3.tableau, sk.Kvaerno3.tableau)
    with pytest.raises(ValueError, match="IMEX pair"):
        sk.MultiButcherTableau(sk.Dopri5.tableau, sk.KenCarp3.tableau)
    sk.MultiButcherTableau(sk.Bosh3.tableau, sk.Kvaerno3.tableau)  # 4 stages each
    f = sk.ODETerm(lambda t, y, a: -y)
    with pytest.raises(ValueError, match="not compatible"):  # a plain tuple
        sk.diffeqsolve((f, f), _double(sk), 0.0, 1.0, 0.1, jnp.array(1.0))
    with pytest.raises(ValueError, match="not compatible"):
        sk.diffeqsolve(sk.MultiTerm(f), _double(sk), 0.0, 1.0, 0.1, jnp.array(1.0))
    with pytest.raises(ValueError, match="MultiTerm of as many"):  # called directly
        _double(sk).step(f, 0.0, 0.1, jnp.array(1.0), None, None, False)


def test_abstract_implicit_solver_subclass():
    # diffrax's AbstractImplicitSolver asks a subclass for `root_finder` and
    # `root_find_max_steps` only (no tableau).
    class MyImplicit(sk.AbstractImplicitSolver):
        interpolation_cls = sk.LocalLinearInterpolation
        root_finder: object
        root_find_max_steps: int = 10

        def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
            y1 = y0 / (1 - (t1 - t0) * -1.0)  # implicit Euler for y' = -y
            return y1, None, dict(y0=y0, y1=y1), None, sk.RESULTS.successful

    solver = MyImplicit(root_finder=sk.VeryChord(rtol=1e-6, atol=1e-6))
    assert isinstance(solver, sk.AbstractImplicitSolver)
    assert not isinstance(sk.Tsit5(), sk.AbstractImplicitSolver)
    assert isinstance(sk.Kvaerno5(), sk.AbstractImplicitSolver)
    sol = sk.diffeqsolve(sk.ODETerm(lambda t, y, a: -y), solver, 0.0, 1.0, 0.01, 1.0)
    # Implicit Euler's global error at t = 1: ~h/2 t e^-t.
    np.testing.assert_allclose(sol.ys, np.exp(-1.0), rtol=0.01)  # pyright: ignore


def _heun_tableau(lib):
    # Heun's method in diffrax's form; the error weights b - b_hat for the
    # embedded Euler (b_hat = (1, 0)).
    return lib.ButcherTableau(
        c=np.array([1.0]),
        b_sol=np.array([0.5, 0.5]),
        b_error=np.array([-0.5, 0.5]),
        a_lower=(np.array([1.0]),),
    )


def _trapezoid_tableau(lib):
    # The trapezoidal rule as a two-stage ESDIRK (explicit first stage, diagonal
    # 1/2), the error against implicit Euler's weights (0, 1).
    return lib.ButcherTableau(
        c=np.array([1.0]),
        b_sol=np.array([0.5, 0.5]),
        b_error=np.array([0.5, -0.5]),
        a_lower=(np.array([0.5]),),
        a_diagonal=np.array([0.0, 0.5]),
        a_predictor=(np.array([1.0]),),
    )


def _user_rk(lib, tableau, order, root_finder=None):
    annotations: dict = dict(tableau=ClassVar)
    namespace = dict(
        tableau=tableau,
        interpolation_cls=staticmethod(
            lambda *, k, **kwargs: lib.LocalLinearInterpolation(**kwargs)
        ),
        order=lambda self, terms: order,
        calculate_jacobian=lib.CalculateJacobian.never,
        __annotations__=annotations,
    )
    if root_finder is not None:
        annotations.update(root_finder=object, root_find_max_steps=int)
        namespace.update(
            root_finder=root_finder,
            root_find_max_steps=10,
            calculate_jacobian=lib.CalculateJacobian.second_stage,
        )
    return type("UserRK", (lib.AbstractRungeKutta,), namespace)()


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.quick_cases(dict(adaptive=True))
def test_diffrax_form_explicit_tableau(adaptive):
    # Heun in diffrax's form is Heun: the same steps, values to round-off, and the
    # same as diffrax running the same class.
    def controller(lib):
        return (
            lib.PIDController(rtol=1e-5, atol=1e-8)
            if adaptive
            else lib.ConstantStepSize()
        )

    k1, index = jnp.array(0.3), jnp.array(1, jnp.int32)
    term = lambda lib: lib.ODETerm(
        lambda t, y, a: -(k1 + K2[index].astype(y.dtype)) * y
    )
    ours = _solve(sk, _user_rk(sk, _heun_tableau(sk), 2), term(sk), controller(sk))
    ref = _solve(sk, sk.Heun(), term(sk), controller(sk))
    theirs = _solve(
        diffrax, _user_rk(diffrax, _heun_tableau(diffrax), 2), term(diffrax),
        controller(diffrax),
    )  # fmt: skip
    assert int(ours.stats["num_steps"]) == int(ref.stats["num_steps"])
    assert int(ours.stats["num_steps"]) == int(theirs.stats["num_steps"])
    # Saves between step ends (adaptive) go through the interpolant, whose
    # arithmetic differs from diffrax's by ulps of y amplified by 1 / dt (JAX 0.12 with
    # a newer diffrax: 1.8e-11), hence 1e-10.
    np.testing.assert_allclose(ours.ys, theirs.ys, rtol=1e-10)
    rows = slice(None) if not adaptive else np.array([0, -1])  # steps' ends
    np.testing.assert_allclose(ours.ys[rows], ref.ys[rows], rtol=1e-12)  # pyright: ignore


# Quick loop: test_diffrax_form_explicit_tableau[True].
@pytest.mark.slow
def test_diffrax_form_esdirk_tableau():
    # The trapezoidal rule as an ESDIRK, fixed steps on a stiff decay: second order
    # (error x1/4 when h halves, 3.5 to 4.5 allowed), A-stable (no blow-up at
    # k h = 50), and as diffrax's same class (stage solves to 1e-12).
    k = jnp.array(10.0)
    chord = lambda lib: lib.VeryChord(rtol=1e-12, atol=1e-12)
    term = lambda lib: lib.ODETerm(lambda t, y, a: -k * y)

    def final(lib, dt):
        sol = lib.diffeqsolve(
            term(lib), _user_rk(lib, _trapezoid_tableau(lib), 2, chord(lib)),
            0.0, 1.0, dt, jnp.array([1.0]),
        )  # fmt: skip
        return sol.ys[-1, 0]  # pyright: ignore

    errors = [abs(float(final(sk, dt)) - np.exp(-10.0)) for dt in (0.02, 0.01)]
    assert 3.5 < errors[0] / errors[1] < 4.5
    np.testing.assert_allclose(final(sk, 0.02), final(diffrax, 0.02), rtol=1e-10)
    assert abs(float(final(sk, 5.0))) <= 1.0  # (1 - 25) / (1 + 25) per step


def test_diffrax_form_tableau_errors():
    with pytest.raises(ValueError, match="sum to c"):
        sk.ButcherTableau(
            c=np.array([0.5]), b_sol=np.array([0.5, 0.5]),
            b_error=np.array([-0.5, 0.5]), a_lower=(np.array([1.0]),),
        )  # fmt: skip
    with pytest.raises(ValueError, match="shape"):
        sk.ButcherTableau(
            c=np.array([1.0]), b_sol=np.array([0.5, 0.5]),
            b_error=np.array([-0.5, 0.5]), a_lower=(np.array([1.0, 0.0]),),
        )  # fmt: skip
    # In a MultiButcherTableau, with solverkit's own tableaux.
    sk.MultiButcherTableau(_heun_tableau(sk), sk.Heun.tableau)
