"""`diffeqsolve` against references: convergence orders, DETEST problems against scipy
and diffrax, backwards solves, pytree / complex / integer states, `jit` / `vmap`, and
no recompilation on a second call. (Step-size controllers:
solve/test_controllers.py.)"""

import functools

import diffrax
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
from helpers import (
    ADAPTIVE_SOLVERS,
    ALL_SOLVERS,
    assert_tree_allclose,
    count_compiles,
    LINEAR_A,
    LINEAR_SPLIT,
    linear_vf,
    make_solver,
    make_terms,
    quick_params,
    RK_SOLVERS,
    rotation,
    rotation_exact,
    solver_params,
)

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


# --- Convergence order --------------------------------------------------------------


# y' = cos(t) A y (helpers.linear_vf) is exactly y(t) = expm(sin(t) A) y0.
def _linear_exact(t, y0):
    s = np.sin(t)
    rot = np.array([[np.cos(s), np.sin(s)], [-np.sin(s), np.cos(s)]])
    return np.exp(-0.2 * s) * rot @ np.asarray(y0)


# Numbers of steps, chosen per order so the error is asymptotic yet above round-off.
_STEPS = {1: [64, 128, 256, 512], 2: [32, 64, 128, 256], 3: [8, 16, 32, 64]}
_STEPS.update({4: [8, 12, 16, 24], 5: [8, 12, 16, 24], 8: [2, 3, 4, 6]})
# Implicit stages solved far below the errors measured (as tight as float64 allows).
_ROOT_TOL = 1e-12


@pytest.mark.parametrize("solver_cls, order, _", solver_params(ALL_SOLVERS))
# Quick loop: these cases (Kvaerno3: solvers/test_implicit.py::test_convergence_order).
@pytest.mark.quick_cases(
    "Euler-1-False",
    "Tsit5-5-True",
    "LeapfrogMidpoint-2-False",
    "KenCarp3-3-True",
    "Rosenbrock23-2-True",
)
def test_convergence_order(solver_cls, order, _):
    assert solver_cls().order(None) == order
    t1 = 2.0
    y0 = jnp.array([1.0, 0.5])
    dts = jnp.array([t1 / n for n in _STEPS[order]])
    # IMEX: the rotation explicit, the decay implicit, so the coupling counts too.
    terms = make_terms(solver_cls, linear_vf, LINEAR_SPLIT)
    solver = make_solver(solver_cls, root_tol=_ROOT_TOL, root_find_max_steps=20)

    def final(dt):
        sol = sk.diffeqsolve(terms, solver, 0.0, t1, dt, y0, max_steps=512)
        return sol.ys[-1]

    ys = jax.jit(jax.vmap(final))(dts)
    errors = np.linalg.norm(np.asarray(ys) - _linear_exact(t1, y0), axis=-1)
    assert np.all(errors > 1e-14), errors  # above round-off: the fit means something
    slope = np.polyfit(np.log(np.asarray(dts)), np.log(errors), 1)[0]
    # Tsit5 is tuned so its leading error terms are tiny: it shows order ~6 before the
    # asymptotic regime, hence the one-sided tolerance above.
    assert order - 0.3 < slope < order + 1.2, (slope, errors)


@pytest.mark.parametrize("solver_cls", ADAPTIVE_SOLVERS)
def test_error_order(solver_cls):
    # The embedded estimate has local order min(p, p_hat) + 1.
    error_order = solver_cls().error_order(None)
    assert error_order is not None and 2 <= error_order <= solver_cls().order(None) + 1
    assert sk.Euler().error_order(None) is None


# --- DETEST problems against scipy DOP853 and diffrax --------------------------------
# (Hull, Enright, Fellen & Sedgwick 1972.) The four scalar A problems share one vector
# field, selected by `args`, so that one compiled solve (vmapped) serves all four.


def _a_problems(t, y, index, xp):
    a1 = -y
    a2 = -(y**3) / 2
    a3 = y * xp.cos(t)
    a4 = y / 4 * (1 - y / 20)
    return xp.stack([a1, a2, a3, a4])[index]


