"""What a diffrax ODE script relies on that has no file of its own (see
solve/test_saveat.py, events/test_events.py, solve/test_progress.py,
solve/test_controllers.py): the names, the exception classes, `max_steps=None`, strict
dtype promotion, the backsolve seminorm, and the two-stage-state solvers. Each is
checked against diffrax on the same input where diffrax gives a value."""

import contextlib

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ADAPTIVE_SOLVERS,
    ALL_SOLVERS,
    assert_tree_allclose,
    float64,
    full_matrix_only,
    quick_params,
)

import solverkit as sk


_NEG = sk.ODETerm(lambda t, y, args: -y)
_PID = sk.PIDController(rtol=1e-6, atol=1e-8)


@contextlib.contextmanager
def _strict():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


# --- Names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [c for c, _, _ in ALL_SOLVERS], ids=lambda c: c.__name__
)
def test_adaptive_solvers_are_the_listed_ones(cls):
    assert isinstance(cls(), sk.AbstractAdaptiveSolver) == (cls in ADAPTIVE_SOLVERS)


@pytest.mark.parametrize(
    "cls", [c for c, _, _ in ALL_SOLVERS], ids=lambda c: c.__name__
)
def test_adaptive_solver_classes_match_diffrax(cls):
    if not hasattr(diffrax, cls.__name__):
        pytest.skip(f"diffrax {diffrax.__version__} has no {cls.__name__}")
    theirs = getattr(diffrax, cls.__name__)()
    assert isinstance(cls(), sk.AbstractAdaptiveSolver) == isinstance(
        theirs, diffrax.AbstractAdaptiveSolver
    )
    assert isinstance(cls(), sk.AbstractERK) == isinstance(theirs, diffrax.AbstractERK)
    assert cls().order(None) == theirs.order(None)


def test_ode_term_methods():
    term = sk.ODETerm(lambda t, y, args: -2 * y)
    y = jnp.array([1.0, 3.0])
    dt = term.contr(0.5, 2.0)
    np.testing.assert_allclose(dt, 1.5)
    np.testing.assert_allclose(term.vf(0.0, y, None), -2 * y)
    np.testing.assert_allclose(term.vf_prod(0.0, y, None, dt), -3 * y)
    np.testing.assert_allclose(term.prod(term.vf(0.0, y, None), dt), -3 * y)
    assert sk.ODETerm[jax.Array] is sk.ODETerm


def test_results_enumeration():
    assert len(sk.RESULTS) == len(list(sk.RESULTS)) > 5
    message = sk.RESULTS[sk.RESULTS.max_steps_reached]
    assert isinstance(message, str) and "max_steps" in message
    assert sk.RESULTS["nonfinite"] is sk.RESULTS.nonfinite
    assert sk.RESULTS.successful._value == 0


def test_made_jump_is_false_and_static():
    @jax.jit
    def run(y0):
        sol = sk.diffeqsolve(
            _NEG, sk.Tsit5(), 0, 1, 0.1, y0, saveat=sk.SaveAt(t1=True, made_jump=True)
        )
        assert sol.made_jump is False
        return sol.ys

    run(1.0)
    no_jump = sk.diffeqsolve(_NEG, sk.Tsit5(), 0, 1, 0.1, 1.0, made_jump=False)
    assert no_jump.made_jump is None


# --- Errors of both kinds -------------------------------------------------------------


def test_bad_input_is_value_and_runtime_error():
    for bad in (
        dict(saveat=sk.SaveAt(ts=[0.0])),  # before t0 = 0.1
        dict(saveat=sk.SaveAt(ts=[3.0])),  # after t1 = 1.1
        dict(stepsize_controller=sk.StepTo(jnp.linspace(0.0, 1.1, 4)), dt0=None),
    ):
        kw = dict(dt0=0.1) | bad
        for error in (ValueError, RuntimeError):
            with pytest.raises(error):
                sk.diffeqsolve(_NEG, sk.Euler(), 0.1, 1.1, y0=1.0, **kw)
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="monotonic"):
            sk.SaveAt(ts=[0.0, 2.3, 2.0])
        with pytest.raises(error, match="monotonic"):
            sk.StepTo(jnp.array([0.0, 2.3, 2.0])).check(1, None, None, None)


