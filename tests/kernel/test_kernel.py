"""The whole-solve kernel (`ensemble_solve(kernel=True)`, `solverkit/_kernel/`), run
in Pallas' interpreter on the CPU, against the lane loop (`kernel=False`): values,
step counts, results and gradients, float64 and float32.

The kernel does the vmap path's arithmetic element by element in the same order, so
in float64 the two agree to round-off and take the same steps; in float32 a step
whose error estimate is within round-off of the tolerance may be decided the other
way, so step counts may differ by a step or two on a few trajectories.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit._errors import UnsupportedError


N = 256  # two blocks of one row of 128 lanes, and one (8, 128) block
T1 = 1.0


def _lorenz(sigma, beta):
    """Lorenz with `sigma` (a float) and `beta` (an array) closed over; `args` is
    `(rho, k)`, `k` a per-trajectory integer that scales the damping."""

    def field(t, y, args):
        rho, k = args
        x, yy, z = y
        damp = 1 + 0.01 * k.astype(y.dtype)
        return jnp.stack(
            [sigma * (yy - x), x * (rho - z) - yy * damp, x * yy - beta * z]
        )

    return field


def _problem(dtype, n=N):
    y0 = jnp.tile(jnp.asarray([1.0, 0.0, 0.0], dtype), (n, 1))
    y0 = y0 + jnp.linspace(0, 0.1, n, dtype=dtype)[:, None]
    rho = jnp.linspace(0.0, 21.0, n, dtype=dtype)
    k = jnp.arange(n, dtype=jnp.int32) % 3
    return y0, (rho, k)


@functools.partial(eqx.filter_jit, donate="none")
def _solve(y0, args, sigma, beta, kernel, solver, rtol, ts):
    return sk.ensemble_solve(
        sk.ODETerm(_lorenz(sigma, beta)),
        solver,
        0.0,
        T1,
        None,
        y0,
        args,
        saveat=sk.SaveAt(ts=ts, t1=True),
        stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
        kernel=kernel,
        max_steps=400,
    )


def _both(dtype, solver, rtol):
    y0, args = _problem(dtype)
    sigma = jnp.asarray(10.0, dtype)
    beta = jnp.asarray(8 / 3, dtype)
    ts = jnp.linspace(0, T1, 5, dtype=dtype)
    return [_solve(y0, args, sigma, beta, k, solver, rtol, ts) for k in (True, False)]


@pytest.mark.parametrize(
    "solver",
    [
        sk.Tsit5(),
        # Dopri5 in the kernel against the lane loop: test_t1_only_pytree_state_dt0.
        pytest.param(
            sk.Dopri5(),
            marks=full_matrix_only(
                "test_values_float64[tsit5] (adaptive steps, saves at ts and t1, "
                "float64) and test_t1_only_pytree_state_dt0 (Dopri5's tableau)"
            ),
        ),
    ],
    ids=["tsit5", "dopri5"],
)
# The full suite; the quick loop's kernel values:
# test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_values_float64(x64, solver):
    kern, ref = _both(jnp.float64, solver, 1e-8)
    # Same arithmetic in the same order: equal to round-off (1e4 ulps of |y| <= 30).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(kern.ts, ref.ts)
    for key in ("num_steps", "num_accepted_steps", "num_rejected_steps"):
        np.testing.assert_array_equal(kern.stats[key], ref.stats[key])
    np.testing.assert_array_equal(kern.result._value, ref.result._value)


# `SOLVERKIT_FULL_MATRIX=1` only (1.8 CPU s): the adaptive kernel's values are
# test_values_float64[tsit5]'s, the kernel in float32 test_kernel_fixed.py::
# test_values_match_lane_loop_float32 and test_kernel_float32_steps.py.
@pytest.mark.slow
@full_matrix_only(
    "test_values_float64[tsit5], test_kernel_fixed.py::"
    "test_values_match_lane_loop_float32"
)
def test_values_float32():
    kern, ref = _both(jnp.float32, sk.Tsit5(), 1e-5)
    # float32 round-off (1e-7 relative) moves decisions near err == 1; a trajectory
    # then differs by the global error, ~ rtol times the growth over [0, 1] (~100).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-3, atol=1e-3)
    steps_k = np.asarray(kern.stats["num_steps"])
    steps_r = np.asarray(ref.stats["num_steps"])
    assert abs(steps_k.sum() - steps_r.sum()) <= 0.02 * steps_r.sum()
    assert np.max(np.abs(steps_k - steps_r)) <= 3


def _loss(kernel, y0, rho, sigma, beta):
    k = jnp.arange(y0.shape[0], dtype=jnp.int32) % 3
    ts = jnp.linspace(0, T1, 3, dtype=y0.dtype)
    sol = _solve(y0, (rho, k), sigma, beta, kernel, sk.Tsit5(), 1e-8, ts)
    return jnp.sum(sol.ys[:, 1:] ** 2)


@functools.cache
def _vmapped_value_and_grad(kernel):
    """`_loss` and its gradient with respect to y0, rho, sigma and beta (closed
    over), jitted and vmapped over sigma: one program per path."""
    value_and_grad = jax.value_and_grad(
        lambda y0, rho, s, b: _loss(kernel, y0, rho, s, b), argnums=(0, 1, 2, 3)
    )
    return jax.jit(jax.vmap(value_and_grad, in_axes=(None, None, 0, None)))


@pytest.mark.slow
def test_gradients_and_vmap_of_grad_float64(x64):
    """The gradient with respect to y0, a per-trajectory float and two closed-over
    arrays, under `jit`, and `jax.vmap` over a closed-over float of the loss and of
    its gradient (one program: it was two tests of three programs each)."""
    n = 128
    y0, (rho, _) = _problem(jnp.float64, n)
    beta = jnp.asarray(8 / 3)
    e = 1e-5
    sigmas = jnp.asarray([9.0, 10.0, 10.0 + e, 10.0 - e])
    v_kernel, g_kernel = _vmapped_value_and_grad(True)(y0, rho, sigmas, beta)
    v_ref, g_ref = _vmapped_value_and_grad(False)(y0, rho, sigmas, beta)
    # The forward pass to round-off (same steps, same arithmetic).
    np.testing.assert_allclose(v_kernel, v_ref, rtol=1e-10)
    # The backward pass is the vmap path's: equal up to round-off.
    for a, b in zip(g_kernel, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(g_kernel[2], g_ref[2], rtol=1e-10)
    # ... and a central difference in sigma at 10 (step 1e-5: error ~1e-10 x
    # curvature).
    fd = (v_ref[2] - v_ref[3]) / (2 * e)
    np.testing.assert_allclose(g_kernel[2][1], fd, rtol=1e-4)


# The full suite; the quick loop's kernel reaching max_steps:
# test_kernel_fixed.py::test_max_steps_and_nonfinite_result (fixed steps).
@pytest.mark.slow
def test_max_steps_and_result(x64):
    y0, args = _problem(jnp.float64, 128)
    sol = sk.ensemble_solve(
        sk.ODETerm(_lorenz(10.0, 8 / 3)), sk.Tsit5(), 0.0, 5.0, None, y0, args,
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        max_steps=30, throw=False, kernel=True,
    )  # fmt: skip
    assert np.all(np.asarray(sol.stats["num_steps"]) <= 30)
    assert np.all(sol.result._value == sk.RESULTS.max_steps_reached.code)


# Quick loop: test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_unsupported_raises_or_falls_back():
    y0, args = _problem(jnp.float32, 128)
    kw = dict(stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-4))
    term = sk.ODETerm(_lorenz(10.0, 8 / 3))
    with pytest.raises(UnsupportedError, match="Bosh3"):
        sk.ensemble_solve(term, sk.Bosh3(), 0.0, 0.1, None, y0, args, kernel=True, **kw)
    # A small table indexed per trajectory is a select chain in the kernel
    # (test_kernel_index.py); a large one is declined, naming its shape.
    table = jnp.linspace(1.0, 3.0, 100)
    gather = sk.ODETerm(lambda t, y, args: -y * table[args[1]])
    with pytest.raises(UnsupportedError, match=r"indexes an array of shape \(100,\)"):
        sk.ensemble_solve(
            gather, sk.Tsit5(), 0.0, 0.1, None, y0, args, kernel=True, **kw
        )
    with pytest.raises(TypeError, match="kernel"):
        sk.ensemble_solve(
            term, sk.Tsit5(), 0.0, 0.1, None, y0, args, kernel="yes", **kw
        )
    # kernel=None on a CPU: the lane loop, which takes any solver.
    sol = sk.ensemble_solve(term, sk.Bosh3(), 0.0, 0.1, None, y0, args, **kw)
    assert sol.ys.shape == (128, 1, 3)


def test_nextafter_goes_to_the_lane_loop(monkeypatch):
    # Mosaic lowers `nextafter` to selects of splat constants, which it does not
    # compile: the support check refuses it (interpret mode would run it).
    y0, args = _problem(jnp.float32, 128)
    kw = dict(stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-4))
    up = jnp.asarray(jnp.inf, jnp.float32)
    term = sk.ODETerm(lambda t, y, args: jnp.nextafter(-y * args[0], up))
    solve = lambda kernel: sk.ensemble_solve(  # noqa: E731
        term, sk.Tsit5(), 0.0, 0.1, None, y0, args, kernel=kernel, **kw
    )
    with pytest.raises(UnsupportedError, match="primitive `nextafter`"):
        solve(True)
    # kernel=None on a TPU: the lane loop, bit for bit.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    np.testing.assert_array_equal(solve(None).ys, solve(False).ys)


def _fall(gravity):
    """Free fall with `gravity` closed over, per-trajectory drag-free scale `a`."""
    return lambda t, y, a: jnp.stack([y[1], -gravity * a])


def _ground(t, y, a, **kwargs):
    return y[0]


def _fall_inputs(n=128):
    height = 10.0 + jnp.linspace(0.0, 5.0, n)
    y0 = jnp.stack([height, jnp.zeros(n)], axis=1)
    return y0, jnp.linspace(0.5, 2.0, n)


@pytest.mark.parametrize(
    "cond", ["real", pytest.param("boolean", marks=pytest.mark.slow)]
)
# Quick loop: test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_event_float64(x64, cond):
    y0, a = _fall_inputs()
    fn = _ground if cond == "real" else (lambda t, y, a, **kw: y[0] < 0)
    out = [
        sk.ensemble_solve(
            sk.ODETerm(_fall(jnp.asarray(9.81))),
            sk.Tsit5(),
            0.0,
            10.0,
            None,
            y0,
            a,
            saveat=sk.SaveAt(ts=jnp.linspace(0.0, 10.0, 6), t1=True),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            event=sk.Event(fn),
            kernel=kernel,
        )  # fmt: skip
        for kernel in (True, False)
    ]
    kern, ref = out
    # The same steps and the same search: equal to round-off (times <= 10).
    np.testing.assert_allclose(kern.t1, ref.t1, rtol=0, atol=1e-11)
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(kern.ts, ref.ts, rtol=0, atol=1e-11)  # inf where inf
    np.testing.assert_array_equal(kern.event_mask, ref.event_mask)
    np.testing.assert_array_equal(kern.stats["num_steps"], ref.stats["num_steps"])
    if cond == "real":  # the analytic time of the fall, to the tolerance's order
        exact = jnp.sqrt(2 * y0[:, 0] / (9.81 * a))
        np.testing.assert_allclose(kern.t1, exact, rtol=1e-6)


# The full suite; the quick loop's kernel values:
# test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_t1_only_pytree_state_dt0():
    """`SaveAt(t1=True)` (the default), a pytree state, a given `dt0`, float32."""
    n = 128
    rate = jnp.asarray(0.5, jnp.float32)
    y0 = {"a": jnp.ones(n), "b": jnp.ones((n, 2))}
    scale = jnp.linspace(1.0, 2.0, n)

    def field(t, y, s):
        return {"a": -rate * s * y["a"], "b": -s * y["b"]}

    kern, ref = [
        sk.ensemble_solve(
            sk.ODETerm(field),
            sk.Dopri5(),
            0.0,
            1.0,
            0.01,
            y0,
            scale,
            stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5),
            kernel=k,
        )  # fmt: skip
        for k in (True, False)
    ]
    assert kern.ys["a"].shape == (n, 1) and kern.ys["b"].shape == (n, 1, 2)
    # The lane loop to float32 round-off amplified by a few steps.
    np.testing.assert_allclose(kern.ys["b"], ref.ys["b"], rtol=1e-5)
    # The exact solution to the tolerance's order (rtol 1e-5, ~10 steps).
    np.testing.assert_allclose(kern.ys["a"][:, 0], jnp.exp(-0.5 * scale), rtol=1e-4)
    np.testing.assert_allclose(kern.ys["b"][:, 0, 1], jnp.exp(-scale), rtol=1e-4)


@pytest.mark.slow
def test_event_gradient_float64(x64):
    """The event time's gradient with respect to `y0` and the closed-over gravity."""
    y0, a = _fall_inputs(128)

    def loss(y0, gravity, kernel):
        sol = sk.ensemble_solve(
            sk.ODETerm(_fall(gravity)), sk.Tsit5(), 0.0, 10.0, None, y0, a,
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            event=sk.Event(_ground), kernel=kernel,
        )  # fmt: skip
        return jnp.sum(sol.t1)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    got, want = grad(y0, jnp.asarray(9.81), True), grad(y0, jnp.asarray(9.81), False)
    for g, w in zip(got, want):  # the same backward pass, from the same steps
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    # d t* / d h = 1 / sqrt(2 h g a), analytically.
    exact = 1 / jnp.sqrt(2 * y0[:, 0] * 9.81 * a)
    np.testing.assert_allclose(got[0][:, 0], exact, rtol=1e-5)


