"""Events: boolean and real-valued conditions, root finding, directions, pytrees of
conditions, under jit / vmap / grad; `steady_state_event`; diffrax's deprecated
`discrete_terminating_event`. Checked against analytic event times and diffrax."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import (
    assert_tree_allclose,
    full_matrix_only,
    rotation_exact,
    skip_unless_full_matrix,
    solve_rotation,
)

import solverkit as sk


_NEG = sk.ODETerm(lambda t, y, args: -y)


# --- Against analytic event times (float64) -----------------------------------------

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


@pytest.mark.usefixtures("x64")
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


@pytest.mark.usefixtures("x64")
def test_real_event_located_exactly():
    t1, y1, result = _event_t1_and_y(jnp.asarray(1.0), jnp.asarray(2.0))
    assert int(result) == int(sk.RESULTS.event_occurred.code)
    np.testing.assert_allclose(float(t1), _t_star(1.0, 2.0), rtol=1e-7)
    np.testing.assert_allclose(float(y1), 0.3, rtol=1e-7)


@pytest.mark.usefixtures("x64")
# Quick loop: test_optimistix_root_after_an_occurrence_is_not_the_previous_one.
@pytest.mark.slow
def test_real_event_with_optimistix_root_finder():
    sol = _event_solve(
        jnp.asarray(1.0),
        jnp.asarray(2.0),
        _real_cond,
        root_finder=optx.Newton(rtol=1e-10, atol=1e-10),
    )
    np.testing.assert_allclose(float(sol.t1), _t_star(1.0, 2.0), rtol=1e-7)


@pytest.mark.usefixtures("x64")
def test_event_direction():
    # y[0] = cos t crosses zero downwards at pi/2 and upwards at 3 pi/2. (Either
    # direction, the default, is tested with the other events.)
    def cond(t, y, args):
        return y[0]

    kw = dict(t1=6.0, saveat=sk.SaveAt(t1=True))
    down = solve_rotation(event=sk.Event(cond, direction=False), **kw)
    up = solve_rotation(event=sk.Event(cond, direction=True), **kw)
    np.testing.assert_allclose(float(down.t1), np.pi / 2, rtol=1e-8)
    np.testing.assert_allclose(float(up.t1), 3 * np.pi / 2, rtol=1e-8)
    np.testing.assert_allclose(up.ys[0], rotation_exact(3 * np.pi / 2), atol=1e-8)


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_event_pytree_of_conditions():
    # "late" (real) fires at t = 2.0, "early" (bool) once t >= 1.0 after a step.
    conds = {
        "late": lambda t, y, args: t - 2.0,
        "early": (lambda t, y, args: t >= 1.0,),
    }
    sol = solve_rotation(sk.SaveAt(t1=True), event=sk.Event(conds), dt0=0.25)
    assert sol.result == sk.RESULTS.event_occurred
    assert jax.tree_util.tree_structure(sol.event_mask) == (
        jax.tree_util.tree_structure(conds)
    )
    assert not bool(sol.event_mask["late"]) and bool(sol.event_mask["early"][0])
    t1 = float(sol.t1)
    assert 1.0 <= t1 < 2.0
    # Only the real-valued condition fires first when the boolean one is later.
    conds = {"late": lambda t, y, args: t >= 2.5, "early": lambda t, y, args: t - 1.3}
    sol = solve_rotation(sk.SaveAt(t1=True), event=sk.Event(conds), dt0=0.25)
    assert bool(sol.event_mask["early"]) and not bool(sol.event_mask["late"])
    np.testing.assert_allclose(float(sol.t1), 1.3, rtol=1e-10)
    np.testing.assert_allclose(sol.ys[0], rotation_exact(1.3), atol=1e-8)


@pytest.mark.usefixtures("x64")
def test_event_that_never_fires():
    t1, y1, result = _event_t1_and_y(jnp.asarray(0.2), jnp.asarray(2.0))
    assert int(result) == int(sk.RESULTS.successful.code)
    assert float(t1) == 10.0
    np.testing.assert_allclose(float(y1), 0.2 * np.exp(-20.0), atol=1e-7)


@pytest.mark.usefixtures("x64")
def test_event_under_vmap():
    y0 = jnp.array([1.0, 2.0, 0.2])
    theta = jnp.array([2.0, 0.5, 1.0])
    t1, _, result = jax.vmap(_event_t1_and_y)(y0, theta)
    expected = [_t_star(1.0, 2.0), _t_star(2.0, 0.5), 10.0]
    np.testing.assert_allclose(t1, expected, rtol=1e-7)
    event, ok = sk.RESULTS.event_occurred.code, sk.RESULTS.successful.code
    np.testing.assert_array_equal(np.asarray(result), [event, event, ok])


# The quick loop's `Event` under `grad` (through impact times and effects:
# test_continuing_events.py::test_gradient_through_impact_times_and_effects, the full
# suite).
@pytest.mark.usefixtures("x64")
def test_event_time_gradient():
    # t* = log(y0 / 0.3) / theta: dt*/dy0 = 1 / (theta y0), dt*/dtheta = -t* / theta.
    # y(t*) = 0.3 whatever y0 and theta, so adding it must not change the gradient.
    def loss(y0, theta):
        t1, y1, _ = _event_t1_and_y(y0, theta)
        return t1 + 10 * y1

    y0, theta = 1.5, 0.8
    # The gradient and the differences' values from one program.
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    g_y0, g_theta = both(jnp.asarray(y0), jnp.asarray(theta))[1]
    t_star = _t_star(y0, theta)
    np.testing.assert_allclose(g_y0, 1 / (theta * y0), rtol=1e-5)
    np.testing.assert_allclose(g_theta, -t_star / theta, rtol=1e-5)
    # And against central finite differences of the (located) event time.
    eps = 1e-5
    plus = both(jnp.asarray(y0), jnp.asarray(theta + eps))[0]
    minus = both(jnp.asarray(y0), jnp.asarray(theta - eps))[0]
    np.testing.assert_allclose(g_theta, (plus - minus) / (2 * eps), rtol=1e-4)


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_boolean_event_true_at_t0_ends_before_any_step():
    # As in diffrax: a boolean condition that holds at t0 ends the solve there, with
    # no step, and a real-valued condition beside it does not move the end point.
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

    # Both cases from one program (vmapped and jitted; eagerly, 12 compiles).
    both = jax.jit(jax.vmap(lambda c: solve(sk, c)))(jnp.array([0.0, -1.0]))
    ours = jax.tree.map(lambda x: x[0], both)
    assert_tree_allclose(ours, solve(diffrax, 0.0), rtol=1e-12)
    # With c = -1 the boolean never holds and the real event ends the solve at
    # t = 2 (diffrax, without a root finder, would stop at the step's end).
    ts, ys, mask, steps = both
    assert steps.tolist()[0] == 0 and steps.tolist()[1] > 0
    last = [int(np.max(np.nonzero(np.isfinite(t))[0])) for t in ts]  # final point
    assert ts[0, last[0]] == 0.0
    np.testing.assert_allclose(ys[0, last[0]], [1.0, -0.1])
    np.testing.assert_allclose(ts[1, last[1]], 2.0, rtol=1e-12)
    np.testing.assert_allclose(ys[1, last[1]], [3.0, 1.9], rtol=1e-10)
    assert mask["bool"].tolist() == [True, False]


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_deprecated_discrete_terminating_events_as_diffrax():
    # diffrax's older `discrete_terminating_event=`: a DiscreteTerminatingEvent on
    # the state after each step, or a SteadyStateEvent; warned, and equal to diffrax.
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

    for make in (
        lambda lib: lib.DiscreteTerminatingEvent(lambda state, **kw: state.tprev > 3),
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


# --- Per-condition directions, kinds of condition, steady state (float32) ----------


def _two_crossings(lib, direction):
    """`up` crosses upwards at t = 5, `down` downwards at t = 4."""
    up = lambda t, y, args, **kw: y[0] - 5.0
    down = lambda t, y, args, **kw: -(y[1] - 5.0)
    sol = lib.diffeqsolve(
        lib.ODETerm(lambda t, y, args: jnp.array([1.0, 1.0])),
        lib.Tsit5(),
        0.0,
        10.0,
        1.0,
        jnp.array([0.0, 1.0]),
        event=lib.Event((up, down), optx.Newton(1e-8, 1e-8), direction),
    )
    return float(sol.ts[0]), [bool(m) for m in sol.event_mask]


# Direction -> (the end time, the mask): `up` fires at 5 where its direction is None
# or True (an upcrossing), `down` at 4 where its is None or False; the earlier one
# ends the solve, at t1 = 10 if neither fires.
_DIRECTIONS = {
    None: (4.0, [False, True]),
    True: (5.0, [True, False]),
    False: (4.0, [False, True]),
    (True, True): (5.0, [True, False]),
    (True, False): (4.0, [False, True]),
    (False, True): (10.0, [False, False]),
    (False, None): (4.0, [False, True]),
}


@pytest.mark.parametrize("direction", list(_DIRECTIONS), ids=str)
@pytest.mark.slow
def test_event_direction_per_condition(direction):
    """Against the exact crossings; against diffrax's solve for one direction and
    for one tuple (diffrax's was compiled for every case: half this test's time),
    which pins the convention the table above writes down."""
    if direction in (True, False):
        # `SOLVERKIT_FULL_MATRIX=1` only: one direction for every condition is
        # test_event_direction's (the quick loop) and [None]'s.
        skip_unless_full_matrix("test_event_direction and [None]")
    if direction in ((True, True), (False, True)):
        # `SOLVERKIT_FULL_MATRIX=1` only: a direction per condition is [(True, False)]'s
        # (against diffrax too) and [(False, None)]'s.
        skip_unless_full_matrix("[(True, False)] and [(False, None)]")
    t, mask = _two_crossings(sk, direction)
    want_t, want_mask = _DIRECTIONS[direction]
    if direction in (None, (True, False)):
        ref_t, ref_mask = _two_crossings(diffrax, direction)
        np.testing.assert_allclose(ref_t, want_t, atol=1e-6)
        assert ref_mask == want_mask
    # Newton on a linear condition, in float32 (times <= 10): 1e-6.
    np.testing.assert_allclose(t, want_t, atol=1e-6)
    assert mask == want_mask


def test_event_direction_structure_checked():
    f = lambda t, y, args: y
    with pytest.raises(ValueError, match="structure of `cond_fn`"):
        sk.Event([f, f, [f, f, f]], None, [True, None, [False, True]])
    sk.Event([f, [f, f]], None, [True, [None, False]])


@pytest.mark.slow
def test_event_condition_module_with_float_fields():
    class Threshold(eqx.Module):
        level: float

        def __call__(self, t, y, args, **kwargs):
            return y - self.level

    def run(lib):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: 1.0),
            lib.Tsit5(),
            0.0,
            10.0,
            1.0,
            0.0,
            event=lib.Event({"a": Threshold(4.0)}, optx.Newton(1e-8, 1e-8)),
        ).ts

    np.testing.assert_allclose(run(sk), run(diffrax), atol=1e-6)


def test_event_condition_must_be_bool_or_float():
    with pytest.raises(ValueError, match="boolean or a float"):
        sk.diffeqsolve(
            _NEG,
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            1.0,
            event=sk.Event(lambda t, y, args, **kw: jnp.array(1, jnp.int32)),
        )


# Quick loop: test_real_event_located_exactly.
@pytest.mark.slow
def test_constant_vector_field_with_event():
    """A vector field returning a Python float, with a real-valued event."""
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: 1.0),
        sk.Tsit5(),
        0.0,
        jnp.inf,
        1.0,
        -10.0,
        event=sk.Event(lambda t, y, args, **kw: y, optx.Newton(1e-8, 1e-8)),
    )
    # y = t - 10 crosses 0 at t = 10: in the solve's precision (float32 here) t and y
    # are resolved to about ulp(10) = 8 eps; rounding in the interpolant and the root
    # finder's last step leave a few of those (1.07e-6 = 1.1 ulp seen on JAX 0.12):
    # four ulps.
    tol = 4 * 8 * np.finfo(sol.ts.dtype).eps
    np.testing.assert_allclose(sol.ys, [0.0], atol=tol)
    np.testing.assert_allclose(sol.ts, [10.0], atol=tol)


# Quick loop: adjoint/test_adjoint.py::test_implicit_adjoint_steady_state_gradient.
@pytest.mark.slow
def test_steady_state_event_and_context_keywords():
    seen = {}

    def cond(t, y, args, *, stepsize_controller, max_steps):
        seen["controller"], seen["max_steps"] = stepsize_controller, max_steps
        return y < 0.5

    kw = dict(stepsize_controller=sk.PIDController(rtol=1e-3, atol=1e-6), max_steps=64)
    sk.diffeqsolve(_NEG, sk.Tsit5(), 0.0, 5.0, 0.1, 1.0, event=sk.Event(cond), **kw)
    assert seen == {"controller": kw["stepsize_controller"], "max_steps": 64}

    def run(lib, event):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -1.0 * y),
            lib.Tsit5(),
            0.0,
            jnp.inf,
            1.0,
            1.0,
            stepsize_controller=lib.PIDController(rtol=1e-3, atol=1e-6),
            event=lib.Event(event),
        )

    sol = run(sk, sk.steady_state_event())
    assert sol.event_mask and abs(float(sol.ys[0])) < 1e-5
    ref = run(diffrax, diffrax.steady_state_event())
    np.testing.assert_allclose(sol.ts, ref.ts, rtol=1e-4)  # float32
    sol = run(sk, sk.steady_state_event(rtol=0.0, atol=1e-2, norm=jnp.abs))
    assert 1e-3 < abs(float(sol.ys[0])) < 1e-2
    with pytest.raises(ValueError, match="steady_state_event"):
        sk.diffeqsolve(
            _NEG,
            sk.Euler(),
            0.0,
            1.0,
            0.1,
            1.0,
            event=sk.Event(sk.steady_state_event()),
        )


# --- Events that continue: a bouncing ball past its accumulation point ----------------

_G = 9.81


def _ball_to(e, h0, t1, tol, dtype=jnp.float64, max_events=1000):
    """A ball dropped from `h0`, restitution `e` (closed over by the effect), solved to
    `t1`; the last saved state."""
    event = sk.Event(
        lambda t, y, args: y[0],
        direction=False,
        effect=lambda t, y, args: jnp.stack([y[0], -e * y[1]]),
        max_events=max_events,
    )
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.stack([y[1], -_G + 0 * y[0]])),
        sk.Tsit5(),
        0.0,
        t1,
        0.01,
        jnp.stack([h0, jnp.zeros_like(h0)]).astype(dtype),
        event=event,
        stepsize_controller=sk.PIDController(rtol=tol, atol=tol),
        saveat=sk.SaveAt(t1=True),
        max_steps=4096,
        throw=False,
    )


@pytest.mark.parametrize(
    "tol",
    [
        # With `SOLVERKIT_FULL_MATRIX=1` only: the same bounces, located to another
        # tolerance, are [1e-10]'s (the tolerance that fell through the floor).
        pytest.param(1e-8, marks=full_matrix_only("[1e-10] (the same bounces)")),
        1e-10,
    ],
)
@pytest.mark.usefixtures("x64")
# Quick loop: events/test_continuing_events.py::test_bouncing_ball_against_analytic.
@pytest.mark.slow
def test_bounces_accumulate_never_fall_through_the_floor(tol):
    """After any occurrence the state never crosses the condition unseen: however
    far past the accumulation point `t1` lies, the solve stops there with
    `events_accumulated`, on the floor (it used to fall through for e = 0.5,
    h0 = 1.5, tol 1e-10: a crossing located in the rounding of a vanishing bounce,
    where the ball moved up, turned down by the effect). Under jit and vmap over the
    restitution, the drop height and the horizon."""
    es = jnp.array([0.3, 0.5, 0.5, 0.7, 0.8])
    h0s = jnp.array([1.0, 1.5, 1.0, 1.5, 1.0])
    grid = [(e, h, t1) for e, h in zip(es, h0s) for t1 in (10.0, 50.0)]
    e, h0, t1 = (jnp.array(v) for v in zip(*grid))

    @jax.jit
    @jax.vmap
    def solve(e, h0, t1):
        sol = _ball_to(e, h0, t1, tol)
        return sol.result.code, sol.ts[-1], sol.ys[-1]

    code, t_end, y_end = solve(e, h0, t1)
    t_zeno = np.sqrt(2 * h0 / _G) * (1 + e) / (1 - e)
    np.testing.assert_array_equal(code, sk.RESULTS.events_accumulated.code)
    # Bounce times are exact to rounding (Tsit5 integrates a parabola exactly), so
    # the accumulation point to the rounding of ~50 impact times, far within 1e-9.
    np.testing.assert_allclose(t_end, t_zeno, rtol=1e-9)
    # On the floor: the height to rounding of h0 ** 2 (its size squared, as a
    # parabola's value near its root), not below it.
    assert np.all(np.asarray(y_end[:, 0]) > -1e-12)
    assert np.all(np.abs(np.asarray(y_end[:, 1])) < 1e-6)


# `SOLVERKIT_FULL_MATRIX=1` only (1.6 CPU s): the gradient through impact times and
# effects is events/test_continuing_events.py::
# test_gradient_through_impact_times_and_effects (the full suite), through many
# occurrences test_gradient_of_later_spike_times_under_an_adaptive_controller there.
@pytest.mark.slow
@full_matrix_only(
    "test_continuing_events.py::test_gradient_through_impact_times_and_effects"
)
@pytest.mark.usefixtures("x64")
def test_accumulation_time_gradient():
    """The time where the bounces accumulate, differentiated with respect to the
    restitution through every impact (its effect) and location: the closed form
    `sqrt(2 h0 / g) 2 / (1 - e) ** 2`."""

    def t_end(e):
        return _ball_to(e, jnp.asarray(1.5), 10.0, 1e-10).ts[-1]

    e = 0.5
    got = jax.jit(jax.grad(t_end))(jnp.asarray(e))  # (eagerly: 8 compiles)
    # ~50 impacts' rounding in a sum whose terms shrink geometrically: 1e-7 is ample.
    np.testing.assert_allclose(got, np.sqrt(2 * 1.5 / _G) * 2 / (1 - e) ** 2, rtol=1e-7)


def test_occurrence_masks_are_boolean():
    """Without a stopping occurrence (`terminal=False`), whether an occurrence is
    applied is a boolean mask (it was `~False == -1`, an int32 mask, right only by
    the bits of -1 and sending `where` down its slow path)."""
    from types import SimpleNamespace

    from solverkit._event import _continuing

    problem = SimpleNamespace(event=SimpleNamespace(stop_at=None, max_events=4))
    continuing = SimpleNamespace(count=jnp.asarray(1, jnp.int32), last=jnp.asarray(0.0))
    out = SimpleNamespace(t0=jnp.asarray(0.0), t1=jnp.asarray(1.0))
    landed = jnp.asarray(True)
    apply, result = _continuing._occurrence_ends(
        problem,
        continuing,
        landed,
        jnp.asarray(2, jnp.int32),
        out,
        jnp.asarray(0, jnp.int32),
    )
    assert apply.dtype == jnp.bool_ and bool(apply)
    assert result.dtype == jnp.int32 and int(result) == sk.RESULTS.successful.code


def _arctan_event(k, y0, root_finder):
    """y' = -2 y, a condition arctan(k (y - 0.3)) (Newton from the middle of a long
    step overshoots for large k), constant steps of 0.5."""
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -2 * y),
        sk.Tsit5(),
        0.0,
        10.0,
        0.5,
        y0,
        event=sk.Event(
            lambda t, y, args: jnp.arctan(k * (y - 0.3)), root_finder=root_finder
        ),
        stepsize_controller=sk.ConstantStepSize(),
        throw=False,
    )


# `SOLVERKIT_FULL_MATRIX=1` only (a regression check of one past failure, 2.2 CPU s):
# an event's optimistix root finder is test_real_event_with_optimistix_root_finder
# and test_optimistix_root_after_an_occurrence_is_not_the_previous_one (the quick
# loop), the bracketed search every other event test's.
@pytest.mark.slow
@full_matrix_only(
    "test_real_event_with_optimistix_root_finder and "
    "test_optimistix_root_after_an_occurrence_is_not_the_previous_one"
)
@pytest.mark.usefixtures("x64")
def test_optimistix_root_finder_that_diverges_falls_back_to_the_bracket():
    """A user's Newton that diverges (its result a failure) used to give the clipped
    or NaN time of its last iterate while the solve said `event_occurred`; now the
    built-in bracketed search finds the crossing: the same time as with no root
    finder (the same dense output), under jit, vmap and grad."""
    newton = optx.Newton(rtol=1e-12, atol=1e-12)

    # Times and their gradients from one program per root finder (the gradient's
    # forward pass; eagerly, each `grad` of a jitted solve compiled two more).
    def times(finder):
        t = lambda y0: _arctan_event(100.0, y0, finder).ts[-1]  # noqa: E731
        return jax.jit(jax.vmap(jax.value_and_grad(t)))(jnp.array([1.0, 1.2]))

    (got, g_user), (want, g_own) = times(newton), times(None)
    # Both locate the root of one interpolant to the root finders' tolerances.
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert np.all(got > 0.5)  # not the clipped start of the step
    # The crossing's time moves with y0 as the dense output's root does.
    np.testing.assert_allclose(g_user[0], g_own[0], rtol=1e-8)


@pytest.mark.usefixtures("x64")
def test_optimistix_root_after_an_occurrence_is_not_the_previous_one():
    """After an occurrence the condition is at zero at the step's start, `a`; a
    user's root finder that converges there (from the middle of the step, on the
    wrong side of the condition's turning point) found the previous occurrence
    again. The bracketed search takes over: the next root. g = -(t-1)(t-3)(t+10)
    on [1, 3.05] (its maximum at 2.04, right of the middle)."""
    from solverkit._event import _detect

    g = lambda t: -(t - 1.0) * (t - 3.0) * (t + 10.0)  # noqa: E731
    a, b = jnp.asarray(1.0), jnp.asarray(3.05)
    newton = optx.Newton(rtol=1e-12, atol=1e-12)
    root = _detect._optx_root(
        g, newton, a, b, jnp.asarray(1e-8), jnp.asarray(False), jnp.asarray(1e-8)
    )
    np.testing.assert_allclose(root, 3.0, rtol=1e-10)


def _ball_singular_effect(e):
    """The ball of `_ball_to` (from 1.5, tol 1e-10), its effect written to be NaN
    away from its events: the ratio (v - |v|) / (v - |v|) is 1 while falling (at an
    impact) and 0 / 0 while rising. The 3rd impact time."""
    ratio = lambda v: (v - jnp.abs(v)) / (v - jnp.abs(v))  # noqa: E731
    event = sk.Event(
        lambda t, y, args: y[0],
        direction=False,
        effect=lambda t, y, args: jnp.stack([y[0], -e * y[1] * ratio(y[1])]),
        terminal=3,
        max_events=3,
    )
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.stack([y[1], -_G + 0 * y[0]])),
        sk.Tsit5(),
        0.0,
        10.0,
        0.01,
        jnp.array([1.5, 0.0]),
        event=event,
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        throw=False,
    )
    return sol.events.ts[2]


# `SOLVERKIT_FULL_MATRIX=1` only (4.8 CPU s in a profile): an effect under `vmap` and
# `grad` is events/test_continuing_events.py::
# test_gradient_through_impact_times_and_effects and
# test_integrate_and_fire_closures_vmap_grad, a timed event's
# test_timed_events.py::test_effect_closes_over_anything_under_vmap_and_grad (the
# quick loop); the quick loop differentiates events in test_event_time_gradient.
@pytest.mark.slow
@full_matrix_only(
    "test_continuing_events.py::test_gradient_through_impact_times_and_effects, "
    "test_integrate_and_fire_closures_vmap_grad"
)
@pytest.mark.usefixtures("x64")
def test_effect_singular_away_from_events_gives_finite_gradients():
    """An effect is evaluated only where an occurrence applies it (and, under vmap,
    differentiated only there): one that is NaN away from its events leaves the
    gradient finite and exact. The 3rd impact is at t_1 (1 + 2 e + 2 e^2),
    t_1 = sqrt(2 h0 / g): its derivative in e, t_1 (2 + 4 e)."""
    t_1 = np.sqrt(2 * 1.5 / _G)
    es = jnp.array([0.5, 0.8])
    # Tsit5 integrates each parabola exactly: times and derivatives exact to
    # rounding (~1e-13); 1e-9 leaves room for the location's tolerance.
    # The values under vmap from the vmapped gradient's forward pass (one program).
    value, got = jax.jit(jax.vmap(jax.value_and_grad(_ball_singular_effect)))(es)
    np.testing.assert_allclose(value, t_1 * (1 + 2 * es + 2 * es**2), rtol=1e-9)
    np.testing.assert_allclose(got, t_1 * (2 + 4 * es), rtol=1e-9)
    got = jax.jit(jax.grad(_ball_singular_effect))(0.5)
    np.testing.assert_allclose(got, t_1 * (2 + 4 * 0.5), rtol=1e-9)
