"""Forward sensitivities inside the whole-solve kernel (`_kernel/_tangent.py`), in
Pallas' interpreter: the tangents the kernel carries along a state component, a
per-trajectory argument and a closed-over value, against the `vmap` path's Jacobian
(reverse mode through `diffeqsolve`), at the save times and at `t1`.

Both differentiate the same discrete solve (the step times have no derivative in
either), so in float64 they agree to round-off.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only
from test_kernel import (
    _inner_jaxprs,
    _splat_selects,
    assert_kernel_selects_on_real_tiles,
)

import solverkit as sk
from solverkit import _kernel
from solverkit._kernel import _pallas, _solve
from solverkit._kernel._layout import from_lanes, per_trajectory


N = 128
TS = 4


def _field(sigma, beta):
    def field(t, y, args):
        rho, k = args
        x, yy, z = y
        damp = 1 + 0.01 * k.astype(y.dtype)
        return jnp.stack(
            [sigma * (yy - x), x * (rho - z) - yy * damp, x * yy - beta * z]
        )

    return field


def _saveat():
    return sk.SaveAt(ts=jnp.linspace(0.0, 1.0, TS), t1=True)


def _controller(tol=1e-8):
    return sk.PIDController(rtol=tol, atol=tol)


def _problem(y0, args, sigma, beta):
    """The `Problem` that `ensemble_solve(kernel=True)` hands the kernel."""
    captured = {}
    original = _kernel.kernel_solve

    def capture(problem, y0, args, *rest, **kwargs):
        captured.update(problem=problem, y0=y0, args=args)
        return original(problem, y0, args, *rest, **kwargs)

    _kernel.kernel_solve = capture
    try:
        sk.ensemble_solve(
            sk.ODETerm(_field(sigma, beta)), sk.Tsit5(), 0.0, 1.0, None, y0, args,
            saveat=_saveat(), stepsize_controller=_controller(), kernel=True,
            throw=False,
        )  # fmt: skip
    finally:
        _kernel.kernel_solve = original
    return captured["problem"], captured["y0"], captured["args"]


# The full suite (10 CPU s) with SOLVERKIT_FULL_MATRIX=1; the tangents at every save
# time through the gradient built from them:
# test_kernel.py::test_gradients_and_vmap_of_grad_float64; the tangent kernel's
# selects: test_tangent_kernel_selects_on_real_tiles.
@pytest.mark.slow
@full_matrix_only(
    "test_kernel.py::test_gradients_and_vmap_of_grad_float64 (the tangents' values, "
    "through the gradient) and test_tangent_kernel_selects_on_real_tiles (its selects)"
)
def test_tangents_match_vmap_jacobian_float64(x64):
    y0 = (
        jnp.tile(jnp.asarray([1.0, 0.0, 0.0]), (N, 1))
        + jnp.linspace(0, 0.1, N)[:, None]
    )
    rho = jnp.linspace(1.0, 21.0, N)
    k = jnp.arange(N, dtype=jnp.int32) % 3  # an integer argument: no tangent
    sigma = jnp.asarray(10.0)  # an array closed over: a direction
    beta = 8 / 3  # a Python float closed over (a literal: no derivative)
    problem, y0_, args_ = _problem(y0, (rho, k), sigma, beta)
    consts = problem.terms.closure.consts  # pyright: ignore
    (isigma,) = [i for i, c in enumerate(consts) if c.size == 1 and float(c) == 10.0]
    directions = (("state", 0), ("state", 2), ("arg", 0, 0), ("const", isigma, 0))
    args_dynamic = eqx.filter(args_, eqx.is_array)
    spec, *inputs = eqx.filter_jit(_solve.lane_inputs)(
        problem, y0_, args_dynamic, 1, directions
    )
    run = jax.jit(lambda *a: _pallas.solve_blocks(spec, *a, True))
    # Mosaic's lesson (test_kernel): no select in the kernel takes a splat, tangents
    # included.
    kernels = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernels.append(eqn.params["jaxpr"])
            for inner in _inner_jaxprs(eqn):
                walk(inner)

    walk(jax.make_jaxpr(run)(*inputs).jaxpr)
    (kernel,) = kernels
    found = []
    _splat_selects(kernel, found)
    assert not found, "\n".join(str(e) for e in found[:3])
    y_end, ys, _, counts = run(*inputs)
    got_t1 = from_lanes(y_end, N)  # (N, 3 + 3 K)
    got_ts = from_lanes(ys, N)  # (N, TS, 3 + 3 K)

    def one(y, r, s, kk):
        return sk.diffeqsolve(
            sk.ODETerm(_field(s, beta)), sk.Tsit5(), 0.0, 1.0, None, y, (r, kk),
            saveat=_saveat(), stepsize_controller=_controller(), throw=False,
        ).ys  # fmt: skip

    jac = jax.vmap(jax.jacrev(one, argnums=(0, 1, 2)), in_axes=(0, 0, None, 0))
    j_y, j_rho, j_sigma = jax.jit(jac)(y0, rho, sigma, k)
    refs = [j_y[..., 0], j_y[..., 2], j_rho, j_sigma]  # each (N, TS + 1, 3)
    for i, ref in enumerate(refs):
        mine = slice(3 * (i + 1), 3 * (i + 2))
        scale = float(np.max(np.abs(ref)))
        # The same arithmetic in another order over <= ~120 steps: round-off
        # (1e-16 x steps x growth), far below the solver's 1e-8.
        np.testing.assert_allclose(
            got_t1[:, mine], ref[:, -1], rtol=0, atol=1e-10 * scale
        )
        np.testing.assert_allclose(
            got_ts[:, :, mine], ref[:, :TS], rtol=0, atol=1e-10 * scale
        )
    # The state itself is untouched by its tangents: the plain kernel's steps, and
    # its values to round-off (two compiled programs, which XLA may fuse and round
    # differently: 1e-16 x steps x growth, as above; XLA's CPU loop emitters of
    # tests/conftest.py differ by 3e-14).
    plain = sk.ensemble_solve(
        sk.ODETerm(_field(sigma, beta)), sk.Tsit5(), 0.0, 1.0, None, y0, (rho, k),
        saveat=_saveat(), stepsize_controller=_controller(), kernel=True,
    )  # fmt: skip
    scale = float(np.max(np.abs(plain.ys[:, -1])))
    np.testing.assert_allclose(
        got_t1[:, :3], plain.ys[:, -1], rtol=0, atol=1e-10 * scale
    )
    np.testing.assert_array_equal(
        per_trajectory(counts[0], N), plain.stats["num_steps"]
    )


@pytest.mark.slow
def test_tangent_kernel_selects_on_real_tiles(x64):
    """Mosaic's lesson (test_kernel): no select in the kernel takes a splat, in the
    kernel that carries tangents (the default backward pass's) too. Traced only."""
    y0, rho, k = _inputs(jnp.float64)

    def loss(y0, rho, sigma):
        sol = sk.ensemble_solve(
            sk.ODETerm(_field(sigma, 8 / 3)), sk.Tsit5(), 0.0, 1.0, None, y0,
            (rho, k), saveat=_saveat(), stepsize_controller=_controller(),
            kernel=True,
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    jaxpr = jax.make_jaxpr(grad)(y0, rho, jnp.asarray(10.0)).jaxpr
    rows = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                rows.append(eqn.outvars[0].aval.shape[0])
            for inner in _inner_jaxprs(eqn):
                walk(inner)

    walk(jaxpr)
    # The state's 3 rows, and with its tangents along y0 (3), rho and sigma: 18.
    assert 3 + 3 * 5 in rows, rows
    assert_kernel_selects_on_real_tiles(jaxpr)


def _loss(backward, y0, rho, k, sigma, monkeypatch):
    monkeypatch.setattr(_solve, "BACKWARD", backward)
    sol = sk.ensemble_solve(
        sk.ODETerm(_field(sigma, 8 / 3)), sk.Tsit5(), 0.0, 1.0, None, y0, (rho, k),
        saveat=_saveat(), kernel=True,
        stepsize_controller=_controller(1e-8 if y0.dtype == jnp.float64 else 1e-5),
    )  # fmt: skip
    return jnp.sum(sol.ys**2) + jnp.sum(jnp.sin(sol.ys[:, 1:, 0]))


def _inputs(dtype, n=N):
    y0 = jnp.tile(jnp.asarray([1.0, 0.0, 0.0], dtype), (n, 1))
    y0 = y0 + jnp.linspace(0, 0.1, n, dtype=dtype)[:, None]
    return y0, jnp.linspace(1.0, 21.0, n, dtype=dtype), jnp.arange(n) % 3


# `SOLVERKIT_FULL_MATRIX=1` only: the default backward pass (`"tangent"`) under `jit`
# against `kernel=False`'s is test_kernel.py::test_gradients_and_vmap_of_grad_float64.
@pytest.mark.slow
@full_matrix_only("test_kernel.py::test_gradients_and_vmap_of_grad_float64")
def test_tangent_backward_matches_loop_float64(x64, monkeypatch):
    """`BACKWARD = "tangent"`: the gradient with respect to y0, a per-trajectory
    float, a closed-over array (with an integer per-trajectory argument alongside)
    under `jit` equals the lane loop's backward pass's."""
    y0, rho, k = _inputs(jnp.float64)
    sigma = jnp.asarray(10.0)
    grads = {}
    for backward in ("loop", "tangent"):
        grad = jax.grad(
            lambda a, b, c: _loss(backward, a, b, k, c, monkeypatch), argnums=(0, 1, 2)
        )
        grads[backward] = jax.jit(grad)(y0, rho, sigma)
    for a, b in zip(grads["tangent"], grads["loop"]):
        # The same derivative of the same discrete solve, by forward sensitivities
        # vs the adjoint: round-off (see the first test), far below rtol 1e-8.
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10 * scale)


# The full suite (12 CPU s) with SOLVERKIT_FULL_MATRIX=1; the kernel's tangent
# backward pass under vmap: test_kernel.py::test_gradients_and_vmap_of_grad_float64
# (the default backward pass, against the lane loop's); the loop's backward pass from
# the kernel's steps: test_kernel.py::test_event_gradient_float64 (an event).
@pytest.mark.slow
@full_matrix_only(
    "test_kernel.py::test_gradients_and_vmap_of_grad_float64 (vmap of the tangent "
    "backward pass) and test_kernel.py::test_event_gradient_float64 (the loop's)"
)
def test_tangent_backward_vmap_float32(monkeypatch):
    """float32, `jax.vmap` of the gradient over a closed-over float, against the
    loop's backward pass; float32's steps may differ by a step or two where an error
    estimate is within round-off of 1 (test_kernel), so to the solver's tolerance
    times the gradient's scale."""
    y0, rho, k = _inputs(jnp.float32)
    sigmas = jnp.asarray([9.0, 10.0], jnp.float32)

    def grads(backward):
        def one(s):
            g = jax.grad(
                lambda a, c: _loss(backward, a, rho, k, c, monkeypatch), (0, 1)
            )
            return g(y0, s)

        return jax.jit(jax.vmap(one))(sigmas)

    got, want = grads("tangent"), grads("loop")
    assert got[0].dtype == jnp.float32 and got[1].shape == (2,)
    for a, b in zip(got, want):
        # rtol 1e-5: a step more or less moves a trajectory's values by ~1e-5
        # relative, and its gradient by about as much times its growth (<~ 30 here).
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * scale)


