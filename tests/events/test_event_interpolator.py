"""`AbstractSolver.interpolator`: a step's dense output as a function of `t`, which
the in-step search of an event that continues evaluates a dozen times a step. A
Runge-Kutta method with its own dense output computes its polynomial's
coefficients once; every evaluation must give `interpolate`'s value (to rounding)
and its derivatives, under `jit`, `vmap` and `grad`, for states of several dtypes.
(The old code has no `interpolator`: its search evaluated the stages' weight
polynomials at each iterate, most of the cost of a step that found a crossing.)"""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

_SOLVERS = [sk.Tsit5(), sk.Dopri5(), sk.Dopri8(), sk.Bosh3()]


def _field(t, y, args):
    return {"v": -y["v"] * jnp.cos(t) + args, "s": y["s"] * (1 - y["s"])}


def _step(solver, y0, args, t0=0.2, t1=0.5):
    """One step of `solver` from `y0`: the loop's dense information."""
    terms = sk.ODETerm(_field)
    t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
    state = solver.init(terms, t0, t1, y0, args)
    _, _, info, _, _ = solver.loop_step(terms, t0, t1, y0, args, state, False)
    return info, t0, t1


def _bound(solver, info, t0, t1):
    """The rounding of either form, leaf by leaf: a few ulps (one per operation
    of the longest chain: stages, degree, and the last two) of the largest term,
    `|y0| + |h| sum_ij |dense_ij| |f_i|` (`|y0|` where there are no stages)."""
    dense = getattr(solver.tableau, "dense", None)
    h = float(t1 - t0)
    if "fs" not in info or dense is None:
        scale = jtu.tree_map(lambda y: jnp.max(jnp.abs(y)), info["y0"])
        ops = 8
    else:
        weight = np.abs(np.asarray(dense)).sum(axis=1)
        scale = jtu.tree_map(
            lambda y, *fs: (
                jnp.max(jnp.abs(y))
                + abs(h)
                * sum(float(w) * jnp.max(jnp.abs(f)) for w, f in zip(weight, fs))
            ),
            info["y0"],
            *info["fs"],
        )
        ops = len(weight) + dense.shape[1] + 2
    return jtu.tree_map(
        lambda y, s: ops * jnp.finfo(y.dtype).eps * s, info["y0"], scale
    )


def _y0():
    # Several dtypes: a float64 vector and a float32 scalar.
    return {"v": jnp.array([1.0, -2.0, 0.5]), "s": jnp.asarray(0.3, jnp.float32)}


@pytest.mark.parametrize("solver", _SOLVERS, ids=lambda s: type(s).__name__)
# The full suite; the quick loop locates events on this interpolator in
# events/test_events.py::test_real_event_located_exactly.
@pytest.mark.slow
def test_interpolator_matches_interpolate_under_jit_and_vmap(solver):
    args = jnp.asarray(0.7)
    info, t0, t1 = _step(solver, _y0(), args)
    ts = jnp.linspace(t0, t1, 7)

    @jax.jit
    def both(ts):
        at = solver.interpolator(info, t0, t1)
        fast = jax.vmap(at)(ts)
        slow = jax.vmap(lambda t: solver.interpolate(info, t0, t1, t))(ts)
        return fast, slow

    fast, slow = both(ts)
    bound = _bound(solver, info, t0, t1)
    for f, s, b in zip(*(jtu.tree_leaves(x) for x in (fast, slow, bound))):
        assert f.dtype == s.dtype
        assert float(jnp.max(jnp.abs(f - s))) <= float(b)
    # At the step's start, the state itself.
    at_t0 = jax.jit(solver.interpolator(info, t0, t1))(t0)
    for f, y in zip(jtu.tree_leaves(at_t0), jtu.tree_leaves(_y0())):
        assert jnp.array_equal(f, y)


@pytest.mark.parametrize("solver", _SOLVERS, ids=lambda s: type(s).__name__)
# The full suite; the quick loop's interpolator:
# test_interpolator_matches_interpolate_under_jit_and_vmap[Tsit5].
@pytest.mark.slow
def test_interpolator_derivatives(solver):
    """Its derivatives in `t` and in what the step depends on (the initial state,
    the closed-over `args`) are `interpolate`'s."""
    y0 = {"v": jnp.array([1.0, -2.0, 0.5]), "s": jnp.asarray(0.3)}

    def value(kind, t, y0, args):
        info, t0, t1 = _step(solver, y0, args)
        if kind == "fast":
            y = solver.interpolator(info, t0, t1)(t)
        else:
            y = solver.interpolate(info, t0, t1, t)
        return jnp.sum(jnp.sin(y["v"])) + y["s"] ** 2

    grad = jax.jit(jax.grad(value, argnums=(1, 2, 3)), static_argnums=0)
    for t in (0.2, 0.31, 0.5):
        fast = grad("fast", jnp.asarray(t), y0, jnp.asarray(0.7))
        slow = grad("slow", jnp.asarray(t), y0, jnp.asarray(0.7))
        # Derivatives of O(1) values over a step of 0.3: rounding, amplified by
        # the dense coefficients (sums up to ~1e2 for Dopri8) and 1/h.
        for f, s in zip(jtu.tree_leaves(fast), jtu.tree_leaves(slow)):
            assert float(jnp.max(jnp.abs(f - s))) <= 1e3 * np.finfo(np.float64).eps


# Quick loop: events/test_events.py::test_real_event_located_exactly.
@pytest.mark.slow
def test_the_search_uses_it():
    """A continuing event's occurrence times with Tsit5 (its `interpolator`)
    against the exact ones: `y' = 1`, reset to 0 at `y = 0.3`, so occurrences at
    0.3, 0.6, ... (each located to about an ulp: the dense output is exact)."""

    def one(rate):
        event = sk.Event(
            lambda t, y, args: y - 0.3,
            direction=True,
            effect=lambda t, y, args: 0 * y,
            max_events=8,
        )
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: rate),
            sk.Tsit5(),
            0.0,
            1.0,
            0.07,
            jnp.asarray(0.0),
            event=event,
            stepsize_controller=sk.PIDController(rtol=1e-9, atol=1e-9),
        )
        assert sol.events is not None
        return sol.events.ts

    ts = jax.jit(jax.vmap(one))(jnp.array([1.0, 2.0]))
    exact = np.full((2, 8), np.inf)
    exact[0, :3] = 0.3 * np.arange(1, 4)
    exact[1, :6] = 0.15 * np.arange(1, 7)
    finite = np.isfinite(exact)
    assert np.array_equal(np.isfinite(np.asarray(ts)), finite)
    # Each time inherits the errors of those before it: a few ulps of t ~ 1 each.
    assert np.max(np.abs(np.asarray(ts)[finite] - exact[finite])) <= 1e-13
