"""What a diffrax ODE script relies on beyond the solve itself: the names, the
exception classes, strict dtype promotion, `max_steps=None`, events that read the
solve's settings, per-condition event directions, progress meter output. Each is
checked against diffrax on the same input where diffrax gives a value."""

import contextlib
import io

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import ADAPTIVE_SOLVERS, ALL_SOLVERS, assert_tree_allclose, float64

import solverkit as sk


_NEG = sk.ODETerm(lambda t, y, args: -y)
_PID = sk.PIDController(rtol=1e-6, atol=1e-8)


@contextlib.contextmanager
def _strict():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


# --- Names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [c for c, _, _ in ALL_SOLVERS], ids=lambda c: c.__name__
)
def test_adaptive_solver_classes_match_diffrax(cls):
    theirs = getattr(diffrax, cls.__name__)()
    assert isinstance(cls(), sk.AbstractAdaptiveSolver) == isinstance(
        theirs, diffrax.AbstractAdaptiveSolver
    )
    assert isinstance(cls(), sk.AbstractAdaptiveSolver) == (cls in ADAPTIVE_SOLVERS)
    assert isinstance(cls(), sk.AbstractERK) == isinstance(theirs, diffrax.AbstractERK)


def test_ode_term_methods():
    term = sk.ODETerm(lambda t, y, args: -2 * y)
    y = jnp.array([1.0, 3.0])
    dt = term.contr(0.5, 2.0)
    np.testing.assert_allclose(dt, 1.5)
    np.testing.assert_allclose(term.vf(0.0, y, None), -2 * y)
    np.testing.assert_allclose(term.vf_prod(0.0, y, None, dt), -3 * y)
    np.testing.assert_allclose(term.prod(term.vf(0.0, y, None), dt), -3 * y)
    assert sk.ODETerm[jax.Array] is sk.ODETerm


def test_results_enumeration():
    assert len(sk.RESULTS) == len(list(sk.RESULTS)) > 5
    message = sk.RESULTS[sk.RESULTS.max_steps_reached]
    assert isinstance(message, str) and "max_steps" in message
    assert sk.RESULTS["nonfinite"] is sk.RESULTS.nonfinite
    assert sk.RESULTS.successful._value == 0


def test_made_jump_is_false_and_static():
    @jax.jit
    def run(y0):
        sol = sk.diffeqsolve(
            _NEG, sk.Tsit5(), 0, 1, 0.1, y0, saveat=sk.SaveAt(t1=True, made_jump=True)
        )
        assert sol.made_jump is False
        return sol.ys

    run(1.0)
    no_jump = sk.diffeqsolve(_NEG, sk.Tsit5(), 0, 1, 0.1, 1.0, made_jump=False)
    assert no_jump.made_jump is None


# --- Errors of both kinds -------------------------------------------------------------


def test_bad_input_is_value_and_runtime_error():
    for bad in (
        dict(saveat=sk.SaveAt(ts=[0.0])),  # before t0 = 0.1
        dict(saveat=sk.SaveAt(ts=[3.0])),  # after t1 = 1.1
        dict(stepsize_controller=sk.StepTo(jnp.linspace(0.0, 1.1, 4)), dt0=None),
    ):
        kw = dict(dt0=0.1) | bad
        for error in (ValueError, RuntimeError):
            with pytest.raises(error):
                sk.diffeqsolve(_NEG, sk.Euler(), 0.1, 1.1, y0=1.0, **kw)
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="monotonic"):
            sk.SaveAt(ts=[0.0, 2.3, 2.0])
        with pytest.raises(error, match="monotonic"):
            sk.StepTo(jnp.array([0.0, 2.3, 2.0])).check(sk.Euler(), None, None, None)


