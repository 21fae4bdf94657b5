"""`ClipStepSizeController` called by hand gives diffrax's step ends exactly: a step
stops one ulp before a jump and the next starts one ulp after it, nested controllers
included (diffrax's own test compares with `==`). The loop's own convention (steps
that end at the jump itself) is tested in solve/test_controllers.py."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


def _nested(lib, same=False):
    # rtol=0, atol=1: an error of 0 grows the step by factormax, 1e6 rejects it;
    # exact in both libraries, so the ends differ only by how they are clipped.
    pid = lib.PIDController(rtol=0.0, atol=1.0)
    inner = lib.ClipStepSizeController(pid, jump_ts=[3.0, 13.0], step_ts=[23.0])
    if same:  # the same time in an inner step_ts and an outer jump_ts
        return lib.ClipStepSizeController(inner, step_ts=[2.0], jump_ts=[2.0, 23.0])
    return lib.ClipStepSizeController(inner, step_ts=[2.0, 13.0], jump_ts=[23.0])


_CASES = {
    "single": lambda lib: lib.ClipStepSizeController(
        lib.PIDController(rtol=0.0, atol=1.0), step_ts=[1.5, 7.0], jump_ts=[4.0, 9.0]
    ),
    "nested": _nested,
    "same_time": lambda lib: _nested(lib, same=True),
    "pid_step_ts": lambda lib: lib.PIDController(  # diffrax's older spelling
        rtol=0.0, atol=1.0, step_ts=jnp.array([1.5, 7.0]), jump_ts=jnp.array([4.0])
    ),
}


def _adapt(controller, *args):
    return controller.adapt_step_size(*args)


def _walk(lib, controller, errors, jit):
    """The controller's outputs over a walk of steps, each from the last's proposal;
    `errors[i]` is step i's error (0 accepts and grows, 1e6 rejects)."""
    term = lib.ODETerm(lambda t, y, args: -y)
    func = lambda terms, t, y, args: -y  # noqa: E731
    y = jnp.array(0.0)
    t1, state = controller.init(term, -1.0, 30.0, y, 0.5, None, func, 5)
    t0 = jnp.asarray(-1.0)
    adapt = controller.adapt_step_size
    if jit:  # the controller an operand, as in a loop
        adapt = jax.tree_util.Partial(eqx.filter_jit(_adapt), controller)
    out = []
    for error in errors:
        keep, t0, t1, jump, state, _ = adapt(
            t0, t1, y, y, None, jnp.asarray(error), 5, state
        )
        out.append((bool(keep), float(t0), float(t1), bool(jump)))
    return out


# The full suite (every controller call made eagerly, in both libraries); the quick
# loop's clipped steps: test_by_hand_under_vmap.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(_CASES))
def test_step_ends_are_diffraxs_exactly(case):
    errors = [0.0, 0.0, 1e6, 0.0] + [0.0] * 8 + [1e6, 0.0, 0.0, 0.0]
    ref = _walk(diffrax, _CASES[case](diffrax), errors, jit=False)
    assert _walk(sk, _CASES[case](sk), errors, jit=False) == ref  # to the ulp
    assert any(jump for *_, jump in ref)  # the walk went past jumps
    # Compiled, XLA may fuse the PID's `t + 10 dt` differently (one rounding fewer):
    # ends the PID alone proposed agree to a few ulps, and the flags exactly.
    jitted = _walk(sk, _CASES[case](sk), errors, jit=True)
    for mine, theirs in zip(jitted, ref, strict=True):
        assert (mine[0], mine[3]) == (theirs[0], theirs[3])
        np.testing.assert_allclose(mine[1:3], theirs[1:3], rtol=8 * np.finfo(float).eps)


