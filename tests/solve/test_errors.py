"""Bad input raises a clear `ValueError` / `TypeError` before tracing; runtime failures
raise a `RuntimeError` naming the cause with `throw=True`, and set `Solution.result`
with `throw=False`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


def _decay(t, y, args):
    return -y


def _solve(vf=_decay, y0=None, **kw):
    args = dict(
        terms=sk.ODETerm(vf),
        solver=sk.Heun(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=jnp.ones(2) if y0 is None else y0,
    )
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return sk.diffeqsolve(*args.values(), **kw)


# --- Bad input, before tracing --------------------------------------------------------


def test_vector_field_output_structure():
    with pytest.raises(TypeError, match="structure"):
        _solve(lambda t, y, args: (y, y))
    with pytest.raises(TypeError, match="structure"):
        _solve(lambda t, y, args: {"a": y["a"]}, y0={"a": jnp.ones(1), "b": 1.0})


def test_vector_field_output_shape():
    # A scalar is broadcast, as diffrax does; any other shape is an error.
    with pytest.raises(ValueError, match=r"\(2,\)"):
        _solve(lambda t, y, args: jnp.ones(3))
    with pytest.raises(ValueError, match=r"\(2,\)"):
        _solve(lambda t, y, args: jnp.ones((1, 2)))


def test_vector_field_output_dtype():
    # Other real dtypes are cast, as diffrax does; complex to real would drop the
    # imaginary part.
    with pytest.raises(TypeError, match="complex"):
        _solve(lambda t, y, args: -y.astype(jnp.complex128))


@pytest.mark.parametrize(
    "t0, t1, dt0", [(0.0, 1.0, -0.1), (1.0, 0.0, 0.1), (0.0, 1.0, 0.0)]
)
def test_dt0_sign(t0, t1, dt0):
    with pytest.raises(ValueError, match="dt0"):
        _solve(t0=t0, t1=t1, dt0=dt0)


def test_dt0_none_needs_adaptive_controller():
    with pytest.raises(ValueError, match="dt0"):
        _solve(dt0=None)
    with pytest.raises(ValueError, match="dt0"):
        _solve(dt0=None, stepsize_controller=sk.ConstantStepSize())


def test_step_to_checks():
    with pytest.raises(ValueError, match="dt0"):
        _solve(stepsize_controller=sk.StepTo(jnp.array([0.0, 0.5, 1.0])))
    with pytest.raises(ValueError, match="t0"):
        _solve(dt0=None, stepsize_controller=sk.StepTo(jnp.array([0.1, 0.5, 1.0])))
    with pytest.raises(ValueError, match="monotonic"):
        _solve(dt0=None, stepsize_controller=sk.StepTo(jnp.array([0.0, 0.7, 0.5, 1.0])))
    with pytest.raises(ValueError):
        sk.StepTo(jnp.array([0.0]))


@pytest.mark.parametrize(
    "ts", [[0.0, 0.5, 0.3], [0.5, 1.5], [-0.1, 0.5], [[0.1, 0.2]]], ids=str
)
def test_saveat_ts(ts):
    with pytest.raises(ValueError, match="ts"):
        _solve(saveat=sk.SaveAt(ts=jnp.asarray(ts)))


def test_saveat_ts_direction_backwards():
    with pytest.raises(ValueError, match="ts"):
        _solve(t0=1.0, t1=0.0, dt0=-0.1, saveat=sk.SaveAt(ts=jnp.array([0.2, 0.8])))


def test_saveat_steps():
    for steps in (0, -2, 1.5):
        with pytest.raises(ValueError, match="steps"):
            sk.SaveAt(steps=steps)
    with pytest.raises(ValueError, match="either"):
        sk.SaveAt(t1=True, subs=sk.SubSaveAt(t0=True))
    with pytest.raises(ValueError, match="pytree of SubSaveAts"):
        sk.SaveAt(subs=[sk.SubSaveAt(t0=True), 1.0])


@pytest.mark.parametrize(
    "kw",
    [dict(rtol=-1e-3, atol=1e-6), dict(rtol=1e-3, atol=-1.0), dict(rtol=0.0, atol=0.0)],
    ids=str,
)
def test_pid_tolerances(kw):
    with pytest.raises(ValueError, match="tol"):
        sk.PIDController(**kw)


def test_pid_needs_error_estimate():
    with pytest.raises(ValueError, match="error estimate"):
        _solve(solver=sk.Euler(), stepsize_controller=sk.PIDController(1e-3, 1e-3))


@pytest.mark.parametrize("max_steps", [0, -1, 2.5, True, "10"], ids=repr)
def test_max_steps(max_steps):
    with pytest.raises(ValueError, match="max_steps"):
        _solve(max_steps=max_steps)


def test_wrong_kinds_of_argument():
    with pytest.raises(TypeError, match="terms"):
        sk.diffeqsolve(_decay, sk.Heun(), 0.0, 1.0, 0.1, jnp.ones(2))
    with pytest.raises(TypeError, match="solver"):
        _solve(solver="tsit5")
    with pytest.raises(TypeError, match="saveat"):
        _solve(saveat=dict(t1=True))
    with pytest.raises(TypeError, match="stepsize_controller"):
        _solve(stepsize_controller="pid")
    with pytest.raises(ValueError, match="t0"):
        _solve(t0=jnp.zeros(2))


def test_event_condition_must_be_scalar():
    with pytest.raises(ValueError, match="scalar"):
        _solve(event=sk.Event(lambda t, y, args: y))


def test_forward_mode_through_checkpointed_adjoint_points_to_direct():
    def final(y0):
        return _solve(y0=y0).ys[-1]

    with pytest.raises(TypeError, match="DirectAdjoint"):
        jax.jvp(final, (jnp.ones(2),), (jnp.ones(2),))


# --- Runtime failures ----------------------------------------------------------------


def _nan_after_half(t, y, args):
    return jnp.where(t > 0.5, jnp.nan, -y)


_FAILURES = {
    # name: (keyword arguments, RESULTS member, words in the message)
    "max_steps": (dict(max_steps=4), sk.RESULTS.max_steps_reached, "max_steps"),
    "nonfinite": (dict(vf=_nan_after_half), sk.RESULTS.nonfinite, "non-finite"),
    "dt_min": (
        dict(
            stepsize_controller=sk.PIDController(
                rtol=1e-14, atol=1e-14, dtmin=0.05, force_dtmin=False
            )
        ),
        sk.RESULTS.dt_min_reached,
        "dtmin",
    ),
}


@pytest.mark.parametrize("name", list(_FAILURES))
def test_throw_false_sets_result(name):
    kw, result, _ = _FAILURES[name]
    sol = _solve(throw=False, **kw)
    assert sol.result == result
    assert not sk.is_okay(sol.result)
    assert sol.result.message()


@pytest.mark.parametrize("name", list(_FAILURES))
def test_throw_true_raises_runtime_error(name):
    kw, _, words = _FAILURES[name]
    with pytest.raises(RuntimeError, match=words):
        jax.block_until_ready(_solve(**kw).ys)


def test_throw_under_jit_and_vmap():
    # One failing batch element makes the batched solve raise with throw=True; with
    # throw=False each element reports its own result.
    def solve(t1, throw):
        return _solve(t1=t1, max_steps=8, throw=throw)

    t1 = jnp.array([0.5, 2.0])
    sol = jax.jit(jax.vmap(lambda t: solve(t, False)))(t1)
    np.testing.assert_array_equal(
        np.asarray(sol.result.code),
        [sk.RESULTS.successful.code, sk.RESULTS.max_steps_reached.code],
    )
    np.testing.assert_allclose(sol.ys[0, -1], np.exp(-0.5) * np.ones(2), rtol=1e-3)
    with pytest.raises(RuntimeError, match="max_steps"):
        jax.block_until_ready(jax.jit(jax.vmap(lambda t: solve(t, True).ys))(t1))
    ok = jax.jit(jax.vmap(lambda t: solve(t, True).ys))(jnp.array([0.5, 0.7]))
    assert np.all(np.isfinite(np.asarray(ok)))


def test_eager_failure_is_raised_from_the_host(monkeypatch):
    """Called eagerly, `diffeqsolve(throw=True)` compiles no device check (a host
    callback: ~2 ms a call on a TPU, and never in the persistent compilation cache)
    and raises the same error from the host; traced, the check stays in the program;
    `throw=False` and successful solves are unchanged."""
    from solverkit import _integrate

    checks = []
    original = _integrate.error_if

    def error_if(*args, **kwargs):
        checks.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_integrate, "error_if", error_if)
    message = sk.RESULTS.max_steps_reached.message()
    with pytest.raises(RuntimeError, match="maximum number of solver steps") as info:
        _solve(t1=10.0, max_steps=3)
    assert str(info.value) == message and checks == []
    quiet = _solve(t1=10.0, max_steps=3, throw=False)
    assert quiet.result == sk.RESULTS.max_steps_reached
    np.testing.assert_array_equal(_solve().ys, _solve(throw=False).ys)
    assert checks == []
    with pytest.raises(RuntimeError, match="maximum number of solver steps"):
        jax.jit(lambda y: _solve(y0=y, t1=10.0, max_steps=3).ys)(jnp.ones(2))
    assert checks == [1]
    # Under vmap (traced, the batch fails if any element does) and grad: on the device.
    with pytest.raises(RuntimeError, match="maximum number of solver steps"):
        jax.vmap(lambda t1: _solve(t1=t1, max_steps=3).ys)(jnp.array([0.2, 10.0]))
    assert checks == [1, 1]
