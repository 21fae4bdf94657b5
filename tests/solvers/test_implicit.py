"""Implicit (ESDIRK) and IMEX solvers: tableaux, convergence order, stiff problems
against scipy's Radau and diffrax, the chord iteration's verdicts, and gradients
through every adjoint (vector fields closing over a differentiated float, a vmapped
int index and a bool mask)."""

import functools
import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
import scipy.linalg
from helpers import float64, full_matrix_only, quick_params

import solverkit as sk
from solverkit._solver._implicit_tableau import (
    IMPLICIT_EULER,
    KENCARP3,
    KENCARP4,
    KENCARP5,
    KVAERNO3,
    KVAERNO4,
    KVAERNO5,
    SIL3,
)


IMPLICIT = [
    (sk.ImplicitEuler, IMPLICIT_EULER),
    (sk.Kvaerno3, KVAERNO3),
    (sk.Kvaerno4, KVAERNO4),
    (sk.Kvaerno5, KVAERNO5),
]
IMEX = [
    (sk.KenCarp3, KENCARP3),
    (sk.KenCarp4, KENCARP4),
    (sk.KenCarp5, KENCARP5),
    (sk.Sil3, SIL3),
]
TIGHT = sk.VeryChord(rtol=1e-11, atol=1e-11)


# ---------------------------------------------------------------------------------
# Order conditions (Butcher trees; for additive methods every colouring of a tree).


@functools.cache
def trees(n: int) -> tuple[tuple, ...]:
    """Every rooted tree with `n` nodes, each a sorted tuple of its subtrees."""
    if n == 1:
        return ((),)
    found = set()

    def forests(m: int, smallest: tuple) -> list[tuple]:
        if m == 0:
            return [()]
        out = []
        for k in range(1, m + 1):
            for t in trees(k):
                if (k, t) >= smallest:
                    out += [(t, *rest) for rest in forests(m - k, (k, t))]
        return out

    for forest in forests(n - 1, (0, ())):
        found.add(tuple(sorted(forest)))
    return tuple(sorted(found))


def size(t: tuple) -> int:
    return 1 + sum(size(u) for u in t)


def density(t: tuple) -> int:
    return size(t) * math.prod(density(u) for u in t)


def phi_root(t: tuple, mats: list, colours: tuple) -> tuple[np.ndarray, int]:
    """(Φ over stages of the subtree, its root colour); pre-order colours."""
    it = iter(colours)

    def walk(u):
        colour = next(it)
        out = np.ones(mats[0].shape[0])
        for v in u:
            child, child_colour = walk(v)
            out = out * (mats[child_colour] @ child)
        return out, colour

    return walk(t)


def order_residual(mats: list, bs: list, order: int) -> float:
    """Largest violation of the (additive) order conditions up to `order`."""
    worst = 0.0
    for n in range(1, order + 1):
        for t in trees(n):
            for colours in np.ndindex(*(len(mats),) * n):
                phi, root = phi_root(t, mats, colours)
                worst = max(worst, abs(bs[root] @ phi - 1 / density(t)))
    return worst


@pytest.mark.parametrize("cls, tab", IMPLICIT, ids=lambda x: getattr(x, "__name__", ""))
def test_tableau_order_conditions(cls, tab):
    assert order_residual([tab.a_im], [tab.b_im], tab.order) < 1e-10
    assert order_residual([tab.a_im], [tab.b_im], tab.order + 1) > 1e-6
    b_hat = tab.b_im - tab.b_err_im
    emb = tab.embedded_order
    assert order_residual([tab.a_im], [b_hat], emb) < 1e-10
    if tab.order > 1:  # the order of the embedded method is no higher
        assert order_residual([tab.a_im], [b_hat], emb + 1) > 1e-8
    assert tab.stiffly_accurate
    assert len(tab.diagonals) == 1  # one LU per step
    # L-stability: the stability function R(z) -> 0 as z -> -inf.
    a, b = tab.a_im, tab.b_im
    z = -1e8
    s = a.shape[0]
    r = 1 + z * b @ np.linalg.solve(np.eye(s) - z * a, np.ones(s))
    assert abs(r) < 1e-6


