"""Events at given times (`TimedEvent`): a one-compartment pharmacokinetic model with
a repeated oral dose, against its analytic solution (values, and gradients with
respect to the rates, the amount and every dose time, the one at `t0` and one at a
save time included); schedules given as `start`/`interval`/`count`, one amount per
dose, an effect that closes over a differentiated float and a vmapped integer
index; backwards time; a solve split in two; with an `Event`; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64, skip_unless_full_matrix

import solverkit as sk


TS = np.linspace(0.0, 60.0, 61)


@jax.jit  # (op by op, each call compiled a dozen small programs)
def _analytic(t, ka, ke, amount, doses):
    """Gut and central amounts after oral doses at `doses` (the left limit at each)."""
    s = jnp.asarray(t)[:, None] - doses[None, :]
    on = s > 0
    s = jnp.where(on, s, 0.0)
    gut = jnp.where(on, amount * jnp.exp(-ka * s), 0.0).sum(-1)
    central = ka / (ka - ke) * (jnp.exp(-ke * s) - jnp.exp(-ka * s))
    central = jnp.where(on, amount * central, 0.0).sum(-1)
    return jnp.stack([gut, central], -1)


def _pk(ka, ke, amount, doses, adjoint=None, t1=60.0, ts=TS, y0=None, **kwargs):
    rates = lambda t, y, args: jnp.stack([-ka * y[0], ka * y[0] - ke * y[1]])
    return sk.diffeqsolve(
        sk.ODETerm(rates),
        sk.Tsit5(),
        0.0,
        t1,
        0.1,
        jnp.zeros(2) if y0 is None else y0,
        saveat=sk.SaveAt(ts=ts),
        event=sk.TimedEvent(doses, amount=jnp.stack([amount, 0.0]), **kwargs),
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint or sk.RecursiveCheckpointAdjoint(),
    )


# Quick loop: test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_repeated_dose_against_analytic():
    with float64():
        doses = jnp.array([0.0, 12.0, 24.0, 36.0])
        sol = _pk(1.2, 0.2, 100.0, doses)
        want = _analytic(TS, 1.2, 0.2, 100.0, doses)
        np.testing.assert_allclose(sol.ys, want, rtol=0, atol=1e-8)
        # Saves at a dose time show the state just before it.
        assert float(sol.ys[12, 0]) < 1e-3 and float(sol.ys[0, 0]) == 0.0
        assert sol.result == sk.RESULTS.successful


@pytest.mark.parametrize(
    "adjoint", [sk.RecursiveCheckpointAdjoint(), sk.DirectAdjoint()]
)
# The full suite; the quick loop's gradients with respect to the dose times (and a
# closed-over amount), against the exact ones: test_effect_closes_over_anything_...
@pytest.mark.slow
def test_gradients_against_analytic(adjoint):
    """With respect to the rates, the amount and each dose time: at `t0`, between
    saves, and at a save time (the one-sided derivative of moving the dose later)."""
    if isinstance(adjoint, sk.DirectAdjoint):
        # `SOLVERKIT_FULL_MATRIX=1` only: DirectAdjoint differentiates the discrete
        # solve [adjoint0]'s checkpointed adjoint does (compared on other problems:
        # adjoint/test_adjoint.py).
        skip_unless_full_matrix("[adjoint0] (RecursiveCheckpointAdjoint)")
    with float64():

        def loss(p):
            sol = _pk(p[0], p[1], p[2], p[3:], adjoint)
            return jnp.sum(sol.ys[:, 1] ** 2)

        def exact(p):
            return jnp.sum(_analytic(TS, p[0], p[1], p[2], p[3:])[:, 1] ** 2)

        p = jnp.array([1.2, 0.2, 100.0, 0.0, 12.3, 24.0, 36.5])
        got, want = jax.jit(jax.grad(loss))(p), jax.jit(jax.grad(exact))(p)
        np.testing.assert_allclose(got, want, rtol=1e-7)


# The full suite; the quick loop's timed-event gradients:
# test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_time_gradients_do_not_grow_with_the_steps():
    """Regression: a step cut short by an event used to pass the derivative of its
    end on to every later step, multiplied by each step's factor."""
    with float64():
        doses = jnp.array([1.0, 12.3, 24.5, 36.5])
        loss = lambda d: jnp.sum(_pk(1.2, 0.2, 100.0, d).ys[:, 1] ** 2)
        exact = lambda d: jnp.sum(_analytic(TS, 1.2, 0.2, 100.0, d)[:, 1] ** 2)
        got, want = jax.jit(jax.grad(loss))(doses), jax.jit(jax.grad(exact))(doses)
        np.testing.assert_allclose(got, want, rtol=1e-7)