@pytest.mark.parametrize(
    "saveat",
    [
        sk.SaveAt(steps=True),
        sk.SaveAt(ts=[0.5], fn=lambda t, y, args: 2 * y),
        sk.SaveAt(subs=(sk.SubSaveAt(t1=True), sk.SubSaveAt(ts=[0.5]))),
    ],
    ids=["steps", "fn", "subs"],
)
def test_backsolve_unsupported_is_value_and_not_implemented_error(saveat):
    def loss(y0):
        sol = sk.diffeqsolve(
            _NEG,
            sk.Tsit5(),
            0,
            1,
            0.1,
            y0,
            saveat=saveat,
            adjoint=sk.BacksolveAdjoint(),
        )
        return sol.ys

    for error in (ValueError, NotImplementedError):
        with pytest.raises(error, match="BacksolveAdjoint does not support"):
            jax.grad(lambda y: jnp.sum(jax.tree.leaves(loss(y))[0]))(1.0)


# --- max_steps=None -------------------------------------------------------------------


def test_max_steps_none():
    with float64():
        sol = sk.diffeqsolve(
            _NEG,
            sk.Tsit5(),
            0.0,
            4.0,
            None,
            1.0,
            stepsize_controller=_PID,
            max_steps=None,
        )
        np.testing.assert_allclose(sol.ys, [np.exp(-4.0)], rtol=1e-6)
        assert sol.stats["max_steps"] is None
        # Reverse mode: BacksolveAdjoint has no bound to keep; the checkpointed
        # adjoint says what to pass instead.
        grad = jax.grad(
            lambda y: sk.diffeqsolve(
                _NEG,
                sk.Tsit5(),
                0.0,
                4.0,
                0.1,
                y,
                max_steps=None,
                adjoint=sk.BacksolveAdjoint(),
            ).ys[0]
        )(1.0)
        np.testing.assert_allclose(grad, np.exp(-4.0), rtol=1e-5)
    with pytest.raises(ValueError, match="max_steps"):
        jax.grad(
            lambda y: sk.diffeqsolve(_NEG, sk.Tsit5(), 0, 1, 0.1, y, max_steps=None).ys[
                0
            ]
        )(1.0)
    for kw in (
        dict(saveat=sk.SaveAt(steps=True)),
        dict(saveat=sk.SaveAt(dense=True)),
        dict(adjoint=sk.DirectAdjoint()),
    ):
        with pytest.raises(ValueError, match="max_steps"):
            sk.diffeqsolve(_NEG, sk.Tsit5(), 0, 1, 0.1, 1.0, max_steps=None, **kw)


# --- Strict dtype promotion -----------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["int-times", "complex-pid", "complex-dense", "float32-pid-event", "complex-grad"],
)
def test_strict_dtype_promotion(case):
    """Under `jax_numpy_dtype_promotion="strict"` (diffrax's own test setting), the
    engine still runs: it promotes on purpose, and only the user's functions are
    held to the user's setting."""
    y0c = np.array([1.0 + 1.0j, 2.0])
    with (
        float64(),
        _strict(),
        pytest.warns(UserWarning) if "complex" in case else (contextlib.nullcontext()),
    ):
        if case == "int-times":
            out = sk.diffeqsolve(
                _NEG,
                sk.Euler(),
                jnp.array(0, jnp.int32),
                jnp.array(1, jnp.int32),
                jnp.array(0.01, jnp.float32),
                jnp.ones(2, jnp.float32),
            ).ys
            np.testing.assert_allclose(out, [[0.99**100] * 2], rtol=1e-5)
        elif case == "complex-pid":
            out = sk.diffeqsolve(
                _NEG, sk.Tsit5(), 0, 1, None, y0c, stepsize_controller=_PID
            ).ys
            np.testing.assert_allclose(out[0], y0c * np.exp(-1), rtol=1e-5)
        elif case == "complex-dense":
            sol = sk.diffeqsolve(
                _NEG,
                sk.Tsit5(),
                0,
                1,
                None,
                y0c,
                stepsize_controller=_PID,
                saveat=sk.SaveAt(ts=[0.3, 0.7], dense=True),
            )
            np.testing.assert_allclose(sol.evaluate(0.5), y0c * np.exp(-0.5), rtol=1e-5)
            np.testing.assert_allclose(
                sol.derivative(0.5), -y0c * np.exp(-0.5), rtol=1e-4
            )
        elif case == "float32-pid-event":
            sol = sk.diffeqsolve(
                _NEG,
                sk.Tsit5(),
                0.0,
                1.0,
                None,
                jnp.ones(2, jnp.float32),
                stepsize_controller=_PID,
                event=sk.Event(lambda t, y, args, **kw: y[0] - 0.5),
            )
            np.testing.assert_allclose(sol.ts, [np.log(2.0)], rtol=1e-5)
        else:
            grad = jax.grad(
                lambda y: jnp.sum(
                    jnp.abs(
                        sk.diffeqsolve(
                            _NEG,
                            sk.Tsit5(),
                            0.0,
                            1.0,
                            None,
                            y,
                            stepsize_controller=_PID,
                        ).ys
                    )
                    ** 2
                )
            )(y0c)
            # Against JAX's own gradient of the exact solution (its convention for
            # complex inputs).
            exact = jax.grad(lambda y: jnp.sum(jnp.abs(y * np.exp(-1.0 + 0j)) ** 2))(
                y0c
            )
            np.testing.assert_allclose(grad, exact, rtol=1e-5)


