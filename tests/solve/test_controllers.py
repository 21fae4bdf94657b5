"""Step-size controllers: `ConstantStepSize`, `StepTo`, `PIDController` (dt0 = None,
dtmin / dtmax, coefficients, factormax) and `ClipStepSizeController` (step_ts /
jump_ts, under jit / vmap / grad and both adjoints), against analytic solutions,
hand-computed steps and diffrax."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    finite_difference,
    LINEAR_A,
    linear_vf,
    rotation,
    rotation_exact,
)

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


# --- ConstantStepSize, StepTo, PIDController ------------------------------------------


# Quick loop: test_constant_steps_differentiable_in_dt0.
@pytest.mark.slow
def test_constant_steps_do_not_accumulate_rounding():
    # 0.01 is not a float32 number: summing it 4000 times overshoots or undershoots
    # 40 and leaves a sliver of a step; step ends are fractions of the interval.
    def solve(t1, dt0):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -y),
            sk.Euler(),
            0.0,
            t1,
            dt0,
            jnp.float32(1.0),
            saveat=sk.SaveAt(steps=True),
            max_steps=4096,
        )

    sol = solve(40.0, 0.01)
    assert int(sol.stats["num_steps"]) == 4000
    assert float(sol.ts[3999]) == 40.0
    # A step that doesn't divide the interval: ceil((t1 - t0) / dt0) steps, as diffrax.
    sol = solve(1.0, 0.3)
    assert int(sol.stats["num_steps"]) == 4
    assert float(sol.ts[3]) == 1.0


def test_constant_steps_under_vmap_report_nonfinite_per_element():
    # A non-finite value doesn't stop a fixed-step solve (it runs on to t1, as in
    # diffrax) but is reported in `result`, per batch element.
    def solve(rate):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: jnp.where(t > 0.5, rate, 1.0) * -y),
            sk.Heun(),
            0.0,
            1.0,
            0.1,
            jnp.ones(2),
            throw=False,
        )
        return sol.ys[-1], sol.result.code, sol.stats["num_steps"]

    ys, results, steps = jax.jit(jax.vmap(solve))(jnp.array([1.0, jnp.nan, 2.0]))
    codes = [int(sk.RESULTS.successful.code), int(sk.RESULTS.nonfinite.code)]
    assert results.tolist() == [codes[0], codes[1], codes[0]]
    assert steps.tolist() == [10, 10, 10]
    np.testing.assert_allclose(ys[0], np.exp(-1.0) * np.ones(2), rtol=1e-2)
    assert np.all(np.isnan(ys[1]))


def test_constant_steps_differentiable_in_dt0():
    # The step count, an integer, is computed with `nextafter` (which JAX can't
    # differentiate) from `dt0`: a differentiated `dt0` must not reach it. The first
    # step ends at t0 + dt0, the others share the rest evenly.
    def final(dt0):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -y), sk.Heun(), 0.0, 1.0, dt0, 1.0
        ).ys[-1]

    grad = jax.grad(final)(0.3)
    assert np.isfinite(grad) and grad != 0
    # Jitted: one program for both solves (each eager call converts a new closure).
    np.testing.assert_allclose(grad, finite_difference(jax.jit(final), 0.3), rtol=1e-6)


def test_step_to_is_euler_on_the_grid():
    grid = np.array([0.0, 0.1, 0.15, 0.4, 0.45, 1.0])
    sol = sk.diffeqsolve(
        sk.ODETerm(linear_vf),
        sk.Euler(),
        0.0,
        1.0,
        None,
        jnp.array([1.0, 0.5]),
        saveat=sk.SaveAt(steps=True),
        stepsize_controller=sk.StepTo(grid),
        max_steps=8,
    )
    y = np.array([1.0, 0.5])
    expected = []
    for a, b in zip(grid[:-1], grid[1:]):
        y = y + (b - a) * np.cos(a) * (LINEAR_A @ y)
        expected.append(y)
    np.testing.assert_allclose(sol.ts[:5], grid[1:])
    assert np.all(np.isinf(np.asarray(sol.ts[5:])))
    np.testing.assert_allclose(sol.ys[:5], np.stack(expected), rtol=1e-12)
    assert int(sol.stats["num_steps"]) == 5


def test_step_to_backwards():
    grid = np.array([1.0, 0.7, 0.2, -0.5])
    sol = sk.diffeqsolve(
        sk.ODETerm(rotation),
        sk.Dopri8(),
        1.0,
        -0.5,
        None,
        jnp.asarray(rotation_exact(1.0)),
        saveat=sk.SaveAt(steps=True),
        stepsize_controller=sk.StepTo(grid),
        max_steps=3,
    )
    np.testing.assert_allclose(sol.ts, grid[1:])
    expected = np.stack([rotation_exact(t) for t in grid[1:]])
    np.testing.assert_allclose(sol.ys, expected, atol=1e-6)


def _pid_steps(controller, dt0=0.01, solver=sk.Tsit5(), t1=10.0):
    return sk.diffeqsolve(
        sk.ODETerm(_b1_vf),
        solver,
        0.0,
        t1,
        dt0,
        jnp.array([1.0, 3.0]),
        saveat=sk.SaveAt(steps=True),
        stepsize_controller=controller,
        max_steps=1024,
        throw=False,
    )


def _b1(t, y, args, xp):
    # DETEST B1 (as in solve/test_integrate.py).
    return xp.stack([2 * (y[0] - y[0] * y[1]), -(y[1] - y[0] * y[1])])


def _b1_vf(t, y, args):
    return _b1(t, y, args, jnp)


def _accepted_steps(sol):
    ts = np.asarray(sol.ts)
    ts = np.concatenate([[0.0], ts[np.isfinite(ts)]])
    return np.diff(ts)


def _hairer_wanner_dt0(f, y0, rtol, atol, order):
    """The initial step of Hairer, Norsett & Wanner (1993), II.4, in NumPy."""
    rms = lambda x: np.sqrt(np.mean(np.abs(x) ** 2))
    scale = atol + np.abs(y0) * rtol
    f0 = f(0.0, y0)
    d0, d1 = rms(y0 / scale), rms(f0 / scale)
    h0 = 1e-6 if min(d0, d1) < 1e-5 else 0.01 * d0 / d1
    d2 = rms((f(h0, y0 + h0 * f0) - f0) / scale) / h0
    h1 = (0.01 / max(d1, d2)) ** (1 / order)
    return min(100 * h0, h1)


# The full suite; the quick loop's dt0=None (the first step from the field):
# diffrax_compat/test_half_solver.py::test_half_solver_accuracy_and_first_step,
# diffrax_compat/test_solver_protocol.py::test_crank_nicolson_solves_the_heat_equation.
@pytest.mark.slow
def test_dt0_none():
    ours = _pid_steps(sk.PIDController(rtol=1e-6, atol=1e-6), dt0=None)
    y0 = np.array([1.0, 3.0])
    dt0 = _hairer_wanner_dt0(
        lambda t, y: _b1(t, y, None, np), y0, 1e-6, 1e-6, sk.Tsit5().error_order(None)
    )
    # The first attempted step is the Hairer-Wanner estimate; if it is accepted it is
    # the first saved step.
    assert ours.result == sk.RESULTS.successful
    first = _accepted_steps(ours)[0]
    assert first == pytest.approx(dt0, rel=1e-9) or first < dt0
    # And the solve agrees with one from a given dt0.
    given = _pid_steps(sk.PIDController(rtol=1e-6, atol=1e-6), dt0=dt0)
    np.testing.assert_allclose(ours.ys, given.ys, rtol=1e-12)


def test_pid_dtmax():
    sol = _pid_steps(sk.PIDController(rtol=1e-4, atol=1e-4, dtmax=0.05))
    steps = _accepted_steps(sol)
    assert sol.result == sk.RESULTS.successful
    assert np.all(steps <= 0.05 + 1e-12)
    assert len(steps) >= 200  # 10 / 0.05


def test_pid_dtmin_forced():
    # Tolerances so tight that the controller wants far smaller steps than dtmin.
    sol = _pid_steps(
        sk.PIDController(rtol=1e-13, atol=1e-13, dtmin=0.05, force_dtmin=True), t1=1.0
    )
    steps = _accepted_steps(sol)
    assert sol.result == sk.RESULTS.successful
    assert np.all(steps[:-1] >= 0.05 - 1e-12)
    assert len(steps) <= 21
    assert int(sol.stats["num_rejected_steps"]) <= 1


def test_pid_dtmin_not_forced():
    sol = _pid_steps(
        sk.PIDController(rtol=1e-13, atol=1e-13, dtmin=0.05, force_dtmin=False), t1=1.0
    )
    assert sol.result == sk.RESULTS.dt_min_reached


def test_pid_coefficients_match_diffrax():
    coeffs = dict(pcoeff=0.2, icoeff=0.4, dcoeff=0.1)
    ours = _pid_steps(sk.PIDController(rtol=1e-6, atol=1e-6, **coeffs))
    theirs = diffrax.diffeqsolve(
        diffrax.ODETerm(_b1_vf),
        diffrax.Tsit5(),
        0.0,
        10.0,
        0.01,
        jnp.array([1.0, 3.0]),
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6, **coeffs),
        max_steps=1024,
    )
    assert ours.result == sk.RESULTS.successful
    y1 = np.asarray(ours.ys)[int(ours.stats["num_accepted_steps"]) - 1]
    np.testing.assert_allclose(y1, theirs.ys[-1], rtol=1e-6)
    n, m = int(ours.stats["num_steps"]), int(theirs.stats["num_steps"])
    assert abs(n - m) <= max(1, 0.02 * m), (n, m)
    r, s = (
        int(ours.stats["num_rejected_steps"]),
        int(theirs.stats["num_rejected_steps"]),
    )
    assert abs(r - s) <= max(1, 0.1 * s), (r, s)


def test_pid_factormax_and_safety():
    # A first step far too small: growth is limited by factormax per step.
    sol = _pid_steps(
        sk.PIDController(rtol=1e-3, atol=1e-3, factormax=2.0), dt0=1e-6, t1=1.0
    )
    steps = _accepted_steps(sol)
    ratios = steps[1:-1] / steps[:-2]
    assert np.all(ratios <= 2.0 + 1e-9)
    assert np.any(ratios > 1.9)


# The full suite; the quick loop's PID coefficients:
# test_pid_coefficients_match_diffrax.
@pytest.mark.slow
def test_pid_traced_error_order_and_coefficients():
    # diffrax skips a power only for a Python zero coefficient, so a traced
    # `error_order` or coefficient works under jit; the controller state layouts are
    # the same, so one step's decision is compared with diffrax's directly.
    y0, y_error = jnp.array([1.0, 2.0]), jnp.array([1e-4, -3e-4])
    state = (jnp.array(1.3), jnp.array(0.7), jnp.array(False))

    def step(controller, order, coeffs):
        c = controller(rtol=1e-3, atol=1e-3, **coeffs)
        return c.adapt_step_size(0.0, 0.1, y0, y0 + 1e-3, None, y_error, order, state)[
            :3
        ]

    coeffs = dict(pcoeff=0.2, icoeff=0.4, dcoeff=0.1)
    for zero in ("pcoeff", "dcoeff"):
        c = dict(coeffs, **{zero: 0.0})
        ours = jax.jit(lambda o, c: step(sk.PIDController, o, c))(5.0, c)
        theirs = step(diffrax.PIDController, 5.0, c)
        for a, b in zip(ours, theirs):
            # Same formula in float64; only the order of the products differs.
            np.testing.assert_allclose(a, b, rtol=1e-13)

    # A whole solve with a traced `error_order`, under jit and vmap.
    def solve(module, order):
        return module.diffeqsolve(
            module.ODETerm(_b1_vf),
            module.Tsit5(),
            0.0,
            2.0,
            0.01,
            jnp.array([1.0, 3.0]),
            stepsize_controller=module.PIDController(
                rtol=1e-6, atol=1e-6, pcoeff=0.2, icoeff=0.4, error_order=order
            ),
            max_steps=1024,
        )

    orders = jnp.array([3.0, 5.0])
    ours = jax.jit(jax.vmap(lambda o: solve(sk, o)))(orders)
    for i, order in enumerate(orders):
        theirs = solve(diffrax, float(order))
        # Both solutions are within ~1e-6 of the truth; same steps, same rounding.
        np.testing.assert_allclose(ours.ys[i], theirs.ys, rtol=1e-9)
        assert (
            abs(int(ours.stats["num_steps"][i]) - int(theirs.stats["num_steps"])) <= 1
        )


# --- ClipStepSizeController -----------------------------------------------------------


def _switch_solution(t, s):
    """y' = -y + [t >= s], y(0) = 1."""
    return jnp.where(t < s, jnp.exp(-t), 1 + (jnp.exp(-s) - 1) * jnp.exp(-(t - s)))


