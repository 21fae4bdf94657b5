"""Events that change the state and continue (`Event(effect=...)`, `terminal=k`),
against analytic solutions: a bouncing ball's impact times, an integrate-and-fire
neuron's spike times; under `jit`, `vmap` and `grad` (checkpointed and direct
adjoints, against the analytic derivatives), with effects and conditions that close
over differentiated floats and vmapped integer indices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64, full_matrix_only

import solverkit as sk


G = 9.81
H0 = 1.0


def _ball(e, adjoint=None, t1=3.5, **event_kwargs):
    """A ball dropped from `H0`, bouncing with restitution `e`."""
    event = sk.Event(
        lambda t, y, args: y[0],
        direction=False,
        effect=lambda t, y, args: jnp.stack([y[0], -e * y[1]]),
        **event_kwargs,
    )
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.stack([y[1], -G + 0 * y[0]])),
        sk.Tsit5(),
        0.0,
        t1,
        0.01,
        jnp.array([H0, 0.0]),
        event=event,
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint or sk.RecursiveCheckpointAdjoint(),
        saveat=sk.SaveAt(ts=jnp.linspace(0.0, t1, 8), t1=True),
        throw=False,
    )


def _impacts(e, n):
    t = np.sqrt(2 * H0 / G)
    v = G * t
    out = [t]
    for _ in range(n - 1):
        v *= e
        t += 2 * v / G
        out.append(t)
    return np.array(out)


def _height(e, t):
    """The exact height at time `t`."""
    impacts = _impacts(e, 64)
    before = impacts[impacts < t]
    if before.size == 0:
        return H0 - G * t**2 / 2
    k = before.size
    v = G * impacts[0] * e**k  # upward speed after the k-th impact
    s = t - before[-1]
    return v * s - G * s**2 / 2


def test_bouncing_ball_against_analytic():
    with float64():
        sol = _ball(0.8)
        n = int(sol.events.num)
        assert n == 9  # impacts before t = 3.5
        np.testing.assert_allclose(
            sol.events.ts[:n], _impacts(0.8, n), rtol=0, atol=1e-11
        )
        assert np.all(np.isinf(np.asarray(sol.events.ts[n:])))
        # Recorded states are those just before each impact (falling, at the floor).
        np.testing.assert_allclose(sol.events.ys[:n, 0], 0.0, atol=1e-10)
        assert np.all(np.asarray(sol.events.ys[:n, 1]) < 0)
        heights = [_height(0.8, float(t)) for t in np.asarray(sol.ts[:-1])]
        np.testing.assert_allclose(sol.ys[:-1, 0], heights, atol=1e-9)
        assert sol.result == sk.RESULTS.successful


@pytest.mark.parametrize(
    "adjoint",
    [
        sk.RecursiveCheckpointAdjoint(),
        # With `SOLVERKIT_FULL_MATRIX=1` only: DirectAdjoint differentiates the
        # discrete solve that the checkpointed adjoint does (compared on other
        # problems: adjoint/test_adjoint.py).
        pytest.param(
            sk.DirectAdjoint(),
            marks=[
                pytest.mark.slow,
                full_matrix_only("[RecursiveCheckpointAdjoint] (the same solve)"),
            ],
        ),
    ],
    ids=lambda a: type(a).__name__,
)
# The full suite; the quick loop's `Event` under `grad`:
# events/test_events.py::test_event_time_gradient.
@pytest.mark.slow
def test_gradient_through_impact_times_and_effects(adjoint):
    """d(third impact time)/de = 2 v0 / g (1 + 2e): through the event times (implicit
    function theorem) and the effects."""
    with float64():
        # Jitted: eagerly, each op of the gradient a compile of its own.
        grad = jax.jit(jax.grad(lambda e: _ball(e, adjoint).events.ts[2]))(0.8)
        v0 = np.sqrt(2 * H0 * G)
        np.testing.assert_allclose(grad, 2 * v0 / G * (1 + 2 * 0.8), rtol=1e-9)


# Quick loop: events/test_events.py::test_event_under_vmap.
@pytest.mark.slow
def test_vmap_and_jit_over_restitution():
    with float64():
        es = jnp.array([0.8, 0.85, 0.9])  # all bounce on past t = 3.5
        nums = jax.jit(jax.vmap(lambda e: _ball(e).events.num))(es)
        expected = [int(np.sum(_impacts(float(e), 64) < 3.5)) for e in es]
        assert list(np.asarray(nums)) == expected


TAU = 0.5


def _neuron(current, reset, thresholds, k, adjoint=None, **event_kwargs):
    """Leaky integrate-and-fire, `tau v' = I - v`, from `v = 0`: a spike where `v`
    reaches `thresholds[k]`, then `v = reset`. The condition and the effect close
    over a vmapped int index and a differentiated float."""
    event = sk.Event(
        lambda t, y, args: y - thresholds[k],
        direction=True,
        effect=lambda t, y, args: reset + 0 * y,
        **event_kwargs,
    )
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: (current - y) / TAU),
        sk.Dopri5(),
        0.0,
        5.0,
        0.05,
        jnp.asarray(0.0),
        event=event,
        stepsize_controller=sk.PIDController(rtol=1e-12, atol=1e-12),
        adjoint=adjoint or sk.RecursiveCheckpointAdjoint(),
        throw=False,
    )


def _spikes(current, reset, threshold, n):
    first = TAU * np.log(current / (current - threshold))
    period = TAU * np.log((current - reset) / (current - threshold))
    return first + period * np.arange(n)


@pytest.mark.slow
def test_integrate_and_fire_closures_vmap_grad():
    with float64():
        thresholds = jnp.array([1.0, 1.5])
        ks = jnp.array([0, 1])

        def third(reset, k):
            events = _neuron(2.0, reset, thresholds, k).events
            return events.ts[2], events

        # The spikes and the gradient from one solve (the gradient's forward pass).
        # (Jitted: eagerly, 16 compiles.)
        grads, events = jax.jit(
            jax.vmap(jax.grad(third, has_aux=True), in_axes=(None, 0))
        )(0.2, ks)
        for i, k in enumerate(np.asarray(ks)):
            n = int(events.num[i])
            expected = _spikes(2.0, 0.2, float(thresholds[k]), 64)
            assert n == int(np.sum(expected < 5.0))
            np.testing.assert_allclose(events.ts[i, :n], expected[:n], atol=1e-9)

        # d(third spike time)/d(reset) = -2 tau / (I - reset): the reset is only
        # in the effect's closure. (The derivative of the computed spike times
        # converges with the tolerance: measured errors 1e-5, 4e-7, 3e-9 at
        # rtol 1e-6, 1e-8, 1e-12.)
        np.testing.assert_allclose(grads, -2 * TAU / (2.0 - 0.2), rtol=1e-7)


# The full suite; the quick loop's event-time gradient:
# events/test_events.py::test_event_time_gradient.
@pytest.mark.slow
def test_gradient_of_later_spike_times_under_an_adaptive_controller():
    """d(k-th spike time)/d(reset) = -k tau / (I - reset), for k up to 9 (the third,
    above, was right to 2e-10 when the eighth was off by 0.8 and the tenth by 5e3:
    the landing step's length was differentiated into the later step sizes)."""
    with float64():
        times = lambda reset: _neuron(2.0, reset, jnp.array([1.0]), 0).events.ts[:10]
        grads = jax.jit(jax.jacrev(times))(0.2)  # (eagerly: 16 compiles)
        exact = -np.arange(10) * TAU / (2.0 - 0.2)
        np.testing.assert_allclose(grads, exact, rtol=0, atol=1e-6)


def test_terminal_count_stops_at_that_occurrence_before_its_effect():
    with float64():
        sol = _neuron(2.0, 0.2, jnp.array([1.0]), 0, terminal=3)
        spikes = _spikes(2.0, 0.2, 1.0, 3)
        assert sol.result == sk.RESULTS.event_occurred
        assert int(sol.events.num) == 3
        np.testing.assert_allclose(sol.t1, spikes[-1], atol=1e-9)
        np.testing.assert_allclose(sol.ys[-1], 1.0, atol=1e-9)  # not reset


# The full suite; the quick loop's max_events: tests/events/test_events.py.
@pytest.mark.slow
def test_more_events_than_recorded_is_a_result_not_a_hang():
    with float64():
        sol = _neuron(2.0, 0.2, jnp.array([1.0]), 0, max_events=2)
        assert sol.result == sk.RESULTS.max_events_reached
        assert int(sol.events.num) == 2
        with pytest.raises(RuntimeError, match="max_events"):
            sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: (2.0 - y) / TAU),
                sk.Dopri5(),
                0.0,
                5.0,
                0.05,
                jnp.asarray(0.0),
                event=sk.Event(
                    lambda t, y, args: y - 1.0,
                    effect=lambda t, y, args: 0.2 + 0 * y,
                    max_events=2,
                ),
                stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            )