def test_complex_state_warns_as_diffrax_does():
    y0 = {"a": jnp.ones(2, jnp.complex64)}
    term = sk.ODETerm(lambda t, y, args: jax.tree.map(lambda v: -1j * v, y))
    with pytest.warns(UserWarning, match="Complex dtype"):
        sol = sk.diffeqsolve(term, sk.Euler(), 0.0, 1.0, 0.01, y0)
    np.testing.assert_allclose(sol.ys["a"][0], (1 - 0.01j) ** 100 * np.ones(2), 1e-5)


def test_empty_state_with_pid():
    sol = sk.diffeqsolve(
        _NEG, sk.Tsit5(), 0.0, 1.0, 0.01, jnp.zeros((2, 0)), stepsize_controller=_PID
    )
    assert sol.result == sk.RESULTS.successful
    assert sol.ys.shape == (1, 2, 0)
    assert int(sol.stats["num_steps"]) < 10


# --- Events ---------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "direction",
    [None, True, False, (True, True), (True, False), (False, True), (False, None)],
    ids=str,
)
def test_event_direction_per_condition(direction):
    t, mask = _two_crossings(sk, direction)
    ref_t, ref_mask = _two_crossings(diffrax, direction)
    np.testing.assert_allclose(t, ref_t, atol=1e-6)
    assert mask == ref_mask


def test_event_direction_structure_checked():
    f = lambda t, y, args: y
    with pytest.raises(ValueError, match="structure of `cond_fn`"):
        sk.Event([f, f, [f, f, f]], None, [True, None, [False, True]])
    sk.Event([f, [f, f]], None, [True, [None, False]])


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
    np.testing.assert_allclose(sol.ys, [0.0], atol=1e-6)
    np.testing.assert_allclose(sol.ts, [10.0], atol=1e-6)


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


# --- Backsolve seminorm ---------------------------------------------------------------


def test_adjoint_seminorm_fewer_steps_same_gradient():
    theta = jnp.array([0.5, 1.5, 2.0])

    def grad(norm):
        controller = sk.PIDController(rtol=1e-6, atol=1e-8)
        adjoint = sk.BacksolveAdjoint(
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-8, norm=norm)
        )

        def loss(theta):
            sol = sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -theta * y + jnp.sin(t)),
                sk.Tsit5(),
                0.0,
                3.0,
                None,
                jnp.ones(3),
                stepsize_controller=controller,
                adjoint=adjoint,
            )
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss))(theta)

    with float64():
        full, semi = (
            grad(sk.PIDController.__dataclass_fields__["norm"].default),
            grad(sk.adjoint_rms_seminorm),
        )
        np.testing.assert_allclose(semi, full, rtol=1e-4)
    with pytest.raises(ValueError, match="adjoint system"):
        sk.adjoint_rms_seminorm(jnp.ones(3))


# --- Progress meters ------------------------------------------------------------------