def _b1(t, y, args, xp):
    return xp.stack([2 * (y[0] - y[0] * y[1]), -(y[1] - y[0] * y[1])])


def _b5(t, y, args, xp):
    return xp.stack([y[1] * y[2], -y[0] * y[2], -0.51 * y[0] * y[1]])


def _c1(t, y, args, xp):
    return xp.concatenate([-y[:1], y[:-2] - y[1:-1], y[-2:-1]])


def _d3(t, y, args, xp):
    r3 = (y[0] ** 2 + y[1] ** 2) ** 1.5
    return xp.stack([y[2], y[3], -y[0] / r3, -y[1] / r3])


_E = 0.5  # orbit eccentricity (D3)
DETEST = {
    "A": (_a_problems, [[1.0]] * 4),  # A1-A4, batched over args = 0..3
    "B1": (_b1, [1.0, 3.0]),
    "B5": (_b5, [0.0, 1.0, 1.0]),
    "C1": (_c1, [1.0] + [0.0] * 9),
    "D3": (_d3, [1 - _E, 0.0, 0.0, np.sqrt((1 + _E) / (1 - _E))]),
}
DETEST_T1 = 20.0
DETEST_CASES = [
    ("A", "Tsit5", 1e-8),
    ("B1", "Tsit5", 1e-8),
    ("B5", "Tsit5", 1e-8),
    ("C1", "Tsit5", 1e-8),
    ("D3", "Tsit5", 1e-8),
    ("A", "Dopri5", 1e-8),
    ("B1", "Dopri5", 1e-8),
    ("A", "Dopri8", 1e-10),
    ("C1", "Dopri8", 1e-10),
    ("D3", "Dopri8", 1e-10),
]


def _batch(name):
    """The problem's `(y0s, args)`, with a leading batch axis."""
    f, y0 = DETEST[name]
    if name == "A":
        return np.asarray(y0), np.arange(4)
    return np.asarray(y0)[None], np.zeros(1, int)


@functools.cache
def _reference(name):
    f, _ = DETEST[name]
    out = []
    for y0, args in zip(*_batch(name)):
        sol = scipy.integrate.solve_ivp(
            lambda t, y: f(t, y, args, np),
            (0.0, DETEST_T1),
            y0,
            method="DOP853",
            rtol=1e-12,
            atol=1e-12,
        )
        assert sol.success
        out.append(sol.y[:, -1])
    return np.stack(out)


def _detest_solve(lib, name, solver, tol):
    f, _ = DETEST[name]
    y0s, index = _batch(name)

    def solve(y0, args):
        sol = lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: f(t, y, args, jnp)),
            getattr(lib, solver)(),
            0.0,
            DETEST_T1,
            0.1,
            y0,
            args,
            stepsize_controller=lib.PIDController(rtol=tol, atol=tol),
            max_steps=2048,
        )
        return sol.ys[-1], sol.stats["num_steps"]

    ys, steps = jax.jit(jax.vmap(solve))(jnp.asarray(y0s), jnp.asarray(index))
    return np.asarray(ys), np.asarray(steps)


_solverkit = functools.cache(functools.partial(_detest_solve, sk))


# The quick loop's comparison with SciPy: one problem, one solver.
_QUICK_DETEST = [("A", "Tsit5", 1e-8)]


@pytest.mark.parametrize("name, solver, tol", quick_params(DETEST_CASES, _QUICK_DETEST))
def test_detest_against_scipy(name, solver, tol):
    ys, _ = _solverkit(name, solver, tol)
    ref = _reference(name)
    # The global error on [0, 20] is a modest multiple of the local tolerance.
    scale = np.maximum(1, np.abs(ref))
    assert np.max(np.abs(ys - ref) / scale) < 1000 * tol, (ys, ref)