@pytest.mark.parametrize(
    "saveat",
    [
        sk.SaveAt(steps=True),
        sk.SaveAt(ts=[0.5], fn=lambda t, y, args: 2 * y),
        sk.SaveAt(subs=(sk.SubSaveAt(t1=True), sk.SubSaveAt(ts=[0.5]))),
    ],
    ids=["steps", "fn", "subs"],
)
def test_backsolve_unsupported_is_value_and_not_implemented_error(saveat):
    def loss(y0):
        sol = sk.diffeqsolve(
            _NEG,
            sk.Tsit5(),
            0,
            1,
            0.1,
            y0,
            saveat=saveat,
            adjoint=sk.BacksolveAdjoint(),
        )
        return sol.ys

    for error in (ValueError, NotImplementedError):
        with pytest.raises(error, match="BacksolveAdjoint does not support"):
            jax.grad(lambda y: jnp.sum(jax.tree.leaves(loss(y))[0]))(1.0)


# --- max_steps=None -------------------------------------------------------------------


# The full suite (diffrax's API); the quick loop's max_steps:
# kernel/test_kernel_fixed.py::test_max_steps_and_nonfinite_result and
# solve/test_errors.py's.
@pytest.mark.slow
def test_max_steps_none():
    with float64():
        sol = sk.diffeqsolve(
            _NEG,
            sk.Tsit5(),
            0.0,
            4.0,
            None,
            1.0,
            stepsize_controller=_PID,
            max_steps=None,
        )
        np.testing.assert_allclose(sol.ys, [np.exp(-4.0)], rtol=1e-6)
        assert sol.stats["max_steps"] is None
        # Reverse mode: BacksolveAdjoint has no bound to keep; the checkpointed
        # adjoint says what to pass instead.
        grad = jax.grad(
            lambda y: sk.diffeqsolve(
                _NEG,
                sk.Tsit5(),
                0.0,
                4.0,
                0.1,
                y,
                max_steps=None,
                adjoint=sk.BacksolveAdjoint(),
            ).ys[0]
        )(1.0)
        np.testing.assert_allclose(grad, np.exp(-4.0), rtol=1e-5)
    with pytest.raises(ValueError, match="max_steps"):
        jax.grad(
            lambda y: sk.diffeqsolve(_NEG, sk.Tsit5(), 0, 1, 0.1, y, max_steps=None).ys[
                0
            ]
        )(1.0)
    for kw in (
        dict(saveat=sk.SaveAt(steps=True)),
        dict(saveat=sk.SaveAt(dense=True)),
        dict(adjoint=sk.DirectAdjoint()),
    ):
        with pytest.raises(ValueError, match="max_steps"):
            sk.diffeqsolve(_NEG, sk.Tsit5(), 0, 1, 0.1, 1.0, max_steps=None, **kw)