def _text_output(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.block_until_ready(fn(*args))
        jax.effects_barrier()
    return out.getvalue()


def test_text_progress_meter_prints_as_diffrax():
    """Ten steps of 0.1: `0.00%`, then each 10%, as diffrax prints them; under
    vmap and grad too (one meter)."""

    def solve(lib, p):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -y),
            lib.Dopri5(),
            0,
            1,
            0.1,
            p * jnp.array([2.0, 3.0]),
            progress_meter=lib.TextProgressMeter(),
        ).ys[-1, 0]

    expected = "".join(f"{10 * k:.2f}%\n" for k in range(11))
    for lib in (sk, diffrax):
        assert _text_output(lambda p: solve(lib, p), 1.0) == expected, lib
        grad = jax.jit(jax.grad(lambda p: solve(lib, p)))
        assert _text_output(grad, 1.0) == expected, lib
    vmapped = jax.vmap(lambda p: solve(sk, p))
    assert _text_output(vmapped, jnp.ones(3)) == expected
    with pytest.raises(ValueError, match="minimum_increase"):
        sk.TextProgressMeter(minimum_increase=0.0)


def test_text_meter_prints_the_lines_diffrax_prints():
    # A new line once the progress has grown by more than `minimum_increase` since
    # the last line (not on a fixed grid): 0.00%, 10.20%, 20.40%, ... under vmap.
    def solve(lib, t0):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -0.2 * y),
            lib.Dopri5(),
            t0,
            5.0,
            0.01,
            1.0,
            progress_meter=lib.TextProgressMeter(minimum_increase=0.1),
        ).ys

    with float64():
        outputs = [
            _text_output(jax.vmap(lambda t0: solve(lib, t0)), jnp.arange(3.0))
            for lib in (sk, diffrax)
        ]
    assert outputs[0] == outputs[1]
    assert outputs[0].split()[:3] == ["0.00%", "10.20%", "20.40%"]


def test_tqdm_refreshes_as_diffrax_under_vmap(capfd):
    pytest.importorskip("tqdm")

    def solve(lib, t0):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -0.2 * y),
            lib.Dopri5(),
            t0,
            5,
            0.01,
            1.0,
            saveat=lib.SaveAt(steps=True),
            progress_meter=lib.TqdmProgressMeter(refresh_steps=5),
        ).ys

    counts = {}
    for lib in (sk, diffrax):
        for name, fn in {
            "plain": lambda: solve(lib, 2.0),
            "vmap": lambda: jax.vmap(lambda t0: solve(lib, t0))(jnp.arange(3.0)),
        }.items():
            capfd.readouterr()
            jax.block_until_ready(fn())
            jax.effects_barrier()
            err = capfd.readouterr().err
            counts[lib.__name__, name] = (err.count("\r"), err.count("\n"))
    for name in ("plain", "vmap"):
        assert counts["solverkit", name] == counts["diffrax", name], counts


def test_saveat_subs_fields():
    sub = sk.SubSaveAt(ts=[0.5], t1=True)
    assert sk.SaveAt(subs=sub).subs is sub
    flat = sk.SaveAt(ts=[0.5], t1=True)
    assert isinstance(flat.subs, sk.SubSaveAt) and flat.t1 and flat.subs.t1
    assert_tree_allclose(flat.ts, jnp.array([0.5]))
    with pytest.raises(AttributeError, match="several"):
        _ = sk.SaveAt(subs=[sub, sub]).ts


# --- ClipStepSizeController -----------------------------------------------------------


def _switch_solution(t, s):
    """y' = -y + [t >= s], y(0) = 1."""
    return jnp.where(t < s, jnp.exp(-t), 1 + (jnp.exp(-s) - 1) * jnp.exp(-(t - s)))


def _switch_solve(s, adjoint=sk.RecursiveCheckpointAdjoint(), t0=0.0, t1=2.0, **clip):
    controller = sk.PIDController(rtol=1e-8, atol=1e-8)
    if clip:
        controller = sk.ClipStepSizeController(controller, **clip)
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y + jnp.where(t < s, 0.0, 1.0)),
        sk.Tsit5(),
        t0,
        t1,
        None,
        jnp.asarray(_switch_solution(t0, s)),
        stepsize_controller=controller,
        saveat=sk.SaveAt(subs=[sk.SubSaveAt(t1=True), sk.SubSaveAt(steps=True)]),
        adjoint=adjoint,
        max_steps=256,
    )


