"""Smaller programs for the first call of a gradient.

- `Traced` keeps only the equations whose results are used
  (`_jaxpr_rewrite.dce`): the step's stage times where the field ignores `t`, and,
  in the checkpointed backward pass, whatever `jax.vjp` of a step computes that the
  cotangents don't need (the new carry, the counters, the decisions).
- The step-size controller and the checkpoint schedule bind no nested `jit`
  (`jnp.clip`, `jnp.isinf`, `jnp.where`, `RESULTS.where` were each a call of their
  own, traced, batched and lowered at every use).

Neither changes a value: the gradients are bitwise those of the programs before, and
agree with `DirectAdjoint` and finite differences, with closed-over values of several
dtypes (an int index among them), under `jit`, `vmap` and `grad`.
"""

import os

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, full_matrix_only, lv_batch, lv_loss

import solverkit as sk
from solverkit._closure import _traced
from solverkit._closure._jaxpr_rewrite import dce
from solverkit._closure._traced import Traced
from solverkit._controller._adaptive import _usable


_loss = lv_loss


def _subjaxprs(jaxpr):
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(sub, jex.ClosedJaxpr):
                    yield sub.jaxpr
                elif isinstance(sub, jex.Jaxpr):
                    yield sub


def _all_equations(jaxpr) -> list:
    out = list(jaxpr.eqns)
    for sub in _subjaxprs(jaxpr):
        out += _all_equations(sub)
    return out


def _loop_bodies(jaxpr) -> list:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            out.append(eqn.params["body_jaxpr"].jaxpr)
    for sub in _subjaxprs(jaxpr):
        out += _loop_bodies(sub)
    return out


# --- `dce` and `Traced` ----------------------------------------------------------


def test_traced_program_keeps_only_used_equations():
    # Fails on the old code: the dead product was evaluated (2 equations).
    def fn(x):
        _ = jnp.sin(x) * 2.0  # computed, never used
        return x + 1.0

    traced = Traced(fn)
    jaxpr = jax.make_jaxpr(lambda x: traced(x) + traced(2 * x))(jnp.float32(1.0))
    assert [e.primitive.name for e in jaxpr.eqns] == ["add", "mul", "add", "add"]
    assert float(jax.jit(lambda x: traced(x))(jnp.float32(1.0))) == 2.0


def test_simplified_merges_repeated_equations():
    # `Traced.simplified`: each repeated equation once, the same values.
    def fn(x, y):
        a, b = jnp.split(y, 2)
        c, d = jnp.split(y, 2)  # the same split again
        return jnp.sin(x) * a + jnp.sin(x) * c - b * d

    traced = Traced(fn)
    x, y = jnp.float32(0.3), jnp.array([1.5, -2.0], jnp.float32)

    def names(f):
        return [e.primitive.name for e in jax.make_jaxpr(f)(x, y).eqns]

    assert names(traced.simplified).count("sin") == 1
    assert names(traced.simplified).count("split") == 1
    assert names(traced).count("sin") == 2
    np.testing.assert_array_equal(
        jax.jit(traced.simplified)(x, y), jax.jit(traced)(x, y)
    )


def test_dce_keeps_effects_and_order():
    seen = []

    def fn(x):
        jax.debug.callback(lambda v: seen.append(float(v)), x)  # no output: kept
        dead = x * 3.0
        return x - 1.0, dead > 0

    jaxpr = jax.make_jaxpr(lambda x: fn(x)[0])(jnp.float32(2.0)).jaxpr
    pruned = dce(jaxpr)
    names = [e.primitive.name for e in pruned.eqns]
    assert "debug_callback" in names and "mul" not in names and "gt" not in names
    assert names == [e.primitive.name for e in jaxpr.eqns if e in pruned.eqns]
    assert dce(pruned) is pruned  # nothing left to drop: the same object
    traced = Traced(lambda x: fn(x)[0])
    assert float(jax.jit(traced)(jnp.float32(2.0))) == 1.0
    jax.effects_barrier()
    assert seen == [2.0]


# --- The programs of a solve -------------------------------------------------------


@pytest.mark.parametrize("adjoint", ["checkpoint", "direct", "forward"])
# Quick loop: [direct].
@pytest.mark.quick_cases("direct", "forward")
def test_no_nested_jit_in_a_pid_solve(adjoint):
    # Fails on the old code: 20 nested `jit`s in the checkpointed gradient (the
    # controller's `jnp.clip`, `jnp.isinf`, `where(keep, 1, factormin)`,
    # `RESULTS.where`; the schedule's and the replay's `jnp.where`).
    rates, y0 = lv_batch()
    adj = {
        "checkpoint": sk.RecursiveCheckpointAdjoint(),
        "direct": sk.DirectAdjoint(),
        "forward": sk.RecursiveCheckpointAdjoint(),
    }[adjoint]
    if adjoint == "forward":
        fn = lambda r, y: _loss(r, y, adj, throw=False)  # noqa: E731
    else:
        fn = jax.grad(lambda r, y: _loss(r, y, adj, throw=False))
    jaxpr = jax.make_jaxpr(fn)(rates, y0).jaxpr
    calls = [e for e in _all_equations(jaxpr) if e.primitive.name in ("jit", "pjit")]
    # (The field's own `lax.dynamic_index_in_dim` is a `jit` of the user's.)
    names = {e.params["name"] for e in calls}
    assert names <= {"dynamic_index_in_dim"}, names


