"""solverkit against diffrax 0.7.2, name by name: each
snippet runs on both libraries. Errors: solverkit's exception is of the class diffrax
raises (or a subclass that is also a `ValueError`) and its message contains
diffrax's words, which scripts and tests match on. Differences kept on purpose are
checked as `docs/migrating.md` describes them."""

import re

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64

import solverkit as sk


LIBS = (diffrax, sk)


def _decay(lib):
    return lib.ODETerm(lambda t, y, args: -y)


def _solve(lib, **kw):
    kw = dict(solver=lib.Euler(), t0=0.0, t1=1.0, dt0=0.1, y0=jnp.array([1.0])) | kw
    return lib.diffeqsolve(
        kw.pop("terms", _decay(lib)),
        kw.pop("solver"),
        kw.pop("t0"),
        kw.pop("t1"),
        kw.pop("dt0"),
        kw.pop("y0"),
        **kw,
    )


def _pid(lib, **kw):
    return lib.PIDController(rtol=1e-5, atol=1e-7, **kw)


# (id, snippet, exception class diffrax raises, diffrax's words)
_ERRORS = [
    ("dt0 sign", lambda lib: _solve(lib, dt0=-0.1), RuntimeError,
     "Must have (t1 - t0) * dt0 >= 0"),
    ("dt0 sign backwards", lambda lib: _solve(lib, t0=1.0, t1=0.0), RuntimeError,
     "Must have (t1 - t0) * dt0 >= 0"),
    ("constant dt0 None", lambda lib: _solve(lib, dt0=None), ValueError,
     "Constant step size solvers cannot select step size automatically"),
    ("saveat ts after t1",
     lambda lib: _solve(lib, saveat=lib.SaveAt(ts=jnp.array([0.5, 2.0]))),
     RuntimeError, "saveat.ts must lie between t0 and t1"),
    ("saveat ts before t0",
     lambda lib: _solve(lib, saveat=lib.SaveAt(ts=jnp.array([-0.5, 0.5]))),
     RuntimeError, "saveat.ts must lie between t0 and t1"),
    ("saveat ts not monotonic",
     lambda lib: _solve(lib, saveat=lib.SaveAt(ts=jnp.array([0.5, 0.2, 0.6]))),
     RuntimeError, "saveat.ts must be increasing or decreasing"),
    ("saveat ts against the direction",
     lambda lib: _solve(lib, saveat=lib.SaveAt(ts=jnp.array([0.5, 0.2]))),
     RuntimeError, "saveat.ts must be increasing or decreasing"),
    ("max_steps None with steps",
     lambda lib: _solve(lib, max_steps=None, saveat=lib.SaveAt(steps=True)),
     ValueError, "`max_steps=None` is incompatible with saving at `steps=n`"),
    ("max_steps None with dense",
     lambda lib: _solve(lib, max_steps=None, saveat=lib.SaveAt(t1=True, dense=True)),
     ValueError, "`max_steps=None` is incompatible with `saveat.dense=True`"),
    ("PID without error estimate",
     lambda lib: _solve(lib, stepsize_controller=_pid(lib)), RuntimeError,
     "Cannot use adaptive step sizes with a solver that does not provide error "
     "estimates"),
    ("StepTo with dt0",
     lambda lib: _solve(lib, stepsize_controller=lib.StepTo(jnp.array([0.0, 1.0]))),
     ValueError, "`dt0` should be `None`. Step location is already determined"),
    ("StepTo ends",
     lambda lib: _solve(
         lib, dt0=None, stepsize_controller=lib.StepTo(jnp.array([0.0, 0.5, 0.9]))
     ),
     RuntimeError, "Must have `t0==ts[0]` and `t1==ts[-1]`"),
    ("StepTo not monotonic",
     lambda lib: _solve(
         lib, dt0=None, stepsize_controller=lib.StepTo(jnp.array([0.0, 0.7, 0.5, 1.0]))
     ),
     RuntimeError, "`StepTo(ts=...)` must be strictly increasing"),
    ("StepTo short", lambda lib: lib.StepTo(jnp.array([0.0])), ValueError,
     "`ts` must have length at least 2"),
    ("StepTo 2-D", lambda lib: lib.StepTo(jnp.zeros((2, 2))), ValueError,
     "`ts` must be one-dimensional"),
    ("SaveAt subs and t0",
     lambda lib: lib.SaveAt(t0=True, subs=lib.SubSaveAt(t1=True)), ValueError,
     "Cannot pass both `subs` and any of `t0`, `t1`, `ts`, `steps` to `SaveAt`"),
    ("evaluate without dense", lambda lib: _solve(lib).evaluate(0.5), ValueError,
     "Dense solution has not been saved; pass SaveAt(dense=True)."),
    ("derivative without dense", lambda lib: _solve(lib).derivative(0.5),
     ValueError, "Dense solution has not been saved; pass SaveAt(dense=True)."),
    ("vector field structure",
     lambda lib: _solve(lib, terms=lib.ODETerm(lambda t, y, args: (y, y))),
     ValueError, "must return a pytree with the same structure as `y0`"),
    ("implicit solver, fixed steps", lambda lib: _solve(lib, solver=lib.Kvaerno3()),
     ValueError, "A fixed step size controller is being used alongside an implicit "
     "solver"),
    ("IMEX solver, one term",
     lambda lib: _solve(lib, solver=lib.KenCarp3(), stepsize_controller=_pid(lib)),
     ValueError, "Terms are not compatible with solver!"),
    ("Clip around a fixed controller",
     lambda lib: lib.ClipStepSizeController(lib.ConstantStepSize()), ValueError,
     "Can only apply `ClipStepSizeController` to adaptive step size controllers"),
    ("Clip store_rejected_steps=0",
     lambda lib: lib.ClipStepSizeController(_pid(lib), store_rejected_steps=0),
     ValueError, "`store_rejected_steps must either be `None`"),
    ("event and discrete_terminating_event",
     lambda lib: _solve(
         lib,
         event=lib.Event(lambda t, y, args, **kw: t > 0.5),
         discrete_terminating_event=lib.DiscreteTerminatingEvent(
             lambda state, **kw: False
         ),
     ),
     ValueError, "Cannot pass both"),
    ("event direction structure",
     lambda lib: lib.Event((lambda t, y, args, **kw: t,), direction=(True, False)),
     ValueError, "Missmatch in the structure of `cond_fn` and `direction`"),
    ("event not scalar",
     lambda lib: _solve(lib, event=lib.Event(lambda t, y, args, **kw: y)),
     ValueError, "Event functions must return a scalar"),
    ("event of int dtype",
     lambda lib: _solve(lib, event=lib.Event(lambda t, y, args, **kw: jnp.array(1))),
     ValueError, "Event functions must return either a boolean or a float"),
    ("steady_state_event, fixed steps",
     lambda lib: _solve(lib, t1=jnp.inf, event=lib.Event(lib.steady_state_event())),
     ValueError, "The `rtol`, `atol`, and `norm` for `steady_state_event` default"),
    ("backsolve and subs",
     lambda lib: _solve(
         lib,
         adjoint=lib.BacksolveAdjoint(),
         saveat=lib.SaveAt(subs=(lib.SubSaveAt(t1=True), lib.SubSaveAt(t0=True))),
     ),
     NotImplementedError, "Cannot use `adjoint=BacksolveAdjoint()` with `SaveAt(subs"),
    ("backsolve and steps",
     lambda lib: _solve(
         lib, adjoint=lib.BacksolveAdjoint(), saveat=lib.SaveAt(steps=True)
     ),
     NotImplementedError,
     "Cannot use `adjoint=BacksolveAdjoint()` with `saveat=SaveAt(steps=True)`"),
    ("backsolve and fn",
     lambda lib: _solve(
         lib,
         adjoint=lib.BacksolveAdjoint(),
         saveat=lib.SaveAt(t1=True, fn=lambda t, y, args: y),
     ),
     NotImplementedError,
     "Cannot use `adjoint=BacksolveAdjoint()` with `saveat=SaveAt(fn=...)`"),
    ("backsolve and events",
     lambda lib: _solve(
         lib,
         adjoint=lib.BacksolveAdjoint(),
         event=lib.Event(lambda t, y, args, **kw: t > 0.5),
     ),
     NotImplementedError, "BacksolveAdjoint` is not compatible with events"),
]  # fmt: skip