def test_bad_events_are_errors():
    term = sk.ODETerm(lambda t, y, args: -y)
    with pytest.raises(ValueError, match="real-valued conditions"):
        sk.diffeqsolve(
            term,
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.asarray(1.0),
            event=sk.Event(lambda t, y, args: y < 0.5, effect=lambda t, y, a: y),
        )
    with pytest.raises(ValueError, match="terminal"):
        sk.Event(lambda t, y, args: y, terminal=0)
    with pytest.raises(ValueError, match="max_events"):
        sk.Event(lambda t, y, args: y, effect=lambda t, y, a: y, max_events=0)
    with pytest.raises(ValueError, match="events"):
        sk.diffeqsolve(
            term,
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.asarray(1.0),
            event=sk.Event(lambda t, y, args: y - 0.5, effect=lambda t, y, a: y),
            adjoint=sk.BacksolveAdjoint(),
        )


# `SOLVERKIT_FULL_MATRIX=1` only: later occurrences' time gradients under an adaptive
# controller (the step sizes' derivative kept out of the later steps) are
# test_gradient_of_later_spike_times_under_an_adaptive_controller's (ten spikes,
# against the analytic derivative).
@pytest.mark.slow
@full_matrix_only("test_gradient_of_later_spike_times_under_an_adaptive_controller")
def test_spike_time_gradient_after_many_spikes():
    """Regression: the derivative of a located occurrence's time reached every later
    step through the controller's step size, multiplied by each step's factor, and
    after a few dozen spikes the gradient was off by orders of magnitude. Against
    central finite differences, at two tolerances (it converges)."""
    with float64():

        def spike(current, tol):
            event = sk.Event(
                lambda t, y, args: y - 1.0,
                direction=True,
                effect=lambda t, y, args: jnp.zeros_like(y),
            )
            sol = sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: (current + jnp.sin(3 * t) - y) / 0.5),
                sk.Tsit5(),
                0.0,
                20.0,
                0.01,
                jnp.array(0.0),
                event=event,
                stepsize_controller=sk.PIDController(rtol=tol, atol=tol),
            )
            return sol.events.ts[15]

        # The difference quotient's noise is about tol / h (the solves' errors over
        # the step 2h) and its truncation h^2 |d3t/dI3| / 6: with h = 1e-4 at tol =
        # 1e-11 both are ~1e-7. Reverse mode differentiates the discrete solve with
        # its step sizes held fixed; what moving steps add is left out, at the
        # level of the local errors over 15 spikes: measured 1.4e-6 to 2e-6 (JAX
        # 0.10 and 0.12, XLA optimizations on and off). So 1e-5 at tol 1e-11: ten
        # times tighter than at 1e-8, which is the convergence this test shows.
        # (The tolerance an operand, the differences' values from the gradient's
        # program: one program for all.)
        both = jax.jit(jax.value_and_grad(spike))
        for tol, h, rtol in [(1e-8, 1e-6, 1e-4), (1e-11, 1e-4, 1e-5)]:
            tol = jnp.asarray(tol)
            got = both(jnp.asarray(1.5), tol)[1]
            plus, minus = (both(jnp.asarray(1.5 + s * h), tol)[0] for s in (1, -1))
            fd = (plus - minus) / (2 * h)
            np.testing.assert_allclose(got, fd, rtol=rtol)