# --- Strict dtype promotion -----------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    quick_params(
        [
            "int-times",
            "complex-pid",
            "complex-dense",
            "float32-pid-event",
            "complex-grad",
        ],
        quick=["int-times", "complex-pid", "float32-pid-event"],
    ),
)
def test_strict_dtype_promotion(case):
    """Under `jax_numpy_dtype_promotion="strict"` (diffrax's own test setting), the
    engine still runs: it promotes on purpose, and only the user's functions are
    held to the user's setting."""
    y0c = np.array([1.0 + 1.0j, 2.0])
    with (
        float64(),
        _strict(),
        pytest.warns(UserWarning) if "complex" in case else (contextlib.nullcontext()),
    ):
        if case == "int-times":
            out = sk.diffeqsolve(
                _NEG,
                sk.Euler(),
                jnp.array(0, jnp.int32),
                jnp.array(1, jnp.int32),
                jnp.array(0.01, jnp.float32),
                jnp.ones(2, jnp.float32),
            ).ys
            np.testing.assert_allclose(out, [[0.99**100] * 2], rtol=1e-5)
        elif case == "complex-pid":
            out = sk.diffeqsolve(
                _NEG, sk.Tsit5(), 0, 1, None, y0c, stepsize_controller=_PID
            ).ys
            np.testing.assert_allclose(out[0], y0c * np.exp(-1), rtol=1e-5)
        elif case == "complex-dense":
            sol = sk.diffeqsolve(
                _NEG,
                sk.Tsit5(),
                0,
                1,
                None,
                y0c,
                stepsize_controller=_PID,
                saveat=sk.SaveAt(ts=[0.3, 0.7], dense=True),
            )
            # One jitted program (op by op: ~40 compiles); the Python float time
            # traced weakly typed, as it runs eagerly.
            value, slope = jax.jit(lambda t: (sol.evaluate(t), sol.derivative(t)))(0.5)
            np.testing.assert_allclose(value, y0c * np.exp(-0.5), rtol=1e-5)
            np.testing.assert_allclose(slope, -y0c * np.exp(-0.5), rtol=1e-4)
        elif case == "float32-pid-event":
            sol = sk.diffeqsolve(
                _NEG,
                sk.Tsit5(),
                0.0,
                1.0,
                None,
                jnp.ones(2, jnp.float32),
                stepsize_controller=_PID,
                event=sk.Event(lambda t, y, args, **kw: y[0] - 0.5),
            )
            np.testing.assert_allclose(sol.ts, [np.log(2.0)], rtol=1e-5)
        else:
            grad = jax.grad(
                lambda y: jnp.sum(
                    jnp.abs(
                        sk.diffeqsolve(
                            _NEG,
                            sk.Tsit5(),
                            0.0,
                            1.0,
                            None,
                            y,
                            stepsize_controller=_PID,
                        ).ys
                    )
                    ** 2
                )
            )(y0c)
            # Against JAX's own gradient of the exact solution (its convention for
            # complex inputs).
            exact = jax.grad(lambda y: jnp.sum(jnp.abs(y * np.exp(-1.0 + 0j)) ** 2))(
                y0c
            )
            np.testing.assert_allclose(grad, exact, rtol=1e-5)


def test_complex_state_warns_as_diffrax_does():
    y0 = {"a": jnp.ones(2, jnp.complex64)}
    term = sk.ODETerm(lambda t, y, args: jax.tree.map(lambda v: -1j * v, y))
    with pytest.warns(UserWarning, match="Complex dtype"):
        sol = sk.diffeqsolve(term, sk.Euler(), 0.0, 1.0, 0.01, y0)
    np.testing.assert_allclose(sol.ys["a"][0], (1 - 0.01j) ** 100 * np.ones(2), 1e-5)


def test_empty_state_with_pid():
    sol = sk.diffeqsolve(
        _NEG, sk.Tsit5(), 0.0, 1.0, 0.01, jnp.zeros((2, 0)), stepsize_controller=_PID
    )
    assert sol.result == sk.RESULTS.successful
    assert sol.ys.shape == (1, 2, 0)
    assert int(sol.stats["num_steps"]) < 10


@pytest.mark.parametrize(
    "solver",
    [
        sk.ImplicitEuler(root_finder=sk.VeryChord(rtol=1e-3, atol=1e-6)),
        sk.Kvaerno3(),
        sk.KenCarp3(),
        sk.Rodas5P(),
        sk.BDF(),
    ],
    ids=lambda s: type(s).__name__,
)
@pytest.mark.quick_cases("ImplicitEuler", "Rodas5P")
def test_empty_state_with_implicit_solvers(solver):
    # diffrax's test_integrate::test_basic draws states with zero-length axes: the
    # Jacobian is then (0, 0), and the small-matrix inverse indexed its [0, 0] entry.
    # KenCarp3 takes (explicit, implicit) terms.
    neg = sk.ODETerm(lambda t, y, args: jax.tree.map(jnp.negative, y))
    terms = sk.MultiTerm(neg, neg) if isinstance(solver, sk.KenCarp3) else neg
    y0 = {"a": jnp.zeros((2, 0)), "b": jnp.zeros((0,))}
    sol = sk.diffeqsolve(terms, solver, 0, 1, 0.01, y0, stepsize_controller=_PID)
    assert sol.result == sk.RESULTS.successful
    assert sol.ys["a"].shape == (1, 2, 0) and sol.ys["b"].shape == (1, 0)