# Quick loop: test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_interval_count_and_one_amount_per_dose():
    with float64():
        sol = _pk(1.2, 0.2, 100.0, None, start=2.0, interval=8.0, count=5)
        doses = 2.0 + 8.0 * jnp.arange(5)
        np.testing.assert_allclose(
            sol.ys, _analytic(TS, 1.2, 0.2, 100.0, doses), atol=1e-8
        )
        # Doses of different sizes, one amount per dose (a leading axis).
        amounts = jnp.array([[100.0, 0.0], [50.0, 0.0], [25.0, 5.0]])
        rates = lambda t, y, args: jnp.stack([-1.2 * y[0], 1.2 * y[0] - 0.2 * y[1]])
        sol = sk.diffeqsolve(
            sk.ODETerm(rates),
            sk.Tsit5(),
            0.0,
            30.0,
            0.1,
            jnp.zeros(2),
            saveat=sk.SaveAt(ts=[9.0, 30.0]),
            event=sk.TimedEvent([0.0, 10.0, 20.0], amount=amounts),
            stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        )
        want = sum(
            _analytic(np.array([9.0, 30.0]), 1.2, 0.2, a, jnp.array([td]))
            for a, td in zip([100.0, 50.0, 25.0], [0.0, 10.0, 20.0])
        )
        # The central dose of 5 at t = 20 decays with ke alone.
        want = want.at[1, 1].add(5.0 * np.exp(-0.2 * 10.0))
        np.testing.assert_allclose(sol.ys, want, atol=1e-8)


def test_effect_closes_over_anything_under_vmap_and_grad():
    """An effect that closes over a differentiated float and a vmapped integer
    index; a schedule batched under `vmap`."""
    table = np.array([1.0, 2.0, 3.0])

    def final(scale, k, doses):
        effect = lambda t, y, args: y + scale * jnp.asarray(table)[k]
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -0.5 * y),
            sk.Tsit5(),
            0.0,
            10.0,
            0.1,
            jnp.array(0.0),
            event=sk.TimedEvent(doses, effect=effect),
            stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        )
        return sol.ys[-1]

    def exact(scale, k, doses):
        return jnp.sum(scale * jnp.asarray(table)[k] * jnp.exp(-0.5 * (10.0 - doses)))

    with float64():
        ks = jnp.array([0, 2])
        doses = jnp.array([[1.0, 4.0, 7.5], [0.5, 2.0, 9.0]])

        def values_and_grads(f):
            # The values and the gradient from one program (its forward pass).
            def total(s, d):
                values = jax.vmap(f, (None, 0, 0))(s, ks, d)
                return values.sum(), values

            return jax.jit(jax.grad(total, (0, 1), has_aux=True))(2.0, doses)

        (grad, got), (want, exact_values) = map(values_and_grads, (final, exact))
        np.testing.assert_allclose(got, exact_values, rtol=1e-9)
        for g, w in zip(grad, want):
            np.testing.assert_allclose(g, w, rtol=1e-8)


# Quick loop: test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_backwards_in_time():
    """Events at times decreasing from `t0` to `t1`; a solve backwards from 10 to 0
    of y' = 0 with `+1` at 8, 5 and 2 (and 10, `t0`; 0, `t1`, is not applied)."""
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.zeros_like(y)),
        sk.Tsit5(),
        10.0,
        0.0,
        -0.5,
        jnp.array(0.0),
        saveat=sk.SaveAt(ts=[10.0, 9.0, 5.0, 4.0, 0.0]),
        event=sk.TimedEvent([10.0, 8.0, 5.0, 2.0, 0.0], amount=1.0),
        stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
    )
    np.testing.assert_allclose(sol.ys, [0.0, 1.0, 2.0, 3.0, 4.0])