@pytest.mark.parametrize("cls, tab", IMEX, ids=lambda x: getattr(x, "__name__", ""))
def test_imex_tableau_order_conditions(cls, tab):
    """Every colouring of every tree: the coupling conditions of additive methods."""
    mats, bs = [tab.a_ex, tab.a_im], [tab.b_ex, tab.b_im]
    # The papers' rationals satisfy the conditions to rounding (4e-16 at most): a
    # mis-copied digit shows (KenCarp5's a_im[6, 5] with denominator 7827059040719
    # for the paper's 7827059040749 left 2e-12).
    tol = 1e-14
    assert order_residual(mats, bs, tab.order) < tol
    assert order_residual(mats, bs, tab.order + 1) > 1e-6
    b_hat = [tab.b_ex - tab.b_err_ex, tab.b_im - tab.b_err_im]
    assert order_residual(mats, b_hat, tab.embedded_order) < tol
    assert order_residual([tab.a_im], [tab.b_im], tab.order) < tol
    assert tab.a_im[-1] @ np.ones(tab.num_stages) == pytest.approx(1.0)
    if cls is not sk.Sil3:
        assert len(tab.diagonals) == 1


# ---------------------------------------------------------------------------------
# Convergence order on a nonlinear, non-autonomous problem with a known solution,
# y' = -2 t y^2 (y(0) = 1, y = 1 / (1 + t^2)), and a forced linear component (not
# stiff at these steps: stiff components show the order reduction of stage order 2).


def _field(t, y, args):
    return jnp.stack([-2 * t * y[0] ** 2, -2.0 * (y[1] - jnp.cos(t))])


def _exact(t):
    y1 = (4 * jnp.cos(t) + 2 * jnp.sin(t) + jnp.exp(-2.0 * t)) / 5
    return jnp.stack([1 / (1 + t**2), y1])


@functools.partial(jax.jit, static_argnums=0)
def _fixed_solve(solver, dt):
    sol = sk.diffeqsolve(
        sk.ODETerm(_field), solver, 0.0, 1.0, dt, jnp.array([1.0, 1.0]), max_steps=64
    )
    return sol.ys[-1]


def _explicit_part(t, y, args):
    return jnp.stack([-2 * t * y[0] ** 2, jnp.zeros_like(y[1])])


def _implicit_part(t, y, args):
    return jnp.stack([jnp.zeros_like(y[0]), -2.0 * (y[1] - jnp.cos(t))])


@functools.partial(jax.jit, static_argnums=0)
def _fixed_solve_imex(solver, dt):
    terms = sk.MultiTerm(sk.ODETerm(_explicit_part), sk.ODETerm(_implicit_part))
    sol = sk.diffeqsolve(
        terms, solver, 0.0, 1.0, dt, jnp.array([1.0, 1.0]), max_steps=64
    )
    return sol.ys[-1]


# Kvaerno3's solve is shared with test_optimistix_root_finder. (solve/test_integrate.py
# checks the orders of all of them too, KenCarp3's in the quick loop.)
@pytest.mark.parametrize(
    "cls",
    quick_params([c for c, _ in IMPLICIT + IMEX], [sk.Kvaerno3]),
    ids=lambda c: c.__name__,
)
def test_convergence_order(cls):
    with float64():
        solver = cls(root_finder=TIGHT, root_find_max_steps=20)
        imex = (
            cls.term_structure == sk.MultiTerm[tuple[sk.AbstractTerm, sk.AbstractTerm]]
        )
        solve = _fixed_solve_imex if imex else _fixed_solve
        dts = np.array([1 / 8, 1 / 12, 1 / 16, 1 / 24, 1 / 32])
        errors = [
            float(jnp.max(jnp.abs(solve(solver, dt) - _exact(1.0)))) for dt in dts
        ]
        slope = np.polyfit(np.log(dts), np.log(errors), 1)[0]
        assert abs(slope - solver.order(None)) < 0.35, (slope, errors)