@pytest.mark.parametrize(
    "controller",
    [
        lambda lib: lib.ConstantStepSize(),
        lambda lib: lib.PIDController(rtol=1e-5, atol=1e-8),
        lambda lib: lib.PIDController(rtol=1e-5, atol=1e-8, pcoeff=0.3, icoeff=0.3),
    ],
    ids=["constant", "pid", "pid-pi"],
)
@pytest.mark.parametrize("solver", ["Tsit5", "ReversibleHeun", "Bosh3"])
# Quick loop: [ReversibleHeun-constant] (a `None` solver state through a controller).
@pytest.mark.quick_cases("ReversibleHeun-constant")
def test_none_state_under_every_controller(controller, solver):
    # y0=None: no leaves, so an empty error estimate, accepted at every step size.
    term = sk.ODETerm(lambda t, y, args: y)
    t0, t1, dt0 = jnp.float32(0), jnp.float32(1), jnp.float32(0.01)
    sol = sk.diffeqsolve(
        term, getattr(sk, solver)(), t0, t1, dt0, None,
        stepsize_controller=controller(sk),
    )  # fmt: skip
    theirs = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: y), getattr(diffrax, solver)(), t0, t1,
        dt0, None, stepsize_controller=controller(diffrax),
    )  # fmt: skip
    assert sol.ys is None and sol.result == sk.RESULTS.successful
    assert int(sol.stats["num_steps"]) == int(theirs.stats["num_steps"])
    np.testing.assert_array_equal(sol.ts, theirs.ts)


def test_abstract_implicit_solver_is_diffrax_name():
    for cls in (sk.ImplicitEuler, sk.Kvaerno5, sk.KenCarp4):
        assert isinstance(cls(), sk.AbstractImplicitSolver)
    assert not isinstance(sk.Tsit5(), sk.AbstractImplicitSolver)


# --- Backsolve seminorm ---------------------------------------------------------------


@pytest.mark.slow
def test_adjoint_seminorm_fewer_steps_same_gradient():
    theta = jnp.array([0.5, 1.5, 2.0])

    def grad(norm):
        controller = sk.PIDController(rtol=1e-6, atol=1e-8)
        adjoint = sk.BacksolveAdjoint(
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-8, norm=norm)
        )

        def loss(theta):
            sol = sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -theta * y + jnp.sin(t)),
                sk.Tsit5(),
                0.0,
                3.0,
                None,
                jnp.ones(3),
                stepsize_controller=controller,
                adjoint=adjoint,
            )
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss))(theta)

    with float64():
        full, semi = (
            grad(sk.PIDController.__dataclass_fields__["norm"].default),
            grad(sk.adjoint_rms_seminorm),
        )
        np.testing.assert_allclose(semi, full, rtol=1e-4)
    with pytest.raises(ValueError, match="adjoint system"):
        sk.adjoint_rms_seminorm(jnp.ones(3))


# --- ReversibleHeun and LeapfrogMidpoint ----------------------------------------------


def _pendulum(t, y, args):
    return jnp.stack([y[1], -jnp.sin(y[0]) + 0.1 * jnp.cos(t)])