# The full suite; the quick loop's timed events:
# test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_split_solve_equals_one_solve():
    """Times outside `[t0, t1)` are skipped, and one at `t1` is left to the solve
    that continues from there: two halves give the one solve's answer."""
    with float64():
        doses = jnp.array([0.0, 12.0, 24.0, 36.0])
        whole = _pk(1.2, 0.2, 100.0, doses, ts=[24.0, 30.0], t1=30.0)
        first = _pk(1.2, 0.2, 100.0, doses, ts=[24.0], t1=24.0)
        rates = lambda t, y, args: jnp.stack([-1.2 * y[0], 1.2 * y[0] - 0.2 * y[1]])
        second = sk.diffeqsolve(
            sk.ODETerm(rates),
            sk.Tsit5(),
            24.0,
            30.0,
            0.1,
            first.ys[-1],
            saveat=sk.SaveAt(ts=[30.0]),
            event=sk.TimedEvent(doses, amount=jnp.array([100.0, 0.0])),
            stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        )
        np.testing.assert_allclose(first.ys[-1], whole.ys[0], atol=1e-9)
        np.testing.assert_allclose(second.ys[-1], whole.ys[-1], atol=1e-9)


def test_constant_steps_land_on_the_times():
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.ones_like(y)),
        sk.Euler(),
        0.0,
        1.0,
        0.3,
        jnp.array(0.0),
        saveat=sk.SaveAt(steps=True),
        event=sk.TimedEvent([0.5], amount=10.0),
    )
    n = int(sol.stats["num_accepted_steps"])
    ts = np.asarray(sol.ts[:n])
    assert 0.5 in ts and ts[-1] == 1.0 and n == 4
    np.testing.assert_allclose(sol.ys[:n], ts + 10.0 * (ts > 0.5), rtol=1e-6)


def _lif_spikes(kicks, amount, t1, threshold=1.5):
    """Exact spike times of v' = 1 - v/2 (reset to 0 at `threshold`, kicked by
    `amount` at `kicks`; a kick across the threshold is not a spike)."""
    t, v, spikes = 0.0, 0.0, []
    for stop in [*kicks, t1]:
        while v < threshold:  # crosses before `stop`?
            tc = t + 2 * np.log((2 - v) / (2 - threshold))
            if tc >= stop:
                break
            spikes.append(tc)
            t, v = tc, 0.0
        v = 2 + (v - 2) * np.exp(-(stop - t) / 2)
        t = stop
        if stop != t1:
            v += amount
    return np.array(spikes), v


