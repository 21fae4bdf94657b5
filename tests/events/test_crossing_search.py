"""The in-step crossing search of an event that continues (`_event/_search.py`):
every loop in it ends, also under `vmap` (`examples/spiking_neurons.py` once
never finished its second Adam step).

The hang: under `vmap`, the Newton loop's predicate was `unvmap_any(~near) &
(count < bound)`, and a converged element's count was frozen. An element that
reached the bound unconverged kept `unvmap_any(~near)` true, a converged one kept
its own `count < bound` true: the batch's loop went on with nothing left to
change. It took an element whose Newton iterate lands within an ulp of the
crossing on its near side: the next Newton step rounds back onto that end of the
bracket, never strictly inside it, so each step bisected and none was "near".

Each condition here counts its evaluations on the host and raises past a budget,
so that the old code fails at once instead of hanging."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit._event import _search


# Evaluations of the condition before the counter raises: far above what the search
# needs (a few dozen under `vmap` of two), far below a hang.
_BUDGET = 2000


class _Counter:
    """Counts the calls of `tick` (one per evaluation of the condition, or one per
    batch under `vmap`); raises past `_BUDGET`."""

    def __init__(self, limit: int = _BUDGET):
        self.calls, self.limit = 0, limit

    def tick(self, *_):
        self.calls += 1
        if self.calls > self.limit:
            raise RuntimeError("the crossing search does not end")


def _rounds_onto_its_end(dtype):
    """A crossing a third of an ulp after `r = 0.5`: `g(t) = (t - r) - lo` (exact up
    to the last subtraction). Newton's iterate from the secant start lands on `r`
    itself, on the near side (`g(r) = -lo`), and its next step, `r + lo`, rounds
    back onto `r`: onto the end of the bracket, never strictly inside it."""
    r = jnp.asarray(0.5, dtype)
    lo = jnp.asarray(np.finfo(dtype).eps / 6, dtype)  # a third of an ulp of `r`
    return r, lo


def _premise(dtype):
    """The case is what its name says, in `dtype`'s own rounding."""
    r, lo = _rounds_onto_its_end(dtype)
    g = lambda t: (t - r) - lo  # noqa: E731
    a, b = jnp.asarray(0.0, dtype), jnp.asarray(1.0, dtype)
    fa, fb = g(a), g(b)
    secant = (a * fb - b * fa) / (fb - fa)
    assert secant == r and g(r) < 0 and r - g(r) == r


def _one(dtype, which, counter, r, lo):
    """The search on `[0, 1]` of `g_which`: 0, the crossing that rounds onto its
    bracket's end (`r`, `lo`: arguments of the compiled function, not constants,
    which XLA would fold into `t - (r + lo)`); 1, a smooth one at 0.3 (Newton
    converges from the secant start in a few steps)."""

    def g(t):
        jax.debug.callback(counter.tick, t)
        slanted = (t - r) - lo
        smooth = jnp.expm1(t - 0.3)
        return jnp.where(which == 0, slanted, smooth)

    a, b = jnp.asarray(0.0, dtype), jnp.asarray(1.0, dtype)
    done = jnp.asarray(False)
    return _search._search(g, a, b, g(a), g(b), done)


