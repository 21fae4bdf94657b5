"""Rosenbrock solves in the whole-solve kernel (`ensemble_solve(kernel=True)` with
`Rodas5P`, `Rodas4`; `solverkit/_kernel/_rosenbrock.py`), in Pallas' interpreter on
the CPU, against `jax.vmap(diffeqsolve)` and closed forms.

The kernel's step is the `vmap` path's arithmetic in the same order (for states of
up to 3 components the same operations), so in float64 both take the same steps and
agree to round-off; in float32 a step whose error estimate is within round-off of
the tolerance may go the other way (a step or two on a few trajectories).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only
from test_kernel import assert_kernel_selects_on_real_tiles

import solverkit as sk
from solverkit._errors import UnsupportedError
from solverkit._kernel import _solve as _kernel_solve


N = 256  # two blocks of one row of 128 lanes
T1 = 3.0


def _vdp(scale, table):
    """Van der Pol, `mu` per trajectory (`args[0]`), a closed-over float `scale` and
    a closed-over table read at a per-trajectory int index `args[1]` (one-hot: the
    kernel evaluates no gathers)."""

    def field(t, y, args):
        mu, k = args
        weight = jnp.sum(table * (jnp.arange(table.shape[0]) == k))
        damp = mu * scale * weight
        return jnp.stack([y[1], damp * (1 - y[0] ** 2) * y[1] - y[0]])

    return field


def _vdp_inputs(dtype, n=N):
    y0 = jnp.tile(jnp.asarray([2.0, 0.0], dtype), (n, 1))
    y0 = y0 + jnp.linspace(0, 0.1, n, dtype=dtype)[:, None]
    mu = jnp.asarray(np.logspace(0, 1.5, n), dtype)
    k = jnp.arange(n, dtype=jnp.int32) % 3
    return y0, (mu, k)


def _kwargs(dtype, rtol, ts):
    return dict(
        saveat=sk.SaveAt(ts=jnp.asarray(ts, dtype), t1=True),
        stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
        max_steps=2000,
        throw=False,
    )


@functools.partial(eqx.filter_jit, donate="none")
def _kernel(field, solver, t0, t1, dt0, y0, args, kw):
    return sk.ensemble_solve(
        sk.ODETerm(field), solver, t0, t1, dt0, y0, args, kernel=True, **kw
    )


@functools.partial(eqx.filter_jit, donate="none")
def _vmapped(field, solver, t0, t1, dt0, y0, args, kw):
    def one(y, a):
        return sk.diffeqsolve(sk.ODETerm(field), solver, t0, t1, dt0, y, a, **kw)

    return jax.vmap(one)(y0, args)


def _vdp_both(dtype, solver, rtol):
    y0, args = _vdp_inputs(dtype)
    field = _vdp(jnp.asarray(1.5, dtype), jnp.asarray([0.5, 1.0, 2.0], dtype))
    kw = _kwargs(dtype, rtol, jnp.linspace(0, T1, 4))
    # Python times: static under `filter_jit` (the kernel needs a known direction).
    return [f(field, solver, 0.0, T1, 1e-3, y0, args, kw) for f in (_kernel, _vmapped)]


def _steps(sol):
    return {
        k: np.asarray(sol.stats[k])
        for k in ("num_steps", "num_accepted_steps", "num_rejected_steps")
    }


@pytest.mark.parametrize(
    "solver",
    [
        sk.Rodas5P(),
        # With `SOLVERKIT_FULL_MATRIX=1` only: a Rodas method's kernel is [rodas5p]'s.
        pytest.param(
            sk.Rodas4(), marks=[pytest.mark.slow, full_matrix_only("[rodas5p]")]
        ),
        # With `SOLVERKIT_FULL_MATRIX=1` only: the Rosenbrock family's kernel is
        # [rodas5p]'s (one kernel for the four methods, their tableaux differ).
        pytest.param(
            sk.Rosenbrock23(),
            marks=[pytest.mark.slow, full_matrix_only("[rodas5p]")],
        ),
    ],
    ids=["rodas5p", "rodas4", "rosenbrock23"],
)
# Quick loop: test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_vdp_float64(x64, solver):
    kern, ref = _vdp_both(jnp.float64, solver, 1e-7)
    np.testing.assert_array_equal(kern.result._value, ref.result._value)
    assert np.all(kern.result._value == sk.RESULTS.successful.code)
    for key, value in _steps(kern).items():
        np.testing.assert_array_equal(value, _steps(ref)[key], err_msg=key)
    # The same steps, the same arithmetic: round-off (ulps of |y| <= 60, amplified
    # over the <= 70 steps of the stiffest trajectories; 9e-14 here).
    # The same steps in two programs (Gauss-Jordan on tiles, the vmap path's
    # refined solve), which round differently: per step ~eps times the conditioning
    # of `I - gamma h A` (up to ~2e3 here: |lambda| <= 1000 s, cond(A) 3.4e3 at
    # large steps), over <= 100 steps: 100 * 2.2e-16 * 3.4e3 = 7.5e-11 (|y| <= 2;
    # measured 2e-11 with XLA's CPU loop emitters, 9e-14 without).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=0, atol=1.5e-10)
    np.testing.assert_array_equal(kern.ts, ref.ts)


# `SOLVERKIT_FULL_MATRIX=1` only (1.9 CPU s): the same check in float64 is
# test_vdp_float64[rodas5p]; the kernel in float32 test_kernel_float32_steps.py and
# test_kernel_fixed.py::test_values_match_lane_loop_float32.
@pytest.mark.slow
@full_matrix_only("test_vdp_float64[rodas5p]")
def test_vdp_float32():
    rtol = 1e-4
    kern, ref = _vdp_both(jnp.float32, sk.Rodas5P(), rtol)
    np.testing.assert_array_equal(kern.result._value, ref.result._value)
    steps_k, steps_r = _steps(kern)["num_steps"], _steps(ref)["num_steps"]
    # float32 round-off flips a decision at an error ratio within ~1e-6 of 1: a
    # few steps on a few trajectories (how many moves with either program's
    # rounding; the total and the values below bound the difference).
    assert np.max(np.abs(steps_k - steps_r)) <= 4
    assert abs(steps_k.sum() - steps_r.sum()) <= 0.02 * steps_r.sum()
    # Where the two took other steps they differ by the global error, each one a
    # solution to the tolerance: a few rtol (|y| <= 2.1; the float32 kernel against
    # the float64 one at this rtol: 1.1e-4; against the vmap path: 3.4e-5).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=0, atol=10 * rtol)


# A stiff linear system with a closed form: y' = s A (y - g(t)) + g'(t), with A =
# P diag(lam) P^-1 closed over and s per trajectory, g(t) = (cos t, sin t, cos 2t):
# y(t) = g(t) + P exp(s lam t) P^-1 (y0 - g(0)). A's first column is (-100, 999,
# 900): for steps past ~1e-3, W = I - γhsA's largest first-column entry is below
# the diagonal, so the inverse's pivoting swaps rows.
_P = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
_LAM = np.array([-1.0, -100.0, -1000.0])


def _g(t):
    return jnp.stack([jnp.cos(t), jnp.sin(t), jnp.cos(2 * t)])


def _linear(a):
    def field(t, y, s):
        dg = jax.jvp(_g, (t,), (jnp.ones_like(t),))[1]
        return s * (a @ (y - _g(t))) + dg

    return field


def _linear_exact(y0, s, t):
    inv = np.linalg.inv(_P)
    g0, gt = np.asarray(_g(0.0)), np.asarray(_g(t))
    decay = np.exp(np.asarray(s)[:, None] * _LAM[None] * t)
    coords = (np.asarray(y0) - g0) @ inv.T
    return gt + (decay * coords) @ _P.T


@pytest.mark.slow  # the full suite; the quick loop's kernel: test_kernel_fixed.py
def test_linear_stiff_closed_form_float64(x64):
    n = 128
    a = jnp.asarray(_P @ np.diag(_LAM) @ np.linalg.inv(_P))
    s = jnp.linspace(0.5, 2.0, n)
    y0 = jnp.stack([jnp.ones(n), jnp.linspace(-1, 1, n), jnp.zeros(n)], axis=1)
    kw = _kwargs(jnp.float64, 1e-8, jnp.asarray([0.5, 1.0]))
    kern, ref = [
        f(_linear(a), sk.Rodas5P(), 0.0, 2.0, None, y0, s, kw)
        for f in (_kernel, _vmapped)
    ]
    np.testing.assert_array_equal(kern.result._value, ref.result._value)
    np.testing.assert_array_equal(_steps(kern)["num_steps"], _steps(ref)["num_steps"])
    # The same steps in two programs (Gauss-Jordan on tiles, the vmap path's
    # refined solve), which round differently: per step ~eps times the conditioning
    # of `I - gamma h A` (up to ~2e3 here: |lambda| <= 1000 s, cond(A) 3.4e3 at
    # large steps), over <= 100 steps: 100 * 2.2e-16 * 3.4e3 = 7.5e-11 (|y| <= 2;
    # measured 2e-11 with XLA's CPU loop emitters, 9e-14 without).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=0, atol=1.5e-10)
    # The closed form to the tolerance's order (rtol 1e-8, |y| <= 2, a decaying
    # error: 10 x rtol); t = 0.5 and 1.0 from the dense output, t1 from the steps.
    for i, t in enumerate([0.5, 1.0, 2.0]):
        exact = _linear_exact(y0, s, t)
        np.testing.assert_allclose(kern.ys[:, i], exact, rtol=0, atol=1e-7)


def _vdp_solve(solver, y0, args, kernel=True, **kw):
    field = _vdp(1.0, jnp.asarray([0.5, 1.0, 2.0]))
    return sk.ensemble_solve(
        sk.ODETerm(field), solver, 0.0, 0.5, 1e-3, y0, args, kernel=kernel,
        stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-4), **kw
    )  # fmt: skip


# Quick loop: test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_unsupported_rosenbrock():
    y0, args = _vdp_inputs(jnp.float32, 128)
    cases = {
        "mass matrix": sk.Rodas5P(mass_matrix=jnp.ones(2)),
        "linear_solver=KrylovLinearSolver": sk.Rodas5P(
            linear_solver=sk.KrylovLinearSolver()
        ),
        "cubic Hermite": sk.Ros3P(),
        "solver HalfSolver": sk.HalfSolver(sk.Rodas5P()),
    }
    for what, solver in cases.items():
        with pytest.raises(UnsupportedError, match=what):
            _vdp_solve(solver, y0, args)
    # A state of 9 components: the unrolled inverse is refused, naming the size.
    big = jnp.ones((128, 9))
    with pytest.raises(UnsupportedError, match="state of 9 components"):
        sk.ensemble_solve(
            sk.ODETerm(lambda t, y, a: -a * y), sk.Rodas5P(), 0.0, 0.1, 0.01, big,
            jnp.ones(128), kernel=True,
        )  # fmt: skip
    # kernel=None on a CPU: the lane loop, which takes every solver.
    sol = _vdp_solve(sk.Ros3P(), y0, args, kernel=None)
    assert sol.ys.shape == (128, 1, 2)


@pytest.mark.slow  # the full suite (the default's switch; solves in the interpreter)
def test_by_default_on_a_tpu(monkeypatch):
    """`kernel=None` on a TPU takes the kernel for Rosenbrock solves (measured
    faster there: `_field.ROSENBROCK_BY_DEFAULT`); with the switch off, the lane
    loop."""
    from solverkit._kernel import _field, _solve

    y0, args = _vdp_inputs(jnp.float32, 128)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(_solve, "DEFAULT_INTERPRET", True)  # the CPU runs it
    got, want = (_vdp_solve(sk.Rodas5P(), y0, args, kernel=k) for k in (None, True))
    assert "refill" not in got.stats  # the kernel's stats (the lane loop has it)
    np.testing.assert_array_equal(got.ys, want.ys)
    monkeypatch.setattr(_field, "ROSENBROCK_BY_DEFAULT", False)
    got = _vdp_solve(sk.Rodas5P(), y0, args, kernel=None)
    assert "refill" in got.stats


def _kinked(t, y, a):
    """A field whose JVP has selects (`max`, `abs`, `pow`'s rules): JAX's own
    JVP of them selects between splat constants, which Mosaic rejects."""
    return jnp.stack(
        [-a * jnp.maximum(y[0], 0.1) * y[1], jnp.abs(y[0]) ** 0.5 - 5 * a * y[1]]
    )


# `SOLVERKIT_FULL_MATRIX=1` only: the Jacobian's JVP on tiles is test_vdp_float64
# [rodas5p]'s, its selects' layout test_lowers_for_tpu_with_real_tiles, anchored
# selects' tangents in the kernel
# test_kernel.py::test_wheres_in_field_and_event_float64.
@pytest.mark.slow
@full_matrix_only(
    "test_vdp_float64[rodas5p], test_lowers_for_tpu_with_real_tiles and "
    "test_kernel.py::test_wheres_in_field_and_event_float64"
)
def test_jvp_of_kinks_float64(x64):
    """The Jacobian of `_kinked` (its JVP evaluated on tiles like the field, every
    select anchored): the vmap path's steps and values."""
    a = jnp.linspace(1.0, 100.0, 128)
    y0 = jnp.stack([jnp.linspace(-0.5, 1.0, 128), jnp.ones(128)], axis=1)
    kw = _kwargs(jnp.float64, 1e-8, jnp.asarray([0.5]))
    kern, ref = [
        f(_kinked, sk.Rodas5P(), 0.0, 1.0, 1e-3, y0, a, kw) for f in (_kernel, _vmapped)
    ]
    np.testing.assert_array_equal(kern.result._value, ref.result._value)
    np.testing.assert_array_equal(_steps(kern)["num_steps"], _steps(ref)["num_steps"])
    # The same steps: round-off (|y| <= 1).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-12, atol=1e-12)


# Quick loop: test_kernel_fixed.py::test_lowers_for_tpu_with_real_tiles.
@pytest.mark.slow
def test_lowers_for_tpu_with_real_tiles(monkeypatch):
    """The Rosenbrock kernel lowers for a TPU (Mosaic's lowering rules, on the CPU),
    and every select in it (the pivoting's included) takes real tiles: Mosaic fails
    on a select that mixes a splat with a vector."""
    y0, args = _vdp_inputs(jnp.float32, 128)
    a = jnp.asarray(_P @ np.diag(_LAM) @ np.linalg.inv(_P), jnp.float32)

    def solve(y0, args):
        saveat = sk.SaveAt(ts=[0.1, 0.2])
        vdp = _vdp_solve(sk.Rodas5P(), y0, args, saveat=saveat, throw=False)
        y3 = jnp.concatenate([y0, y0[:, :1]], axis=1)
        linear = sk.ensemble_solve(
            sk.ODETerm(_linear(a)), sk.Rodas5P(), 0.0, 0.5, 1e-3, y3, args[0],
            stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-4), kernel=True,
            throw=False,
        )  # fmt: skip
        kinked = sk.ensemble_solve(
            sk.ODETerm(_kinked), sk.Rodas5P(), 0.0, 0.5, 1e-3, y0, args[0],
            kernel=True, throw=False,
        )  # fmt: skip
        return vdp.ys, linear.ys, kinked.ys

    # (Lowered first: `make_jaxpr` below would cache the interpreted trace.)
    monkeypatch.setattr(_kernel_solve, "DEFAULT_INTERPRET", False)
    lowered = jax.jit(solve).trace(y0, args).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") >= 3
    monkeypatch.setattr(_kernel_solve, "DEFAULT_INTERPRET", None)
    assert_kernel_selects_on_real_tiles(jax.make_jaxpr(solve)(y0, args).jaxpr)