# Quick loop: test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_with_a_continuing_event():
    """A leaky integrate-and-fire neuron, kicked at given times, spiking and reset
    where it crosses a threshold: `event=(Event, TimedEvent)`."""
    with float64():
        spike = sk.Event(
            lambda t, y, args: y - 1.5,
            direction=True,
            effect=lambda t, y, args: jnp.zeros_like(y),
        )
        kicks = [0.5, 4.0, 6.0, 11.5]
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: 1.0 - 0.5 * y),
            sk.Tsit5(),
            0.0,
            14.0,
            0.1,
            jnp.array(0.0),
            event=(spike, sk.TimedEvent(kicks, amount=0.25)),
            stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        )
        spikes, v_end = _lif_spikes(kicks, 0.25, 14.0)
        assert len(spikes) == int(sol.events.num) == 4
        np.testing.assert_allclose(sol.events.ts[:4], spikes, atol=1e-9)
        np.testing.assert_allclose(sol.ys[-1], v_end, atol=1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="exactly one of"):
        sk.TimedEvent([1.0])
    with pytest.raises(ValueError, match="exactly one of"):
        sk.TimedEvent([1.0], amount=1.0, effect=lambda t, y, a: y)
    with pytest.raises(ValueError, match="strictly increasing"):
        sk.TimedEvent([1.0, 1.0], amount=1.0)
    with pytest.raises(ValueError, match="1-D"):
        sk.TimedEvent([[1.0]], amount=1.0)
    with pytest.raises(ValueError, match="count"):
        sk.TimedEvent(interval=1.0, count=0, amount=1.0)
    with pytest.raises(ValueError, match="not both"):
        sk.TimedEvent([1.0], interval=1.0, count=2, amount=1.0)
    with pytest.raises(ValueError, match="needs its times"):
        sk.TimedEvent(amount=1.0)
    term = sk.ODETerm(lambda t, y, args: -y)

    def solve(event, **kwargs):
        return sk.diffeqsolve(
            term, sk.Tsit5(), 0.0, 1.0, 0.1, jnp.ones(2), event=event, **kwargs
        )

    with pytest.raises(ValueError, match=r"amount.*leaf 0 must have the state's shape"):
        solve(sk.TimedEvent([0.5], amount=jnp.ones(3)))
    with pytest.raises(ValueError, match="structure of `y0`"):
        solve(sk.TimedEvent([0.5], amount=(1.0, 2.0)))
    with pytest.raises(ValueError, match="direction from t0 to t1"):
        solve(sk.TimedEvent([0.8, 0.5], amount=jnp.ones(2)))
    with pytest.raises(ValueError, match=r"TimedEvent\(effect=...\)'s output"):
        solve(sk.TimedEvent([0.5], effect=lambda t, y, a: jnp.ones(3)))
    with pytest.raises(ValueError, match="two TimedEvents"):
        solve(
            (
                sk.TimedEvent([0.5], amount=jnp.ones(2)),
                sk.TimedEvent([0.6], amount=jnp.ones(2)),
            )
        )
    with pytest.raises(TypeError, match="must be an Event, a TimedEvent"):
        solve((sk.TimedEvent([0.5], amount=jnp.ones(2)), "x"))
    with pytest.raises(ValueError, match="BacksolveAdjoint"):
        solve(sk.TimedEvent([0.5], amount=jnp.ones(2)), adjoint=sk.BacksolveAdjoint())


@pytest.mark.parametrize(
    "shape, dtype",
    [((), "float32"), ((1,), "float32"), ((2, 1), "float32"), ((2,), "int32")],
)
def test_effect_and_amount_match_the_state_exactly(shape, dtype):
    """An `Event` effect, a `TimedEvent` effect and an `amount` must have the
    state's structure, shapes and dtypes: nothing is broadcast or cast (a scalar
    effect used to turn a 2-state `[h, v]` into `[h, h]`)."""
    term = sk.ODETerm(lambda t, y, args: -y)
    wrong = jnp.ones(shape, dtype)

    def solve(event):
        return sk.diffeqsolve(term, sk.Tsit5(), 0.0, 1.0, 0.1, jnp.ones(2), event=event)

    expected = r"leaf 0 must have the state's shape \(2,\) and dtype float32"
    with pytest.raises(ValueError, match=r"Event\(effect=...\)'s output: " + expected):
        solve(sk.Event(lambda t, y, a: y[0] - 0.5, effect=lambda t, y, a: wrong))
    with pytest.raises(
        ValueError, match=r"TimedEvent\(effect=...\)'s output: " + expected
    ):
        solve(sk.TimedEvent([0.5], effect=lambda t, y, a: wrong))
    with pytest.raises(ValueError, match=r"TimedEvent\(amount=...\).*" + expected):
        solve(sk.TimedEvent([0.5], amount=wrong))
    with pytest.raises(ValueError, match=r"TimedEvent\(amount=...\).*" + expected):
        solve(sk.TimedEvent([0.5, 0.6, 0.7], amount=jnp.stack([wrong] * 3)))


