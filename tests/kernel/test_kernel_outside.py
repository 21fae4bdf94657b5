"""What runs around the whole-solve kernel (`ensemble_solve(kernel=True)`): the
program outside the `pallas_call`, lowered for a TPU on the CPU, and the run-time
error check.

On a TPU, an `(N, k)` array with a small `k` is padded to 128 lanes: the kernel's
counts taken as `(N, 5)` were transposed and then sliced with a stride outside the
kernel, and at N = 2^20 that slice ran out of scoped VMEM at compile time. The
error check (`throw=True`) passed every output through a `cond`.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit._kernel import _solve


def _field(sigma, beta):
    def field(t, y, rho):
        x, yy, z = y
        return jnp.stack([sigma * (yy - x), x * (rho - z) - yy, x * yy - beta * z])

    return field


def _solver(throw: bool, saveat=None, max_steps=4096, t1=1.0):
    sigma, beta = jnp.asarray(10.0, jnp.float32), jnp.asarray(8 / 3, jnp.float32)

    def solve(y0, rho):
        return sk.ensemble_solve(
            sk.ODETerm(_field(sigma, beta)), sk.Tsit5(), 0.0, t1, None, y0, rho,
            saveat=saveat or sk.SaveAt(t1=True), max_steps=max_steps, throw=throw,
            stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5), kernel=True,
        )  # fmt: skip

    return solve


def _inputs(n: int, dtype=jnp.float32):
    y0 = jnp.tile(jnp.asarray([1.0, 0.0, 0.0], dtype), (n, 1))
    return y0, jnp.linspace(0.0, 21.0, n, dtype=dtype)


@pytest.mark.parametrize("n", [4096, 2**20])
def test_outside_the_kernel_lowered_for_tpu(monkeypatch, n):
    """Lowered for a TPU: no strided slice, no select, no concatenate of outputs,
    and only the state's own transposes (in and out) around the kernel."""
    monkeypatch.setattr(_solve, "DEFAULT_INTERPRET", False)
    shapes = (
        jax.ShapeDtypeStruct((n, 3), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    lowered = jax.jit(_solver(throw=False)).trace(*shapes)
    text = lowered.lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    ops = re.findall(r"stablehlo\.(\w+)", text)
    assert ops.count("transpose") == 2, ops  # y0 into lanes, y(t1) back
    assert "select" not in ops and "gather" not in ops, ops
    strided = re.findall(r"stablehlo\.slice %\S+ \[[^\]]*:\d+:\d+", text)
    assert not strided, strided
    assert not re.search(rf"tensor<{n}x5xi32>", text)  # counts stay in lanes


def _conds_outside_kernels(jaxpr, found):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name == "cond":
            found.append(eqn)
        for value in eqn.params.values():
            inner = [value] if not isinstance(value, tuple) else value
            for j in inner:
                if isinstance(j, jax.extend.core.ClosedJaxpr):
                    _conds_outside_kernels(j.jaxpr, found)
                elif isinstance(j, jax.extend.core.Jaxpr):
                    _conds_outside_kernels(j, found)


def test_error_check_takes_a_scalar():
    """`throw=True`: the error check's `cond` takes a scalar, not the outputs."""
    y0, rho = _inputs(256)
    ts = jnp.linspace(0.0, 1.0, 4, dtype=jnp.float32)
    solve = _solver(throw=True, saveat=sk.SaveAt(t0=True, ts=ts, t1=True))
    found = []
    _conds_outside_kernels(jax.make_jaxpr(solve)(y0, rho).jaxpr, found)
    assert found
    for eqn in found:
        sizes = [int(np.prod(v.aval.shape)) for v in eqn.invars]
        assert max(sizes) <= 1, sizes


# [t0_ts_t1] with `SOLVERKIT_FULL_MATRIX=1` only: the throw is [t1]'s, the kernel's
# saved rows test_kernel.py::test_values_float64.
@pytest.mark.parametrize(
    "saveat",
    [
        "t1",
        pytest.param(
            "t0_ts_t1", marks=full_matrix_only("[t1] and test_kernel.py's values")
        ),
    ],
)
# Quick loop: test_errors.py::test_throw_under_jit_and_vmap.
@pytest.mark.slow
def test_throw_same_values_and_raises(saveat):
    """`throw=True` returns `throw=False`'s values (the saved `y0` bit for bit,
    signed zeros too) and raises, under `jit`, when a trajectory reaches
    `max_steps`; vmapped over a second ensemble, likewise."""
    y0, rho = _inputs(256)
    ts = jnp.linspace(0.0, 1.0, 4, dtype=jnp.float32)
    save = sk.SaveAt(t1=True) if saveat == "t1" else sk.SaveAt(t0=True, ts=ts, t1=True)
    y0 = y0.at[:, 1].set(-0.0)  # a signed zero kept by the t0 row
    loud = eqx.filter_jit(_solver(throw=True, saveat=save))(y0, rho)
    quiet = eqx.filter_jit(_solver(throw=False, saveat=save))(y0, rho)
    np.testing.assert_array_equal(loud.ts, quiet.ts)
    np.testing.assert_array_equal(loud.t1, quiet.t1)
    if saveat != "t1":  # the t0 row is `y0` itself
        np.testing.assert_array_equal(np.signbit(loud.ys[:, 0]), np.signbit(y0))
        np.testing.assert_array_equal(loud.ys[:, 0], quiet.ys[:, 0])
    # The rest are the results of two compiled programs (the interpreted kernel is
    # compiled with what surrounds it), which XLA may round differently in float32:
    # a step whose error ratio is within round-off of 1 may then be decided the
    # other way (docs/ensembles.md: step counts within 3), and the two solutions
    # differ by up to both global errors, each at most the steps taken times the
    # local tolerance (rtol = atol = 1e-5, relative to 1 + |y|).
    steps_l, steps_q = (np.asarray(s.stats["num_steps"]) for s in (loud, quiet))
    assert np.max(np.abs(steps_l - steps_q)) <= 3
    bound = 2 * np.max(steps_q) * 1e-5 * (1 + np.abs(np.asarray(quiet.ys)))
    assert np.all(np.abs(np.asarray(loud.ys) - np.asarray(quiet.ys)) <= bound)
    if saveat != "t1":
        # The raise under jit and vmap whatever is saved: the [t1] case's, with
        # test_error_check_takes_a_scalar (these saves: the check takes a scalar).
        return
    short = eqx.filter_jit(_solver(throw=True, saveat=save, max_steps=8))
    with pytest.raises(Exception, match="maximum number of solver steps"):
        jax.block_until_ready(short(y0, rho))
    batched = eqx.filter_jit(jax.vmap(_solver(throw=True, saveat=save, max_steps=8)))
    with pytest.raises(Exception, match="maximum number of solver steps"):
        jax.block_until_ready(batched(y0[None].repeat(2, 0), rho[None].repeat(2, 0)))


# `SOLVERKIT_FULL_MATRIX=1` only: a developer tool's smoke run (4 CPU s); the pieces it
# times are the tests above (the callback, the kernel, the throw, the vmap).
@pytest.mark.slow
@full_matrix_only("test_throw_same_values_and_raises and test_eager_checks_on_the_host")
def test_profile_benchmark_runs(tmp_path):
    """`tools.kernel_profile` (the chip command) runs every piece on the CPU."""
    import json

    from tools import kernel_profile

    argv = ["--out", str(tmp_path), "--sizes", "128", "--t1", "1", "--repeats", "1"]
    assert kernel_profile.main([*argv, "--interpret"]) == 0
    rows = json.loads((tmp_path / "kernel_profile.json").read_text())["rows"]
    assert [r["piece"] for r in rows] == [
        "dispatch", "callback", "kernel_only", "kernel", "kernel_throw", "vmap",
        "vmap_throw",
    ]  # fmt: skip
    assert not [r for r in rows if "error" in r]


def _eager_solve(kernel: bool, max_steps: int, throw: bool = True):
    y0, rho = _inputs(256)
    sigma = jnp.asarray(10.0, jnp.float32)  # a closed-over array: concrete here
    return sk.ensemble_solve(
        sk.ODETerm(_field(sigma, 8 / 3)), sk.Tsit5(), 0.0, 1.0, None, y0, rho,
        stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5), kernel=kernel,
        max_steps=max_steps, throw=throw,
    )  # fmt: skip


# The full suite; the quick loop's run-time checks:
# test_errors.py::test_throw_under_jit_and_vmap.
@pytest.mark.slow
def test_eager_checks_on_the_host(monkeypatch):
    """Called eagerly, `ensemble_solve` compiles no error check (no host callback)
    and raises from the host what the check would, for the kernel and the vmap
    paths alike; under `jit` the check stays in the program."""
    from solverkit._ensemble import _solve as ensemble

    checks = []

    def record(module):
        original = module.error_if

        def error_if(*args, **kwargs):
            checks.append(module.__name__)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, "error_if", error_if)

    record(ensemble)
    record(_solve)
    errors = {}
    for kernel in (True, False):
        with pytest.raises(eqx.EquinoxRuntimeError) as info:
            _eager_solve(kernel, max_steps=8)
        errors[kernel] = str(info.value)
    assert errors[True] == errors[False] == sk.RESULTS.max_steps_reached.message()
    assert checks == []
    for kernel in (True, False):  # no failure: the solve's values, nothing raised
        loud = _eager_solve(kernel, max_steps=4096)
        quiet = _eager_solve(kernel, max_steps=4096, throw=False)
        np.testing.assert_array_equal(loud.ys, quiet.ys)
    assert checks == []
    y0, rho = _inputs(256)
    jax.make_jaxpr(_solver(throw=True))(y0, rho)  # traced: the device check
    assert checks == ["solverkit._kernel._solve"]
