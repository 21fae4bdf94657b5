"""Events that continue (`Event(terminal=False)`, `terminal=k`, `effect=...`)
against SciPy's `solve_ivp` on the same problems: the recorded event times
(`sol.events.ts[:num]` against `t_events`), directions, SciPy's integer `terminal`
count, and a bouncing ball with air drag (no closed form) whose impacts SciPy finds
by the usual restart loop (terminal event, apply the effect, solve on). Both sides
at tight tolerances, float64."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64, full_matrix_only
from scipy.integrate import solve_ivp

import solverkit as sk


RTOL = ATOL = 1e-12
# Event times of the two libraries agree to this (each at RTOL).
AGREE = 1e-8


def _scipy_event(f, direction=0, terminal=False):
    """`f(t, y)` with SciPy's event attributes."""

    def event(t, y):
        return f(t, y)

    event.direction = direction
    event.terminal = terminal
    return event


def _solve(vf, y0, t1, event, saveat=None):
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.stack(vf(t, y))),
        sk.Dopri8(),
        0.0,
        t1,
        0.01,
        jnp.asarray(y0),
        event=event,
        stepsize_controller=sk.PIDController(rtol=RTOL, atol=ATOL),
        saveat=saveat or sk.SaveAt(t1=True),
        max_steps=100_000,
        throw=False,
    )


def _scipy(vf, y0, t1, events):
    sol = solve_ivp(
        lambda t, y: np.stack(vf(t, y)),
        (0.0, t1),
        np.asarray(y0),
        method="DOP853",
        rtol=RTOL,
        atol=ATOL,
        events=events,
    )
    assert sol.success, sol.message
    return sol


def _recorded(sol) -> np.ndarray:
    n = int(sol.events.num)
    ts = np.asarray(sol.events.ts)
    assert np.all(np.isinf(ts[n:]))  # the padding
    return ts[:n]


# A forced, damped oscillator (Duffing): no closed form, crossings in both directions
# at uneven intervals.
def _duffing(t, y):
    x, v = y[0], y[1]
    return v, -0.2 * v - x - 0.5 * x**3 + 0.8 * np.cos(1.3 * t)


DUFFING_Y0 = (1.0, 0.0)
DUFFING_T1 = 20.0


def _duffing_jnp(t, y):
    x, v = y[0], y[1]
    return v, -0.2 * v - x - 0.5 * x**3 + 0.8 * jnp.cos(1.3 * t)


@pytest.mark.parametrize(
    "direction, scipy_direction",
    [
        (None, 0),
        # With `SOLVERKIT_FULL_MATRIX=1` only: one direction against SciPy's is
        # [down]'s, an upcrossing's
        # test_backward_in_time_directions_match_scipy[True-1].
        pytest.param(
            True,
            1,
            marks=full_matrix_only(
                "[down] and test_backward_in_time_directions_match_scipy[True-1]"
            ),
        ),
        (False, -1),
    ],
    ids=["any", "up", "down"],
)
# Quick loop: test_harmonic_oscillator_zero_crossings.
@pytest.mark.slow
def test_non_terminal_crossings_match_scipy(direction, scipy_direction):
    """`Event(cond, direction=..., terminal=False)` records every crossing, as
    SciPy's non-terminal event with `direction = 0, +1, -1` does; the solve runs
    on to t1."""
    with float64():
        event = sk.Event(lambda t, y, args: y[0], direction=direction, terminal=False)
        sol = _solve(_duffing_jnp, DUFFING_Y0, DUFFING_T1, event)
        ref = _scipy(
            _duffing,
            DUFFING_Y0,
            DUFFING_T1,
            _scipy_event(lambda t, y: y[0], scipy_direction),
        )
        got, want = _recorded(sol), ref.t_events[0]
        assert len(want) >= 4  # (several crossings of each direction)
        assert len(got) == len(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=AGREE)
        assert sol.result == sk.RESULTS.successful
        np.testing.assert_allclose(sol.ts[-1], DUFFING_T1)
        np.testing.assert_allclose(sol.ys[-1], ref.y[:, -1], rtol=0, atol=1e-8)
        # The recorded states are those at the crossings (no effect: unchanged).
        n = len(got)
        np.testing.assert_allclose(sol.events.ys[:n, 0], 0.0, atol=1e-9)
        np.testing.assert_allclose(
            sol.events.ys[:n], np.stack(ref.y_events[0]), rtol=0, atol=1e-8
        )