# The full suite; the quick loop's timed events under vmap and grad:
# test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_exact_effect_and_amounts_are_accepted_under_jit_vmap_grad():
    """What matches passes, traced too: a weakly typed (Python) scalar for a scalar
    leaf, one amount per time; under jit, vmap and grad against the exact
    solution of y' = -y with the doses."""
    term = sk.ODETerm(lambda t, y, args: -y)

    def solve(a):
        doses = sk.TimedEvent([0.5, 0.75], amount=jnp.stack([a, 2 * a]))
        return sk.diffeqsolve(
            term,
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.ones(2),
            event=doses,
            stepsize_controller=sk.PIDController(rtol=1e-7, atol=1e-7),
        ).ys[-1]

    def exact(a):
        return np.exp(-1.0) + a * np.exp(-0.5) + 2 * a * np.exp(-0.25)

    a = jnp.array([[0.5, 1.0], [2.0, -1.0]])
    got = jax.jit(jax.vmap(solve))(a)
    # Tolerance 1e-7 in float32: errors of ~1e-6 relative.
    np.testing.assert_allclose(got, exact(np.asarray(a)), rtol=2e-5)
    grad = jax.jit(jax.grad(lambda a: jnp.sum(solve(a))))(jnp.array([0.5, 1.0]))
    np.testing.assert_allclose(grad, [np.exp(-0.5) + 2 * np.exp(-0.25)] * 2, rtol=2e-5)
    scalar = sk.diffeqsolve(
        term,
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.asarray(1.0),
        event=sk.TimedEvent([0.5], amount=1.0),
    )
    np.testing.assert_allclose(scalar.ys[-1], np.exp(-1.0) + np.exp(-0.5), rtol=2e-5)


_NAN = float("nan")
_SCHEDULES = {
    # name: (the schedule from one traced value, the bad value, the message)
    "nan-time": (
        lambda v: sk.TimedEvent(jnp.stack([0.5, v, 2.0]), amount=jnp.ones(2)),
        _NAN,
        r"TimedEvent\(ts=...\): time 1 is NaN",
    ),
    "not-increasing": (
        lambda v: sk.TimedEvent(jnp.stack([0.5, 1.5, v]), amount=jnp.ones(2)),
        1.0,
        r"TimedEvent\(ts=...\)(: time 2 does not come after time 1| must be strictly)",
    ),
    "repeated-time": (
        lambda v: sk.TimedEvent(jnp.stack([0.5, v]), amount=jnp.ones(2)),
        0.5,
        r"TimedEvent\(ts=...\)(: time 1 does not come after time 0| must be strictly)",
    ),
    "nan-amount": (
        lambda v: sk.TimedEvent([0.5, 1.0], amount=jnp.stack([1.0, v])),
        _NAN,
        r"TimedEvent\(amount=...\): leaf 0 is NaN",
    ),
    "nan-amount-per-time": (
        lambda v: sk.TimedEvent([0.5, 1.0], amount=jnp.array([[1.0, 1.0], [1.0, v]])),
        _NAN,
        r"TimedEvent\(amount=...\): leaf 0, at time 1, is NaN",
    ),
    "nan-start": (
        lambda v: sk.TimedEvent(start=v, interval=0.5, count=3, amount=jnp.ones(2)),
        _NAN,
        r"TimedEvent\(start=...\) is NaN",
    ),
    "nan-interval": (
        lambda v: sk.TimedEvent(start=0.5, interval=v, count=3, amount=jnp.ones(2)),
        _NAN,
        r"TimedEvent\(interval=...\) is NaN",
    ),
    "zero-interval": (
        lambda v: sk.TimedEvent(start=0.5, interval=v, count=3, amount=jnp.ones(2)),
        0.0,
        r"TimedEvent\(interval=...\) is 0",
    ),
    "negative-interval": (
        lambda v: sk.TimedEvent(start=0.5, interval=v, count=3, amount=jnp.ones(2)),
        -0.5,
        r"TimedEvent\(interval=...\) must be positive for a solve forwards",
    ),
}


def _dosed(schedule):
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y),
        sk.Tsit5(),
        0.0,
        3.0,
        0.1,
        jnp.ones(2),
        event=schedule,
        stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
    ).ys[-1]