@pytest.mark.parametrize(
    "name, solver, tol",
    [("A", "Tsit5", 1e-8), ("B1", "Dopri5", 1e-8), ("D3", "Dopri8", 1e-10)],
)
@pytest.mark.slow
def test_detest_against_diffrax(name, solver, tol):
    ys, steps = _solverkit(name, solver, tol)
    dys, dsteps = _detest_solve(diffrax, name, solver, tol)
    # Same tableaux, same controller: the same answer, far below the tolerance.
    assert np.max(np.abs(ys - dys) / np.maximum(1, np.abs(dys))) < 10 * tol
    assert np.all(np.abs(steps - dsteps) <= np.maximum(1, 0.02 * dsteps)), (
        steps,
        dsteps,
    )


# --- Backwards in time ----------------------------------------------------------------


def test_backwards_against_analytic():
    ts = jnp.array([0.0, -0.5, -2.0])
    sol = sk.diffeqsolve(
        sk.ODETerm(rotation),
        sk.Tsit5(),
        0.0,
        -2.0,
        -0.01,
        jnp.array([1.0, 0.0]),
        saveat=sk.SaveAt(t0=True, ts=ts, t1=True),
        stepsize_controller=sk.PIDController(rtol=1e-9, atol=1e-9),
    )
    np.testing.assert_allclose(sol.ts, [0.0, 0.0, -0.5, -2.0, -2.0])
    expected = np.stack([rotation_exact(t) for t in np.asarray(sol.ts)])
    np.testing.assert_allclose(sol.ys, expected, atol=1e-7)
    assert float(sol.t0) == 0.0 and float(sol.t1) == -2.0
    assert sol.result == sk.RESULTS.successful


@pytest.mark.slow
def test_backwards_is_forwards_in_reversed_time():
    # Solving y' = f(t, y) from 1 down to -3 is solving z' = -f(-s, z) from -1 up to 3.
    def f(t, y, args):
        return jnp.stack([y[1] * jnp.cos(t), -y[0]])

    kw = dict(
        saveat=sk.SaveAt(steps=True),
        stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
        max_steps=256,
    )
    y0 = jnp.array([1.0, 0.0])
    back = sk.diffeqsolve(sk.ODETerm(f), sk.Dopri5(), 1.0, -3.0, -0.1, y0, **kw)
    fwd = sk.diffeqsolve(
        sk.ODETerm(lambda s, z, args: -f(-s, z, args)),
        sk.Dopri5(),
        -1.0,
        3.0,
        0.1,
        y0,
        **kw,
    )
    n = int(back.stats["num_accepted_steps"])
    assert int(back.stats["num_steps"]) == int(fwd.stats["num_steps"])
    assert n == int(fwd.stats["num_accepted_steps"]) and n > 5
    # The same steps (counted above) with time negated: the same arithmetic up to
    # rounding of the time arithmetic, a few ulps per step over n < 256 steps.
    np.testing.assert_allclose(back.ts[:n], -fwd.ts[:n], rtol=1e-12)
    np.testing.assert_allclose(back.ys[:n], fwd.ys[:n], rtol=1e-12, atol=1e-12)
    assert np.all(np.isinf(np.asarray(back.ts[n:])))


# --- Kinds of state ----------------------------------------------------------------


def test_pytree_state():
    def vf(t, y, args):
        return {"a": -y["a"], "b": (2 * y["b"][0], -3 * y["b"][1])}

    y0 = {"a": jnp.ones((2, 3)), "b": (jnp.array(0.5), jnp.arange(3.0))}
    sol = sk.diffeqsolve(
        sk.ODETerm(vf),
        sk.Tsit5(),
        0.0,
        1.0,
        0.05,
        y0,
        saveat=sk.SaveAt(t0=True, t1=True),
        stepsize_controller=sk.PIDController(rtol=1e-9, atol=1e-9),
    )
    expected = {
        "a": np.stack([np.ones((2, 3)), np.full((2, 3), np.exp(-1))]),
        "b": (
            np.array([0.5, 0.5 * np.exp(2)]),
            np.stack([np.arange(3.0), np.arange(3.0) * np.exp(-3)]),
        ),
    }
    assert_tree_allclose(sol.ys, expected, rtol=1e-7)