@pytest.mark.parametrize(
    "name, adaptive",
    quick_params(
        [
            ("ReversibleHeun", False),
            ("ReversibleHeun", True),
            ("LeapfrogMidpoint", False),
        ],
        quick=[("ReversibleHeun", True), ("LeapfrogMidpoint", False)],
    ),
)
@pytest.mark.parametrize(
    "backwards", [False, pytest.param(True, marks=pytest.mark.slow)]
)
@pytest.mark.quick_cases("False-ReversibleHeun-True")
def test_two_stage_state_solvers_match_diffrax(name, adaptive, backwards):
    t0, t1, dt0 = (3.0, 0.0, -0.01) if backwards else (0.0, 3.0, 0.01)

    def solve(lib):
        controller = (
            lib.PIDController(rtol=1e-6, atol=1e-6)
            if adaptive
            else lib.ConstantStepSize()
        )
        sol = lib.diffeqsolve(
            lib.ODETerm(_pendulum),
            getattr(lib, name)(),
            t0,
            t1,
            dt0,
            jnp.array([1.0, 0.0]),
            stepsize_controller=controller,
            saveat=lib.SaveAt(ts=jnp.linspace(t0, t1, 7)),
            max_steps=4096,
        )
        return sol.ys, sol.stats["num_steps"]

    with float64():
        ours = jax.jit(lambda: solve(sk))()
        assert_tree_allclose(ours, solve(diffrax), rtol=1e-12, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ReversibleHeun", "LeapfrogMidpoint"])
def test_two_stage_state_solvers_second_order_and_differentiable(name):
    solver = getattr(sk, name)()
    assert solver.order(None) == 2
    assert isinstance(solver, sk.AbstractAdaptiveSolver) == (name == "ReversibleHeun")
    with float64():

        def final(k, n, adjoint=sk.RecursiveCheckpointAdjoint()):
            return sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -k * y),
                solver,
                0.0,
                1.0,
                1.0 / n,
                1.0,
                adjoint=adjoint,
                max_steps=256,
            ).ys[-1]

        errors = [abs(final(1.3, n) - np.exp(-1.3)) for n in (32, 64, 128)]
        slopes = np.diff(np.log(errors)) / np.diff(np.log([1 / 32, 1 / 64, 1 / 128]))
        assert np.all(np.abs(slopes - 2) < 0.2), slopes
        # Gradients w.r.t. the closed-over rate, under vmap: two adjoints agree.
        ks = jnp.array([0.5, 1.3])
        g_rca = jax.jit(jax.vmap(jax.grad(lambda k: final(k, 64))))(ks)
        g_direct = jax.vmap(jax.grad(lambda k: final(k, 64, sk.DirectAdjoint())))(ks)
        np.testing.assert_allclose(g_rca, g_direct, rtol=1e-12)
        eps = 1e-6
        value = jax.jit(lambda k: final(k, 64))  # one program for the 4 solves
        fd = [(value(k + eps) - value(k - eps)) / (2 * eps) for k in ks]
        np.testing.assert_allclose(g_rca, fd, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ReversibleHeun", "LeapfrogMidpoint"])
def test_two_stage_state_solvers_close_over_every_dtype(name):
    # A vmapped int index into a differentiated table, a bool mask and a PRNG key,
    # all closed over, under jit(vmap(grad)): y' = -rate * y has y(1) = exp(-rate).
    table = jnp.array([0.5, 1.0, 2.0])
    mask = jnp.array([True, False])
    noise = jax.random.normal(jax.random.key(0), (2,))

    def final(table, k):
        def field(t, y, args):
            rate = table[k] + jnp.where(mask, 0.0, 0.0 * noise)
            return -rate * y

        return sk.diffeqsolve(
            sk.ODETerm(field),
            getattr(sk, name)(),
            0.0,
            1.0,
            1e-3,
            jnp.ones(2),
            max_steps=1024,
        ).ys[-1, 0]

    with float64():
        ks = jnp.arange(3)
        grads = jax.jit(jax.vmap(jax.grad(final), in_axes=(None, 0)))(table, ks)
        # d exp(-table[k]) / d table = -exp(-table[k]) at row k, zero elsewhere.
        np.testing.assert_allclose(
            grads, -np.diag(np.exp(-np.asarray(table))), rtol=1e-3, atol=1e-12
        )


# --- Interpolation classes as diffrax constructs them ---------------------------------


def _cubic(t):
    return jnp.asarray(0.4 + 0.7 * t - 1.1 * t**2 + 0.4 * t**3)


@pytest.mark.parametrize("lib", [diffrax, sk], ids=["diffrax", "solverkit"])
def test_hermite_from_increments_python_float_times(lib):
    t0, t1 = 2.0, 3.9  # Python floats, as diffrax's own test passes them
    y0, f0 = jax.jvp(_cubic, (t0,), (1.0,))
    y1, f1 = jax.jvp(_cubic, (t1,), (1.0,))
    interp = lib.ThirdOrderHermitePolynomialInterpolation(
        t0=t0, t1=t1, y0=y0, y1=y1, k0=f0 * (t1 - t0), k1=f1 * (t1 - t0)
    )
    # A cubic is reproduced exactly: float32 rounding of values of order 1.
    np.testing.assert_allclose(interp.evaluate(2.6), _cubic(2.6), rtol=1e-5)
    np.testing.assert_allclose(interp.evaluate(2.6, 3.0), _cubic(3.0) - _cubic(2.6),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    k = jnp.stack([f0 * (t1 - t0), jnp.asarray(0.0), f1 * (t1 - t0)])
    from_k = lib.ThirdOrderHermitePolynomialInterpolation.from_k(
        t0=t0, t1=t1, y0=y0, y1=y1, k=k
    )
    np.testing.assert_allclose(from_k.evaluate(3.3), _cubic(3.3), rtol=1e-5)


def test_hermite_takes_increments_or_rates_not_both():
    with pytest.raises(ValueError, match="k0=, k1="):
        sk.ThirdOrderHermitePolynomialInterpolation(
            t0=0.0, t1=1.0, y0=0.0, y1=1.0, k0=1.0, k1=1.0, f0=1.0, f1=1.0
        )


@pytest.mark.parametrize("y0", [2.1, jnp.array(2.1), jnp.array([2.1, 3.1])])
def test_local_linear_as_diffrax_builds_it(y0):
    t0, t1, s0, s1 = 2.0, 3.3, 2.8, 2.9
    y1 = y0 + 0.1
    ours = sk.LocalLinearInterpolation(t0=t0, t1=t1, y0=y0, y1=y1)
    theirs = diffrax.LocalLinearInterpolation(t0=t0, t1=t1, y0=y0, y1=y1)
    # One linear formula in float32: a few ulps of values of order 2.
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours.evaluate(s0), theirs.evaluate(s0), **tol)
    np.testing.assert_allclose(ours.evaluate(s0, s1), theirs.evaluate(s0, s1), **tol)
    np.testing.assert_allclose(ours.derivative(s0), theirs.derivative(s0), **tol)
    np.testing.assert_allclose(ours.derivative(s0), (y1 - y0) / (t1 - t0), **tol)
    # An empty step: y0, and a zero derivative (not (y1 - y0) / 1).
    empty = sk.LocalLinearInterpolation(t0=t0, t1=t0, y0=y0, y1=y1)
    np.testing.assert_allclose(empty.evaluate(t0), jnp.broadcast_to(y0, np.shape(y1)))
    _, slope = jax.jvp(empty.evaluate, (t0,), (1.0,))
    np.testing.assert_array_equal(slope, 0.0)


# The full suite; the quick loop's strict promotion: test_strict_dtype_promotion.
@pytest.mark.slow
def test_complex_cubic_interpolation_under_strict_promotion():
    with float64(), _strict():
        ts = jnp.linspace(0.0, 5.0, 8)
        re, im = np.random.default_rng(0).normal(size=(2, 8, 4))
        ys = jnp.asarray(re + 1j * im)
        ours = sk.CubicInterpolation(ts, sk.backward_hermite_coefficients(ts, ys))
        with jax.numpy_dtype_promotion("standard"):
            theirs = diffrax.CubicInterpolation(
                ts, diffrax.backward_hermite_coefficients(ts, ys)
            )
            want, want_slope = theirs.evaluate(1.3), theirs.derivative(1.3)
        t = jnp.asarray(1.3)
        # The same cubic in float64: rounding only.
        np.testing.assert_allclose(ours.evaluate(t), want, rtol=1e-12)
        np.testing.assert_allclose(ours.derivative(t), want_slope, rtol=1e-12)
        _, slope = jax.jvp(ours.evaluate, (t,), (jnp.ones_like(t),))
        np.testing.assert_allclose(slope, want_slope, rtol=1e-12)


# --- ClipStepSizeController -----------------------------------------------------------


@pytest.mark.parametrize("backwards", [False, True])
# Quick loop: [True]; the clipped steps forwards:
# solve/test_controllers.py::test_clip_steps_land_on_step_ts_and_jump_ts[False].
@pytest.mark.quick_cases("True")
def test_clip_integer_step_ts_under_strict_promotion(backwards):
    t0, t1 = (5, 0) if backwards else (0, 5)
    with float64(), _strict():
        controller = sk.ClipStepSizeController(
            sk.PIDController(rtol=1e-4, atol=1e-6), step_ts=[3, 4]
        )
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -0.2 * y), sk.Dopri5(), t0, t1, None, 1.0,
            stepsize_controller=controller, saveat=sk.SaveAt(steps=True),
        )  # fmt: skip
    assert 3 in np.asarray(sol.ts) and 4 in np.asarray(sol.ts)