# `SOLVERKIT_FULL_MATRIX=1` only (3 CPU s): the kernel's forward pass with
# BacksolveAdjoint's own backward solve, against the loop's, is
# test_vmap_kernel.py::test_gradients_through_the_kernel[backsolve] (grad of a jitted
# vmap); BacksolveAdjoint against the checkpointed adjoint adjoint/test_adjoint.py's.
# The quick loop's ensemble_solve x grad:
# test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep].
@pytest.mark.slow
@full_matrix_only("test_vmap_kernel.py::test_gradients_through_the_kernel[backsolve]")
def test_backsolve_gradient_is_the_continuous_adjoints(x64):
    """With `BacksolveAdjoint` the kernel's backward pass is the lane loop's backsolve
    (the adjoint asked for, not forward sensitivities of the steps): its gradient is
    `kernel=False`'s to round-off, where the tangents' would differ from it by the
    adjoint's own error (about the tolerance, 1e-6 here)."""
    y0, rho, k = _inputs(jnp.float64, n=16)
    sigma = jnp.asarray(10.0)

    def loss(y0, rho, sigma, kernel):
        sol = sk.ensemble_solve(
            sk.ODETerm(_field(sigma, 8 / 3)), sk.Tsit5(), 0.0, 1.0, None, y0,
            (rho, k), saveat=_saveat(), kernel=kernel,
            stepsize_controller=_controller(1e-6), adjoint=sk.BacksolveAdjoint(),
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    got, want = grad(y0, rho, sigma, True), grad(y0, rho, sigma, False)
    for a, b in zip(got, want):
        # The same backward solves from the same forward steps (float64: the kernel
        # takes the lane loop's steps): round-off of the scale, far below 1e-6.
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10 * scale)