@pytest.mark.parametrize(
    "controller", [sk.ConstantStepSize(), sk.PIDController(rtol=1e-8, atol=1e-8)]
)
def test_complex_state(controller):
    # y' = (i - 0.1) y: the error estimate and step control must use |.|.
    lam = 1j - 0.1
    y0 = jnp.array([1.0 + 0.0j, 0.5j])
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: lam * y),
        sk.Dopri5(),
        0.0,
        3.0,
        0.01,
        y0,
        stepsize_controller=controller,
    )
    assert sol.ys.dtype == jnp.complex128
    np.testing.assert_allclose(sol.ys[-1], np.asarray(y0) * np.exp(3 * lam), atol=1e-7)


def test_integer_y0_is_promoted():
    y0 = {"x": jnp.array([1, 2]), "n": 3}
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: {"x": -y["x"], "n": -y["n"]}),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        y0,
    )
    assert sol.ys["x"].dtype == jnp.float64
    assert sol.ys["n"].dtype == jnp.float64
    np.testing.assert_allclose(sol.ys["x"][-1], np.array([1, 2]) * np.exp(-1), 1e-6)
    np.testing.assert_allclose(sol.ys["n"][-1], 3 * np.exp(-1), rtol=1e-6)


# The rotation from y0 = (1, 1), at t = 1.
_ROTATED_ONES = [np.cos(1) + np.sin(1), np.cos(1) - np.sin(1)]


def test_float32_state():
    kw = dict(stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5))
    with jax.enable_x64(False):
        sol = sk.diffeqsolve(
            sk.ODETerm(rotation), sk.Tsit5(), 0.0, 1.0, 0.1, jnp.ones(2), **kw
        )
    assert sol.ys.dtype == jnp.float32
    np.testing.assert_allclose(
        sol.ys[-1], [np.cos(1) + np.sin(1), np.cos(1) - np.sin(1)], rtol=1e-4
    )


def test_float32_state_under_x64():
    # A float32 y0 with float64 times (x64 on) must work: diffrax promotes it to
    # float64; keeping float32 would be fine too.
    y0 = jnp.ones(2, jnp.float32)
    sol = sk.diffeqsolve(
        sk.ODETerm(rotation),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        y0,
        stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5),
    )
    assert sol.ys.dtype in (jnp.float32, jnp.float64)
    np.testing.assert_allclose(
        sol.ys[-1], [np.cos(1) + np.sin(1), np.cos(1) - np.sin(1)], rtol=1e-4
    )


# The full suite (an edge case, 26 compiles); the quick loop's diffeqsolve:
# test_convergence_order's quick cases and
# test_traced_once_inside_jit_under_transformations.
@pytest.mark.slow
def test_t0_equals_t1():
    y0 = jnp.array([1.0, 2.0])
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y),
        sk.Tsit5(),
        1.0,
        1.0,
        0.1,
        y0,
        saveat=sk.SaveAt(t0=True, t1=True, dense=True),
        stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
    )
    np.testing.assert_allclose(sol.ys, np.stack([y0, y0]))
    np.testing.assert_allclose(sol.ts, [1.0, 1.0])
    assert int(sol.stats["num_steps"]) == 0
    assert sol.result == sk.RESULTS.successful
    np.testing.assert_allclose(sol.evaluate(1.0), y0)


# --- jit, vmap, and no recompilation ------------------------------------------------


def _decay(t, y, args):
    return -args["k"] * y + args["c"]


def _decay_exact(t, y0, k, c):
    return c / k + (y0 - c / k) * np.exp(-k * t)


_decay_controller = sk.PIDController(rtol=1e-8, atol=1e-8)