@pytest.mark.parametrize(
    "direction, scipy_direction",
    [
        (True, 1),
        # With `SOLVERKIT_FULL_MATRIX=1` only: the direction's sign in the order of
        # integration is [True-1]'s, a downcrossing test_non_terminal_crossings_
        # match_scipy[down]'s.
        pytest.param(False, -1, marks=full_matrix_only("[True-1] and [down]")),
    ],
)
# Quick loop: test_harmonic_oscillator_zero_crossings.
@pytest.mark.slow
def test_backward_in_time_directions_match_scipy(direction, scipy_direction):
    """Solving from 0 back to -10: a direction is that of the change of sign in the
    order of integration, as in SciPy."""
    with float64():
        event = sk.Event(lambda t, y, args: y[0], direction=direction, terminal=False)
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: jnp.stack(_duffing_jnp(t, y))),
            sk.Dopri8(),
            0.0,
            -10.0,
            -0.01,
            jnp.asarray(DUFFING_Y0),
            event=event,
            stepsize_controller=sk.PIDController(rtol=RTOL, atol=ATOL),
            max_steps=100_000,
        )
        ref = solve_ivp(
            lambda t, y: np.stack(_duffing(t, y)),
            (0.0, -10.0),
            np.asarray(DUFFING_Y0),
            method="DOP853",
            rtol=RTOL,
            atol=ATOL,
            events=_scipy_event(lambda t, y: y[0], scipy_direction),
        )
        want = ref.t_events[0]
        assert len(want) >= 2
        np.testing.assert_allclose(_recorded(sol), want, rtol=0, atol=AGREE)


def test_harmonic_oscillator_zero_crossings():
    """x'' = -x from (1, 0): crossings of x at pi/2 + k pi, in both libraries."""
    with float64():
        vf = lambda t, y: (y[1], -y[0])
        event = sk.Event(lambda t, y, args: y[0], terminal=False)
        sol = _solve(vf, (1.0, 0.0), 10.0, event)
        ref = _scipy(vf, (1.0, 0.0), 10.0, _scipy_event(lambda t, y: y[0]))
        exact = np.pi / 2 + np.pi * np.arange(3)
        np.testing.assert_allclose(ref.t_events[0], exact, atol=1e-9)
        np.testing.assert_allclose(_recorded(sol), exact, atol=1e-9)


# Quick loop: test_harmonic_oscillator_zero_crossings.
@pytest.mark.slow
def test_two_conditions_record_the_union_in_time_order():
    """A pytree of conditions: `sol.events` holds the occurrences of all of them
    in time order, SciPy's `t_events` one list per condition."""
    with float64():
        event = sk.Event(
            (lambda t, y, args: y[0], lambda t, y, args: y[1] - 0.3),
            direction=(True, False),
            terminal=False,
        )
        sol = _solve(_duffing_jnp, DUFFING_Y0, DUFFING_T1, event)
        ref = _scipy(
            _duffing,
            DUFFING_Y0,
            DUFFING_T1,
            [
                _scipy_event(lambda t, y: y[0], 1),
                _scipy_event(lambda t, y: y[1] - 0.3, -1),
            ],
        )
        want = np.sort(np.concatenate(ref.t_events))
        got = _recorded(sol)
        assert len(got) == len(want) and len(want) >= 8
        np.testing.assert_allclose(got, want, rtol=0, atol=AGREE)


@pytest.mark.parametrize(
    "k",
    [
        # With `SOLVERKIT_FULL_MATRIX=1` only: a terminal count against SciPy's is
        # [4]'s (one occurrence: every terminal event's default).
        pytest.param(1, marks=full_matrix_only("[4] (the same count)")),
        4,
    ],
)
# Quick loop: test_continuing_events.py::
# test_terminal_count_stops_at_that_occurrence_before_its_effect.
@pytest.mark.slow
def test_terminal_count_matches_scipy(k):
    """`terminal=k` stops at the k-th occurrence, as SciPy's `event.terminal = k`
    (an int count, SciPy >= 1.12): same stop time, same state there."""
    with float64():
        event = sk.Event(lambda t, y, args: y[0], direction=False, terminal=k)
        sol = _solve(_duffing_jnp, DUFFING_Y0, DUFFING_T1, event)
        ref = _scipy(
            _duffing,
            DUFFING_Y0,
            DUFFING_T1,
            _scipy_event(lambda t, y: y[0], -1, terminal=k),
        )
        assert ref.status == 1  # SciPy: a terminal event occurred
        assert len(ref.t_events[0]) == k
        assert sol.result == sk.RESULTS.event_occurred
        got = _recorded(sol)
        assert len(got) == k
        np.testing.assert_allclose(got, ref.t_events[0], rtol=0, atol=AGREE)
        np.testing.assert_allclose(sol.ts[-1], ref.t[-1], rtol=0, atol=AGREE)
        np.testing.assert_allclose(sol.ys[-1], ref.y[:, -1], rtol=0, atol=1e-8)


