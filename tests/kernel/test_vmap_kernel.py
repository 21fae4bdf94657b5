"""`jax.vmap(diffeqsolve)` on the whole-solve kernel (`_kernel/_vmap.py`), in Pallas'
interpreter (`ENABLED = True` here; by default only on a TPU). The quick loop keeps
the forward pass against the loop, a fallback, the float32 gradient and the solves
left alone; the rest (each transformation order of reverse mode, both adjoints,
shared values, failures) is slow.

The rule takes the kernel when the vmap batches only `y0`, `args` and the values the
vector field closes over; its solution equals the plain vmap's to the tolerance's
order (float64, rtol 1e-10 here). Anything else batched falls back to the plain vmap
of the same traced solve, bit for bit; a differentiated solve never reaches the rule
(its forward rule is the plain solve's), so gradients are unchanged bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit._kernel import _vmap


N = 6
TOL = 1e-10


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(_vmap, "ENABLED", True)


def _solve(
    rho, y0, k, t1=1.0, fixed=False, saveat=None, throw=True, max_steps=4096,
    adjoint=None,
):  # fmt: skip
    """Lorenz closing over a float `rho`, an int `k` and an array `beta`; the
    kernel can't index with a traced value (it would fall back)."""
    beta, k = jnp.array([8 / 3]), jnp.asarray(k)

    def field(t, y, args):
        x, yy, z = y
        damp = 1 + 0.1 * k.astype(y.dtype)
        return jnp.stack(
            [args * (yy - x), x * (rho - z) - yy, x * yy - beta[0] * damp * z]
        )

    controller = sk.ConstantStepSize() if fixed else sk.PIDController(TOL, TOL)
    return sk.diffeqsolve(
        sk.ODETerm(field), sk.Tsit5(), 0.0, t1, 1e-3, y0, 10.0,
        saveat=saveat or sk.SaveAt(t1=True), stepsize_controller=controller,
        throw=throw, max_steps=max_steps,
        adjoint=adjoint or sk.RecursiveCheckpointAdjoint(),
    )  # fmt: skip


def _data():
    rho = jnp.linspace(10.0, 28.0, N)
    y0 = jnp.ones((N, 3)) + 0.1 * jnp.arange(N)[:, None]
    k = jnp.arange(N) % 3
    return rho, y0, k


def _fresh(fn):
    """`fn` under a new identity: JAX caches traces by function (`jit`, and
    `make_jaxpr` through it), and the cache does not know `ENABLED`."""
    return lambda *args: fn(*args)


def _uses_kernel(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(_fresh(fn))(*args))


def _assert_same_tree(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.shape(x) == np.shape(y) and jnp.result_type(x) == jnp.result_type(y)


# With `SOLVERKIT_FULL_MATRIX=1` only: adaptive steps saved at `ts` on the route
# against the loop are test_vmap_route.py::test_route_matches_loop's
# [elem-ts-tsit5-axes], a closed-over int [mixed-t1-tsit5-grad_vmap]; fixed steps
# [mlp-ts-fixed-vmap] and [elem-stats-fixed-vmap] (the same step counts).
@pytest.mark.slow
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "fixed",
    [
        pytest.param(
            False,
            marks=full_matrix_only(
                "test_vmap_route.py::test_route_matches_loop[elem-ts-tsit5-axes], "
                "[mixed-t1-tsit5-grad_vmap]"
            ),
        ),
        pytest.param(
            True,
            marks=full_matrix_only(
                "test_vmap_route.py::test_route_matches_loop[mlp-ts-fixed-vmap], "
                "[elem-stats-fixed-vmap]"
            ),
        ),
    ],
)
def test_vmap_runs_on_the_kernel_and_matches(fixed, monkeypatch):
    rho, y0, k = _data()
    saveat = sk.SaveAt(ts=jnp.linspace(0.0, 1.0, 5), t1=True)
    run = jax.vmap(lambda r, y, i: _solve(r, y, i, fixed=fixed, saveat=saveat))
    ref = jax.jit(run)(rho, y0, k)
    monkeypatch.setattr(_vmap, "ENABLED", True)
    assert _uses_kernel(run, rho, y0, k)
    out = jax.jit(_fresh(run))(rho, y0, k)
    _assert_same_tree(out, ref)
    scale = jnp.max(jnp.abs(ref.ys))
    np.testing.assert_allclose(out.ys, ref.ys, rtol=0, atol=1e-7 * scale)
    np.testing.assert_array_equal(out.ts, ref.ts)
    np.testing.assert_array_equal(out.result._value, ref.result._value)
    if fixed:  # the same steps, so the same counts
        np.testing.assert_array_equal(out.stats["num_steps"], ref.stats["num_steps"])
    else:
        steps, ref_steps = out.stats["num_steps"], ref.stats["num_steps"]
        assert np.all(np.abs(steps - ref_steps) <= 0.02 * ref_steps + 1)


