"""`HalfSolver` and `SemiImplicitEuler`, as diffrax defines them: the same steps as
diffrax 0.7.2 (same `ts`, `ys` to round-off) given the same `dt0`; `isinstance`
forwarding through the wrapper; a plain tuple of terms for `SemiImplicitEuler`, and
a clear error for terms of the wrong structure; under `jit`, `vmap` and `grad`, with
closed-over values of several dtypes, against diffrax and finite differences."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finite_difference, skip_unless_full_matrix

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

# The same arithmetic as diffrax's in float64, up to the order of additions: steps
# agree to a few ulps, which PID step-size rounding can grow by a few factors.
SAME = 1e-12


def _decay(lib, solver, k, dt0=0.05, rtol=1e-4, atol=1e-7):
    term = lib.ODETerm(lambda t, y, args: -k * y)
    return lib.diffeqsolve(
        term,
        solver,
        0.0,
        2.0,
        dt0,
        jnp.array([1.0, 2.0]),
        stepsize_controller=lib.PIDController(rtol=rtol, atol=atol),
        saveat=lib.SaveAt(steps=True),
    )


@pytest.mark.parametrize("inner", ["Euler", "Heun", "Tsit5"])
# Quick loop: test_half_solver_accuracy_and_first_step.
@pytest.mark.slow
def test_half_solver_steps_as_diffrax(inner):
    if inner == "Heun":
        # `SOLVERKIT_FULL_MATRIX=1` only: an explicit method inside HalfSolver, its
        # steps as diffrax's, is [Euler]'s (order 1) and [Tsit5]'s.
        skip_unless_full_matrix("[Euler] and [Tsit5]")
    k = jnp.array(1.3)
    ours = _decay(sk, sk.HalfSolver(getattr(sk, inner)()), k)
    theirs = _decay(diffrax, diffrax.HalfSolver(getattr(diffrax, inner)()), k)
    n = int(theirs.stats["num_accepted_steps"])
    assert int(ours.stats["num_accepted_steps"]) == n
    assert int(ours.stats["num_steps"]) == int(theirs.stats["num_steps"])
    assert theirs.ys is not None and ours.ys is not None
    # The error estimate is a difference of two solutions: its round-off, relative
    # to itself, is ~ulp |y| / (rtol |y|), which sets how far the step sizes may
    # drift apart (a factor 100 for the steps it compounds over).
    tol = 100 * np.finfo(float).eps / 1e-4 if inner == "Tsit5" else SAME
    np.testing.assert_allclose(ours.ts[:n], theirs.ts[:n], rtol=tol)
    np.testing.assert_allclose(ours.ys[:n], theirs.ys[:n], rtol=tol)


def test_half_solver_accuracy_and_first_step():
    # dt0=None (the first step from `func`). Each step's local error, ~c h^2 with
    # c = k^2 |y| / 8 for two half Euler steps, is held at ~rtol |y|: h ~ sqrt(rtol /
    # c), so the global error, steps x rtol |y|, is ~T sqrt(c rtol |y|) <= T
    # sqrt(rtol) |y0|, and falls as sqrt(rtol): x10 for rtol / 100 (5 to 20 allowed).
    k, t1, y0 = 0.7, 2.0, np.array([1.0, 2.0])
    errors = []
    for rtol in (1e-3, 1e-5):
        sol = _decay(sk, sk.HalfSolver(sk.Euler()), k, dt0=None, rtol=rtol, atol=1e-9)
        n = int(sol.stats["num_accepted_steps"])
        assert sol.ys is not None
        errors.append(np.max(np.abs(sol.ys[n - 1] - np.exp(-k * t1) * y0)))
        assert errors[-1] < t1 * np.sqrt(rtol) * np.max(y0)
    assert 5 < errors[0] / errors[1] < 20


@pytest.mark.parametrize("inner", ["ImplicitEuler", "Kvaerno3"])
# Quick loop: test_half_solver_accuracy_and_first_step.
@pytest.mark.slow
def test_half_solver_implicit(inner):
    if inner == "ImplicitEuler":
        # `SOLVERKIT_FULL_MATRIX=1` only: an ESDIRK method inside HalfSolver is
        # [Kvaerno3]'s.
        skip_unless_full_matrix("[Kvaerno3] (the same family)")
    # diffrax 0.7.2 can't run these (its tolerance lookup asks the wrapper for
    # `root_finder`): the wrapped solver gets the controller's tolerances here. A
    # stiff decay against the exact solution: as in the test above, the global
    # error of a method of order >= 1 under a half-step estimate is at most ~T
    # sqrt(rtol) |y0|.
    rtol, t1, y0 = 1e-5, 2.0, jnp.array([1.0, 2.0])
    k = jnp.array(50.0)
    sol = _decay(sk, sk.HalfSolver(getattr(sk, inner)()), k, rtol=rtol, atol=1e-8)
    assert sol.ys is not None and sol.ts is not None
    n = int(sol.stats["num_accepted_steps"])
    exact = jnp.outer(jnp.exp(-k * sol.ts[:n]), y0)
    assert float(jnp.max(jnp.abs(sol.ys[:n] - exact))) < t1 * np.sqrt(rtol) * 2.0


def test_instance_check():
    half = sk.HalfSolver(sk.Euler())
    assert isinstance(half, sk.Euler)
    assert isinstance(half, sk.HalfSolver)
    assert isinstance(half, sk.AbstractAdaptiveSolver)
    assert not isinstance(half, sk.Heun)
    assert not isinstance(sk.Euler(), sk.HalfSolver)
    assert isinstance(sk.HalfSolver(sk.Kvaerno3()), sk.AbstractImplicitSolver)
    assert half.error_order(None) == 2 and half.order(None) == 1
    assert half.interpolation_cls is sk.Euler.interpolation_cls
    with pytest.raises(TypeError, match="HalfSolver"):
        sk.HalfSolver(object())  # pyright: ignore[reportArgumentType]


def _closed_over_solve(lib, solver_cls, k, index, flag):
    """A decay whose rate is `k[index]`, sign-flipped by a boolean: float, int and
    bool values closed over."""

    def vf(t, y, args):
        rate = jnp.where(flag, -k[index], k[index])
        return rate * y

    sol = lib.diffeqsolve(
        lib.ODETerm(vf),
        lib.HalfSolver(solver_cls(lib)),
        0.0,
        1.0,
        0.1,
        jnp.array(1.5),
        stepsize_controller=lib.PIDController(rtol=1e-6, atol=1e-9),
    )
    assert sol.ys is not None
    return sol.ys[-1]


# Euler only: the wrapper under jit, vmap and grad; the wrapped Heun's (and Tsit5's)
# steps against diffrax's are test_half_solver_steps_as_diffrax's.
@pytest.mark.parametrize("solver_cls", [lambda lib: lib.Euler()])
# Quick loop: test_half_solver_adjoints[adjoint0].
@pytest.mark.slow
def test_half_solver_jit_vmap_grad(solver_cls):
    k = jnp.array([0.3, 0.9, 1.4])
    index, flag = jnp.array(1, jnp.int32), jnp.array(True)
    fn = lambda lib: jax.jit(
        lambda k, i, f: _closed_over_solve(lib, solver_cls, k, i, f)
    )
    ours, theirs = fn(sk), fn(diffrax)
    np.testing.assert_allclose(ours(k, index, flag), theirs(k, index, flag), rtol=SAME)
    # vmap over the int index and the bool flag.
    idx = jnp.array([0, 1, 2], jnp.int32)
    flags = jnp.array([True, False, True])
    # Against diffrax element by element (its program above, the index and the
    # flag operands: no batched diffrax program).
    want = np.stack([theirs(k, i, f) for i, f in zip(idx, flags)])
    got = jax.vmap(ours, in_axes=(None, 0, 0))(k, idx, flags)
    np.testing.assert_allclose(got, want, rtol=SAME)
    # grad through the adaptive steps: diffrax's (the same discretisation, so to
    # round-off), and the exact d/dk of 1.5 exp(-k[1]) to the solve's accuracy
    # (global error <= T sqrt(rtol) |y0| for a half-step estimate, see above).
    # Each gradient one jitted program.
    g = jax.jit(jax.grad(lambda k: ours(k, index, flag)))(k)
    g_ref = jax.jit(jax.grad(lambda k: theirs(k, index, flag)))(k)
    np.testing.assert_allclose(g, g_ref, rtol=1e-9, atol=1e-12)
    exact = np.array([0.0, -1.5 * np.exp(-0.9), 0.0])
    np.testing.assert_allclose(g, exact, rtol=0, atol=1.0 * np.sqrt(1e-6) * 1.5)


@pytest.mark.parametrize(
    "adjoint",
    [sk.BacksolveAdjoint(), sk.DirectAdjoint(), sk.RecursiveCheckpointAdjoint()],
)
@pytest.mark.quick_cases("adjoint0")  # BacksolveAdjoint, the one that broke
def test_half_solver_adjoints(adjoint):
    if isinstance(adjoint, sk.DirectAdjoint):
        # `SOLVERKIT_FULL_MATRIX=1` only: DirectAdjoint differentiates the discrete
        # solve [adjoint2]'s checkpointed adjoint does (the adjoints are compared on
        # other problems: adjoint/test_adjoint.py).
        skip_unless_full_matrix("[adjoint2] (RecursiveCheckpointAdjoint)")

    # Every adjoint differentiates through the wrapper (BacksolveAdjoint looked for
    # a Runge-Kutta solver's `scan_kind` on it): d/dk of exp(-k) at k = 1, to the
    # solve's accuracy (Tsit5 at 1e-8: ~1e-7 after the wrapped steps).
    def f(k):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -k * y),
            sk.HalfSolver(sk.Tsit5()),
            0.0,
            1.0,
            0.1,
            jnp.array(1.0),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            adjoint=adjoint,
        )
        return sol.ys[0]  # pyright: ignore

    np.testing.assert_allclose(jax.grad(f)(1.0), -np.exp(-1.0), rtol=1e-6)


def test_half_solver_wraps_a_users_solver():
    class MyEuler(sk.AbstractSolver):
        interpolation_cls = sk.LocalLinearInterpolation

        def init(self, terms, t0, t1, y0, args):
            return None

        def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
            y1 = y0 + terms.vf_prod(t0, y0, args, terms.contr(t0, t1))
            return y1, None, dict(y0=y0, y1=y1), None, sk.RESULTS.successful

        def func(self, terms, t0, y0, args):
            return terms.vf(t0, y0, args)

    # No `order`: diffrax's default is None, so no error order either (a plain solve
    # works, an adaptive one says why not; wrapped with an order it adapts).
    sk.diffeqsolve(sk.ODETerm(lambda t, y, a: -y), MyEuler(), 0.0, 1.0, 0.1, 1.0)
    with pytest.raises(ValueError, match="error estimate"):
        sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -y),
            MyEuler(),
            0.0,
            1.0,
            0.1,
            1.0,
            stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-6),
        )

    class MyEuler1(MyEuler):
        def order(self, terms):
            return 1

    ours = _decay(sk, sk.HalfSolver(MyEuler1()), jnp.array(1.3))
    ref = _decay(sk, sk.HalfSolver(sk.Euler()), jnp.array(1.3))
    assert int(ours.stats["num_steps"]) == int(ref.stats["num_steps"])
    np.testing.assert_allclose(ours.ys, ref.ys, rtol=SAME)


def _oscillator(lib, solver, dt0, controller=None, t1=3.0, saveat=None):
    # q' = p, p' = -w^2 q: SemiImplicitEuler's term a is dq/dt from p, term b dp/dt
    # from q. w is closed over.
    w = jnp.array(2.0)
    f = lib.ODETerm(lambda t, p, args: p)
    g = lib.ODETerm(lambda t, q, args: -(w**2) * q)
    return lib.diffeqsolve(
        (f, g),
        solver,
        0.0,
        t1,
        dt0,
        (jnp.array([1.0]), jnp.array([0.0])),
        stepsize_controller=controller or lib.ConstantStepSize(),
        saveat=saveat or lib.SaveAt(ts=jnp.linspace(0.0, t1, 7)),
    )


# The full suite; the quick loop's SemiImplicitEuler: test_semi_implicit_euler_is_
# symplectic and test_semi_implicit_euler_jit_vmap_grad; HalfSolver:
# test_half_solver_accuracy_and_first_step.
@pytest.mark.slow
def test_semi_implicit_euler_as_diffrax():
    ours = _oscillator(sk, sk.SemiImplicitEuler(), 0.01)
    theirs = _oscillator(diffrax, diffrax.SemiImplicitEuler(), 0.01)
    for a, b in zip(ours.ys, theirs.ys):  # pyright: ignore
        np.testing.assert_allclose(a, b, rtol=SAME, atol=1e-15)
    pid = lambda lib: lib.PIDController(rtol=1e-5, atol=1e-5)
    for dt0 in (0.01, None):
        ours = _oscillator(sk, sk.HalfSolver(sk.SemiImplicitEuler()), dt0, pid(sk))
        theirs = _oscillator(
            diffrax, diffrax.HalfSolver(diffrax.SemiImplicitEuler()), dt0, pid(diffrax)
        )
        exact = (np.cos(2.0 * ours.ts), -2.0 * np.sin(2.0 * ours.ts))
        for a, b, e in zip(ours.ys, theirs.ys, exact):  # pyright: ignore
            # First order, local error per unit time ~ tolerance: 3 time units.
            np.testing.assert_allclose(a[:, 0], e, atol=3e-3)
            if dt0 is not None:
                np.testing.assert_allclose(a, b, rtol=SAME, atol=1e-14)


def test_semi_implicit_euler_is_symplectic():
    # The modified energy p^2 + w^2 q^2 + h w^2 p q is conserved exactly by
    # symplectic Euler on a harmonic oscillator (to round-off over 3000 steps).
    h = 0.01
    sol = _oscillator(
        sk, sk.SemiImplicitEuler(), h, t1=30.0, saveat=sk.SaveAt(steps=True)
    )
    n = int(sol.stats["num_accepted_steps"])
    q, p = sol.ys[0][:n, 0], sol.ys[1][:n, 0]  # pyright: ignore
    energy = p**2 + 4.0 * q**2 + h * 4.0 * p * q
    np.testing.assert_allclose(energy, energy[0], rtol=1e-11)


def test_semi_implicit_euler_jit_vmap_grad():
    def final_q(w, key_scale, n):
        f = sk.ODETerm(lambda t, p, args: p * key_scale[n])
        g = sk.ODETerm(lambda t, q, args: -(w**2) * q)
        y0 = (jnp.array(1.0), jnp.array(0.0))
        sol = sk.diffeqsolve((f, g), sk.SemiImplicitEuler(), 0.0, 1.0, 0.01, y0)
        return sol.ys[0][-1]  # pyright: ignore

    scale, n = jnp.array([1.0, 0.5], jnp.float32), jnp.array(0)
    fn = jax.jit(final_q)
    ws = jnp.array([1.0, 2.0, 3.0])
    batched = jax.vmap(fn, in_axes=(0, None, None))(ws, scale, n)
    for w, b in zip(ws, batched):
        np.testing.assert_allclose(b, fn(w, scale, n), rtol=1e-14)
    g = jax.grad(fn)(jnp.array(2.0), scale, n)
    fd = finite_difference(lambda w: fn(w, scale, n), jnp.array(2.0), eps=1e-6)
    np.testing.assert_allclose(g, fd, rtol=1e-6)  # fixed steps: differences ~eps^2


def test_term_structure_errors():
    f = sk.ODETerm(lambda t, y, args: y)
    y0 = (1.0, 1.0)
    with pytest.raises(ValueError, match="not compatible.*SemiImplicitEuler"):
        sk.diffeqsolve(sk.MultiTerm(f, f), sk.SemiImplicitEuler(), 0.0, 1.0, 0.1, y0)
    with pytest.raises(ValueError, match="not compatible"):
        sk.diffeqsolve((f, f, f), sk.SemiImplicitEuler(), 0.0, 1.0, 0.1, y0)
    with pytest.raises(ValueError, match="not compatible"):
        sk.diffeqsolve(f, sk.SemiImplicitEuler(), 0.0, 1.0, 0.1, y0)
    pid = sk.PIDController(rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="not compatible.*KenCarp3"):
        sk.diffeqsolve(
            (f, f), sk.KenCarp3(), 0.0, 1.0, 0.1, 1.0, stepsize_controller=pid
        )


def test_half_solver_is_a_module():
    half = sk.HalfSolver(sk.Tsit5())
    assert eqx.tree_equal(half, sk.HalfSolver(sk.Tsit5()))
    assert half.term_structure is sk.Tsit5.term_structure