# ---------------------------------------------------------------------------------
# Stiff problems against scipy's Radau at tight tolerance, and against diffrax.


def _rober(t, y, args):
    # `args` is the array module: jax.numpy in solves, NumPy for scipy.
    xp = jnp if args is None else args
    k1, k2, k3 = 0.04, 3e7, 1e4
    return xp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def _vdp(t, y, args):
    xp = jnp if args is None else args
    mu = 1000.0
    return xp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def _scipy(fn, t1, y0):
    # The same field in NumPy (`fn` is written for either), for a fast reference.
    sol = scipy.integrate.solve_ivp(
        lambda t, y: np.array(fn(t, y, np), dtype=np.float64),
        (0.0, t1),
        np.asarray(y0),
        method="Radau",
        rtol=1e-11,
        atol=1e-13,
    )
    return sol.y[:, -1]


@pytest.mark.parametrize(
    "fn, t1, y0, rtol",
    [
        pytest.param(_rober, 1e4, [1.0, 0.0, 0.0], 1e-5, marks=pytest.mark.slow),
        (_vdp, 100.0, [2.0, 0.0], 1e-4),
    ],
    ids=["rober", "vdp1000"],
)
def test_stiff_against_radau(fn, t1, y0, rtol):
    with float64():
        sol = sk.diffeqsolve(
            sk.ODETerm(fn),
            sk.Kvaerno5(),
            0.0,
            t1,
            1e-6,
            jnp.array(y0),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-12),
            max_steps=20_000,
        )
        ref = _scipy(fn, t1, y0)
        np.testing.assert_allclose(np.asarray(sol.ys[-1]), ref, rtol=rtol, atol=1e-9)
        assert int(sol.stats["num_steps"]) < 2_000


@pytest.mark.parametrize("explicit_share", [0.0, 0.3])
# Quick loop: [0.0].
@pytest.mark.quick_cases("0.0")
def test_kencarp5_error_at_step_ends_and_between(explicit_share):
    """KenCarp5 on a stiff linear pair (eigenvalues -20.1, -1.9), its field split
    between the terms: the error at the last step end is within 10 rtol (measured
    0.3-1.7: its embedded estimate, whose weights satisfy the linear fifth-order
    condition to 2e-8, reads about 0.1 of the local error on a linear problem,
    which the controller's safety factor covers here). Between step ends (saved
    from the third-order dense output, at steps sized for a fifth-order method)
    the error is far larger: measured 18-350 rtol, bounded here by 10^3 rtol."""
    a = np.array([[-20.0, 1.0], [1.5, -2.0]])
    y0 = np.array([0.2, 0.36])
    ts = np.array([0.05, 0.1, 0.15, 0.2])
    exact = np.stack([scipy.linalg.expm(t * a) @ y0 for t in ts])
    share = explicit_share
    with float64():

        @jax.jit
        def solve(rtol):
            terms = sk.MultiTerm(
                sk.ODETerm(lambda t, y, args: share * (jnp.asarray(a) @ y)),
                sk.ODETerm(lambda t, y, args: (1 - share) * (jnp.asarray(a) @ y)),
            )
            controller = sk.PIDController(rtol=rtol, atol=rtol * 1e-2)
            return sk.diffeqsolve(
                terms, sk.KenCarp5(), 0.0, 0.2, 0.01, jnp.asarray(y0),
                saveat=sk.SaveAt(ts=jnp.asarray(ts)), stepsize_controller=controller,
            ).ys  # fmt: skip

        for rtol in (1e-6, 1e-8, 1e-10):
            err = np.max(np.abs(np.asarray(solve(rtol)) - exact), axis=1) / rtol
            assert err[-1] < 10, (rtol, err)
            assert np.all(err < 1e3), (rtol, err)