def _zeno_ball(e, y0, t1, **kwargs):
    event = sk.Event(
        lambda t, y, args: y[0],
        direction=False,
        effect=lambda t, y, args: jnp.stack([y[0], -e * y[1]]),
        **kwargs,
    )
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.stack([y[1], -G + 0 * y[0]])),
        sk.Tsit5(),
        0.0,
        t1,
        0.01 if t1 > 0 else -0.01,
        y0,
        event=event,
        stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
        throw=False,
    )


# Quick loop: test_bouncing_ball_against_analytic.
@pytest.mark.slow
def test_zeno_point_is_a_result_not_a_fall_through_the_floor():
    """A ball whose bounces shrink to nothing at t = t_1 (1 + e) / (1 - e): the solve
    follows the bounces down to the resolution of time, then stops there with
    `RESULTS.events_accumulated` (it used to lose the crossing and fall through)."""
    with float64():
        sol = _zeno_ball(0.5, jnp.array([1.0, 0.0]), 3.0)
        t_zeno = np.sqrt(2 * H0 / G) * 1.5 / 0.5
        assert sol.result == sk.RESULTS.events_accumulated
        np.testing.assert_allclose(sol.ts[-1], t_zeno, rtol=1e-9)
        assert int(sol.events.num) > 40  # bounces down to ~1e-16 s apart
        assert float(sol.ys[-1, 0]) > -1e-12  # on the floor, not below it
        with pytest.raises(RuntimeError, match="accumulate"):
            sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: jnp.stack([y[1], -G + 0 * y[0]])),
                sk.Tsit5(),
                0.0,
                3.0,
                0.01,
                jnp.array([1.0, 0.0]),
                event=sk.Event(
                    lambda t, y, args: y[0],
                    direction=False,
                    effect=lambda t, y, args: jnp.stack([y[0], -0.5 * y[1]]),
                ),
                stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            )


