"""The checkpointed backward pass of a fixed-step solve (the vmapped fixed-step
Lorenz gradient, the accelerator table's `lorenz/fixed-grad`).

- The pullback replays each step's recorded decision (`_loop.Replay.accepted`,
  known only at run time). A fixed step accepts every step whatever the state, so
  the step ignores it there (`_loop._decision`): else each `where` of the step is a
  select at run time, and each select's pullback two (the pullback's loop body:
  1795 -> 1636 instructions of XLA's CPU program). The gradients are those of the
  replayed program to round-off.
- The row operations (gathers, scatters, dynamic slices and their updates) in each
  loop of the backward pass stay at today's count, read from the optimized HLO
  (`tools/hlo_loops.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import solverkit as sk
from solverkit import _loop
from tools.hlo_loops import loops


def _reads(jaxpr, var) -> bool:
    """Whether `jaxpr` reads `var` (an equation's operand or an output)."""
    return any(var in eqn.invars for eqn in jaxpr.eqns) or var in jaxpr.outvars


def _replayed_decision_read(monkeypatch, controller) -> bool:
    """Whether `_loop.step` reads a replayed decision, in the checkpointed gradient
    of a vmapped solve under `controller`."""
    found = []
    init = _loop.init

    def spy(problem):
        carry, bufs = init(problem)

        def step(accepted):
            return _loop.step(problem, carry, _loop.Replay(accepted))

        jaxpr = jax.make_jaxpr(step)(jnp.asarray(True)).jaxpr
        found.append(_reads(jaxpr, jaxpr.invars[0]))
        return carry, bufs

    monkeypatch.setattr(_loop, "init", spy)
    jax.make_jaxpr(jax.grad(lambda r, s: _loss(r, s, controller)))(*_data(jnp.float64))
    assert found
    return found[0]


def _field(t, y, args):
    rho, sigma, index = args
    beta = jnp.array([8.0 / 3.0, 2.0], y.dtype)[index]
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


_CONTROLLERS = {
    "constant": lambda dtype: (sk.ConstantStepSize(), 1e-3),
    "step_to": lambda dtype: (
        sk.StepTo(ts=jnp.linspace(0.0, 0.05, 51, dtype=dtype)),
        None,
    ),
    "pid": lambda dtype: (sk.PIDController(rtol=1e-6, atol=1e-6), 1e-3),
}


def _loss(rho, sigma, controller="constant", adjoint=None):
    """Lorenz from t = 0 to 0.05 in steps of 1e-3 (`StepTo`: the same grid), its
    field closing over a float `rho` (vmapped), a float32 `sigma` and an int32
    index; 8 checkpoint slots, so chunks are recomputed."""
    index = jnp.asarray(0, jnp.int32)
    adjoint = adjoint or sk.RecursiveCheckpointAdjoint(checkpoints=8)
    stepsize_controller, dt0 = _CONTROLLERS[controller](rho.dtype)

    def one(r):
        y0 = jnp.array([1.0, 0.0, 0.0], r.dtype)
        args = (r, sigma.astype(r.dtype), index)
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, _: _field(t, y, args)), sk.Tsit5(), 0.0, 0.05,
            dt0, y0, stepsize_controller=stepsize_controller, max_steps=64,
            adjoint=adjoint,
        )  # fmt: skip
        return sol.ys[-1]

    return jnp.sum(jax.vmap(one)(rho) ** 2)


def _data(dtype):
    return jnp.linspace(0.0, 21.0, 4, dtype=dtype), jnp.asarray(10.0, jnp.float32)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("name", ["constant", "step_to"])
def test_fixed_step_ignores_replayed_decision(monkeypatch, name):
    # Fails on the old code (the replayed decision is read).
    assert not _replayed_decision_read(monkeypatch, name)


@pytest.mark.usefixtures("x64")
def test_adaptive_step_reads_replayed_decision(monkeypatch):
    assert _replayed_decision_read(monkeypatch, "pid")


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("name", ["constant", "step_to"])
def test_gradient_against_direct_and_differences(name):
    # jit(grad(vmap)): rho float64 (vmapped), sigma float32, an int32 index.
    rho, sigma = _data(jnp.float64)
    grad = jax.jit(jax.grad(_loss, (0, 1)), static_argnums=(2, 3))
    got = grad(rho, sigma, name, None)
    want = grad(rho, sigma, name, sk.DirectAdjoint())
    # The same 50 steps, float64 round-off of their sums (no controller's gain).
    assert_tree_allclose(got, want, rtol=1e-12, atol=1e-12)
    value = jax.jit(lambda r: _loss(r, sigma, name))
    eps = 1e-5
    v = jnp.array([0.3, -1.0, 0.7, 0.2])
    quotient = (float(value(rho + eps * v)) - float(value(rho - eps * v))) / (2 * eps)
    # Central differences: O(eps**2) times the third derivative (~1e2 here), plus
    # round-off 1e-16 / eps, relative to a loss of ~1e1.
    np.testing.assert_allclose(float(jnp.sum(got[0] * v)), quotient, rtol=1e-7)


def _benchmark_loss(rho):
    """`benchmarks.cases`' `lorenz/fixed-grad` loss: 1000 steps of 1e-3 (the default
    checkpoints: 128 slots, 32-step chunks), rho closed over, float32."""

    def one(r):
        y0 = jnp.array([1.0, 0.0, 0.0], r.dtype)
        field = lambda t, y, args: _field(t, y, (r, 10.0, 0))  # noqa: E731
        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 1e-3, y0, max_steps=4096,
            stepsize_controller=sk.ConstantStepSize(), throw=False,
        )  # fmt: skip
        return sol.ys[-1]

    return jnp.sum(jax.vmap(one)(rho) ** 2)


@pytest.mark.usefixtures("optimized_compiles")
def test_backward_row_operations():
    # The vmapped fixed-step Lorenz gradient of the benchmarks (N = 8): each loop of
    # its backward pass reads and writes as many rows as today (the chunk loop 8
    # reads and 2 writes; the refill 2 and 2; the pullback 2 reads; on JAX 0.4.38,
    # 0.10.2 and 0.12.1 alike). A row read is a gather under `vmap` that XLA turns
    # into a dynamic slice; either counts.
    rho = jnp.linspace(0.0, 21.0, 8, dtype=jnp.float32)
    found = loops(jax.jit(jax.grad(_benchmark_loss)).lower(rho).compile().as_text())
    backward = [i for i, loop in enumerate(found) if loop["ops"]["while"] == 2]
    assert len(backward) == 1, found
    i = backward[0]
    chunk, refill, pullback = (found[i + k]["ops"] for k in range(3))

    def reads(ops):
        return ops["gather"] + ops["dynamic-slice"]

    def writes(ops):
        return ops["scatter"] + ops["dynamic-update-slice"]

    assert reads(chunk) <= 8 and writes(chunk) <= 2, found
    assert reads(refill) <= 2 and writes(refill) <= 2, found
    assert reads(pullback) <= 2 and writes(pullback) == 0, found