# The full suite: a second case of the same check and message (each compiles a
# solve in both libraries first); the quick loop keeps the first ("saveat ts after
# t1", "saveat ts not monotonic", "evaluate without dense").
_FULL_SUITE_ERRORS = (
    "saveat ts before t0",
    "saveat ts against the direction",
    "derivative without dense",
)


@pytest.mark.parametrize(
    "snippet, error, words",
    [
        pytest.param(
            *c[1:],
            id=c[0],
            marks=pytest.mark.slow if c[0] in _FULL_SUITE_ERRORS else (),
        )
        for c in _ERRORS
    ],
)
def test_errors_as_diffrax(snippet, error, words):
    for lib in LIBS:
        # equinox on a TPU cannot raise from the device: it prints every failed check
        # and raises the last one's message, so diffrax's words go unchecked there.
        peer_on_tpu = lib is diffrax and jax.default_backend() == "tpu"
        with pytest.raises(error, match=None if peer_on_tpu else re.escape(words)):
            snippet(lib)
    with pytest.raises(ValueError):  # solverkit's promise: bad input is a ValueError
        snippet(sk)


# Quick loop: diffrax_compat/test_diffrax_api.py::test_max_steps_none.
@pytest.mark.slow
def test_reverse_mode_without_max_steps_as_diffrax():
    import jax

    for lib in LIBS:
        f = lambda y0: _solve(lib, y0=y0, max_steps=None).ys.sum()  # noqa: B023, E731
        with pytest.raises(RuntimeError, match="Cannot reverse-mode autodifferentiate"):
            jax.grad(f)(jnp.array([1.0]))