# The full suite; the quick loop's backward-in-time events:
# tests/events/test_continuing_events_scipy.py.
@pytest.mark.slow
def test_occurrence_at_t0_and_backwards_in_time():
    """A condition at zero at `t0` moving in the event's direction fires there (as
    in SciPy); moving the other way it does not. Backwards in time, the impacts
    are those of the ball run forwards, mirrored."""
    with float64():
        falling = _zeno_ball(0.8, jnp.array([0.0, -1.0]), 0.5)
        assert float(falling.events.ts[0]) == 0.0
        np.testing.assert_allclose(falling.events.ts[1], 2 * 0.8 / G, rtol=1e-9)
        rising = _zeno_ball(0.8, jnp.array([0.0, 1.0]), 0.5)
        np.testing.assert_allclose(rising.events.ts[0], 2 / G, rtol=1e-9)
        back = _zeno_ball(0.8, jnp.array([H0, 0.0]), -1.5)
        np.testing.assert_allclose(
            back.events.ts[:2], -_impacts(0.8, 2), rtol=0, atol=1e-9
        )
        assert back.result == sk.RESULTS.successful


# The full suite (5 CPU s for float32), as are the accumulation and occurrence
# checks (test_zeno_point_is_a_result_not_a_fall_through_the_floor,
# events/test_continuing_event_steps.py); the quick loop's events:
# events/test_events.py::test_real_event_located_exactly.
@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "float64",
            marks=full_matrix_only(
                "[float32] (the same grid, steps and locations, in the dtype whose "
                "rounding showed the bug) and float64 occurrences under jit(vmap) "
                "and grad: events/test_continuing_event_steps.py::"
                "test_occurrence_is_never_before_the_crossing[float64]"
            ),
        ),
    ],
)
def test_step_ending_just_before_a_crossing_is_not_an_accumulation(dtype):
    """A step that ends within a hundred ulps before a crossing, which the next step
    finds: an occurrence like any other, not a Zeno point (the solve stopped there
    with `events_accumulated`, its later occurrences lost, when the crossing was
    compared with the start of its step instead of the previous occurrence: float32
    spiking neurons kept a third of their spikes). And after each occurrence the
    steps go on along `StepTo`'s grid (they went back to its start). `v' = a`, reset
    to 0 at `v = 1`: occurrences at `k / a`; grid times `k + 1/2` and `k + 1 - d`,
    `d` from 0 (a grid time on the crossing) to 16 ulps. Under jit, vmap over `d`
    and grad with respect to `a` (closed over), against `d(k / a)/da = -k / a**2`."""
    with jax.enable_x64(dtype == "float64"):
        eps = float(jnp.finfo(dtype).eps)
        ds = jnp.asarray([0.0, 1.0, 4.0, 16.0], dtype) * eps * 4
        half = jnp.arange(6, dtype=dtype) + 0.5

        def spikes(a, d):
            grid = jnp.stack([half[:5], half[:5] + 0.5 - d], axis=1).reshape(-1)
            ts = jnp.concatenate([jnp.zeros(1, dtype), grid, half[5:]])
            sol = sk.diffeqsolve(
                sk.ODETerm(lambda t, v, args: a + 0 * v),
                sk.Tsit5(),
                ts[0],
                ts[-1],
                None,
                jnp.asarray(0.0, dtype),
                event=sk.Event(
                    lambda t, v, args: v - 1,
                    direction=True,
                    effect=lambda t, v, args: 0 * v,
                    max_events=8,
                ),
                stepsize_controller=sk.StepTo(ts),
                saveat=sk.SaveAt(t1=True),
                throw=False,
            )
            return sol.events.ts, sol.result.code, sol.stats["num_steps"]

        def total(a):
            out = jax.vmap(spikes, in_axes=(None, 0))(a, ds)
            times = out[0]
            return jnp.sum(jnp.where(jnp.isfinite(times), times, 0)), out

        # The values and the gradient from one program (the gradient's forward pass).
        a = jnp.asarray(1.0, dtype)
        got, (ts, code, steps) = jax.jit(jax.grad(total, has_aux=True))(a)
        np.testing.assert_array_equal(code, sk.RESULTS.successful.code)
        # 11 grid steps, and at most one more a crossing (the rest of a cut step).
        assert np.all(np.asarray(steps) <= 16)
        want = np.array([1.0, 2.0, 3.0, 4.0, 5.0] + [np.inf] * 3)
        # Each location exact to the rounding of the times (Tsit5 is exact here).
        np.testing.assert_allclose(ts, np.broadcast_to(want, ts.shape), rtol=20 * eps)
        # Each d's five spike times: -(1 + ... + 5) / a**2 = -15, to rounding.
        np.testing.assert_allclose(got, -15.0 * len(ds), rtol=100 * eps)