def _switch_solve(s, adjoint=sk.RecursiveCheckpointAdjoint(), t0=0.0, t1=2.0, **clip):
    controller = sk.PIDController(rtol=1e-8, atol=1e-8)
    if clip:
        controller = sk.ClipStepSizeController(controller, **clip)
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y + jnp.where(t < s, 0.0, 1.0)),
        sk.Tsit5(),
        t0,
        t1,
        None,
        jnp.asarray(_switch_solution(t0, s)),
        stepsize_controller=controller,
        saveat=sk.SaveAt(subs=[sk.SubSaveAt(t1=True), sk.SubSaveAt(steps=True)]),
        adjoint=adjoint,
        max_steps=256,
    )


@pytest.mark.parametrize(
    "backwards", [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_clip_steps_land_on_step_ts_and_jump_ts(backwards):
    s = 0.7
    t0, t1 = (2.0, 0.0) if backwards else (0.0, 2.0)
    plain = _switch_solve(s, t0=t0, t1=t1)
    steps = _switch_solve(s, t0=t0, t1=t1, step_ts=jnp.array([0.3, s, 1.9]))
    jumps = _switch_solve(s, t0=t0, t1=t1, jump_ts=[s])
    # A step across the switch costs accuracy; so does one that ends on it where
    # its last stage sees the far side (step_ts, backwards). A jump does neither,
    # in both directions (backwards, the field is re-evaluated below the jump).
    for sol in (plain, steps, jumps):
        atol = 1e-5 if sol is plain or (sol is steps and backwards) else 1e-7
        np.testing.assert_allclose(sol.ys[0][-1], _switch_solution(t1, s), atol=atol)
    ts = np.asarray(steps.ts[1])
    for p in (0.3, s, 1.9):
        assert p in ts
    # A jump needs no rejected steps to find: fewer steps, as in diffrax.
    assert jumps.stats["num_steps"] < plain.stats["num_steps"]
    assert np.any(np.abs(np.asarray(jumps.ts[1]) - s) <= 1e-15)


@pytest.mark.slow
def test_clip_under_jit_vmap_and_grad():
    s = jnp.array([0.5, 0.7, 1.1])
    final = jax.jit(jax.vmap(lambda s: _switch_solve(s, jump_ts=s[None]).ys[0][-1]))(s)
    np.testing.assert_allclose(final, _switch_solution(2.0, s), atol=1e-7)
    # The switch time moves the step that ends on it: d y(2)/ds = -exp(s - 2).
    for clip in ("step_ts", "jump_ts"):
        grad = jax.jit(
            jax.vmap(jax.grad(lambda s: _switch_solve(s, **{clip: s[None]}).ys[0][-1]))
        )(s)
        np.testing.assert_allclose(grad, -np.exp(s - 2.0), rtol=1e-5)
    # BacksolveAdjoint steps to the same times backwards; gradients w.r.t. a
    # parameter of the field agree with the checkpointed adjoint.

    def loss(k, adjoint):
        controller = sk.ClipStepSizeController(
            sk.PIDController(rtol=1e-9, atol=1e-9), jump_ts=[0.7]
        )
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -k * y + jnp.where(t < 0.7, 0.0, 1.0)),
            sk.Tsit5(),
            0.0,
            2.0,
            None,
            1.0,
            stepsize_controller=controller,
            adjoint=adjoint,
        ).ys[-1]

    # Jitted: one program each (eagerly, each gradient was many small compiles).
    g_back = jax.jit(jax.grad(lambda k: loss(k, sk.BacksolveAdjoint())))(1.3)
    g_rca = jax.jit(jax.grad(lambda k: loss(k, sk.RecursiveCheckpointAdjoint())))(1.3)
    np.testing.assert_allclose(g_back, g_rca, rtol=1e-6)


def test_clip_rejects_non_adaptive_controller():
    # diffrax's older spelling: PIDController(step_ts=..., jump_ts=...) solves as
    # ClipStepSizeController(PIDController(...), step_ts, jump_ts).
    pid = sk.PIDController(rtol=1e-4, atol=1e-6, step_ts=[3.0, 4.0], jump_ts=[3.0])
    assert pid.step_ts.tolist() == [3.0, 4.0] and pid.jump_ts.tolist() == [3.0]
    clip = pid.to_internal(None)
    assert isinstance(clip, sk.ClipStepSizeController)
    assert isinstance(clip.controller, sk.PIDController)
    assert clip.controller.step_ts is None
    assert clip.step_ts.tolist() == [3.0, 4.0] and clip.jump_ts.tolist() == [3.0]
    with pytest.raises(ValueError, match="adaptive"):
        sk.ClipStepSizeController(sk.ConstantStepSize(), step_ts=[1.0])
    with pytest.raises(ValueError, match="1-D"):
        sk.ClipStepSizeController(sk.PIDController(rtol=1e-3, atol=1e-3), step_ts=1.0)
