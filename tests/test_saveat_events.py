"""What a solve saves (`SaveAt`, dense output), events, and progress meters, against
analytic solutions."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import assert_tree_allclose, float64

import solverkit as sk


@pytest.fixture(autouse=True)
def _x64():
    with float64():
        yield


# y'' = -y as a first-order system: y(t) = (cos t, -sin t) from (1, 0).
def _rotation(t, y, args):
    return jnp.stack([y[1], -y[0]])


def _exact(t):
    t = np.asarray(t)
    return np.stack([np.cos(t), -np.sin(t)], axis=-1)


_Y0 = np.array([1.0, 0.0])  # made a JAX array inside the float64 context
_PID = sk.PIDController(rtol=1e-9, atol=1e-9)


def _solve(saveat, t0=0.0, t1=3.0, dt0=0.1, solver=sk.Tsit5(), **kw):
    kw.setdefault("stepsize_controller", _PID)
    kw.setdefault("max_steps", 512)
    return sk.diffeqsolve(
        sk.ODETerm(_rotation),
        solver,
        t0,
        t1,
        dt0,
        jnp.asarray(_Y0),
        saveat=saveat,
        **kw,
    )


# --- SaveAt -------------------------------------------------------------------------

# Dense output at many times, compiled once (eager vmap would compile op by op).
_evaluate = eqx.filter_jit(lambda sol, ts: jax.vmap(sol.evaluate)(ts))
_derivative = eqx.filter_jit(lambda sol, ts: jax.vmap(sol.derivative)(ts))


def test_t0_ts_t1_and_dense():
    ts = jnp.array([0.0, 0.3, 1.0, 2.5, 3.0])
    sol = _solve(sk.SaveAt(t0=True, ts=ts, t1=True, dense=True))
    expected_ts = np.concatenate([[0.0], np.asarray(ts), [3.0]])
    np.testing.assert_allclose(sol.ts, expected_ts)
    np.testing.assert_allclose(sol.ys, _exact(expected_ts), atol=1e-8)
    assert float(sol.t0) == 0.0 and float(sol.t1) == 3.0
    # Dense output: every point, its derivative, and differences.
    grid = np.linspace(0.0, 3.0, 37)
    values = _evaluate(sol, jnp.asarray(grid))
    np.testing.assert_allclose(values, _exact(grid), atol=1e-7)
    derivs = _derivative(sol, jnp.asarray(grid))
    np.testing.assert_allclose(
        derivs, np.stack([-np.sin(grid), -np.cos(grid)], -1), atol=1e-6
    )
    np.testing.assert_allclose(
        sol.evaluate(0.5, 2.0), _exact(2.0) - _exact(0.5), atol=1e-7
    )
    # The dense solution passes through the step ends exactly.
    np.testing.assert_allclose(sol.evaluate(3.0), sol.ys[-1], rtol=1e-12)


def test_default_saveat_is_t1():
    sol = _solve(sk.SaveAt(t1=True))
    default = sk.diffeqsolve(
        sk.ODETerm(_rotation),
        sk.Tsit5(),
        0.0,
        3.0,
        0.1,
        jnp.asarray(_Y0),
        stepsize_controller=_PID,
        max_steps=512,
    )
    assert sol.ts.shape == (1,) and sol.ys.shape == (1, 2)
    np.testing.assert_allclose(default.ys, sol.ys)
    np.testing.assert_allclose(sol.ys[0], _exact(3.0), atol=1e-8)
    with pytest.raises(ValueError, match="dense"):
        sol.evaluate(1.0)


def test_steps_true_and_every_n():
    every = _solve(sk.SaveAt(steps=True), max_steps=64)
    third = _solve(sk.SaveAt(steps=3), max_steps=64)
    n = int(every.stats["num_accepted_steps"])
    assert every.ts.shape == (64,) and third.ts.shape == (64 // 3,)
    assert np.all(np.isfinite(np.asarray(every.ts[:n])))
    assert np.all(np.isinf(np.asarray(every.ts[n:])))
    assert np.all(np.isinf(np.asarray(every.ys[n:])))
    np.testing.assert_allclose(every.ts[n - 1], 3.0)
    assert np.all(np.diff(np.asarray(every.ts[:n])) > 0)
    np.testing.assert_allclose(every.ys[:n], _exact(every.ts[:n]), atol=1e-8)
    # Every third accepted step: rows 2, 5, 8, ... of the every-step save.
    m = n // 3
    np.testing.assert_allclose(third.ts[:m], every.ts[2 : 3 * m : 3])
    np.testing.assert_allclose(third.ys[:m], every.ys[2 : 3 * m : 3])
    assert np.all(np.isinf(np.asarray(third.ts[m:])))


def test_fn_pytree_output():
    def fn(t, y, args):
        return {"energy": y[0] ** 2 + y[1] ** 2, "t": t, "first": y[:1]}

    ts = jnp.array([0.5, 1.5])
    sol = _solve(sk.SaveAt(t0=True, ts=ts, t1=True, fn=fn))
    times = np.array([0.0, 0.5, 1.5, 3.0])
    np.testing.assert_allclose(sol.ts, times)
    expected = {
        "energy": np.ones(4),
        "first": _exact(times)[:, :1],
        "t": times,
    }
    assert_tree_allclose(sol.ys, expected, atol=1e-8)


@pytest.mark.parametrize("solver", [sk.Bosh3(), sk.Heun()])
def test_dense_hermite(solver):
    # Solvers without their own dense output interpolate by cubic Hermite.
    sol = _solve(
        sk.SaveAt(dense=True),
        solver=solver,
        stepsize_controller=sk.PIDController(rtol=1e-7, atol=1e-7),
        max_steps=2048,
        t1=1.0,
    )
    grid = np.linspace(0.0, 1.0, 23)
    values = _evaluate(sol, jnp.asarray(grid))
    np.testing.assert_allclose(values, _exact(grid), atol=1e-5)


def test_dense_and_ts_backwards():
    ts = jnp.array([0.0, -1.0, -2.0])
    sol = _solve(sk.SaveAt(ts=ts, dense=True), t1=-2.0, dt0=-0.1)
    np.testing.assert_allclose(sol.ts, ts)
    np.testing.assert_allclose(sol.ys, _exact(ts), atol=1e-8)
    grid = np.linspace(-2.0, 0.0, 11)
    np.testing.assert_allclose(
        _evaluate(sol, jnp.asarray(grid)), _exact(grid), atol=1e-7
    )
    np.testing.assert_allclose(
        _derivative(sol, jnp.array([-1.0]))[0],
        [-np.sin(-1.0), -np.cos(-1.0)],
        atol=1e-6,
    )


def test_unreached_ts_padded_with_inf():
    ts = jnp.array([0.5, 1.0, 2.9])
    sol = _solve(
        sk.SaveAt(ts=ts, t1=True),
        stepsize_controller=sk.ConstantStepSize(),
        max_steps=12,
        throw=False,
    )
    assert sol.result == sk.RESULTS.max_steps_reached
    # 12 steps of 0.1 reach t = 1.2: ts 0.5 and 1.0 saved, 2.9 not. As in diffrax,
    # the final point follows the saved rows and the padding comes last.
    np.testing.assert_allclose(sol.ts[:3], [0.5, 1.0, 1.2])
    np.testing.assert_allclose(sol.ys[:3], _exact([0.5, 1.0, 1.2]), atol=1e-8)
    assert np.isinf(float(sol.ts[3])) and np.all(np.isinf(np.asarray(sol.ys[3])))
    np.testing.assert_allclose(float(sol.t1), 1.2)


_LAYOUTS = {
    "ts+steps+t0+t1": lambda lib: lib.SaveAt(
        ts=jnp.array([0.25, 0.5]), steps=True, t0=True, t1=True
    ),
    "ts+steps=2+t1": lambda lib: lib.SaveAt(
        ts=jnp.array([0.25, 0.5]), steps=2, t1=True
    ),
    "steps+t1": lambda lib: lib.SaveAt(steps=True, t1=True),
    "steps=3+t1": lambda lib: lib.SaveAt(steps=3, t1=True),
    "steps=3": lambda lib: lib.SaveAt(steps=3),
    "subs": lambda lib: lib.SaveAt(
        subs=[
            lib.SubSaveAt(ts=jnp.array([0.1, 0.9]), t1=True, fn=lambda t, y, a: y[0]),
            {"steps": lib.SubSaveAt(steps=True, t0=True)},
        ]
    ),
}


@pytest.mark.parametrize("event", [False, True], ids=["no-event", "event"])
@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_rows_laid_out_as_diffrax(layout, event):
    """Rows in time order (ts and step saves interleaved), the final point after
    them, padding last; an event removes rows past it."""
    import diffrax

    def run(lib):
        kw = {}
        if event:
            root = optx.Newton(rtol=1e-10, atol=1e-10)
            kw["event"] = lib.Event(lambda t, y, args, **_: y[0] - 0.55, root)
        sol = lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -y),
            lib.Tsit5(),
            0.0,
            1.0,
            0.3,
            jnp.array([1.0, 2.0]),
            saveat=_LAYOUTS[layout](lib),
            max_steps=8,
            **kw,
        )
        return sol.ts, sol.ys

    (ts, ys), (ref_ts, ref_ys) = run(sk), run(diffrax)
    assert jax.tree.structure(ts) == jax.tree.structure(ref_ts)
    assert_tree_allclose(ts, ref_ts, atol=1e-6)
    assert_tree_allclose(ys, ref_ys, atol=1e-6)


def test_subs_under_jit_vmap_grad():
    saveat = sk.SaveAt(
        subs=(sk.SubSaveAt(ts=jnp.linspace(0.0, 1.0, 5)), sk.SubSaveAt(t1=True))
    )

    def loss(k):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -k * y),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.asarray(1.0),
            saveat=saveat,
        )
        (_, ys_ts), (_, ys_t1) = zip(sol.ts, sol.ys)
        return jnp.sum(ys_ts) + ys_t1[0]

    ks = jnp.array([0.5, 1.0])
    grads = jax.jit(jax.vmap(jax.grad(loss)))(ks)
    ts = np.linspace(0.0, 1.0, 5)
    exact = [-np.sum(ts * np.exp(-k * ts)) - np.exp(-k) for k in (0.5, 1.0)]
    np.testing.assert_allclose(grads, exact, rtol=1e-6)


def test_vmap_over_save_times():
    @jax.jit
    @jax.vmap
    def at(ts):
        return _solve(sk.SaveAt(ts=ts)).ys

    ts = jnp.array([[0.1, 0.2], [1.0, 2.9]])
    np.testing.assert_allclose(at(ts), _exact(ts), atol=1e-8)


# --- Events -------------------------------------------------------------------------

# y' = -theta * y from y0: y falls through the level 0.3 at t* = log(y0 / 0.3) / theta.


def _decay(t, y, theta):
    return -theta * y


def _t_star(y0, theta):
    return np.log(y0 / 0.3) / theta


def _event_solve(y0, theta, cond_fn, direction=None, root_finder=None, **kw):
    kw.setdefault("stepsize_controller", sk.PIDController(rtol=1e-8, atol=1e-8))
    return sk.diffeqsolve(
        sk.ODETerm(_decay),
        sk.Tsit5(),
        0.0,
        10.0,
        0.1,
        y0,
        theta,
        event=sk.Event(cond_fn, root_finder=root_finder, direction=direction),
        max_steps=256,
        **kw,
    )


def _real_cond(t, y, theta):
    return y - 0.3


def _bool_cond(t, y, theta):
    return y < 0.3


def test_boolean_event_stops_after_the_crossing_step():
    sol = _event_solve(jnp.asarray(1.0), jnp.asarray(2.0), _bool_cond)
    t_star = _t_star(1.0, 2.0)
    assert sol.result == sk.RESULTS.event_occurred
    assert sk.is_okay(sol.result) and sk.is_event(sol.result)
    assert bool(sol.event_mask)
    t1 = float(sol.t1)
    # Ends at the end of the first step whose end satisfies the condition.
    assert t_star <= t1 < t_star + 0.5
    np.testing.assert_allclose(sol.ts, [t1])
    np.testing.assert_allclose(sol.ys[0], np.exp(-2.0 * t1), rtol=1e-6)
    assert float(sol.ys[0]) < 0.3


@jax.jit
def _event_t1_and_y(y0, theta):
    sol = _event_solve(y0, theta, _real_cond)
    return sol.t1, sol.ys[0], sol.result.code


def test_real_event_located_exactly():
    t1, y1, result = _event_t1_and_y(jnp.asarray(1.0), jnp.asarray(2.0))
    assert int(result) == int(sk.RESULTS.event_occurred.code)
    np.testing.assert_allclose(float(t1), _t_star(1.0, 2.0), rtol=1e-7)
    np.testing.assert_allclose(float(y1), 0.3, rtol=1e-7)


def test_real_event_with_optimistix_root_finder():
    sol = _event_solve(
        jnp.asarray(1.0),
        jnp.asarray(2.0),
        _real_cond,
        root_finder=optx.Newton(rtol=1e-10, atol=1e-10),
    )
    np.testing.assert_allclose(float(sol.t1), _t_star(1.0, 2.0), rtol=1e-7)


def test_event_direction():
    # y[0] = cos t crosses zero downwards at pi/2 and upwards at 3 pi/2. (Either
    # direction, the default, is tested with the other events.)
    def cond(t, y, args):
        return y[0]

    kw = dict(t1=6.0, saveat=sk.SaveAt(t1=True))
    down = _solve(event=sk.Event(cond, direction=False), **kw)
    up = _solve(event=sk.Event(cond, direction=True), **kw)
    np.testing.assert_allclose(float(down.t1), np.pi / 2, rtol=1e-8)
    np.testing.assert_allclose(float(up.t1), 3 * np.pi / 2, rtol=1e-8)
    np.testing.assert_allclose(up.ys[0], _exact(3 * np.pi / 2), atol=1e-8)


def test_event_pytree_of_conditions():
    # "late" (real) fires at t = 2.0, "early" (bool) once t >= 1.0 after a step.
    conds = {
        "late": lambda t, y, args: t - 2.0,
        "early": (lambda t, y, args: t >= 1.0,),
    }
    sol = _solve(sk.SaveAt(t1=True), event=sk.Event(conds), dt0=0.25)
    assert sol.result == sk.RESULTS.event_occurred
    assert jax.tree_util.tree_structure(sol.event_mask) == (
        jax.tree_util.tree_structure(conds)
    )
    assert not bool(sol.event_mask["late"]) and bool(sol.event_mask["early"][0])
    t1 = float(sol.t1)
    assert 1.0 <= t1 < 2.0
    # Only the real-valued condition fires first when the boolean one is later.
    conds = {"late": lambda t, y, args: t >= 2.5, "early": lambda t, y, args: t - 1.3}
    sol = _solve(sk.SaveAt(t1=True), event=sk.Event(conds), dt0=0.25)
    assert bool(sol.event_mask["early"]) and not bool(sol.event_mask["late"])
    np.testing.assert_allclose(float(sol.t1), 1.3, rtol=1e-10)
    np.testing.assert_allclose(sol.ys[0], _exact(1.3), atol=1e-8)


def test_event_that_never_fires():
    t1, y1, result = _event_t1_and_y(jnp.asarray(0.2), jnp.asarray(2.0))
    assert int(result) == int(sk.RESULTS.successful.code)
    assert float(t1) == 10.0
    np.testing.assert_allclose(float(y1), 0.2 * np.exp(-20.0), atol=1e-7)


def test_event_under_vmap():
    y0 = jnp.array([1.0, 2.0, 0.2])
    theta = jnp.array([2.0, 0.5, 1.0])
    t1, _, result = jax.vmap(_event_t1_and_y)(y0, theta)
    expected = [_t_star(1.0, 2.0), _t_star(2.0, 0.5), 10.0]
    np.testing.assert_allclose(t1, expected, rtol=1e-7)
    event, ok = sk.RESULTS.event_occurred.code, sk.RESULTS.successful.code
    np.testing.assert_array_equal(np.asarray(result), [event, event, ok])


def test_event_time_gradient():
    # t* = log(y0 / 0.3) / theta: dt*/dy0 = 1 / (theta y0), dt*/dtheta = -t* / theta.
    # y(t*) = 0.3 whatever y0 and theta, so adding it must not change the gradient.
    def loss(y0, theta):
        t1, y1, _ = _event_t1_and_y(y0, theta)
        return t1 + 10 * y1

    y0, theta = 1.5, 0.8
    g_y0, g_theta = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jnp.asarray(y0), jnp.asarray(theta)
    )
    t_star = _t_star(y0, theta)
    np.testing.assert_allclose(g_y0, 1 / (theta * y0), rtol=1e-5)
    np.testing.assert_allclose(g_theta, -t_star / theta, rtol=1e-5)
    # And against central finite differences of the (located) event time.
    eps = 1e-5
    plus = loss(jnp.asarray(y0), jnp.asarray(theta + eps))
    minus = loss(jnp.asarray(y0), jnp.asarray(theta - eps))
    np.testing.assert_allclose(g_theta, (plus - minus) / (2 * eps), rtol=1e-4)


# --- Progress meters ----------------------------------------------------------------


_PERCENT = re.compile(r"^(\d+\.\d\d)%$")


def _percentages(text):
    values = []
    for line in text.splitlines():
        match = _PERCENT.match(line.strip())
        if match:
            values.append(float(match.group(1)))
    return values


def _meter_solve(y0, meter):
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y),
        sk.Euler(),
        0.0,
        1.0,
        0.01,
        y0,
        progress_meter=meter,
        max_steps=128,
    ).ys


def test_text_progress_meter(capsys):
    _meter_solve(jnp.array([1.0]), sk.TextProgressMeter()).block_until_ready()
    jax.effects_barrier()
    values = _percentages(capsys.readouterr().out)
    assert len(values) >= 3, values
    assert values == sorted(values)
    assert values[-1] == 100.0


def test_text_progress_meter_under_vmap_shows_one_bar(capsys):
    jax.jit(jax.vmap(lambda y: _meter_solve(y, sk.TextProgressMeter())))(
        jnp.ones((4, 1))
    ).block_until_ready()
    jax.effects_barrier()
    values = _percentages(capsys.readouterr().out)
    assert values.count(100.0) == 1, values
    assert values == sorted(values)


def test_text_progress_meter_under_jit_and_grad(capsys):
    grad = jax.jit(jax.grad(lambda y: _meter_solve(y, sk.TextProgressMeter()).sum()))(
        jnp.array([1.0])
    )
    jax.effects_barrier()
    np.testing.assert_allclose(grad, [0.99**100], rtol=1e-10)
    values = _percentages(capsys.readouterr().out)
    assert values and values[-1] == 100.0


def test_tqdm_progress_meter(capsys):
    pytest.importorskip("tqdm")
    out = _meter_solve(jnp.array([1.0]), sk.TqdmProgressMeter())
    jax.effects_barrier()
    np.testing.assert_allclose(out[-1], [0.99**100], rtol=1e-10)
    err = capsys.readouterr().err
    assert "100" in err


def test_boolean_event_true_at_t0_ends_before_any_step():
    # As in diffrax: a boolean condition that holds at t0 ends the solve there, with
    # no step, and a real-valued condition beside it does not move the end point.
    import diffrax

    def solve(lib, c):
        event = lib.Event(
            {
                "bool": lambda t, y, args, **kw: y[1] < c,
                "real": lambda t, y, args, **kw: y[0] - 3.0,
            }
        )
        sol = lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: jnp.ones(2)),
            lib.Tsit5(),
            0.0,
            10.0,
            1.0,
            jnp.array([1.0, -0.1]),
            event=event,
            saveat=lib.SaveAt(t0=True, t1=True, ts=jnp.array([0.5, 2.0])),
        )
        return sol.ts, sol.ys, sol.event_mask, sol.stats["num_steps"]

    with float64():
        ours = jax.jit(lambda c: solve(sk, c))(0.0)
        assert_tree_allclose(ours, solve(diffrax, 0.0), rtol=1e-12)
        # With c = -1 the boolean never holds and the real event ends the solve at
        # t = 2 (diffrax, without a root finder, would stop at the step's end).
        ts, ys, mask, steps = jax.vmap(lambda c: solve(sk, c))(jnp.array([0.0, -1.0]))
        assert steps.tolist()[0] == 0 and steps.tolist()[1] > 0
        last = [int(np.max(np.nonzero(np.isfinite(t))[0])) for t in ts]  # final point
        assert ts[0, last[0]] == 0.0
        np.testing.assert_allclose(ys[0, last[0]], [1.0, -0.1])
        np.testing.assert_allclose(ts[1, last[1]], 2.0, rtol=1e-12)
        np.testing.assert_allclose(ys[1, last[1]], [3.0, 1.9], rtol=1e-10)
        assert mask["bool"].tolist() == [True, False]


def test_deprecated_discrete_terminating_events_as_diffrax():
    # diffrax's older `discrete_terminating_event=`: a DiscreteTerminatingEvent on
    # the state after each step, or a SteadyStateEvent; warned, and equal to diffrax.
    import diffrax

    def solve(lib, event):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -(y - 2.0)),
            lib.Tsit5(),
            0.0,
            jnp.inf,
            0.1,
            jnp.array([1.0, 3.0]),
            stepsize_controller=lib.PIDController(rtol=1e-6, atol=1e-6),
            discrete_terminating_event=event,
        )

    with float64():
        for make in (
            lambda lib: lib.DiscreteTerminatingEvent(
                lambda state, **kw: state.tprev > 3
            ),
            lambda lib: lib.SteadyStateEvent(rtol=1e-4, atol=1e-4),
        ):
            with pytest.warns(Warning, match="discrete_terminating_event"):
                ours = solve(sk, make(sk))
            with pytest.warns(Warning, match="discrete_terminating_event"):
                theirs = solve(diffrax, make(diffrax))
            assert_tree_allclose(
                (ours.ts, ours.ys, ours.stats["num_steps"]),
                (theirs.ts, theirs.ys, theirs.stats["num_steps"]),
                rtol=1e-12,
            )
    with pytest.warns(Warning, match="deprecated"):
        with pytest.raises(ValueError, match="not both"):
            sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -y),
                sk.Tsit5(),
                0.0,
                1.0,
                0.1,
                1.0,
                event=sk.Event(lambda t, y, args, **kw: y < 0.5),
                discrete_terminating_event=sk.SteadyStateEvent(),
            )