def _linear_stiff(t, y, args):
    a = jnp.array([[-1.0, 0.5], [0.0, -1000.0]])
    return a @ y + jnp.stack([jnp.sin(t), 0.0])


@pytest.mark.slow
def test_same_as_diffrax():
    """On a problem where both root finders converge at once, step sequences agree;
    so does the dense output (cubic Hermite for both)."""
    with float64():
        out = {}
        ts = jnp.linspace(0.0, 10.0, 7)
        for lib in (sk, diffrax):
            sol = lib.diffeqsolve(
                lib.ODETerm(_linear_stiff),
                lib.Kvaerno5(),
                0.0,
                10.0,
                1e-3,
                jnp.array([1.0, 1.0]),
                saveat=lib.SaveAt(ts=ts),
                stepsize_controller=lib.PIDController(rtol=1e-7, atol=1e-9),
            )
            out[lib] = (int(sol.stats["num_steps"]), np.asarray(sol.ys))
        steps, ys = out[sk]
        steps_dfx, ys_dfx = out[diffrax]
        assert abs(steps - steps_dfx) <= 0.2 * steps_dfx, (steps, steps_dfx)
        np.testing.assert_allclose(ys, ys_dfx, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------
# The chord iteration: its verdicts, called on one step directly.


@functools.partial(jax.jit, static_argnums=1)
def _one_step(jac_scale, max_steps: int, h: float = 10.0):
    """One Kvaerno3 step of y' = -y with the Jacobian in the state scaled by
    `jac_scale` (so that the chord iteration contracts at a chosen rate)."""
    term = sk.ODETerm(lambda t, y, args: -y)
    solver = sk.Kvaerno3(root_finder=sk.VeryChord(rtol=1e-10, atol=1e-10))
    solver = sk.Kvaerno3(root_finder=solver.root_finder, root_find_max_steps=max_steps)
    y0 = jnp.array([1.0])
    state = solver.init(term, 0.0, h, y0, None)
    state = state._replace(jac=jac_scale * state.jac)
    return solver.step(term, 0.0, h, y0, None, state)


# Quick loop: test_stiff_against_radau[vdp1000].
@pytest.mark.slow
def test_chord_slow_convergence_is_not_divergence():
    with float64():
        # With half the Jacobian and γh = 4.4 the iteration contracts by ~0.69.
        y1, err, _, _, result = _one_step(0.5, 100)
        assert result == sk.RESULTS.successful
        np.testing.assert_allclose(np.asarray(y1), np.asarray(_one_step(1.0, 10)[0]))
        # Too few iterations at that rate: not converged, but never "diverged".
        *_, result = _one_step(0.5, 3)
        assert result == sk.RESULTS.implicit_nonconvergence
        # A fifth of the Jacobian: the iteration grows (rate ~2.4): diverged.
        _, err, _, _, result = _one_step(0.2, 100)
        assert result == sk.RESULTS.implicit_divergence
        assert np.all(np.isinf(np.asarray(err)))


def test_results_messages():
    for name in ("implicit_divergence", "implicit_nonconvergence"):
        message = sk.RESULTS[sk.RESULTS[name]]
        assert "implicit" in message and "`" in message


# ---------------------------------------------------------------------------------
# Errors.


def _terms_as_asked(library, solver):
    """The terms a solver asks for through its `term_structure`, built the way
    diffrax-based code does: a `MultiTerm` of the split field for an IMEX solver, else
    one term of the whole field."""
    split = library.MultiTerm[tuple[library.AbstractTerm, library.AbstractTerm]]
    if solver.term_structure == split:
        return library.MultiTerm(
            library.ODETerm(_explicit_part), library.ODETerm(_implicit_part)
        )
    whole = lambda t, y, args: _explicit_part(t, y, args) + _implicit_part(t, y, args)
    return library.ODETerm(whole)


@pytest.mark.parametrize(
    "name",
    [
        "KenCarp3",
        # With `SOLVERKIT_FULL_MATRIX=1` only: terms built from `term_structure` as
        # diffrax's tests do are [KenCarp3]'s, an ESDIRK solve against diffrax's
        # test_same_as_diffrax.
        pytest.param(
            "Kvaerno3", marks=full_matrix_only("[KenCarp3] and test_same_as_diffrax")
        ),
    ],
)
# Quick loop: test_kencarp5_error_at_step_ends_and_between[0.0].
@pytest.mark.slow
def test_term_structure_as_diffrax(name):
    # Code that builds terms from `term_structure` (as diffrax's tests do) builds
    # the same terms for solverkit, and the solves agree with diffrax's.
    out = []
    for library in (sk, diffrax):
        solver = getattr(library, name)()
        sol = library.diffeqsolve(
            _terms_as_asked(library, solver),
            solver,
            0.0,
            1.0,
            0.05,
            jnp.array([1.0, 1.0]),
            stepsize_controller=library.PIDController(rtol=1e-6, atol=1e-6),
        )
        out.append(sol.ys[-1])
    assert isinstance(_terms_as_asked(sk, sk.KenCarp3()), sk.MultiTerm)
    np.testing.assert_allclose(out[0], out[1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[0], _exact(1.0), rtol=1e-4, atol=1e-5)


def test_imex_needs_two_terms():
    # diffrax's first words (its TermAndSolverIncompatible), then ours.
    with pytest.raises(ValueError, match="Terms are not compatible with solver"):
        sk.diffeqsolve(
            sk.ODETerm(_field),
            sk.KenCarp3(),
            0.0,
            1.0,
            0.1,
            jnp.array([1.0, 1.0]),
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
        )


def test_constant_step_needs_tolerances():
    term = sk.ODETerm(lambda t, y, args: -y)
    with pytest.raises(ValueError, match="root_finder=VeryChord"):
        sk.diffeqsolve(term, sk.Kvaerno5(), 0.0, 1.0, 0.1, jnp.array([1.0]))
    # diffrax's own wording, which its users and tests match on.
    for diffeqsolve in (sk.diffeqsolve, diffrax.diffeqsolve):
        library = sk if diffeqsolve is sk.diffeqsolve else diffrax
        with pytest.raises(
            ValueError,
            match="fixed step size controller is being used alongside an implicit",
        ):
            diffeqsolve(
                library.ODETerm(lambda t, y, args: -y),
                library.Kvaerno5(),
                0.0,
                1.0,
                0.1,
                jnp.array([1.0]),
            )
    with pytest.raises(ValueError, match="taken from the step-size controller"):
        sk.with_stepsize_controller_tols(sk.VeryChord)(rtol=1e-3)


def test_root_finder_tolerances_from_controller():
    tolerances = sk.PIDController(rtol=1e-4, atol=1e-7).tolerances()
    solver = sk.Kvaerno5().bind_controller_tols(tolerances)
    assert solver.root_finder.rtol == 1e-4 and solver.root_finder.atol == 1e-7


# ---------------------------------------------------------------------------------
# Gradients: a field closing over a differentiated float `p`, a vmapped int index
# and a bool mask; fixed steps so that finite differences see the same steps.

_TABLE = np.array([1.0, 3.0])  # NumPy: float64 inside `float64()`


def _loss(p, index, mask, solver, adjoint, controller, dt):
    def field(t, y, args):
        rate = p * jnp.asarray(_TABLE)[index] * jnp.where(mask, 20.0, 1.0)
        return jnp.stack([-rate * (y[0] - jnp.cos(t)), p * y[0] - y[1] ** 2])

    sol = sk.diffeqsolve(
        sk.ODETerm(field),
        solver,
        0.0,
        1.0,
        dt,
        jnp.array([1.0, 0.5]),
        adjoint=adjoint,
        stepsize_controller=controller,
        max_steps=256,
    )
    return jnp.sum(sol.ys[-1] ** 2)


_FIXED = dict(controller=sk.ConstantStepSize(), dt=0.05)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _grads(p, index, mask, solver, adjoint):
    loss = functools.partial(_loss, solver=solver, adjoint=adjoint, **_FIXED)
    return jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0))(p, index, mask)