# The full suite (a comparison with diffrax); the quick loop reads `stats` in
# ensemble/test_ensemble.py::test_under_jit_and_the_work_done and
# solve/test_integrate.py::test_backwards_against_analytic.
@pytest.mark.slow
def test_stats_as_diffrax():
    """The same keys, values and dtypes (the default integer: int64 with x64)."""
    with float64():
        stats = {
            lib: _solve(
                lib, solver=lib.Tsit5(), stepsize_controller=_pid(lib), dt0=0.05
            ).stats
            for lib in LIBS
        }
    ours, theirs = stats[sk], stats[diffrax]
    assert sorted(ours) == sorted(theirs)
    assert ours["max_steps"] == theirs["max_steps"] == 4096
    for key in ("num_steps", "num_accepted_steps", "num_rejected_steps"):
        assert jnp.shape(ours[key]) == jnp.shape(theirs[key]) == ()
        assert ours[key].dtype == theirs[key].dtype
        assert int(ours[key]) == int(theirs[key])
    assert ours["num_steps"].dtype == jnp.int64


@pytest.mark.parametrize(
    "options",
    [dict(dtmin=0.3), dict(dtmax=0.02), dict(dtmin=0.2, force_dtmin=False)],
    ids=str,
)
# Quick loop:
# solve/test_controllers.py::test_clip_steps_land_on_step_ts_and_jump_ts[False].
@pytest.mark.slow
def test_pid_clips_given_dt0_as_diffrax(options):
    """A given `dt0` is clipped to `[dtmin, dtmax]` (diffrax's `init` does so)."""

    def steps(lib):
        sol = _solve(
            lib,
            solver=lib.Tsit5(),
            terms=lib.ODETerm(
                lambda t, y, args: jnp.stack([y[1], -10 * jnp.sin(y[0]) - 0.1 * y[1]])
            ),
            y0=jnp.array([2.5, 0.0]),
            t1=2.0,
            dt0=0.05,
            stepsize_controller=_pid(lib, **options),
            saveat=lib.SaveAt(steps=True),
            max_steps=128,
            throw=False,
        )
        return sol.ts, sol.stats["num_steps"], sol.result == lib.RESULTS.successful

    with float64():
        ours, theirs = steps(sk), steps(diffrax)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-10)
    assert int(ours[1]) == int(theirs[1])
    assert bool(ours[2]) == bool(theirs[2])