def _ulp(dtype, t):
    return float(np.spacing(np.asarray(t, dtype)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_crossing_within_an_ulp_of_newtons_iterate_is_found_at_once(dtype):
    """Alone: Newton's step onto the end of the bracket is small, so the iterate is
    near (the probes then close the bracket), not bisected on for `_MAX_STEPS`
    (100) Newton steps: 105 evaluations on the old code."""
    with jax.enable_x64(dtype == "float64"):
        _premise(dtype)
        counter = _Counter()
        r, lo = _rounds_onto_its_end(dtype)
        b = jax.jit(lambda r, lo: _one(dtype, jnp.asarray(0), counter, r, lo))(r, lo)
        # On the far side of the crossing (`g(b) > 0`), within the search's 8 ulps.
        assert float((b - r) - lo) > 0
        assert float(b) - 0.5 <= 8 * _ulp(dtype, 0.5)
        # Two at the start, one Newton step, its probes and at most one Newton
        # step more: a handful.
        assert counter.calls <= 8, counter.calls


@pytest.mark.parametrize("dtype", ["float32", "float64"])
# Quick loop: [float32].
@pytest.mark.quick_cases("float32")
def test_search_ends_under_vmap(dtype):
    """The spiking neurons' hang, reduced: under `jit(vmap)`, the crossing that
    rounds onto its bracket's end beside a smooth one. Both located on the far
    side of the crossing to a few ulps, in few evaluations (the old code: until the
    counter's budget)."""
    with jax.enable_x64(dtype == "float64"):
        counter = _Counter()
        which = jnp.arange(2)
        r, lo = _rounds_onto_its_end(dtype)
        one = lambda w, r, lo: _one(dtype, w, counter, r, lo)  # noqa: E731
        b = jax.jit(jax.vmap(one, (0, None, None)))(which, r, lo)
        assert float((b[0] - r) - lo) > 0
        assert float(b[0]) - 0.5 <= 8 * _ulp(dtype, 0.5)
        assert float(jnp.expm1(b[1] - 0.3)) >= 0
        assert float(b[1]) - 0.3 <= 8 * _ulp(dtype, 0.3) + 8 * _ulp(dtype, 1.0)
        assert counter.calls <= 40, counter.calls


def test_each_loop_ends_at_its_bound_under_vmap(monkeypatch):
    """An element that needs more steps than the bound beside one that converges
    at once: the loop ends when the first reaches the bound (here 3: `g = t^3`
    from `[-1, 2]`, Newton converges linearly towards its triple root), and still
    returns a point past the crossing. The old code's loop never ended there."""
    monkeypatch.setattr(_search, "_MAX_STEPS", 3)
    counter = _Counter()

    def one(which):
        def g(t):
            jax.debug.callback(counter.tick, t)
            return jnp.where(which == 0, t**3, t - 0.25)

        a, b = jnp.asarray(-1.0), jnp.asarray(2.0)
        return _search._search(g, a, b, g(a), g(b), jnp.asarray(False))

    b = jax.jit(jax.vmap(one))(jnp.arange(2))
    assert float(b[0]) > 0 and float(b[1]) >= 0.25
    assert float(b[1]) - 0.25 <= 8 * _ulp("float32", 2.0)
    assert counter.calls <= 20, counter.calls


# The reduced spiking case: `examples/spiking_neurons.py --quick` (seed 0), its
# student's table after the first Adam step, whose second step's solve never ended
# (neuron 3's eleventh search: a = 46.562611355915074, g(a) = -6.7e-16).
_W1 = np.array(
    [
        [0.2983746199886107, 0.804369301326704, 0.6903714070652113, 0.5976701465416026],
        [
            0.5085618035970959,
            0.5700159772479104,
            0.6333720584083419,
            0.6836820210827017,
        ],
        [
            0.29576732881427614,
            0.7737148344794309,
            0.3859836281297044,
            0.6438539259873196,
        ],
        [
            0.4253472218611113,
            0.6457738653802534,
            0.6276190784659145,
            0.5271891742388379,
        ],
        [
            0.6416108883642764,
            0.5407698738684208,
            0.7339828122960276,
            0.7166703238117061,
        ],
        [
            0.7009249219535791,
            0.48261767788038357,
            0.6198359940643481,
            0.5425368025855427,
        ],
        [0.6075901453769185, 0.743304531247447, 0.5279975589212321, 0.6997710883530156],
        [
            0.5739966072726695,
            0.6462314897378626,
            0.39858513512516996,
            0.3307814021537869,
        ],
    ]
)
_TAU, _T_END, _TOL = 10.0, 60.0, 1e-8
_PERIODS = np.array([23.0, 37.0, 51.0, 79.0])
_PHASES = np.array([0.0, 1.3, 2.9, 4.4])


def _inputs(t):
    return 1.0 + 0.6 * jnp.sin(2 * jnp.pi * t / _PERIODS + _PHASES)


def _neuron(weights, k, counter, t0=0.0, terminal=False):
    """The example's neuron `k` (a float table and an int index closed over by the
    field), from rest at `t0`; the condition counts its evaluations."""

    def field(t, v, args):
        return (-v + weights[k] @ _inputs(t)) / _TAU

    def threshold(t, v, args):
        jax.debug.callback(counter.tick, t)
        return v - 1.0

    reset = None if terminal else (lambda t, v, args: jnp.zeros_like(v))
    return sk.diffeqsolve(
        sk.ODETerm(field),
        sk.Tsit5(),
        t0=t0,
        t1=_T_END,
        dt0=0.5,
        y0=jnp.asarray(0.0),
        event=sk.Event(threshold, direction=True, effect=reset, max_events=24),
        stepsize_controller=sk.PIDController(rtol=_TOL, atol=_TOL),
        max_steps=1024,
    )


def _restart_loop(weights, k, solve):
    """What diffrax users write: a terminal event, solved again from each spike
    (`solve`: the jitted solve from `t0`). The spike times, differentiable."""
    spikes, t0 = [], jnp.asarray(0.0)
    while True:
        sol = solve(weights, k, t0)
        if sol.result != sk.RESULTS.event_occurred:
            return spikes
        t0 = sol.ts[-1]
        spikes.append(t0)


# `SOLVERKIT_FULL_MATRIX=1` only (the reduced example, 6.5 CPU s): the hang's cases
# are the searches above (the quick loop), continuing events of spiking neurons
# under vmap and grad events/test_continuing_events.py::
# test_integrate_and_fire_closures_vmap_grad, their spike times' gradients
# test_gradient_of_later_spike_times_under_an_adaptive_controller there.
@pytest.mark.slow
@full_matrix_only(
    "this file's searches and test_continuing_events.py::"
    "test_integrate_and_fire_closures_vmap_grad"
)
@pytest.mark.usefixtures("x64")
def test_spiking_neurons_second_adam_step():
    """The example's hang, reduced: its eight neurons at the table where the
    second Adam step's solve never ended, under `jit(vmap)` over the neuron index
    and under `grad`. The spike times and their gradient against the restart loop
    (a terminal event located after each solve, the old location), which takes
    the same steps from each spike."""
    weights = jnp.asarray(_W1)
    # ~5,700 evaluations of the condition here; the old code's loop never ended.
    counter = _Counter(limit=50_000)

    def loss(w):
        events = jax.vmap(lambda k: _neuron(w, k, counter).events)(jnp.arange(8))
        ts = events.ts
        return jnp.sum(jnp.where(jnp.isfinite(ts), ts, 0.0)), events

    # The spike times and their gradient from one program (the gradient's forward
    # pass): the condition's evaluations forwards and backwards, about twice the
    # forward's work.
    grad, events = jax.jit(jax.grad(loss, has_aux=True))(weights)
    unbounded = _Counter(limit=2**62)
    solve = jax.jit(lambda w, k, t0: _neuron(w, k, unbounded, t0, terminal=True))
    for k in range(8):
        spikes = np.asarray(_restart_loop(weights, k, solve))
        n = int(events.num[k])
        assert n == len(spikes)
        # Both take the same steps from each spike (1e-12 apart here); where a step
        # differed, each spike would move by about the solver's tolerance over the
        # potential's rate there (1e-8 / (0.015 / ms) at most here), carried into
        # the next spikes: 12 of them within 1e-5 ms.
        np.testing.assert_allclose(events.ts[k, :n], spikes, rtol=0, atol=1e-5)

    for k in (3, 7):
        expected = jax.grad(lambda w: sum(_restart_loop(w, k, solve)))(weights)
        # The same steps: equal to rounding (3e-13 here); a different step would
        # move each derivative by about the solver's relative error (1e-8).
        np.testing.assert_allclose(grad[k], expected[k], rtol=1e-6)


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        # With `SOLVERKIT_FULL_MATRIX=1` only: the same settle, in ulps of t, is
        # [float32]'s.
        pytest.param("float64", marks=full_matrix_only("[float32] (the same check)")),
    ],
)
# Quick loop: events/test_events.py::test_real_event_located_exactly.
@pytest.mark.slow
def test_settle_moves_an_occurrence_located_before_the_crossing(monkeypatch, dtype):
    """`settle`: where the located time's state has not crossed (there by
    rounding; here the search's result moved 16 ulps back, before the crossing it
    located to 8 ulps after), the recorded state has still crossed, at a time a
    few ulps on, under `jit(vmap)` over the input current (closed over by the
    field); the lanes that found no crossing keep their steps."""
    from solverkit._event import _continuing

    located = _continuing.crossing

    def early(*args):
        t = located(*args)
        return t - 16 * jnp.finfo(t.dtype).eps * jnp.abs(t)

    monkeypatch.setattr(_continuing, "crossing", early)
    with jax.enable_x64(dtype == "float64"):
        tol = 1e-9 if dtype == "float64" else 1e-5

        def one(current):
            sol = sk.diffeqsolve(
                sk.ODETerm(lambda t, v, args: current - v),
                sk.Tsit5(),
                0.0,
                4.0,
                0.05,
                jnp.zeros((), dtype),
                event=sk.Event(
                    lambda t, v, args: v - 1.0,
                    direction=True,
                    effect=lambda t, v, args: jnp.zeros_like(v),
                ),
                stepsize_controller=sk.PIDController(rtol=tol, atol=tol),
            )
            return sol.events.ts, sol.events.ys, sol.events.num

        currents = jnp.linspace(1.3, 4.0, 8, dtype=dtype)
        ts, ys, num = jax.jit(jax.vmap(one))(currents)
        for i, current in enumerate(np.asarray(currents, np.float64)):
            first = np.log(current / (current - 1))
            n = int(num[i])
            assert n == int(4.0 // first)
            assert np.all(np.asarray(ys[i, :n]) >= 1.0), ys[i, :n] - 1
            if dtype == "float64":
                # Within the nudges (15 ulps) of the located times. (In float32 the
                # dense output's rounding, several ulps of `v` over a rate of 0.3,
                # can outlast the nudges: the occurrence is then the step's end,
                # whose state has crossed, as `settle` says.)
                exact = first * np.arange(1, n + 1)
                np.testing.assert_allclose(ts[i, :n], exact, rtol=100 * tol)
