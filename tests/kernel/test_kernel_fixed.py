"""`ConstantStepSize` in the whole-solve kernel (`ensemble_solve(kernel=True)`, in
Pallas' interpreter) against the lane loop (`kernel=False`): the same grid of steps
(`t0 + (t1 - t0) k / n`, landing on `t1`), so the same values to round-off in
float64 and float32 alike (no accept/reject decision can flip), the same step counts
and results; gradients by forward sensitivities in the kernel and by the lane loop's
backward pass, against `kernel=False` and a central difference.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FULL_MATRIX, full_matrix_only
from test_kernel import _lorenz, _problem, assert_kernel_selects_on_real_tiles

import solverkit as sk
from solverkit._errors import UnsupportedError
from solverkit._kernel import _solve as _kernel_solve


N = 128  # one block row of 128 lanes
T1 = 1.0
DT0 = 0.03  # 1 / 0.03 is not an integer: 34 steps, the grid k / 34 after the first


def _saveat(dtype):
    return sk.SaveAt(t0=True, ts=jnp.linspace(0.1, 0.9, 3, dtype=dtype), t1=True)


@functools.partial(eqx.filter_jit, donate="none")
def _solve(y0, args, sigma, kernel, max_steps=4096):
    return sk.ensemble_solve(  # (times of the default float dtype: y0's here)
        sk.ODETerm(_lorenz(sigma, 8 / 3)), sk.Tsit5(), 0.0, T1, DT0, y0, args,
        saveat=_saveat(y0.dtype), stepsize_controller=sk.ConstantStepSize(),
        kernel=kernel, max_steps=max_steps, throw=False,
    )  # fmt: skip


def _both(dtype):
    y0, args = _problem(dtype, N)
    sigma = jnp.asarray(10.0, dtype)  # a closed-over float; args: a per-lane int
    return [_solve(y0, args, sigma, kernel) for kernel in (True, False)]


# The full suite with SOLVERKIT_FULL_MATRIX=1; float64's fixed-step kernel against
# the lane loop: test_max_steps_and_nonfinite_result and test_event_float64.
@pytest.mark.slow
@full_matrix_only(
    "test_values_match_lane_loop_float32 (the same grid, counts and saves) and "
    "test_max_steps_and_nonfinite_result (float64 values to round-off)"
)
def test_values_match_lane_loop_float64(x64):
    _check_values(jnp.dtype("float64"))


# The full suite; the quick loop's fixed-step kernel against the lane loop:
# test_max_steps_and_nonfinite_result (values to round-off, results).
@pytest.mark.slow
def test_values_match_lane_loop_float32():
    _check_values(jnp.dtype("float32"))


def _check_values(dtype):
    kern, ref = _both(dtype)
    steps = int(np.ceil(T1 / DT0))
    for sol in (kern, ref):
        np.testing.assert_array_equal(sol.stats["num_steps"], steps)
        np.testing.assert_array_equal(sol.stats["num_accepted_steps"], steps)
        np.testing.assert_array_equal(sol.stats["num_rejected_steps"], 0)
        np.testing.assert_array_equal(sol.result._value, sk.RESULTS.successful.code)
    np.testing.assert_array_equal(kern.ts, ref.ts)
    np.testing.assert_array_equal(kern.t1, ref.t1)
    scale = float(np.max(np.abs(ref.ys)))
    eps = float(jnp.finfo(dtype).eps)
    # The same steps and arithmetic, in another order (fused or not): a few ulps a
    # step, over 34 steps of a flow that grows perturbations < 10x on [0, 1].
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=0, atol=1e4 * eps * scale)


def test_max_steps_and_nonfinite_result(x64):
    """A lane whose field turns NaN records `nonfinite` and runs on to `max_steps`
    (as the lane loop's fixed-step loop, which no failure stops); the rest end with
    `max_steps_reached`."""
    cut = jnp.linspace(0.2, 2.0, N)  # the field is NaN from t = cut on

    def field(t, y, c):
        return -y + jnp.sqrt(c - t)

    def solve(kernel):
        return sk.ensemble_solve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, T1, DT0, jnp.ones((N, 1)), cut,
            stepsize_controller=sk.ConstantStepSize(), max_steps=20, throw=False,
            kernel=kernel,
        )  # fmt: skip

    kern, ref = solve(True), solve(False)
    codes = np.asarray(kern.result._value)
    np.testing.assert_array_equal(codes, ref.result._value)
    assert set(codes) == {
        sk.RESULTS.nonfinite.code,
        sk.RESULTS.max_steps_reached.code,
    }
    np.testing.assert_array_equal(kern.stats["num_steps"], 20)
    np.testing.assert_array_equal(kern.t1, ref.t1)
    # NaN where the lane loop has NaN; elsewhere round-off (|y| <= 2, 20 steps).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=0, atol=1e-13)


# `SOLVERKIT_FULL_MATRIX=1` only: this fall's event in the kernel against the lane
# loop and the analytic time is test_kernel.py::test_event_float64[real]'s (adaptive
# steps), constant steps in the kernel test_values_match_lane_loop_float32's.
@pytest.mark.slow
@full_matrix_only(
    "test_kernel.py::test_event_float64[real] and test_values_match_lane_loop_float32"
)
def test_event_float64(x64):
    """A terminal event with fixed steps: the lane loop's steps, event times and
    saves to round-off, and the analytic time of a fall."""
    height = 10.0 + jnp.linspace(0.0, 5.0, N)
    y0 = jnp.stack([height, jnp.zeros(N)], axis=1)
    scale = jnp.linspace(0.5, 2.0, N)
    gravity = jnp.asarray(9.81)

    def solve(kernel):
        return sk.ensemble_solve(
            sk.ODETerm(lambda t, y, a: jnp.stack([y[1], -gravity * a])), sk.Tsit5(),
            0.0, 10.0, 0.1, y0, scale, saveat=sk.SaveAt(ts=jnp.linspace(0, 10, 6),
            t1=True), stepsize_controller=sk.ConstantStepSize(),
            event=sk.Event(lambda t, y, a, **kw: y[0]), kernel=kernel,
        )  # fmt: skip

    kern, ref = solve(True), solve(False)
    # The same steps and crossing search: round-off (times <= 10, heights <= 15).
    np.testing.assert_allclose(kern.t1, ref.t1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(kern.ts, ref.ts, rtol=0, atol=1e-12)  # inf where inf
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=0, atol=1e-11)
    np.testing.assert_array_equal(kern.stats["num_steps"], ref.stats["num_steps"])
    np.testing.assert_array_equal(kern.event_mask, ref.event_mask)
    # A quadratic fall, which Tsit5 integrates exactly: the analytic time, to the
    # crossing search's accuracy (test_kernel.py's bound).
    exact = jnp.sqrt(2 * height / (9.81 * scale))
    np.testing.assert_allclose(kern.t1, exact, rtol=1e-6)


def _loss(y0, rho, sigma, kernel):
    k = jnp.arange(y0.shape[0], dtype=jnp.int32) % 3  # a vmapped integer index
    sol = sk.ensemble_solve(
        sk.ODETerm(_lorenz(sigma, 8 / 3)), sk.Tsit5(), 0.0, T1, DT0, y0, (rho, k),
        saveat=_saveat(y0.dtype), stepsize_controller=sk.ConstantStepSize(),
        kernel=kernel,
    )  # fmt: skip
    return jnp.sum(sol.ys**2) + jnp.sum(jnp.sin(sol.ys[:, 1:, 0]))


def _vmapped_grad(kernel):
    """The gradient with respect to y0, rho (per trajectory) and sigma (closed
    over), jitted and vmapped over sigma."""
    grad = jax.grad(lambda y, r, s: _loss(y, r, s, kernel), argnums=(0, 1, 2))
    return jax.jit(jax.vmap(grad, in_axes=(None, None, 0)))


def _grads(monkeypatch):
    """`(inputs, {backward: the kernel's gradients with it})`, each against
    kernel=False's (computed once)."""
    y0, (rho, _) = _problem(jnp.float64, N)
    sigmas = jnp.asarray([9.0, 10.0])
    want = _vmapped_grad(False)(y0, rho, sigmas)
    got = {}
    # The loop's backward pass from the kernel's steps with SOLVERKIT_FULL_MATRIX=1
    # only: test_kernel.py::test_event_gradient_float64 checks it (adaptive steps,
    # an event), and the tangents here check the fixed steps.
    for backward in ("tangent", "loop") if FULL_MATRIX else ("tangent",):
        monkeypatch.setattr(_kernel_solve, "BACKWARD", backward)
        got[backward] = _vmapped_grad(True)(y0, rho, sigmas)
        for a, b in zip(got[backward], want):
            # The same derivative of the same discrete solve (step times have no
            # derivative in either): round-off over 34 steps, far below 1e-8.
            scale = float(jnp.max(jnp.abs(b)))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10 * scale)
    return (y0, rho), got