@jax.jit
def _decay_solve(y0, k, c, t1):
    return sk.diffeqsolve(
        sk.ODETerm(_decay),
        sk.Tsit5(),
        0.0,
        t1,
        0.1,
        y0,
        {"k": k, "c": c},
        stepsize_controller=_decay_controller,
        max_steps=256,
    ).ys[-1]


def test_vmap_over_y0_args_t1():
    y0 = jnp.array([[1.0], [2.0], [-1.0]])
    k = jnp.array([0.5, 1.0, 2.0])
    c = jnp.array([0.0, 1.0, -0.5])
    t1 = jnp.array([0.5, 1.0, 3.0])
    out = jax.vmap(_decay_solve)(y0, k, c, t1)
    expected = _decay_exact(
        np.asarray(t1)[:, None], np.asarray(y0), k[:, None], c[:, None]
    )
    np.testing.assert_allclose(out, expected, rtol=1e-7)


def test_vmap_matches_loop_over_problems():
    y0 = jnp.array([[1.0], [2.0]])
    k = jnp.array([0.5, 3.0])
    c = jnp.array([0.2, 0.0])
    t1 = jnp.array([2.0, 1.0])
    batched = jax.vmap(_decay_solve)(y0, k, c, t1)
    single = [_decay_solve(y0[i], k[i], c[i], t1[i]) for i in range(2)]
    # vmap runs each element's own steps with the same arithmetic: equal to a few
    # ulps (XLA may fuse differently batched).
    np.testing.assert_allclose(batched, np.stack(single), rtol=1e-12)


def test_no_recompile_on_new_values_under_jit():
    args = (jnp.array([1.0]), jnp.asarray(1.0), jnp.asarray(0.0), jnp.asarray(1.0))
    _decay_solve(*args).block_until_ready()
    y0 = jnp.array([3.0])
    with count_compiles() as counter:
        out = _decay_solve(y0, 2.0, 1.0, 1.5).block_until_ready()
    assert counter.count == 0
    np.testing.assert_allclose(out, _decay_exact(1.5, 3.0, 2.0, 1.0), rtol=1e-7)


def _solve_decay_unjitted(y0, k, c):
    return sk.diffeqsolve(
        sk.ODETerm(_decay),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        y0,
        {"k": k, "c": c},
        stepsize_controller=_decay_controller,
        max_steps=256,
    )


def test_no_recompile_on_new_values_without_jit():
    # (Python scalars in `args` are static, as in diffrax: pass arrays.)
    one, zero = jnp.asarray(1.0), jnp.asarray(0.0)
    _solve_decay_unjitted(jnp.array([1.0]), one, zero).ys.block_until_ready()
    y0, k, c = jnp.array([2.0]), jnp.asarray(3.0), jnp.asarray(0.5)
    with count_compiles() as counter:
        sol = _solve_decay_unjitted(y0, k, c)
        sol.ys.block_until_ready()
    assert counter.count == 0
    np.testing.assert_allclose(sol.ys[-1], _decay_exact(1.0, 2.0, 3.0, 0.5), 1e-7)


def test_no_recompile_for_new_closure_over_new_value():
    # A fresh vector field closing over a new array each call (e.g. in a Python loop
    # over parameter values) must not recompile.
    def solve(theta):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -theta * y),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.array([1.0]),
            stepsize_controller=_decay_controller,
            max_steps=256,
        ).ys

    solve(jnp.asarray(1.0)).block_until_ready()
    theta = jnp.asarray(2.0)
    with count_compiles() as counter:
        out = solve(theta).block_until_ready()
    assert counter.count == 0
    np.testing.assert_allclose(out[-1], np.exp(-2.0), rtol=1e-7)


def test_new_function_does_recompile_and_is_right():
    # Two vector fields with the same signature but different code must not share a
    # compiled program.
    def solve(vf):
        return sk.diffeqsolve(
            sk.ODETerm(vf), sk.Tsit5(), 0.0, 1.0, 0.1, jnp.array([1.0]), max_steps=64
        ).ys[-1]

    a = solve(lambda t, y, args: -y)
    b = solve(lambda t, y, args: y)
    np.testing.assert_allclose(a, np.exp(-1.0), rtol=1e-6)
    np.testing.assert_allclose(b, np.exp(1.0), rtol=1e-6)