# A ball dropped from 1 m, with quadratic air drag and restitution 0.8 at the floor.
G, DRAG, E = 9.81, 0.3, 0.8
BALL_T1 = 3.0


def _ball(t, y):
    v = y[1]
    return v, -G - DRAG * v * abs(v)


def _ball_jnp(t, y):
    v = y[1]
    return v, -G - DRAG * v * jnp.abs(v)


def _scipy_bounces(t1):
    """SciPy's restart loop: solve to the impact (a terminal event), reverse and
    damp the velocity, solve on from there."""
    hit = _scipy_event(lambda t, y: y[0], -1, terminal=True)
    t, y, impacts, states = 0.0, np.array([1.0, 0.0]), [], []
    while True:
        sol = solve_ivp(
            lambda t, y: np.stack(_ball(t, y)),
            (t, t1),
            y,
            method="DOP853",
            rtol=RTOL,
            atol=ATOL,
            events=hit,
        )
        assert sol.success, sol.message
        if sol.status != 1:
            return np.array(impacts), np.array(states), sol.y[:, -1]
        t, y = sol.t_events[0][0], sol.y_events[0][0]
        impacts.append(t)
        states.append(y)
        y = np.array([0.0, -E * y[1]])


# The full suite; the quick loop's bouncing ball:
# events/test_continuing_events.py::test_bouncing_ball_against_analytic.
@pytest.mark.slow
def test_bouncing_ball_with_drag_against_scipy_restart_loop():
    with float64():
        event = sk.Event(
            lambda t, y, args: y[0],
            direction=False,
            effect=lambda t, y, args: jnp.stack([0 * y[0], -E * y[1]]),
        )
        sol = _solve(_ball_jnp, (1.0, 0.0), BALL_T1, event)
        impacts, states, final = _scipy_bounces(BALL_T1)
        assert len(impacts) >= 6
        got = _recorded(sol)
        assert len(got) == len(impacts)
        np.testing.assert_allclose(got, impacts, rtol=0, atol=AGREE)
        # The states just before each impact, and at t1.
        n = len(got)
        np.testing.assert_allclose(sol.events.ys[:n], states, rtol=0, atol=1e-8)
        assert sol.result == sk.RESULTS.successful
        np.testing.assert_allclose(sol.ys[-1], final, rtol=0, atol=1e-8)


# Quick loop: test_continuing_events.py::
# test_terminal_count_stops_at_that_occurrence_before_its_effect.
@pytest.mark.slow
def test_bouncing_ball_terminal_count_stops_before_the_effect():
    """With an effect and `terminal=3`, the solve ends at the third impact, with the
    state just before it: SciPy's restart loop's third impact."""
    with float64():
        event = sk.Event(
            lambda t, y, args: y[0],
            direction=False,
            effect=lambda t, y, args: jnp.stack([0 * y[0], -E * y[1]]),
            terminal=3,
        )
        sol = _solve(_ball_jnp, (1.0, 0.0), BALL_T1, event)
        impacts, states, _ = _scipy_bounces(BALL_T1)
        assert sol.result == sk.RESULTS.event_occurred
        np.testing.assert_allclose(_recorded(sol), impacts[:3], rtol=0, atol=AGREE)
        np.testing.assert_allclose(sol.ts[-1], impacts[2], rtol=0, atol=AGREE)
        np.testing.assert_allclose(sol.ys[-1], states[2], rtol=0, atol=1e-8)
        assert float(sol.ys[-1, 1]) < 0  # falling: the effect not applied
