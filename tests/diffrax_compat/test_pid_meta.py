"""diffrax's older spelling `PIDController(..., step_ts=, jump_ts=)` constructs the
`ClipStepSizeController` (diffrax's `test_pid_meta`), and solves as the explicit
wrapper does, and as diffrax."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


def test_pid_with_times_is_a_clip_controller():
    ts = jnp.array([3.0, 4.0])
    plain = sk.PIDController(rtol=1e-4, atol=1e-6)
    stepped = sk.PIDController(rtol=1e-4, atol=1e-6, step_ts=ts)
    both = sk.PIDController(rtol=1e-4, atol=1e-6, step_ts=ts, jump_ts=ts)
    assert isinstance(plain, sk.PIDController)
    assert not isinstance(plain, sk.ClipStepSizeController)
    for clip in (stepped, both):
        assert isinstance(clip, sk.ClipStepSizeController)
        assert isinstance(clip.controller, sk.PIDController)
        np.testing.assert_array_equal(clip.step_ts, ts)
        assert clip.controller.step_ts is None and clip.controller.jump_ts is None
    np.testing.assert_array_equal(both.jump_ts, ts)


# Quick loop:
# solve/test_controllers.py::test_clip_steps_land_on_step_ts_and_jump_ts[False].
@pytest.mark.slow
def test_pid_with_times_solves_as_the_wrapper_and_diffrax():
    def solve(lib, controller, k):
        sol = lib.diffeqsolve(
            lib.ODETerm(lambda t, y, a: -k * y), lib.Tsit5(), 0.0, 6.0, 0.1,
            jnp.array(1.0), stepsize_controller=controller,
            saveat=lib.SaveAt(steps=True),
        )  # fmt: skip
        return sol.ts

    ts = jnp.array([3.0, 4.0])
    old = lambda lib: lib.PIDController(rtol=1e-6, atol=1e-9, step_ts=ts, jump_ts=ts)
    new = sk.ClipStepSizeController(
        sk.PIDController(rtol=1e-6, atol=1e-9), step_ts=ts, jump_ts=ts
    )
    k = jnp.array(0.5)
    ours = jax.jit(lambda k: solve(sk, old(sk), k))(k)
    np.testing.assert_array_equal(ours, jax.jit(lambda k: solve(sk, new, k))(k))
    theirs = solve(diffrax, old(diffrax), k)
    finite = np.isfinite(theirs)
    # The same steps; their sizes come from an error estimate whose round-off,
    # relative to itself, is ~ulp / rtol (x100 for the steps it compounds over).
    assert int(finite.sum()) == int(np.isfinite(ours).sum())
    tol = 100 * np.finfo(float).eps / 1e-6
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=tol)