@pytest.mark.parametrize("how", ["now", "jit", "vmap"])
@pytest.mark.parametrize("case", sorted(_SCHEDULES))
# Quick loop: every known bad schedule; traced, the times, amounts and interval once.
@pytest.mark.quick_cases(
    dict(how="now"),
    "nan-time-jit",
    "zero-interval-jit",
    "nan-amount-per-time-vmap",
    "not-increasing-vmap",
)
def test_bad_schedules_are_errors_also_when_traced(case, how):
    """A NaN time, amount, start or interval, a non-positive interval and times not
    increasing are errors naming the schedule's argument and entry: known, a
    `ValueError` before the solve; traced (jit, vmap: one bad element fails the
    batch), at run time. They used to drop doses silently, or end in
    `max_steps_reached`."""
    make, bad, message = _SCHEDULES[case]
    solve = lambda v: _dosed(make(v))  # noqa: E731
    with pytest.raises(ValueError if how == "now" else Exception, match=message):
        if how == "now":
            solve(jnp.asarray(bad))
        elif how == "jit":
            jax.block_until_ready(jax.jit(solve)(jnp.asarray(bad)))
        else:
            jax.block_until_ready(jax.vmap(solve)(jnp.array([0.75, bad])))


# The full suite; the quick loop's timed events:
# test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_traced_schedule_solves_and_differentiates():
    """A valid traced schedule solves as a known one, and its interval is
    differentiable: y' = -y, doses of 1 at 0.5, 0.5 + d, 0.5 + 2 d, against the
    exact solution and its derivative in `d`."""

    def y_end(d):
        doses = sk.TimedEvent(start=0.5, interval=d, count=3, amount=jnp.ones(2))
        return _dosed(doses)[0]

    def exact(d):
        return np.exp(-3.0) + sum(np.exp(-(2.5 - k * d)) for k in range(3))

    d = 0.75
    # rtol 1e-6 in float32: errors of a few 1e-6 relative.
    # The values under jit and vmap and the gradient at `d` from one program (the
    # gradient's forward pass; eagerly, vmap and grad compiled op by op).
    got, grad = jax.jit(jax.vmap(jax.value_and_grad(y_end)))(jnp.array([0.5, d]))
    np.testing.assert_allclose(got[1], exact(d), rtol=2e-5)
    np.testing.assert_allclose(got, [exact(0.5), exact(0.75)], rtol=2e-5)
    slope = sum(k * np.exp(-(2.5 - k * d)) for k in range(3))
    np.testing.assert_allclose(grad[1], slope, rtol=1e-4)


# Quick loop: test_effect_closes_over_anything_under_vmap_and_grad.
@pytest.mark.slow
def test_one_traced_time():
    """A schedule of one traced time (nothing to order) solves under jit and vmap:
    its order check is empty (it used to fail tracing, an argmax of nothing).
    y' = -y, y(0) = 1, a dose of 1 at tau: y(3) = exp(-3) + exp(-(3 - tau))."""

    def y_end(tau):
        return _dosed(sk.TimedEvent(tau[None], amount=jnp.ones(2)))[0]

    exact = lambda tau: np.exp(-3.0) + np.exp(-(3.0 - tau))  # noqa: E731
    # rtol 1e-6 in float32: errors of a few 1e-6 relative.
    np.testing.assert_allclose(jax.jit(y_end)(jnp.asarray(1.0)), exact(1.0), rtol=2e-5)
    got = jax.vmap(y_end)(jnp.array([0.5, 1.5]))
    np.testing.assert_allclose(got, [exact(0.5), exact(1.5)], rtol=2e-5)


def test_float32_state_with_float64_times(x64):
    """A dose at `t0` of a float32 state, with 64-bit times (its time derivative is
    added in the times' dtype): the state stays float32 (it became float64, and
    the vector field's next call raised), under `jit` and `grad` alike."""

    def final(amount):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -y), sk.Tsit5(), 0.0, 1.0, 0.1,
            jnp.ones(2, jnp.float32),
            event=sk.TimedEvent(jnp.array([0.0, 0.5]), amount=amount),
        )  # fmt: skip
        assert sol.ys is not None and sol.ys.dtype == jnp.float32
        return sol.ys[-1, 0]

    amount = jnp.ones(2, jnp.float32)
    want = 2 * np.exp(-1.0) + np.exp(-0.5)  # doses of 1 at t = 0 and t = 0.5
    np.testing.assert_allclose(jax.jit(final)(amount), want, rtol=1e-5)
    grad = jax.grad(final)(amount)
    np.testing.assert_allclose(grad, [np.exp(-1.0) + np.exp(-0.5), 0.0], rtol=1e-5)