def _inner_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _splat_selects(jaxpr, found):
    """Append each `select_n` on tiles of `jaxpr` (and its inner jaxprs) that has a
    splat operand: a literal, a broadcast of a 0-d value, or an element-wise value of
    such ones only (the layout Mosaic can't select with)."""
    splat = set()
    is_splat = lambda v: isinstance(v, jax.extend.core.Literal) or v in splat  # noqa: E731
    for eqn in jaxpr.eqns:
        name, ins = eqn.primitive.name, eqn.invars
        shape = eqn.outvars[0].aval.shape if eqn.outvars else ()
        scalar = lambda v: getattr(v.aval, "shape", ()) == ()  # noqa: E731
        if name == "select_n" and shape and any(is_splat(v) or scalar(v) for v in ins):
            found.append(eqn)
        if name == "broadcast_in_dim" and scalar(ins[0]):
            splat.update(eqn.outvars)
        elif ins and all(is_splat(v) or scalar(v) for v in ins) and name != "get":
            splat.update(v for v in eqn.outvars if not scalar(v))
        for inner in _inner_jaxprs(eqn):
            _splat_selects(inner, found)


def _clipped_fall(t, y, a):  # `jnp.where`s with constants, in the field
    return jnp.stack([y[1], jnp.where(y[0] > 100.0, 0.0, -9.81 * a)])


