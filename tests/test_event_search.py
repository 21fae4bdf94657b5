"""The in-step crossing search of an event that continues (`_event/_search.py`):
every loop in it ends, also under `vmap` (#37 D15: `examples/spiking_neurons.py`
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

from solverkit._event import _search


# Evaluations of the condition before the counter raises: far above what the search
# needs (a few dozen under `vmap` of two), far below a hang.
_BUDGET = 2000


class _Counter:
    """Counts the calls of `tick` (one per evaluation of the condition, or one per
    batch under `vmap`); raises past `_BUDGET`."""

    def __init__(self):
        self.calls = 0

    def tick(self, *_):
        self.calls += 1
        if self.calls > _BUDGET:
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