def test_results_names_and_messages_as_diffrax():
    names = [n for n in diffrax.RESULTS._name_to_item if not n.startswith("_")]
    for name in names:
        assert isinstance(getattr(sk.RESULTS, name), sk.RESULTS.successful.__class__)
    assert sk.RESULTS.nonlinear_divergence is sk.RESULTS.implicit_divergence
    for name in ("max_steps_reached", "dt_min_reached", "event_occurred"):
        words = diffrax.RESULTS[getattr(diffrax.RESULTS, name)].rstrip(".")
        assert words in sk.RESULTS[getattr(sk.RESULTS, name)]
    with pytest.warns(DeprecationWarning):
        assert sk.RESULTS.discrete_terminating_event_occurred is (
            sk.RESULTS.event_occurred
        )


# Quick loop: solve/test_errors.py::test_throw_false_sets_result[dt_min].
@pytest.mark.slow
def test_dt_min_reached_message_as_diffrax():
    """With `force_dtmin=False` both stop with `dt_min_reached`, and its message
    holds diffrax's words."""

    def solve(lib, throw):
        return _solve(
            lib,
            solver=lib.Tsit5(),
            terms=lib.ODETerm(lambda t, y, args: y**2),
            t1=2.0,
            stepsize_controller=_pid(lib, dtmin=1e-3, force_dtmin=False),
            throw=throw,
        )

    for lib in LIBS:
        assert bool(solve(lib, False).result == lib.RESULTS.dt_min_reached)
        with pytest.raises(RuntimeError, match="The minimum step size was reached"):
            solve(lib, True)


# --- Differences kept on purpose (docs/migrating.md, "What differs") -----------------


# Quick loop: solve/test_saveat.py::test_t0_ts_t1_and_dense.
@pytest.mark.slow
def test_solution_t1_is_where_the_solve_ended():
    """diffrax's `Solution.t1` is the `t1` passed in; solverkit's is where the solve
    ended (the event time, or where it stopped); `ts` agree."""
    event = lambda lib: lib.Event(lambda t, y, args, **kw: t > 0.55)  # noqa: E731
    sols = {lib: _solve(lib, event=event(lib)) for lib in LIBS}
    assert float(sols[diffrax].t1) == 1.0
    assert float(sols[sk].t1) == pytest.approx(0.6)
    np.testing.assert_allclose(sols[sk].ts, sols[diffrax].ts)
    np.testing.assert_allclose(sols[sk].ys, sols[diffrax].ys, rtol=1e-6)


# The full suite; the quick loop's dense output against diffrax's:
# diffrax_compat/test_dense_info.py::test_dense_info_is_diffraxs[Tsit5].
@pytest.mark.slow
def test_dense_output_past_t1_extrapolates():
    """diffrax's `evaluate` past the end of the solve is NaN; solverkit's extends the
    last step's interpolant. Inside the interval they agree."""
    ts = jnp.array([1.5, 0.0, 0.35, 1.0])

    def at_ts(lib):  # one jitted program (op by op: ~15 compiles a library)
        return jax.jit(jax.vmap(_solve(lib, saveat=lib.SaveAt(dense=True)).evaluate))(
            ts
        )

    ours, theirs = at_ts(sk), at_ts(diffrax)
    assert np.isnan(theirs[0]).all()
    np.testing.assert_allclose(ours[0], 0.9**10 * 4 / 9, rtol=1e-5)
    np.testing.assert_allclose(ours[1:], theirs[1:], rtol=1e-6)