def _solve_jits(fn, *args) -> int:
    """How many `jit`s of diffeqsolve's own the program of `jax.jit(fn)` holds."""

    def count(jaxpr) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            n += eqn.primitive.name in ("jit", "pjit") and eqn.params[
                "name"
            ].startswith("_solve")
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub)
        return n

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def test_traced_once_inside_jit_under_transformations():
    # Inside a jit, under vmap or grad, the solve is traced directly rather than as a
    # jit of its own that each transformation then traces again; under a plain jit it
    # stays one (repeated solves share its trace). The numbers are the same.
    power = jnp.asarray(1, jnp.int32)  # closed-over values of two dtypes

    def final(k, y0):
        field = lambda t, y, args: -k * y**power  # noqa: E731
        return sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 0.1, y0,
            stepsize_controller=_decay_controller, max_steps=256,
        ).ys[-1, 0]  # fmt: skip

    k, y0 = jnp.array([0.5, 2.0]), jnp.array([[1.0], [3.0]])
    batched = jax.vmap(final)
    loss = jax.grad(lambda k, y0: batched(k, y0).sum())
    assert _solve_jits(batched, k, y0) == 0
    assert _solve_jits(loss, k, y0) == 0
    assert _solve_jits(final, k[0], y0[0]) == 1
    exact = np.asarray(y0[:, 0]) * np.exp(-np.asarray(k))
    # PID at rtol = atol = 1e-8 on a smooth decay: the final state to ~1e-7.
    np.testing.assert_allclose(jax.jit(batched)(k, y0), exact, rtol=1e-7)
    np.testing.assert_allclose(jax.jit(loss)(k, y0), -exact, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(batched)(k, y0), batched(k, y0), rtol=1e-12)


@pytest.mark.parametrize("controller", [sk.ConstantStepSize(), _decay_controller])
def test_vmap_settles_the_loop_carry_in_one_pass(monkeypatch, controller):
    # Under vmap JAX batches a while loop's body until the batched parts of the carry
    # stop changing, each pass a trace of the whole body. The loop's initial carry is
    # batched wherever the body would batch it (with fixed steps too: the state, the
    # solver's state and the result code), so one pass settles it.
    batching = pytest.importorskip("jax._src.interpreters.batching")
    loops = pytest.importorskip("jax._src.lax.control_flow.loops")
    passes, batch_jaxpr = [], batching.batch_jaxpr

    def counted(jaxpr, axis_data, batched, instantiate):
        out = batch_jaxpr(jaxpr, axis_data, batched, instantiate)
        if isinstance(instantiate, list) and len(jaxpr.jaxpr.eqns) > 50:
            passes.append(list(instantiate) == list(out[1]))
        return out

    monkeypatch.setattr(loops.batching, "batch_jaxpr", counted)
    scale = jnp.array([0.5, 2.0])
    count = jnp.asarray(2, jnp.int32)  # closed-over values of two dtypes

    def final(k):
        field = lambda t, y, args: -k * y * (count // 2)  # noqa: E731
        return sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 1e-2, jnp.array([1.0, 3.0]),
            stepsize_controller=controller, max_steps=256,
        ).ys[-1]  # fmt: skip

    out = jax.jit(jax.vmap(final))(scale)
    if not passes:
        pytest.skip("this JAX batches a while loop without `batching.batch_jaxpr`")
    assert passes == [True]  # the loop body's one pass found nothing to batch anew
    exact = np.array([1.0, 3.0]) * np.exp(-np.asarray(scale))[:, None]
    # Tsit5 with dt = 1e-2 (error ~ dt^5 = 1e-10) or PID at 1e-8: well inside 1e-7.
    np.testing.assert_allclose(out, exact, rtol=1e-7)