# `SOLVERKIT_FULL_MATRIX=1` only (10 CPU s): the kernel's gradient (forward
# sensitivities) under `jit` and `vmap` against the loop's and a central difference is
# test_kernel.py::test_gradients_and_vmap_of_grad_float64, with fixed steps
# test_vmap_route.py::test_route_matches_loop[elem-t1-fixed-jacrev].
@pytest.mark.slow
@full_matrix_only(
    "test_kernel.py::test_gradients_and_vmap_of_grad_float64 and "
    "test_vmap_route.py::test_route_matches_loop[elem-t1-fixed-jacrev]"
)
def test_gradients_tangent_and_loop_backward_float64(x64, monkeypatch):
    """Forward sensitivities in the kernel (the default backward pass) and, with
    SOLVERKIT_FULL_MATRIX=1, the lane loop's backward pass (where the kernel's does
    not apply: an event, more than 32 inputs) from the kernel's step counts, under
    `jit` and `vmap`: `kernel=False`'s gradient (computed once for both; they were
    two tests) and a central difference."""
    (y0, rho), got = _grads(monkeypatch)
    monkeypatch.setattr(_kernel_solve, "BACKWARD", "tangent")
    # A central difference along a direction of (y0, rho, sigma): the discrete
    # solve is smooth in them (fixed steps), so O(e^2) = 1e-10 relative, plus
    # round-off ~1e-16 / e.
    dy, dr = jnp.cos(jnp.arange(3 * N)).reshape(N, 3), jnp.sin(jnp.arange(N))
    along = lambda e: _loss(y0 + e * dy, rho + e * dr, 10.0 + e, True)  # noqa: E731
    e = 1e-5
    pair = jax.jit(jax.vmap(along))(jnp.asarray([e, -e]))
    fd = (pair[0] - pair[1]) / (2 * e)
    g_y, g_r, g_s = (x[1] for x in got["tangent"])  # at sigma = 10
    exact = jnp.sum(g_y * dy) + jnp.sum(g_r * dr) + g_s
    np.testing.assert_allclose(exact, fd, rtol=1e-6)