@pytest.mark.parametrize("backwards", [False, True])
def test_clip_steps_land_on_step_ts_and_jump_ts(backwards):
    with float64():
        s = 0.7
        t0, t1 = (2.0, 0.0) if backwards else (0.0, 2.0)
        plain = _switch_solve(s, t0=t0, t1=t1)
        steps = _switch_solve(s, t0=t0, t1=t1, step_ts=jnp.array([0.3, s, 1.9]))
        jumps = _switch_solve(s, t0=t0, t1=t1, jump_ts=[s])
        # A step across the switch costs accuracy; so does one that ends on it where
        # its last stage sees the far side (step_ts, backwards). A jump does neither,
        # in both directions (backwards, the field is re-evaluated below the jump).
        for sol in (plain, steps, jumps):
            atol = 1e-5 if sol is plain or (sol is steps and backwards) else 1e-7
            np.testing.assert_allclose(
                sol.ys[0][-1], _switch_solution(t1, s), atol=atol
            )
        ts = np.asarray(steps.ts[1])
        for p in (0.3, s, 1.9):
            assert p in ts
        # A jump needs no rejected steps to find: fewer steps, as in diffrax.
        assert jumps.stats["num_steps"] < plain.stats["num_steps"]
        assert np.any(np.abs(np.asarray(jumps.ts[1]) - s) <= 1e-15)


def test_clip_under_jit_vmap_and_grad():
    with float64():
        s = jnp.array([0.5, 0.7, 1.1])
        final = jax.jit(
            jax.vmap(lambda s: _switch_solve(s, jump_ts=s[None]).ys[0][-1])
        )(s)
        np.testing.assert_allclose(final, _switch_solution(2.0, s), atol=1e-7)
        # The switch time moves the step that ends on it: d y(2)/ds = -exp(s - 2).
        for clip in ("step_ts", "jump_ts"):
            grad = jax.jit(
                jax.vmap(
                    jax.grad(lambda s: _switch_solve(s, **{clip: s[None]}).ys[0][-1])
                )
            )(s)
            np.testing.assert_allclose(grad, -np.exp(s - 2.0), rtol=1e-5)
        # BacksolveAdjoint steps to the same times backwards; gradients w.r.t. a
        # parameter of the field agree with the checkpointed adjoint.

        def loss(k, adjoint):
            controller = sk.ClipStepSizeController(
                sk.PIDController(rtol=1e-9, atol=1e-9), jump_ts=[0.7]
            )
            return sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -k * y + jnp.where(t < 0.7, 0.0, 1.0)),
                sk.Tsit5(),
                0.0,
                2.0,
                None,
                1.0,
                stepsize_controller=controller,
                adjoint=adjoint,
            ).ys[-1]

        g_back = jax.grad(loss)(1.3, sk.BacksolveAdjoint())
        g_rca = jax.grad(loss)(1.3, sk.RecursiveCheckpointAdjoint())
        np.testing.assert_allclose(g_back, g_rca, rtol=1e-6)


def test_clip_rejects_non_adaptive_controller():
    # diffrax's older spelling: PIDController(step_ts=..., jump_ts=...) solves as
    # ClipStepSizeController(PIDController(...), step_ts, jump_ts).
    pid = sk.PIDController(rtol=1e-4, atol=1e-6, step_ts=[3.0, 4.0], jump_ts=[3.0])
    assert pid.step_ts.tolist() == [3.0, 4.0] and pid.jump_ts.tolist() == [3.0]
    clip = pid.to_internal(None)
    assert isinstance(clip, sk.ClipStepSizeController)
    assert isinstance(clip.controller, sk.PIDController)
    assert clip.controller.step_ts is None
    assert clip.step_ts.tolist() == [3.0, 4.0] and clip.jump_ts.tolist() == [3.0]
    with pytest.raises(ValueError, match="adaptive"):
        sk.ClipStepSizeController(sk.ConstantStepSize(), step_ts=[1.0])
    with pytest.raises(ValueError, match="1-D"):
        sk.ClipStepSizeController(sk.PIDController(rtol=1e-3, atol=1e-3), step_ts=1.0)


# --- ReversibleHeun and LeapfrogMidpoint ----------------------------------------------


def _pendulum(t, y, args):
    return jnp.stack([y[1], -jnp.sin(y[0]) + 0.1 * jnp.cos(t)])