# `SOLVERKIT_FULL_MATRIX=1` only (2 CPU s): batched axes on the route are
# test_vmap_route.py::test_route_matches_loop's cells ([elem-ts-tsit5-axes], `y0` and
# `args` batched), a batched closed-over int test_kernel_index.py::
# test_table_index_on_the_route_equals_the_loop.
@pytest.mark.slow
@full_matrix_only(
    "test_vmap_route.py::test_route_matches_loop[elem-ts-tsit5-axes], "
    "test_kernel_index.py::test_table_index_on_the_route_equals_the_loop"
)
@pytest.mark.usefixtures("x64")
def test_in_axes_of_each_kind(on):
    """Only `y0` batched, only a closed-over int, and an unbatched `jit` call."""
    rho, y0, k = _data()
    by_y0 = jax.vmap(lambda y: _solve(20.0, y, 1).ys)
    by_k = jax.vmap(lambda i: _solve(20.0, y0[0], i).ys)
    assert _uses_kernel(by_y0, y0) and _uses_kernel(by_k, k)
    single = jax.jit(lambda y: _solve(20.0, y, 1).ys)
    for i in range(2):
        np.testing.assert_allclose(by_y0(y0)[i], single(y0[i]), rtol=1e-7)
        one = jax.jit(lambda: _solve(20.0, y0[0], i).ys)()
        np.testing.assert_allclose(by_k(k)[i], one, rtol=1e-7)


@pytest.mark.usefixtures("x64")
def test_anything_else_batched_falls_back_bit_for_bit(monkeypatch):
    rho, y0, k = _data()
    t1 = jnp.linspace(0.5, 1.0, N)
    run = jax.vmap(lambda r, y, i, t: _solve(r, y, i, t1=t).ys)
    ref = jax.jit(run)(rho, y0, k, t1)
    monkeypatch.setattr(_vmap, "ENABLED", True)
    assert not _uses_kernel(run, rho, y0, k, t1)
    np.testing.assert_array_equal(jax.jit(_fresh(run))(rho, y0, k, t1), ref)


# [checkpoint] with `SOLVERKIT_FULL_MATRIX=1` only: the kernel's reverse mode under
# grad of vmap and vmap of grad is test_vmap_route.py's route-vs-loop cells, grad of a
# jitted vmap [backsolve]'s third case.
@pytest.mark.slow
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(
            "checkpoint",
            marks=full_matrix_only(
                "test_vmap_route.py::test_route_matches_loop[elem-t1-tsit5-vmap_grad], "
                "[elem-ts-tsit5-grad_vmap] and test_gradients_through_the_kernel"
                "[backsolve] (grad of a jitted vmap)"
            ),
        ),
        "backsolve",
    ],
)
def test_gradients_through_the_kernel(adjoint, monkeypatch):
    """grad of vmap, vmap of grad and grad of a jitted vmap take the kernel's
    reverse mode (forward sensitivities), equal to the plain vmap's gradient to the
    tolerance's order; `BacksolveAdjoint`'s gradient is its own adjoint's, so a
    solve seen differentiated is left alone (inside the jit, differentiated after
    tracing, the kernel's forward pass serves and the backward rule solves again
    with the adjoint); a solve differentiated unbatched is left alone (its program
    is the one before)."""
    rho, y0, k = _data()
    adj = (
        sk.RecursiveCheckpointAdjoint()
        if adjoint == "checkpoint"
        else sk.BacksolveAdjoint()
    )
    loss = lambda r, y, i: jnp.sum(_solve(r, y, i, adjoint=adj).ys ** 2)  # noqa: E731
    args = (0, 1)
    grad_vmap = jax.grad(lambda r, y: jnp.sum(jax.vmap(loss)(r, y, k)), args)
    vmap_grad = jax.vmap(jax.grad(loss, args))
    inner = jax.jit(jax.vmap(_fresh(loss)))
    grad_jit = jax.grad(lambda r, y: jnp.sum(inner(r, y, k)), args)
    single = jax.grad(loss, args)
    ref = jax.jit(grad_vmap)(rho, y0)  # the three ways' gradients are the same
    monkeypatch.setattr(_vmap, "ENABLED", True)
    inner = jax.jit(jax.vmap(_fresh(loss)))
    cases = [(grad_vmap, (rho, y0)), (vmap_grad, (rho, y0, k)), (grad_jit, (rho, y0))]
    kernel = [adjoint == "checkpoint"] * 2 + [True]
    for (fn, xs), expected in zip(cases, kernel):
        assert _uses_kernel(fn, *xs) == expected
        if not expected:  # left alone: the program as before
            continue
        out = jax.jit(_fresh(fn))(*xs)
        for a, b in zip(out, ref):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9 * np.max(np.abs(b)))
    assert not _uses_kernel(single, rho[0], y0[0], k[0])