# `SOLVERKIT_FULL_MATRIX=1` only (6.6 CPU s in a profile): the occurrences' rows are
# written by `_save._put`, the save rows' writer, whose one-hot selects (values and
# gradients, under jit, vmap and grad) are ensemble/test_ensemble_ts_grad.py::
# test_ensemble_equals_vmap[one-hot-*] (the quick loop's [one-hot-rows-lockstep]);
# event rows under vmap and grad events/test_events.py::test_event_under_vmap and this
# file's impact-time gradient.
@pytest.mark.slow
@full_matrix_only(
    "test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-*] (the same row "
    "writes) and test_gradient_through_impact_times_and_effects"
)
def test_event_rows_written_by_one_hot_selects_as_by_index(monkeypatch):
    """The occurrences' rows written as on a TPU (a select against a one-hot mask of
    the rows, `_save.ONE_HOT_BACKENDS`: a scatter with each batch element's own row
    ran as a serial loop over the batch there, 4 ms a step at N = 1024) hold what the
    indexed writes hold: times, states and the gradient of an impact time, under jit,
    vmap over the restitution and grad."""
    from solverkit import _save

    def third(e):
        events = _ball(e, max_events=8).events
        return events.ts[2], (events.ts, events.ys)

    def run():
        # The rows and the gradient from one program (the gradient's forward pass).
        with float64():
            es = jnp.array([0.8, 0.85, 0.9])
            grad, (ts, ys) = jax.jit(jax.vmap(jax.grad(third, has_aux=True)))(es)
            return ts, ys, grad

    by_index = run()
    monkeypatch.setattr(_save, "ONE_HOT_BACKENDS", (jax.default_backend(),))
    jax.clear_caches()
    one_hot = run()
    with float64():
        jaxpr = jax.make_jaxpr(jax.vmap(lambda e: _ball(e, max_events=8).events.ts))(
            jnp.array([0.8, 0.9])
        )
    # No scatter left in the step loop (the old code wrote the rows by index there).
    loops = _while_bodies(jaxpr.jaxpr)
    assert loops and not any("scatter" in str(body) for body in loops)
    assert np.isfinite(np.asarray(by_index[0])).sum() > 10  # rows were written
    # The same values written (selects are exact), to the rounding of the rest of
    # the program, compiled apart: float64 round-off carried from impact to impact
    # (each time inherits the errors of those before it; 2e-14 seen), far below the
    # solver's 1e-10, while a row written in the wrong place is off by O(0.1).
    for a, b in zip(jax.tree.leaves(by_index), jax.tree.leaves(one_hot)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def _while_bodies(jaxpr) -> list:
    """The bodies of the `while` loops in `jaxpr`, at any depth."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            out.append(eqn.params["body_jaxpr"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out.extend(_while_bodies(sub))
    return out