# Quick loop: test_no_nested_jit_in_a_pid_solve[direct].
@pytest.mark.slow
def test_pullback_program_is_pruned(monkeypatch):
    # The checkpointed backward pass: the pullback loop's body holds fewer
    # equations than with every traced program kept whole (the old code's), and
    # the step's programs in the forward and recomputation loops lose the stage
    # times (the field ignores `t`) and their repeated equations (the field's
    # split of its closed-over rates, once a stage).
    rates, y0 = lv_batch()

    def sizes():
        jaxpr = jax.make_jaxpr(jax.grad(_loss))(rates, y0).jaxpr
        return [len(body.eqns) for body in _loop_bodies(jaxpr)]

    pruned = sizes()
    _unpruned(monkeypatch)
    whole = sizes()
    assert len(pruned) == len(whole) == 4  # forward, chunks, recomputation, pullback
    # The chunk loop's own body: the schedule's index arithmetic and the buffer
    # reads, each once.
    assert all(p < w for p, w in zip(pruned, whole)), (pruned, whole)
    # LV: 821 -> 672 (what the cotangents need, each equation once); forward
    # 419 -> 357, recomputation 411 -> 346, chunk 103 -> 87.
    assert whole[-1] - pruned[-1] >= 0.1 * whole[-1], (pruned, whole)


def _unpruned(monkeypatch):
    """Every traced program evaluated whole (the old code's)."""
    monkeypatch.setattr(_traced, "dce", lambda jaxpr: jaxpr)
    monkeypatch.setattr(_traced, "cse", lambda jaxpr: jaxpr)


def _grads(rates, y0, **kwargs):
    return jax.jit(jax.vmap(jax.grad(lambda r, y: _loss(r[None], y[None], **kwargs))))(
        rates, y0
    )


# The full suite (4-5 CPU s a case), as are test_pullback_program_is_pruned and
# programs/test_traced_step.py::test_gradient_against_direct_and_differences (the
# same LV loss); the quick loop's pruned programs:
# test_no_nested_jit_in_a_pid_solve[direct]. [None] and [steps] with
# `SOLVERKIT_FULL_MATRIX=1` only: [ts] prunes the same pullback (the saved rows'
# cotangents too), and the pruned gradients of the other saves are checked against
# DirectAdjoint and differences (programs/test_traced_step.py,
# adjoint/test_ts_gradients.py).
_UNPRUNED_COVER = (
    "[ts], and programs/test_traced_step.py (pruned gradients against Direct)"
)


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "saveat",
    [
        pytest.param(None, marks=full_matrix_only(_UNPRUNED_COVER)),
        "ts",
        pytest.param("steps", marks=full_matrix_only(_UNPRUNED_COVER)),
    ],
)
def test_gradients_bitwise_as_unpruned(monkeypatch, saveat):
    # The same primitives in the same order, less the dead ones: the same
    # gradients, bit for bit (`vmap` of `grad`, `jit`; float64 rates, float32
    # scale, int32 index).
    saves = {
        None: None,
        "ts": sk.SaveAt(ts=jnp.linspace(0.0, 3.0, 7)),
        "steps": sk.SaveAt(steps=True),
    }[saveat]
    rates, y0 = lv_batch()
    got = _grads(rates, y0, saveat=saves)
    _unpruned(monkeypatch)
    jax.clear_caches()
    want = _grads(rates, y0, saveat=saves)
    if os.environ.get("SOLVERKIT_TEST_XLA_FLAGS"):
        # XLA's older CPU loop emitters at optimization level 0 (the test session's
        # compile, tests/conftest.py) fuse the two programs differently once the
        # checkpointed counters are dead in both, and round the pullback's sums
        # differently: 4.6e-14 relative with SaveAt(ts) (~200 float64 roundings
        # over the solve's steps). With XLA's default compile: bit for bit.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# The full suite (5 CPU s a case), as are the checkpointed gradients of the same LV