@pytest.mark.slow
def test_gradients_discrete_adjoints():
    """Reverse mode (RecursiveCheckpointAdjoint, vmapped) against finite differences,
    and forward mode (DirectAdjoint) against it."""
    with float64():
        solver = sk.Kvaerno5(root_finder=sk.VeryChord(rtol=1e-12, atol=1e-12))
        p = jnp.asarray(0.7)
        index = jnp.array([0, 1])
        mask = jnp.array([True, False])
        rc = sk.RecursiveCheckpointAdjoint()
        _, g_rc = _grads(p, index, mask, solver, rc)
        eps = 1e-6
        up, _ = _grads(p + eps, index, mask, solver, rc)
        down, _ = _grads(p - eps, index, mask, solver, rc)
        fd = (np.asarray(up) - np.asarray(down)) / (2 * eps)
        np.testing.assert_allclose(np.asarray(g_rc), fd, rtol=1e-6)
        loss = functools.partial(
            _loss, solver=solver, adjoint=sk.DirectAdjoint(), **_FIXED
        )
        jvp = jax.jit(lambda q: jax.jvp(lambda r: loss(r, 1, False), (q,), (1.0,)))
        _, tangent = jvp(p)
        np.testing.assert_allclose(float(tangent), float(g_rc[1]), rtol=1e-8)