# diffrax's nested clip test (the wrappers' step_ts and jump_ts all clip) is
# diffrax_compat/test_clip_step_ends.py::test_step_ends_are_diffraxs_exactly[nested]:
# the same two wrappers, a longer walk past every jump, its ends equal to diffrax's to
# the ulp.


# --- VeryChord as an optimistix root finder -------------------------------------------


def _shifted(x, args):
    a, b = args
    return jax.tree.map(lambda v: a * v + b + 0.1 * jnp.sin(v), x)


# The full suite; the quick loop's optimistix root finders:
# tests/solvers/test_implicit.py.
@pytest.mark.slow
@pytest.mark.parametrize(
    "x0",
    [
        pytest.param(
            lambda: jnp.array(-2.0),
            id="0d",
            marks=full_matrix_only("[tree] (a pytree with a 0-d leaf)"),
        ),
        pytest.param(lambda: (jnp.array([1.0, 0.5]), jnp.array(0.3)), id="tree"),
    ],
)
@pytest.mark.quick_cases("tree")
@pytest.mark.usefixtures("x64")  # a tolerance of 1e-6 is float64's, as diffrax tests
def test_very_chord_is_an_optimistix_root_finder(x0):
    import optimistix as optx

    tol = 1e-6
    x0 = x0()
    args = (jnp.array(2.0), jnp.array(1.0))
    ours = sk.VeryChord(rtol=tol, atol=tol)
    sol = optx.root_find(_shifted, ours, x0, args, max_steps=100)
    assert sol.result == optx.RESULTS.successful
    ref = optx.root_find(_shifted, optx.Newton(rtol=1e-10, atol=1e-10), x0, args)
    # Both converge to the root: the chord's tolerance bounds the difference.
    assert_tree_allclose(sol.value, ref.value, rtol=10 * tol, atol=10 * tol)
    # diffrax's "very chord" use: the linearisation of an earlier `init` reused.
    state = optx.root_find(_shifted, ours, x0, args, max_steps=0, throw=False).state
    again = optx.root_find(
        _shifted, ours, x0, args, max_steps=100, options=dict(init_state=state)
    )
    assert_tree_allclose(again.value, ref.value, rtol=10 * tol, atol=10 * tol)

    # Gradient wrt args by optimistix's implicit function theorem, under jit and vmap.
    def root_sum(a):
        out = optx.root_find(_shifted, ours, x0, (a, args[1]), max_steps=100)
        return sum(jnp.sum(v) for v in jax.tree.leaves(out.value))

    def ref_sum(a):
        out = optx.root_find(_shifted, optx.Newton(rtol=1e-10, atol=1e-10), x0,
                             (a, args[1]))  # fmt: skip
        return sum(jnp.sum(v) for v in jax.tree.leaves(out.value))

    a_s = jnp.array([2.0, 3.0])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(root_sum)))(a_s),
        jax.vmap(jax.grad(ref_sum))(a_s),
        rtol=1e-4,  # the roots agree to ~10 tol; their sensitivity is of order 1
    )