@pytest.mark.parametrize(
    "name, adaptive",
    [("ReversibleHeun", False), ("ReversibleHeun", True), ("LeapfrogMidpoint", False)],
)
@pytest.mark.parametrize("backwards", [False, True])
def test_two_stage_state_solvers_match_diffrax(name, adaptive, backwards):
    t0, t1, dt0 = (3.0, 0.0, -0.01) if backwards else (0.0, 3.0, 0.01)

    def solve(lib):
        controller = (
            lib.PIDController(rtol=1e-6, atol=1e-6)
            if adaptive
            else lib.ConstantStepSize()
        )
        sol = lib.diffeqsolve(
            lib.ODETerm(_pendulum),
            getattr(lib, name)(),
            t0,
            t1,
            dt0,
            jnp.array([1.0, 0.0]),
            stepsize_controller=controller,
            saveat=lib.SaveAt(ts=jnp.linspace(t0, t1, 7)),
            max_steps=4096,
        )
        return sol.ys, sol.stats["num_steps"]

    with float64():
        ours = jax.jit(lambda: solve(sk))()
        assert_tree_allclose(ours, solve(diffrax), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", ["ReversibleHeun", "LeapfrogMidpoint"])
def test_two_stage_state_solvers_second_order_and_differentiable(name):
    solver = getattr(sk, name)()
    assert solver.order(None) == 2
    assert isinstance(solver, sk.AbstractAdaptiveSolver) == (name == "ReversibleHeun")
    with float64():

        def final(k, n, adjoint=sk.RecursiveCheckpointAdjoint()):
            return sk.diffeqsolve(
                sk.ODETerm(lambda t, y, args: -k * y),
                solver,
                0.0,
                1.0,
                1.0 / n,
                1.0,
                adjoint=adjoint,
                max_steps=256,
            ).ys[-1]

        errors = [abs(final(1.3, n) - np.exp(-1.3)) for n in (32, 64, 128)]
        slopes = np.diff(np.log(errors)) / np.diff(np.log([1 / 32, 1 / 64, 1 / 128]))
        assert np.all(np.abs(slopes - 2) < 0.2), slopes
        # Gradients w.r.t. the closed-over rate, under vmap: two adjoints agree.
        ks = jnp.array([0.5, 1.3])
        g_rca = jax.jit(jax.vmap(jax.grad(lambda k: final(k, 64))))(ks)
        g_direct = jax.vmap(jax.grad(lambda k: final(k, 64, sk.DirectAdjoint())))(ks)
        np.testing.assert_allclose(g_rca, g_direct, rtol=1e-12)
        eps = 1e-6
        fd = [(final(k + eps, 64) - final(k - eps, 64)) / (2 * eps) for k in ks]
        np.testing.assert_allclose(g_rca, fd, rtol=1e-6)


@pytest.mark.parametrize("name", ["ReversibleHeun", "LeapfrogMidpoint"])
def test_two_stage_state_solvers_close_over_every_dtype(name):
    # A vmapped int index into a differentiated table, a bool mask and a PRNG key,
    # all closed over, under jit(vmap(grad)): y' = -rate * y has y(1) = exp(-rate).
    table = jnp.array([0.5, 1.0, 2.0])
    mask = jnp.array([True, False])
    noise = jax.random.normal(jax.random.key(0), (2,))

    def final(table, k):
        def field(t, y, args):
            rate = table[k] + jnp.where(mask, 0.0, 0.0 * noise)
            return -rate * y

        return sk.diffeqsolve(
            sk.ODETerm(field),
            getattr(sk, name)(),
            0.0,
            1.0,
            1e-3,
            jnp.ones(2),
            max_steps=1024,
        ).ys[-1, 0]

    with float64():
        ks = jnp.arange(3)
        grads = jax.jit(jax.vmap(jax.grad(final), in_axes=(None, 0)))(table, ks)
        # d exp(-table[k]) / d table = -exp(-table[k]) at row k, zero elsewhere.
        np.testing.assert_allclose(
            grads, -np.diag(np.exp(-np.asarray(table))), rtol=1e-3, atol=1e-12
        )