# The full suite; the quick loop's zero-length solve:
# solve/test_integrate.py::test_t0_equals_t1.
@pytest.mark.slow
def test_zero_length_solve_saves_every_row():
    """With `t0 == t1` and `SaveAt(t0, ts, steps, t1)`, diffrax fills two rows (no
    step is taken, and one of `ts`/`t1` is lost); solverkit fills the `t0`, `ts` and
    `t1` rows with `y0`."""

    def saveat(lib):
        return lib.SaveAt(t0=True, ts=jnp.array([0.0]), steps=True, t1=True)

    sols = {lib: _solve(lib, t1=0.0, saveat=saveat(lib), max_steps=4) for lib in LIBS}
    for lib, rows in ((sk, 3), (diffrax, 2)):
        ts, ys = np.asarray(sols[lib].ts), np.asarray(sols[lib].ys)
        assert ts.shape == (6,)
        np.testing.assert_array_equal(ts[:rows], 0.0)
        np.testing.assert_array_equal(ys[:rows], 1.0)
        assert np.all(ts[rows:] == np.inf)
    assert int(sols[sk].stats["num_steps"]) == int(sols[diffrax].stats["num_steps"])


def test_save_time_at_t0_gradient_as_diffrax():
    """`d loss / d ts` where `SaveAt(ts)` starts at `t0`: the row there moves with
    its time as the solution does (the one-sided derivative `f(t0, y0)`, as diffrax's
    first step interpolates it); it was 0. Every adjoint, under `jit` and `vmap`."""

    def loss(lib, ts, adjoint):
        sol = lib.diffeqsolve(
            lib.ODETerm(lambda t, y, a: -0.7 * y), lib.Tsit5(), 0.0, 1.0, None,
            jnp.array([1.0, 2.0]), saveat=lib.SaveAt(ts=ts),
            stepsize_controller=lib.PIDController(rtol=1e-8, atol=1e-8),
            adjoint=adjoint,
        )  # fmt: skip
        return jnp.sum(sol.ys[:, 0] * jnp.arange(1, 4)) + jnp.sum(sol.ys[:, 1] ** 2)

    with float64():
        ts = jnp.array([0.0, 0.5, 1.0])
        grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=(0, 2))
        want = grad(diffrax, ts, diffrax.RecursiveCheckpointAdjoint())
        np.testing.assert_allclose(want[0], -6.3, rtol=1e-6)  # y1' + 2 y2 y2' at t0
        for adjoint in (sk.RecursiveCheckpointAdjoint(), sk.DirectAdjoint()):
            np.testing.assert_allclose(grad(sk, ts, adjoint), want, rtol=1e-7)
        back = grad(sk, ts, sk.BacksolveAdjoint())
        np.testing.assert_allclose(back, want, rtol=1e-6)
        many = jax.vmap(grad, in_axes=(None, 0, None))(
            sk, jnp.stack([ts, ts]), sk.RecursiveCheckpointAdjoint()
        )
        np.testing.assert_allclose(many, jnp.stack([want, want]), rtol=1e-7)

        def imex(ts):  # a MultiTerm: the row at t0 moves with the parts' sum
            terms = sk.MultiTerm(
                sk.ODETerm(lambda t, y, a: -0.7 * y),
                sk.ODETerm(lambda t, y, a: -0.3 * y),
            )
            sol = sk.diffeqsolve(
                terms, sk.KenCarp4(), 0.0, 1.0, 0.01, jnp.array([1.0, 2.0]),
                saveat=sk.SaveAt(ts=ts),
                stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
            )  # fmt: skip
            return jnp.sum(sol.ys[:, 0] * jnp.arange(1, 4)) + jnp.sum(sol.ys[:, 1] ** 2)

        np.testing.assert_allclose(jax.grad(imex)(ts)[0], -9.0, rtol=1e-12)