# --- Built-in solvers' steps outside diffeqsolve --------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "Euler",
        "Heun",
        "Midpoint",
        "Ralston",
        "Bosh3",
        "Tsit5",
        "Dopri5",
        "Dopri8",
        "ReversibleHeun",
        "LeapfrogMidpoint",
    ],  # fmt: skip
)
def test_interpolation_cls_builds_each_steps_dense_output(name):
    # diffrax's protocol, used by libraries that build dense output themselves:
    # `solver.interpolation_cls(t0=, t1=, **dense_info)` from one `step`.
    solver = getattr(sk, name)()
    assert solver.interpolation_cls is not None
    term = sk.ODETerm(lambda t, y, args: -y)
    y0 = jnp.array([1.0, 2.0])
    t0, t1 = jnp.asarray(0.0), jnp.asarray(0.1)
    state = solver.init(term, t0, t1, y0, None)
    y1, _, info, _, _ = solver.step(term, t0, t1, y0, None, state, False)
    interp = solver.interpolation_cls(t0=0.0, t1=0.1, **info)  # Python-float times
    # float32 rounding of sums over up to 14 stage weights (Dopri8): ~10 ulps.
    np.testing.assert_allclose(interp.evaluate(0.0), y0, rtol=1e-5)
    np.testing.assert_allclose(interp.evaluate(0.1), y1, rtol=1e-5)
    mid = interp.evaluate(0.05)
    np.testing.assert_allclose(mid, solver.interpolate(info, t0, t1, 0.05), rtol=1e-6)
    # Every interpolant is at least linear: within h²/8 max|y''| + the step's own
    # error (h²/2 |y''| for Euler) of the exact solution, h = 0.1.
    np.testing.assert_allclose(mid, y0 * np.exp(-0.05), rtol=0.1**2 * 0.7)
