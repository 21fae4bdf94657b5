"""`vmap` batches each loop body of a checkpointed gradient once (first calls).

`lax.while_loop`'s batching rule batches its body twice when part of the carry stays
unbatched (a fixed-point round, then the body it binds) and once when all of it is
batched. The checkpointed adjoint's loops carry their counters batched and read them
unbatched (`_loops.counted_loop`), so every body is batched once: tracing
`jax.grad(jax.vmap(diffeqsolve))` costs less. These tests check that structure
(every loop carry batched, stores still one-row writes) and that the gradients are
those of the other paths: `DirectAdjoint`, `ensemble_solve`, finite differences,
with closed-over values of several dtypes (an int index among them).
"""

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_allclose,
    full_matrix_only,
    lv_batch,
    lv_closing_over,
    lv_loss,
)

import solverkit as sk
from solverkit._closure._unvmap import unvmap_first


pytestmark = pytest.mark.usefixtures("x64")

N = 3
TOL = 1e-8


def _data():
    return lv_batch()


def _loss(rates, y0, adjoint=None):
    """`helpers.lv_loss`: Lotka-Volterra whose field closes over the rates, a float32
    scale and an int32 index into a table (an unbatched index: a dynamic slice, not
    a gather, under `vmap`)."""
    return lv_loss(rates, y0, adjoint)