# `SOLVERKIT_FULL_MATRIX=1` only: `value_and_grad` of a vmap on the kernel is
# test_float32_forward_and_gradient, a vmap of a vmap test_vmap_route.py's [nested].
@pytest.mark.slow
@full_matrix_only(
    "test_float32_forward_and_gradient (value_and_grad) and "
    "test_vmap_route.py::test_route_matches_loop[elem-t1-tsit5-nested]"
)
@pytest.mark.usefixtures("x64")
def test_value_and_grad_and_nested_vmap(on):
    rho, y0, _ = _data()
    loss = lambda r: jnp.sum(_solve(r, y0[0], 0).ys ** 2)  # noqa: E731
    value, grad = jax.value_and_grad(lambda r: jnp.sum(jax.vmap(loss)(r)))(rho)
    np.testing.assert_allclose(value, jnp.sum(jax.vmap(loss)(rho)), rtol=1e-7)
    assert np.all(np.isfinite(grad))
    nested = jax.vmap(jax.vmap(lambda r: _solve(r, y0[0], 0).ys))(rho.reshape(2, 3))
    flat = jax.vmap(lambda r: _solve(r, y0[0], 0).ys)(rho)
    np.testing.assert_allclose(nested.reshape(flat.shape), flat, rtol=1e-7)


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_failures_raise_or_are_reported(on):
    rho, y0, k = _data()
    run = jax.vmap(lambda r: _solve(r, y0[0], 0, t1=20.0, max_steps=30, throw=False))
    sol = jax.jit(run)(rho)
    assert np.all(sol.result._value == sk.RESULTS.max_steps_reached._value)
    with pytest.raises(Exception, match="maximum number of solver steps"):
        jax.block_until_ready(
            jax.jit(jax.vmap(lambda r: _solve(r, y0[0], 0, t1=20.0, max_steps=30)))(rho)
        )


@pytest.mark.usefixtures("x64")
def test_forward_mode_adjoints_are_left_alone(on):
    """`DirectAdjoint` supports `jax.jvp`: not wrapped, so vmap of jvp works."""
    y0 = jnp.ones((N, 3))

    def solve(y):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -y), sk.Tsit5(), 0.0, 1.0, 0.1, y,
            adjoint=sk.DirectAdjoint(),
        ).ys  # fmt: skip

    _, tangent = jax.vmap(lambda y: jax.jvp(solve, (y,), (y,)))(y0)
    np.testing.assert_allclose(tangent[:, 0], y0 * np.exp(-1.0), rtol=1e-3)