# loss (programs/test_traced_step.py) and through `SaveAt(ts)`
# (adjoint/test_ts_gradients.py); the quick loop's checkpointed gradients:
# closure/test_closure_matrix.py's checkpoint cells. `SOLVERKIT_FULL_MATRIX=1` only
# (7 CPU s): the checkpointed gradient through `SaveAt(ts)` against DirectAdjoint,
# all checkpoints and 4, is
# adjoint/test_ts_gradients.py::test_checkpointed_equals_direct[default],
# [recomputed] (and test_checkpointed_against_finite_differences); of this LV loss
# programs/test_traced_step.py::test_gradient_against_direct_and_differences.
@pytest.mark.slow
@full_matrix_only("adjoint/test_ts_gradients.py::test_checkpointed_equals_direct")
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("checkpoints", [None, 4])
def test_gradient_against_direct_and_differences(checkpoints):
    rates, y0 = lv_batch()
    adjoint = sk.RecursiveCheckpointAdjoint(checkpoints=checkpoints)
    saveat = sk.SaveAt(ts=jnp.linspace(0.0, 3.0, 7))
    got = jax.jit(jax.grad(lambda r: _loss(r, y0, adjoint, saveat=saveat)))(rates)
    want = jax.jit(jax.grad(lambda r: _loss(r, y0, sk.DirectAdjoint(), saveat=saveat)))(
        rates
    )
    # The same discrete steps under another schedule: float64 round-off of the
    # sums, times the ~1e2 gain of the controller.
    assert_tree_allclose(got, want, rtol=1e-10, atol=1e-12)
    value = jax.jit(lambda r: _loss(r, y0, adjoint, saveat=saveat))
    eps = 1e-6
    v = jax.random.normal(jax.random.key(1), rates.shape, rates.dtype)
    quotient = (float(value(rates + eps * v)) - float(value(rates - eps * v))) / (
        2 * eps
    )
    # Central differences: O(eps**2) plus round-off 1e-16 / eps, while no step is
    # decided differently (the solver's 1e-8 bounds its own error).
    np.testing.assert_allclose(float(jnp.sum(got * v)), quotient, rtol=1e-5)


# The full suite, as is the float64 comparison with DirectAdjoint
# (programs/test_traced_step.py:: test_gradient_against_direct_and_differences); the
# quick loop's pruned programs:
# test_no_nested_jit_in_a_pid_solve[direct].
# `SOLVERKIT_FULL_MATRIX=1` only: the same float32 check of the same loss is
# test_traced_step.py::test_float32_gradient_against_direct.
@pytest.mark.slow
@full_matrix_only("test_traced_step.py::test_float32_gradient_against_direct")
def test_float32_gradient_against_direct():
    rates, y0 = (x.astype(jnp.float32) for x in lv_batch())
    got = jax.jit(jax.grad(_loss))(rates, y0)
    want = jax.jit(jax.grad(lambda r, y: _loss(r, y, sk.DirectAdjoint())))(rates, y0)
    # float32 round-off (6e-8) over ~100 steps, times the controller's gain.
    assert_tree_allclose(got, want, rtol=1e-4, atol=1e-6)


# --- The controller without nested `jit`s ------------------------------------------


def _old(pid, keep, factor, inv):
    """The old code's clip and `inv` fix, as written there."""
    factor = jnp.clip(
        factor,
        jnp.where(keep, 1, pid.factormin),
        jnp.where(keep, pid.factormax, pid.safety),
    )
    inv = jnp.where((inv == 0) | jnp.isinf(inv), 1, inv)
    return factor, inv


def _assert_same(a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    assert (a.dtype, a.shape, a.weak_type) == (b.dtype, b.shape, b.weak_type)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_INT_LIMITS = dict(factormin=0, factormax=5, safety=1)


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("factors", [{}, _INT_LIMITS], ids=["floats", "ints"])
# Quick loop: one case (x64 checks float32 and float64); the rest in the full suite.
@pytest.mark.quick_cases("ints-True")
def test_controller_limits_as_before(x64, factors):
    # The step-size factor's limits and the inverse error's fix, against the old
    # code's `jnp.clip`/`jnp.isinf`/`jnp.where` on the same inputs (0, inf, NaN,
    # around the limits; float32 under x64 too; int limits), under `jit` and
    # `vmap`: equal, dtype and weak type included.
    with jax.enable_x64(x64):
        pid = sk.PIDController(rtol=1e-3, atol=1e-6, **factors)
        dtypes = [jnp.float32] + ([jnp.float64] if x64 else [])
        for dtype in dtypes:
            values = [0.0, 1e-9, 0.1, 0.2, 0.5, 0.9, 1.0, 3.0, 10.0, 11.0, np.inf]
            x = jnp.asarray(values + [np.nan], dtype)
            keep = jnp.arange(x.size) % 2 == 0

            def new(k, f):
                return pid._limited(k, f), _usable(f)

            got = jax.jit(jax.vmap(new))(keep, x)
            want = jax.jit(jax.vmap(lambda k, f: _old(pid, k, f, f)))(keep, x)
            for a, b in zip(got, want):
                _assert_same(a, b)
            for k in (True, False):  # unbatched, and a weakly typed factor
                _assert_same(pid._limited(k, 0.05), _old(pid, k, 0.05, 1.0)[0])
                _assert_same(pid._limited(k, x), _old(pid, k, x, 1.0)[0])