# `SOLVERKIT_FULL_MATRIX=1` only (11 CPU s): the Rosenbrock kernel's solve with the lane
# loop's backward pass from its step counts, against the loop, is
# test_vmap_route.py::test_route_matches_loop[elem-t1-rodas5p-grad_vmap]; `jax.vmap` of
# the kernel's gradient over a closed-over float test_kernel.py's.
@pytest.mark.slow
@full_matrix_only(
    "test_vmap_route.py::test_route_matches_loop[elem-t1-rodas5p-grad_vmap] and "
    "test_kernel.py::test_gradients_and_vmap_of_grad_float64"
)
def test_vmap_jit_and_gradient_float64(x64):
    """`jax.vmap` over a closed-over float, of the solve and of its gradient (the
    lane loop's backward pass, from the kernel's step counts)."""
    n = 128
    y0, (mu, k) = _vdp_inputs(jnp.float64, n)
    table = jnp.asarray([0.5, 1.0, 2.0])

    def loss(scale, kernel):
        sol = sk.ensemble_solve(
            sk.ODETerm(_vdp(scale, table)), sk.Rodas5P(), 0.0, 0.5, 1e-3, y0,
            (mu, k), saveat=sk.SaveAt(ts=jnp.asarray([0.25, 0.5])),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            kernel=kernel,
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    scales = jnp.asarray([1.0, 1.5])
    # The kernel's solve and its gradient, each its own program; the reference (the
    # vmap path) both from one `value_and_grad` (3 programs, where 5 were).
    value = jax.jit(jax.vmap(lambda s: loss(s, True)))
    got = value(scales), jax.jit(jax.vmap(jax.grad(lambda s: loss(s, True))))(scales)
    both = jax.value_and_grad(lambda s: loss(s, False))
    want = jax.jit(jax.vmap(both))(scales)
    for g, w in zip(got, want):
        # The same steps, and the same backward pass: round-off.
        np.testing.assert_allclose(g, w, rtol=1e-10)
    # ... and the kernel's gradient at scale 1 (`got[1][0]`) against a central
    # difference (step 1e-5: error ~1e-10 x the curvature), both evaluations of the
    # loss in one call of the vmapped kernel solve above.
    e = 1e-5
    ends = value(jnp.asarray([1.0 + e, 1.0 - e]))
    fd = (ends[0] - ends[1]) / (2 * e)
    np.testing.assert_allclose(got[1][0], fd, rtol=1e-5)


# The full suite (16 s), as is every Rosenbrock kernel test.
@pytest.mark.slow
def test_event_float64(x64):
    """A terminal event located on the last Rosenbrock step's dense output (the
    step recomputed by the kernel's Rosenbrock step): the vmap path's times."""
    y0, args = _vdp_inputs(jnp.float64, 128)
    field = _vdp(1.0, jnp.asarray([0.5, 1.0, 2.0]))
    kw = _kwargs(jnp.float64, 1e-8, jnp.asarray([0.5, 1.0]))
    kw["event"] = sk.Event(lambda t, y, args, **kwargs: y[0])
    kern, ref = [
        f(field, sk.Rodas5P(), 0.0, T1, 1e-3, y0, args, kw) for f in (_kernel, _vmapped)
    ]
    fired = np.asarray(ref.result._value == sk.RESULTS.event_occurred.code)
    assert 0 < fired.sum() < 128  # the small mu cross y = 0 before T1, not the large
    np.testing.assert_array_equal(kern.result._value, ref.result._value)
    np.testing.assert_array_equal(_steps(kern)["num_steps"], _steps(ref)["num_steps"])
    # The same steps and search: round-off (times <= 3, |y| <= 2.1, |y'| <= 60).
    np.testing.assert_allclose(kern.t1, ref.t1, rtol=0, atol=1e-11)
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(kern.ys[fired][:, -1, 0], 0, atol=1e-10)


# `SOLVERKIT_FULL_MATRIX=1` only: the Rosenbrock step in the kernel is
# test_vdp_float64[rodas5p]'s, `ConstantStepSize` in the kernel (saves between
# steps) test_kernel_fixed.py::test_values_match_lane_loop_float32.
@pytest.mark.slow
@full_matrix_only(
    "test_vdp_float64[rodas5p] and "
    "test_kernel_fixed.py::test_values_match_lane_loop_float32"
)
def test_constant_step_size_float64(x64):
    """`ConstantStepSize` (no error estimate used; saves between steps): the vmap
    path's grid and values."""
    y0, args = _vdp_inputs(jnp.float64, 128)
    field = _vdp(1.0, jnp.asarray([0.5, 1.0, 2.0]))
    kw = _kwargs(jnp.float64, 1e-8, jnp.linspace(0, 1, 7))
    kw["stepsize_controller"] = sk.ConstantStepSize()
    kern, ref = [
        f(field, sk.Rodas5P(), 0.0, 1.0, 0.01, y0, args, kw)
        for f in (_kernel, _vmapped)
    ]
    np.testing.assert_array_equal(_steps(kern)["num_steps"], 100)
    np.testing.assert_array_equal(_steps(ref)["num_steps"], 100)
    # The same 100 steps: round-off (|y| <= 2.1).
    np.testing.assert_allclose(kern.ys, ref.ys, rtol=1e-12, atol=1e-12)
