"""Checkpoints keep only what a step changes: the carry leaves that a loop iteration
returns unchanged (`ConstantStepSize`'s step count and interval ends) are stored once,
not in every checkpoint row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk
from solverkit._adjoint import _checkpoint
from solverkit._adjoint._stack import fixed_leaves, pack, stack, unpack


def _lorenz_grad(n_steps: int = 1000, adaptive: bool = False):
    controller = sk.PIDController(rtol=1e-5, atol=1e-5) if adaptive else None

    def one(rho):
        f = lambda t, y, args: jnp.stack(  # noqa: E731
            [10 * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - 8 / 3 * y[2]]
        )
        sol = sk.diffeqsolve(
            sk.ODETerm(f),
            sk.Tsit5(),
            0.0,
            1.0,
            1.0 / n_steps,
            jnp.array([1.0, 0.0, 0.0], rho.dtype),
            max_steps=4096,
            **({} if controller is None else dict(stepsize_controller=controller)),
        )
        return sol.ys[-1]

    return jax.grad(lambda rho: jnp.sum(jax.vmap(one)(rho) ** 2))


def test_stack_keeps_fixed_leaves_once():
    tree = (jnp.arange(3.0), jnp.asarray(7, jnp.int32), jnp.asarray(2.5))
    s = stack(tree, 4, (False, True, False))
    assert [a.shape for a in s.arrays] == [(4, 4)]  # the int32 leaf is not in rows
    assert fixed_leaves(s) == (False, True, False)
    back = unpack(s, pack(s, tree))
    for a, b in zip(back, tree):
        np.testing.assert_array_equal(a, b)


def test_constant_step_invariants_detected():
    seen = {}

    def spy(step, problem, carry):
        flags = real(step, problem, carry)
        paths = jax.tree_util.tree_leaves_with_path(carry)
        seen.update({jax.tree_util.keystr(p): f for (p, _), f in zip(paths, flags)})
        return flags

    real = _checkpoint._invariant
    _checkpoint._invariant = spy
    try:
        jax.make_jaxpr(_lorenz_grad())(jnp.linspace(0.0, 21.0, 4))
    finally:
        _checkpoint._invariant = real
    fixed = {k for k, f in seen.items() if f}
    assert fixed == {
        ".controller_state.n",
        ".controller_state.start",
        ".controller_state.end",
    }


# The full suite; the quick loop's fixed-step gradient:
# solve/test_controllers.py::test_constant_steps_differentiable_in_dt0.
@pytest.mark.slow
def test_fixed_step_gradient_memory_per_trajectory():
    # Rows: 129 checkpoint slots + 32 recomputation rows (the default layout for
    # max_steps=4096). A row holds what a Tsit5 step changes: t, tnext, y (3), the
    # FSAL derivative (3), and 5 int32 counters (done, num_steps, num_accepted,
    # num_rejected, result) = 13 words of 4 bytes; everything else is under 5 %.
    n = 1024
    compiled = jax.jit(_lorenz_grad()).lower(jnp.linspace(0.0, 21.0, n)).compile()
    stats = compiled.memory_analysis()
    assert stats is not None  # the CPU has it
    total = stats.temp_size_in_bytes + stats.argument_size_in_bytes
    total += stats.output_size_in_bytes
    assert total / n <= (129 + 32) * 13 * 4 * 1.05


def _bytes_per_trajectory(grad, n: int) -> float:
    compiled = jax.jit(grad).lower(jnp.linspace(0.0, 21.0, n)).compile()
    stats = compiled.memory_analysis()
    assert stats is not None  # the CPU has it
    total = stats.temp_size_in_bytes + stats.argument_size_in_bytes
    return (total + stats.output_size_in_bytes) / n


@pytest.mark.slow
def test_adaptive_gradient_memory_per_trajectory():
    # Rows: 129 checkpoint slots + 32 recomputation rows (max_steps=4096), each the
    # 10 float32 words an adaptive Tsit5 step changes (t, tnext, y, the FSAL
    # derivative, the PID controller's state: 2 words); and the step
    # record, a byte and a float32 step end a step (`_replay.py`; the end was 6 bits
    # of the byte until a recomputation sized a step otherwise: 10,837 B then). Not
    # the int32 counters: with a record the backward pass reads the recorded
    # decisions, and XLA drops the counters (they took 2.5 KiB more). Else under 5 %.
    per = _bytes_per_trajectory(_lorenz_grad(adaptive=True), 1024)
    assert per <= ((129 + 32) * 10 * 4 + 4096 * (1 + 4)) * 1.05, per


# Quick loop: solve/test_controllers.py::test_constant_steps_differentiable_in_dt0.
@pytest.mark.slow
def test_fixed_step_gradient_matches_direct_adjoint():
    # The gradient from checkpoints without the fixed leaves equals DirectAdjoint's
    # (same operations, so to a few float32 roundings of the 1000-step solve).
    def loss(rho, adjoint):
        def one(r):
            power = jnp.asarray(2, jnp.int32)  # a closed-over integer too
            f = lambda t, y, args: -r * y**power + jnp.sin(t)  # noqa: E731
            sol = sk.diffeqsolve(
                sk.ODETerm(f), sk.Tsit5(), 0.0, 1.0, 0.01, jnp.ones(2), adjoint=adjoint
            )
            return jnp.sum(sol.ys[-1] ** 2)

        return jnp.sum(jax.vmap(one)(rho))

    rho = jnp.linspace(0.5, 2.0, 8)
    got = jax.jit(jax.grad(loss), static_argnums=1)(
        rho, sk.RecursiveCheckpointAdjoint()
    )
    want = jax.jit(jax.grad(loss), static_argnums=1)(rho, sk.DirectAdjoint())
    # 100 steps, each a few float32 roundings of an O(1) gradient.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