# `SOLVERKIT_FULL_MATRIX=1` only (1.2 CPU s): an ESDIRK method's BacksolveAdjoint
# gradient is closure/test_closure_matrix.py's esdirk-backsolve cells (against the
# analytic one), the continuous adjoint against the discrete one
# adjoint/test_adjoint.py's.
@pytest.mark.slow
@full_matrix_only("test_closure_matrix.py's esdirk-backsolve cells")
def test_gradients_backsolve():
    """The continuous adjoint (same fixed steps backwards) agrees with the
    discrete one to the accuracy of the solves."""
    with float64():
        solver = sk.Kvaerno5(root_finder=sk.VeryChord(rtol=1e-12, atol=1e-12))
        p = jnp.asarray(0.7)
        index = jnp.array([0, 1])
        mask = jnp.array([True, False])
        _, g_back = _grads(p, index, mask, solver, sk.BacksolveAdjoint())
        _, g_rc = _grads(p, index, mask, solver, sk.RecursiveCheckpointAdjoint())
        # The adjoint ODE's own discretisation error at dt = 0.05 is ~1e-4.
        np.testing.assert_allclose(np.asarray(g_back), np.asarray(g_rc), rtol=5e-4)


def _rober(t, y, args):
    a, b, c = y
    return jnp.stack(
        [-0.04 * a + 1e4 * b * c, 0.04 * a - 1e4 * b * c - 3e7 * b**2, 3e7 * b**2]
    )