# Quick loop:
# solve/test_controllers.py::test_clip_steps_land_on_step_ts_and_jump_ts[False].
@pytest.mark.slow
def test_nested_by_diffraxs_rule():
    # diffrax's rule stated on its own: ends one ulp before each jump, the next start
    # one ulp after it, an inner jump and an outer step time both respected.
    before = lambda t: float(np.nextafter(t, -np.inf))  # noqa: E731
    after = lambda t: float(np.nextafter(t, np.inf))  # noqa: E731
    controller = _nested(sk)
    term = sk.ODETerm(lambda t, y, args: -y)
    _, state = controller.init(term, -1.0, 0.0, 0.0, 4.0, None, None, 5)
    adapt = jax.tree_util.Partial(eqx.filter_jit(_adapt), controller)
    y, err, order = jnp.array(0.0), jnp.array(0.0), 5

    def walk(t0, t1):
        nonlocal state
        _, t0, t1, jump, state, _ = adapt(t0, t1, y, y, None, err, order, state)
        return float(t0), float(t1), bool(jump)

    assert walk(0.0, 1.0) == (1.0, 2.0, False)  # the outer step time
    assert walk(1.0, 2.0) == (2.0, before(3.0), False)  # the inner jump
    assert walk(10.0, 11.0) == (11.0, before(13.0), False)
    t0, t1, jump = walk(11.0, before(13.0))
    assert (t0, t1, jump) == (after(13.0), before(23.0), True)  # outer jump next
    t0, t1, jump = walk(21.0, before(23.0))
    assert t0 == after(23.0) and t1 > t0 and jump


def test_by_hand_under_vmap():
    # A batch of step starts, each clipped as diffrax clips it alone.
    starts = jnp.array([0.0, 2.5, 3.5, 8.0])
    ours, ref = _CASES["single"](sk), _CASES["single"](diffrax)

    def ends(controller, t0):
        term = sk.ODETerm(lambda t, y, args: -y)
        _, state = controller.init(term, t0, 30.0, 0.0, 0.5, None, None, 5)
        zero = jnp.array(0.0)
        out = controller.adapt_step_size(t0, t0 + 1.0, zero, zero, None, zero, 5, state)
        return out[1], out[2], out[3]

    # Jitted (op by op, the two were ~110 compiles).
    got = jax.jit(jax.vmap(lambda t: ends(ours, t)))(starts)
    alone = jax.jit(lambda t: ends(ref, t))
    for i, t0 in enumerate(starts):
        want = alone(t0)
        assert [float(g[i]) for g in got[:2]] == [float(w) for w in want[:2]]
        assert bool(got[2][i]) == bool(want[2])


@pytest.mark.parametrize("solver", ["Heun", "Tsit5"])
@pytest.mark.parametrize("clip", [False, True])
# Quick loop: one case (Tsit5 and clipping: test_by_hand_under_vmap,
# solve/test_controllers.py::test_clip_steps_land_on_step_ts_and_jump_ts).
@pytest.mark.quick_cases("False-Heun")
def test_initial_step_by_hand(solver, clip):
    # `init(..., dt0=None, ..., func, ...)` calls `func(terms, t, y, args)`, as diffrax
    # does with `solver.func` (it was called as `func(t, y, args)`: a TypeError).
    # The heuristic is diffrax's own arithmetic on a bare ODETerm: equal to 1e-14.
    def first(lib):
        term = lib.ODETerm(lambda t, y, args: -args * y + jnp.sin(t))
        s = getattr(lib, solver)()
        c = lib.PIDController(rtol=1e-3, atol=1e-6)
        if clip:
            c = lib.ClipStepSizeController(c, step_ts=jnp.array([0.5]))
        y0, args = jnp.array([1.0, 2.0]), jnp.asarray(3.0)
        init = lambda y0, args: c.init(  # noqa: E731
            term, 0.0, 1.0, y0, None, args, s.func, s.error_order(term)
        )[0]
        return init(y0, args), jax.jit(init)(y0, args)

    want, got = first(diffrax), first(sk)
    np.testing.assert_allclose(got, want, rtol=1e-14)