def _while_loops(jaxpr):
    """Every `while` equation of `jaxpr`, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from _while_loops(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from _while_loops(sub)


# Quick loop: solve/test_integrate.py::test_vmap_over_y0_args_t1.
@pytest.mark.slow
def test_every_loop_carry_batched():
    # Fails with a counter carried unbatched (then the body is batched twice).
    jaxpr = jax.make_jaxpr(jax.grad(_loss))(*_data()).jaxpr
    loops = list(_while_loops(jaxpr))
    assert len(loops) >= 4  # forward, chunks, recomputation, steps back
    for eqn in loops:
        consts = eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]
        carry = [v.aval for v in eqn.invars[consts:]]
        unbatched = [a.str_short() for a in carry if a.shape[:1] != (N,)]
        assert unbatched == [], unbatched


# Quick loop: solve/test_integrate.py::test_vmap_over_y0_args_t1.
@pytest.mark.slow
def test_stores_stay_row_writes():
    # The counters are read unbatched: checkpoints and recomputed carries are
    # written and read as rows, never by a per-element index (under `vmap` a row
    # is a gather/scatter with an unbatched index, which XLA makes a slice again).
    jaxpr = jax.make_jaxpr(jax.grad(_loss))(*_data()).jaxpr
    for loop in _while_loops(jaxpr):
        for eqn in loop.params["body_jaxpr"].jaxpr.eqns:
            name = eqn.primitive.name
            if name == "gather" or name.startswith("scatter"):
                numbers = eqn.params["dimension_numbers"]
                assert not getattr(numbers, "operand_batching_dims", ())
                assert eqn.invars[1].aval.shape[:1] != (N,), name


# Quick loop: solve/test_integrate.py::test_vmap_over_y0_args_t1.
@pytest.mark.slow
def test_bodies_batched_once(monkeypatch):
    # How often `vmap` traces each large loop body: once (twice on the old code).
    # JAX caches a batching by its batched inputs and outputs; a miss traces the
    # body. (JAX internals: skipped where absent.)
    from jax._src.interpreters import batching

    cached = getattr(batching, "_batch_jaxpr_axes", None)
    inner = getattr(batching, "_batch_jaxpr_inner", None)
    if cached is None or inner is None:
        pytest.skip("this JAX batches jaxprs otherwise: nothing to count with")
    active, traced = [], []  # [jaxpr, traced?] being batched; those traced

    def counted_inner(*args, **kwargs):
        if active:  # (else not a batching of a whole jaxpr)
            active[-1][1] = True
        return inner(*args, **kwargs)

    def counted(closed, *args):
        active.append([closed, False])
        try:
            return cached(closed, *args)
        finally:
            closed, missed = active.pop()
            if missed:
                traced.append(closed)

    jax.clear_caches()
    monkeypatch.setattr(batching, "_batch_jaxpr_inner", counted_inner)
    monkeypatch.setattr(batching, "_batch_jaxpr_axes", counted)
    jax.make_jaxpr(jax.grad(_loss))(*_data())
    large = [c for c in traced if len(c.jaxpr.eqns) > 100]  # the steps' bodies
    assert len(large) >= 3  # forward, recomputation, steps back
    assert len({id(c) for c in large}) == len(large), [len(c.jaxpr.eqns) for c in large]


# This batch's checkpointed gradient against DirectAdjoint's (the same `lv_loss`,
# data and tolerance) and central differences: programs/test_traced_step.py::
# test_gradient_against_direct_and_differences; against `ensemble_solve`'s:
# ensemble/test_ensemble.py::test_gradient_matches_vmap.


def _field_args(y, p):
    """`helpers.lv_closing_over`'s field, with its closed-over values folded in
    (scale 1, table[1] = 1): the same steps."""
    a, b, c, d = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])


# `SOLVERKIT_FULL_MATRIX=1` only: this batch's checkpointed gradient against central
# differences is programs/test_traced_step.py::
# test_gradient_against_direct_and_differences[False]'s; `vmap` of `grad` of a batch
# the quick loop's adjoint/test_adjoint.py::
# test_vmap_grad_closed_over_float_and_t1_analytic.
@pytest.mark.slow
@full_matrix_only(
    "test_traced_step.py::test_gradient_against_direct_and_differences[False] and "
    "test_adjoint.py::test_vmap_grad_closed_over_float_and_t1_analytic"
)
def test_gradient_against_finite_differences():
    rates, y0 = _data()
    grad = jax.jit(
        jax.vmap(
            jax.grad(
                lambda r, y: jnp.sum(
                    lv_closing_over(r, y, sk.RecursiveCheckpointAdjoint()) ** 2
                )
            )
        )
    )(rates, y0)
    value = jax.jit(lambda r: _loss(r, y0))
    eps = 1e-6
    for seed in range(2):
        v = jax.random.normal(jax.random.key(seed), rates.shape, rates.dtype)
        quotient = (float(value(rates + eps * v)) - float(value(rates - eps * v))) / (
            2 * eps
        )
        # The solve's discrete map is smooth while no step is accepted or rejected
        # differently: central differences are good to O(eps**2) plus the round-off
        # 1e-16 / eps, far under the solve's tolerance.
        np.testing.assert_allclose(float(jnp.sum(grad * v)), quotient, rtol=1e-5)


def test_unvmap_first():
    # Unbatched (vmap broadcasts it back): the first element's value, at any depth.
    x = jnp.array([5, 6, 7], jnp.int32)
    assert jax.vmap(unvmap_first)(x).tolist() == [5, 5, 5]
    nested = jax.jit(jax.vmap(jax.vmap(unvmap_first)))(jnp.arange(6).reshape(2, 3))
    assert nested.tolist() == [[0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="int scalar"):
        unvmap_first(jnp.ones(2, jnp.int32))


# `SOLVERKIT_FULL_MATRIX=1` only: a vmapped fixed-step batch's checkpointed gradient
# against DirectAdjoint's is programs/test_checkpoint_memory.py::
# test_fixed_step_gradient_matches_direct_adjoint's; the quick loop's fixed-step
# gradient solve/test_controllers.py::test_constant_steps_differentiable_in_dt0.
@pytest.mark.slow
@full_matrix_only(
    "test_checkpoint_memory.py::test_fixed_step_gradient_matches_direct_adjoint"
)
def test_fixed_step_gradient_against_direct():
    # Fixed steps keep the forward loop's times and counters unbatched; the
    # backward loops are still batched throughout.
    rates, y0 = _data()

    def loss(rates, y0, adjoint):
        def one(r, y):
            term = sk.ODETerm(lambda t, y, args: _field_args(y, r))
            sol = sk.diffeqsolve(
                term, sk.Tsit5(), 0.0, 1.0, 0.05, y, adjoint=adjoint, max_steps=64
            )
            return sol.ys[-1]

        return jnp.sum(jax.vmap(one)(rates, y0) ** 2)

    got = jax.grad(loss, (0, 1))(rates, y0, sk.RecursiveCheckpointAdjoint())
    want = jax.grad(loss, (0, 1))(rates, y0, sk.DirectAdjoint())
    # The same 20 steps, differentiated by two schedules: float64 round-off.
    assert_tree_allclose(got, want, rtol=1e-12, atol=1e-12)