def _clipped_ground(t, y, a, **kwargs):  # and in the condition (under `jax.jvp`)
    return jnp.where(y[0] > 100.0, 1.0, y[0])


@pytest.mark.parametrize("wheres", [False, True], ids=["plain", "wheres"])
# Quick loop: [plain].
@pytest.mark.quick_cases("plain")
def test_selects_on_real_tiles(x64, wheres):
    """Every `select_n` in the kernel body takes real tiles (no splats, no 0-d
    operands): the TPU's compiler (Mosaic) fails on a select mixing layouts."""
    y0, a = _fall_inputs()
    field = _clipped_fall if wheres else _fall(jnp.asarray(9.81))
    cond = _clipped_ground if wheres else _ground

    def solve(y0, a):
        return sk.ensemble_solve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 10.0, None, y0, a,
            saveat=sk.SaveAt(ts=jnp.linspace(0.0, 10.0, 6), t1=True),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            event=sk.Event(cond), kernel=True,
        )  # fmt: skip

    assert_kernel_selects_on_real_tiles(jax.make_jaxpr(solve)(y0, a).jaxpr)


def assert_kernel_selects_on_real_tiles(jaxpr):
    """`jaxpr` holds a Pallas kernel, and no `select_n` in it has a splat operand."""
    kernels, found = [], []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernels.append(eqn.params["jaxpr"])
            for inner in _inner_jaxprs(eqn):
                walk(inner)

    walk(jaxpr)
    assert kernels
    for k in kernels:
        _splat_selects(k, found)
    assert not found, "\n".join(str(e) for e in found[:5])


# The full suite; the quick loop's kernel: test_kernel_fixed.py.
@pytest.mark.slow
def test_wheres_in_field_and_event_float64(x64):
    """`jnp.where`s with constants in the field and in the event's condition (the
    kernel's anchored selects and their tangents, in the event search): the lane
    loop's values, steps and event times to round-off."""
    y0, a = _fall_inputs()
    out = [
        sk.ensemble_solve(
            sk.ODETerm(_clipped_fall),
            sk.Tsit5(),
            0.0,
            10.0,
            None,
            y0,
            a,
            saveat=sk.SaveAt(ts=jnp.linspace(0.0, 10.0, 6), t1=True),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            event=sk.Event(_clipped_ground),
            kernel=kernel,
        )  # fmt: skip
        for kernel in (True, False)
    ]
    kern, ref = out
    # The same steps and search (as test_event_float64): round-off, times <= 10.
    np.testing.assert_allclose(kern.t1, ref.t1, rtol=0, atol=1e-11)
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(kern.stats["num_steps"], ref.stats["num_steps"])
    exact = jnp.sqrt(2 * y0[:, 0] / (9.81 * a))  # heights < 100: the plain fall
    np.testing.assert_allclose(kern.t1, exact, rtol=1e-6)