# The full suite; the quick loop's optimistix root finder: test_optimistix_root_finder.
@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_optimistix_root_finder_tolerances_in_derivative_units():
    # A user's optimistix root finder solves the stage equation for the stage's slope,
    # in the units of dy/dt, as in diffrax: `atol=1e-18` is reachable there, while in
    # the units of y (ROBER's second species is ~1e-5 and starts at 0) it is not, and
    # the solve stalled at t0 until max_steps (it did before this was changed).
    import optimistix as optx

    out = []
    for library in (sk, diffrax):
        sol = library.diffeqsolve(
            library.ODETerm(_rober),
            library.Kvaerno5(root_finder=optx.Newton(rtol=1e-5, atol=1e-18)),
            0.0,
            0.01,
            1e-6,
            jnp.array([1.0, 0.0, 0.0]),
            stepsize_controller=library.PIDController(rtol=1e-6, atol=1e-10),
            max_steps=4096,
        )
        out.append((sol.ys[-1], int(sol.stats["num_steps"])))
    (y_sk, steps_sk), (y_dfx, steps_dfx) = out
    np.testing.assert_allclose(y_sk, y_dfx, rtol=1e-6, atol=1e-12)
    assert steps_sk <= 1.5 * steps_dfx, (steps_sk, steps_dfx)  # diffrax: 100


def test_optimistix_root_finder():
    import optimistix as optx

    with float64():
        out = []
        for finder in (optx.Newton(rtol=1e-10, atol=1e-10), TIGHT):
            solver = sk.Kvaerno3(root_finder=finder, root_find_max_steps=20)
            out.append(_fixed_solve(solver, 1 / 8))  # shares a compile with the above
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(out[1]), rtol=1e-9)


def _imex_solve(p, key, adjoint, saveat, event=None):
    """A stiff linear decay (implicit) plus a forcing that closes over a float being
    differentiated and a PRNG key (explicit), with an event and dense output."""
    phase = jax.random.uniform(key)
    stiff = sk.ODETerm(lambda t, y, args: -50.0 * (y - jnp.cos(t)))
    forcing = sk.ODETerm(lambda t, y, args: p * jnp.sin(t + phase) * jnp.ones_like(y))
    return sk.diffeqsolve(
        sk.MultiTerm(forcing, stiff),
        sk.KenCarp4(),
        0.0,
        2.0,
        0.01,
        jnp.array([1.0, 0.0]),
        saveat=saveat,
        stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
        adjoint=adjoint,
        event=event,
    )


@pytest.mark.slow
def test_imex_events_dense_gradients_and_no_recompile():
    from helpers import count_compiles

    with float64():
        key = jax.random.key(0)
        # Dense output against SaveAt(ts) of the same solve.
        ts = jnp.linspace(0.0, 2.0, 7)
        both = sk.SaveAt(ts=ts, dense=True)
        sol = _imex_solve(0.3, key, sk.RecursiveCheckpointAdjoint(), both)
        # Jitted, as the forward-mode derivative below (op by op: ~40 compiles).
        dense = eqx.filter_jit(lambda sol: jax.vmap(sol.evaluate)(ts))(sol)
        np.testing.assert_allclose(dense, sol.ys, rtol=1e-5, atol=1e-7)
        # A real-valued event: y0 crosses 0.5, located on the step's dense output.
        event = sk.Event(lambda t, y, args, **kw: y[0] - 0.5)
        hit = _imex_solve(
            0.3, key, sk.RecursiveCheckpointAdjoint(), sk.SaveAt(t1=True), event
        )
        np.testing.assert_allclose(hit.ys[-1, 0], 0.5, atol=1e-6)
        # Gradients w.r.t. the closed-over float: reverse mode against forward mode.
        final = lambda p, adjoint: (
            _imex_solve(p, key, adjoint, sk.SaveAt(t1=True)).ys[-1].sum()
        )
        grad = jax.jit(jax.grad(final, argnums=0), static_argnums=1)
        g_rc = grad(0.3, sk.RecursiveCheckpointAdjoint())
        direct = lambda p: final(p, sk.DirectAdjoint())  # noqa: E731
        _, g_fwd = jax.jit(lambda p: jax.jvp(direct, (p,), (1.0,)))(0.3)
        np.testing.assert_allclose(g_rc, g_fwd, rtol=1e-7)
        # A second call with new values does not compile again.
        with count_compiles() as counter:
            grad(0.6, sk.RecursiveCheckpointAdjoint())
        assert counter.count == 0