@pytest.mark.parametrize("solver_cls", solver_params(RK_SOLVERS))
def test_stages_in_a_loop_match_unrolled(solver_cls):
    # `scan_kind` (set by BacksolveAdjoint on its backward solver) runs the stages in
    # a loop: the same numbers as unrolled.
    from solverkit._term import ClosureTerm

    y0 = {"a": jnp.array([1.0, 0.5]), "b": jnp.asarray(0.3)}
    vf = lambda t, y, args: {"a": jnp.cos(t) * (LINEAR_A @ y["a"]), "b": -y["b"] * t}
    t0, t1 = jnp.asarray(0.1), jnp.asarray(0.3)
    term = ClosureTerm(sk.closure_convert(vf, t0, y0, None), None)
    out = []
    for scan_kind in (None, "lax"):
        solver = solver_cls(scan_kind=scan_kind)
        f0 = solver.init(term, t0, t1, y0, None)
        out.append(solver.step(term, t0, t1, y0, None, f0, False))
    (y_u, err_u, dense_u, f_u, _), (y_l, err_l, dense_l, f_l, _) = out
    assert_tree_allclose(y_l, y_u, rtol=1e-6, atol=1e-7)
    assert_tree_allclose(f_l, f_u, rtol=1e-6, atol=1e-7)
    assert_tree_allclose(err_l, err_u, rtol=1e-5, atol=1e-7)
    assert_tree_allclose(dense_l, dense_u, rtol=1e-6, atol=1e-7)


# Quick loop: test_convergence_order[Tsit5-5-True].
@pytest.mark.slow
def test_small_reductions_match_numpy():
    # The error norm and the finiteness check reduce small arrays element by element
    # (solverkit/_reduce.py); they must agree with the ordinary reductions, batched too.
    from solverkit._reduce import all_true, sum_all

    rng = np.random.default_rng(0)
    for shape in [(), (0,), (1,), (2,), (3,), (4,), (2, 3), (8,), (9,), (3, 4)]:
        x = rng.normal(size=(5,) + shape)
        np.testing.assert_allclose(
            jax.vmap(sum_all)(jnp.asarray(x)),
            x.reshape(5, -1).sum(axis=1),
            rtol=1e-6,
            atol=1e-6,
        )
        mask = x > -1.0
        np.testing.assert_array_equal(
            jax.vmap(all_true)(jnp.asarray(mask)), mask.reshape(5, -1).all(axis=1)
        )


# Tsit5 with the backward pass's stages in a loop, vmapped and lowered; every
# solver's products (Kvaerno5's stage sums and `(I - γhJ)^-1`, Rodas5P's dense output
# coefficients, ...), forward and reverse, are programs/test_precision.py's.
@pytest.mark.parametrize("solver, adjoint", [("Tsit5", "BacksolveAdjoint")])
# Quick loop: programs/test_precision.py::test_adjoint_products_are_highest.
@pytest.mark.slow
def test_float32_products_use_full_precision(solver, adjoint):
    """Every matrix product the engine makes in float32 asks for full precision: at
    default precision a GPU runs a large batched product in TF32 (10-bit mantissa),
    which on an H200 cost a vmapped backsolve gradient 40x its accuracy and 5x its
    backward steps. (The user's own vector field keeps whatever it asks for.)"""

    def loss(k):
        def one(k):
            sol = sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -k * y),
                getattr(sk, solver)(),
                0.0,
                1.0,
                0.1,
                jnp.ones(3, jnp.float32),
                saveat=sk.SaveAt(ts=jnp.linspace(0.0, 1.0, 4)),
                stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-6),
                adjoint=getattr(sk, adjoint)(),
            )
            return jnp.sum(sol.ys)

        return jnp.sum(jax.vmap(one)(k))

    text = jax.jit(jax.grad(loss)).lower(jnp.ones(8, jnp.float32)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots, "no matrix products to check"
    default = [line for line in dots if "DEFAULT" in line and "f32" in line]
    assert not default, "\n".join(default[:3])