def test_unsupported_controllers_and_missing_dt0():
    y0, args = _problem(jnp.float32, N)
    term = sk.ODETerm(_lorenz(10.0, 8 / 3))
    step_to = sk.StepTo(jnp.linspace(0.0, T1, 5))
    with pytest.raises(UnsupportedError, match="StepTo"):
        sk.ensemble_solve(
            term, sk.Tsit5(), 0.0, T1, None, y0, args, stepsize_controller=step_to,
            kernel=True,
        )  # fmt: skip
    # No `dt0` with ConstantStepSize: the lane loop's error, on either path.
    for kernel in (True, False):
        with pytest.raises(ValueError, match="please pass a value for `dt0`"):
            sk.ensemble_solve(
                term, sk.Tsit5(), 0.0, T1, None, y0, args, kernel=kernel,
                stepsize_controller=sk.ConstantStepSize(),
            )  # fmt: skip


def test_lowers_for_tpu_with_real_tiles(monkeypatch):
    """The fixed-step kernel lowers for a TPU (Mosaic's lowering rules, on the CPU)
    and, as test_kernel checks for the PID kernel, no select in it takes a splat
    (the TPU's compiler rejects those)."""
    y0, args = _problem(jnp.float32, N)

    def solve(y0, args):
        return sk.ensemble_solve(
            sk.ODETerm(_lorenz(jnp.asarray(10.0), 8 / 3)), sk.Tsit5(), 0.0, T1, DT0,
            y0, args, saveat=_saveat(jnp.float32), kernel=True, throw=False,
            stepsize_controller=sk.ConstantStepSize(),
        )  # fmt: skip

    # (Lowered first: `make_jaxpr` below would cache the interpreted trace.)
    monkeypatch.setattr(_kernel_solve, "DEFAULT_INTERPRET", False)
    lowered = jax.jit(solve).trace(y0, args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
    assert_kernel_selects_on_real_tiles(jax.make_jaxpr(solve)(y0, args).jaxpr)