# `SOLVERKIT_FULL_MATRIX=1` only (3.6 CPU s): a shared differentiated value's summed
# cotangent is test_vmap_route.py::test_per_example_gradients_of_shared_inputs and
# the matrix's [elem-t1-tsit5-shared_args]; `args` of mixed kinds its
# [mixed-t1-tsit5-grad_vmap].
@pytest.mark.slow
@full_matrix_only(
    "test_vmap_route.py::test_route_matches_loop[elem-t1-tsit5-shared_args], "
    "[mixed-t1-tsit5-grad_vmap], test_per_example_gradients_of_shared_inputs"
)
@pytest.mark.usefixtures("x64")
def test_shared_values_and_mixed_args(monkeypatch):
    """A differentiated closed-over value shared by the batch (its cotangent summed
    over it), `args` mixing a Python number with a batched array, only `args`
    batched."""
    _, y0, _ = _data()
    w = jnp.linspace(0.5, 1.5, N)

    def loss(sigma, w):
        def one(w):
            def field(t, y, args):
                x, yy, z = y
                decay = args["scale"] * args["w"]
                return jnp.stack([sigma * (yy - x), x * (28.0 - z) - yy, -decay * z])

            args = {"scale": 2.0, "w": w}
            sol = sk.diffeqsolve(
                sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 1e-3, y0[0], args,
                stepsize_controller=sk.PIDController(TOL, TOL),
            )  # fmt: skip
            return jnp.sum(sol.ys**2)

        return jnp.sum(jax.vmap(one)(w))

    grad = jax.grad(loss, (0, 1))
    ref = jax.jit(grad)(10.0, w)
    monkeypatch.setattr(_vmap, "ENABLED", True)
    assert _uses_kernel(grad, 10.0, w)
    out = jax.jit(_fresh(grad))(10.0, w)
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.usefixtures("x64")
def test_wrapped_solver_is_left_alone(on):
    """`HalfSolver(Tsit5())` passes `isinstance` for an explicit RK method: the
    kernel's check goes by class and says no, rather than failing on an attribute."""
    y0 = jnp.ones((N, 3))

    def solve(y):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, a: -y), sk.HalfSolver(sk.Tsit5()), 0.0, 1.0, 0.1,
            y, stepsize_controller=sk.PIDController(1e-6, 1e-6),
        ).ys  # fmt: skip

    assert not _uses_kernel(jax.vmap(solve), y0)
    np.testing.assert_allclose(jax.vmap(solve)(y0)[:, 0], y0 * np.exp(-1.0), rtol=1e-4)


# The full suite; the quick loop's route under `grad`:
# test_vmap_route.py::test_route_matches_loop[elem-t1-tsit5-vmap_grad].
@pytest.mark.slow
def test_float32_forward_and_gradient(monkeypatch):
    """Without float64 (so it runs on a TPU too, on the compiled kernel): the
    kernel's forward pass and gradient against the loop's at float32 tolerances."""
    rho = jnp.linspace(10.0, 28.0, N, dtype=jnp.float32)

    def loss(r):
        def field(t, y, args):
            x, yy, z = y
            return jnp.stack([10.0 * (yy - x), x * (r - z) - yy, x * yy - 8 / 3 * z])

        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 0.5, None, jnp.ones(3, jnp.float32),
            stepsize_controller=sk.PIDController(1e-5, 1e-5),
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    fn = jax.value_and_grad(lambda r: jnp.sum(jax.vmap(loss)(r)))
    monkeypatch.setattr(_vmap, "ENABLED", False)
    ref = jax.jit(fn)(rho)
    monkeypatch.setattr(_vmap, "ENABLED", True)
    assert _uses_kernel(fn, rho)
    out = jax.jit(_fresh(fn))(rho)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-3)
    np.testing.assert_allclose(out[1], ref[1], rtol=1e-2, atol=1e-3 * jnp.max(ref[1]))


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_forward_over_reverse_is_left_alone(monkeypatch):
    """`jax.hessian` (forward over reverse) of a vmapped solve: two differentiations
    see it, so it is not wrapped (the rules' kernel can't be differentiated in
    forward mode; wrapped, this raises)."""
    rho, y0, k = _data()
    loss = lambda r: jnp.sum(jax.vmap(lambda r: _solve(r, y0[0], 0).ys)(r) ** 2)  # noqa: E731
    hess = jax.jacfwd(jax.grad(loss))
    monkeypatch.setattr(_vmap, "ENABLED", True)
    assert not _uses_kernel(hess, rho[:2])  # the program as before
    assert np.all(np.isfinite(jax.jit(_fresh(hess))(rho[:2])))
