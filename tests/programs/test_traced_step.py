"""The checkpointed adjoint traces a step once and evaluates that program elsewhere
(first calls): `_closure._traced.Traced`.

The forward loop, the carry leaves a step leaves unchanged (`_invariant`) and the
backward pass's recomputation share one Python trace of `_loop.step`; before, each
traced it anew (with the pullback, four traces; now two). The program JAX builds is
the same, so the gradients are bitwise those of the step traced at each use, and
they agree with `DirectAdjoint` and finite differences, with closed-over values of
several dtypes (an int index among them), under `jit`, `vmap` and `grad`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, full_matrix_only, lv_batch, lv_loss

import solverkit as sk
from solverkit import _loop
from solverkit._adjoint import _checkpoint
from solverkit._closure._traced import Traced


def _data():
    return lv_batch()


def _loss(rates, y0, adjoint=None, controller=None):
    return lv_loss(rates, y0, adjoint, controller=controller)


class _Untraced(Traced):
    """`Traced` that calls the function at every use (the old code's program)."""

    def __call__(self, *args):
        return self.fn(*args)


def _count_step_traces(monkeypatch) -> list[int]:
    calls = [0]
    real = _loop.step

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_loop, "step", counted)
    return calls


def test_step_traced_twice(monkeypatch):
    # Forward loop and `_invariant`: one trace; the recomputation and the pullback
    # (which replay the recorded decisions): one. Fails on the old code (four).
    calls = _count_step_traces(monkeypatch)
    jax.make_jaxpr(jax.grad(_loss))(*_data())
    assert calls[0] == 2


# The full suite (two compiles of the gradient); the quick loop checks the single
# trace (test_step_traced_twice) and the gradient (below, `constant=False`).
@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_same_program_bitwise(monkeypatch):
    # The same primitives in the same order: the same gradient, bit for bit, as
    # with the step traced at each use.
    grad = jax.jit(jax.grad(_loss, (0, 1)))
    got = grad(*_data())
    monkeypatch.setattr(_checkpoint, "Traced", _Untraced)
    want = jax.jit(jax.grad(_loss, (0, 1)))(*_data())
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "constant",
    [
        False,
        # With `SOLVERKIT_FULL_MATRIX=1` only: the traced step's gradient is [False]'s,
        # the leaves a constant step keeps test_invariant_of_a_constant_step_size's,
        # a fixed-step batch's checkpointed gradient against DirectAdjoint's
        # test_checkpoint_memory.py::test_fixed_step_gradient_matches_direct_adjoint.
        pytest.param(
            True,
            marks=full_matrix_only(
                "[False], test_invariant_of_a_constant_step_size and "
                "test_checkpoint_memory.py::"
                "test_fixed_step_gradient_matches_direct_adjoint"
            ),
        ),
    ],
)
# The full suite; the quick loop's traced steps:
# solve/test_integrate.py::test_traced_once_inside_jit_under_transformations.
@pytest.mark.slow
def test_gradient_against_direct_and_differences(constant):
    # ConstantStepSize: leaves the step returns unchanged are kept once.
    controller = sk.ConstantStepSize() if constant else None
    rates, y0 = _data()

    def loss(r, y, adjoint):
        return _loss(r, y, adjoint, controller)

    got = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(
        rates, y0, sk.RecursiveCheckpointAdjoint()
    )
    want = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(
        rates, y0, sk.DirectAdjoint()
    )
    # The same discrete steps under another schedule: float64 round-off of the
    # sums, times the ~1e2 gain of the controller.
    assert_tree_allclose(got, want, rtol=1e-10, atol=1e-12)
    value = jax.jit(lambda r: loss(r, y0, sk.RecursiveCheckpointAdjoint()))
    eps = 1e-6
    v = jax.random.normal(jax.random.key(0), rates.shape, rates.dtype)
    quotient = (float(value(rates + eps * v)) - float(value(rates - eps * v))) / (
        2 * eps
    )
    # Central differences: O(eps**2) plus round-off 1e-16 / eps, while no step is
    # decided differently.
    np.testing.assert_allclose(float(jnp.sum(got[0] * v)), quotient, rtol=1e-5)


# `SOLVERKIT_FULL_MATRIX=1` only (2 CPU s): the same check in float64 is
# test_gradient_against_direct_and_differences; float32 checkpointed gradients
# closure/test_closure.py's (float32 by default).
@pytest.mark.slow
@full_matrix_only("test_gradient_against_direct_and_differences")
def test_float32_gradient_against_direct():
    # float32 data (the closed-over index int32, the scale float32).
    rates, y0 = (x.astype(jnp.float32) for x in _data())
    got = jax.jit(jax.grad(_loss))(rates, y0)
    want = jax.jit(jax.grad(lambda r, y: _loss(r, y, sk.DirectAdjoint())))(rates, y0)
    # float32 round-off (6e-8) over ~100 steps, times the controller's gain.
    assert_tree_allclose(got, want, rtol=1e-4, atol=1e-6)


# --- `Traced` itself ------------------------------------------------------------


def test_traced_once_per_kind():
    calls = []

    def fn(x, y):
        calls.append(1)
        return {"sum": x + y, "tag": "static", "x": x}

    traced = Traced(fn)

    def use(x, y):
        a = traced(x, y)
        b = traced(x * 2, y)  # same kind: evaluated, not traced
        assert a["tag"] == b["tag"] == "static"
        return a["sum"] + b["sum"] + b["x"]

    out = jax.jit(use)(jnp.float32(1.0), jnp.float32(2.0))
    assert float(out) == 3.0 + 4.0 + 2.0
    assert len(calls) == 1
    jax.jit(use)(jnp.zeros(3), jnp.float32(2.0))  # another shape: another trace
    assert len(calls) == 2


def test_traced_kinds_differ():
    calls = []

    def fn(x, c):
        calls.append(1)
        # Python branching on a concrete value: `c` stays concrete in the trace.
        return x * 2 if float(np.asarray(c)) > 0 else x

    traced = Traced(fn)
    one, minus = np.float32(1.0), np.float32(-1.0)

    def use(x):
        return traced(x, one), traced(x, minus), traced(x.astype(jnp.int32), one)

    a, b, c = jax.jit(use)(jnp.float32(3.0))
    assert (float(a), float(b), int(c)) == (6.0, 3.0, 6)
    assert len(calls) == 3  # another concrete object, another dtype: traced anew


def test_traced_passed_through():
    def fn(x, y):
        return y, x + 1, x

    traced = Traced(fn)

    def use(x, y):
        assert traced.passed_through(x, y) == (1, None, 0)
        return traced(x, y)

    out = jax.jit(use)(jnp.float32(1.0), jnp.float32(5.0))
    assert [float(v) for v in out] == [5.0, 2.0, 1.0]


def test_traced_kept_with_a_closed_over_tracer():
    # A function closing over a value of an enclosing trace is traced once: the
    # tracer is a constant of its program, which later calls evaluate. (Such
    # programs used to be dropped and the function traced at every call:
    # tests/adjoint/test_norm_closing_over_traced.py.)
    calls = []

    def use(x, z):
        def fn(y):
            calls.append(None)
            return y + z

        traced = Traced(fn)
        first = traced(x)
        assert traced.entry(x) is not None and traced.passed_through(x) == (None,)
        return first + traced(x)

    assert float(jax.jit(use)(jnp.float32(1.0), jnp.float32(2.0))) == 6.0
    assert len(calls) == 1


@pytest.mark.slow  # the full suite (a compile of a gradient)
def test_invariant_of_a_constant_step_size(monkeypatch):
    # `_invariant` finds the leaves a step returns unchanged in the step's traced
    # program (ConstantStepSize: its step count and interval ends).
    seen = []
    real = _checkpoint._invariant

    def spy(step, problem, carry):
        seen.append(real(step, problem, carry))
        return seen[-1]

    monkeypatch.setattr(_checkpoint, "_invariant", spy)
    loss = lambda r, y: _loss(r, y, controller=sk.ConstantStepSize())  # noqa: E731
    rates, y0 = (x.astype(jnp.float32) for x in _data())
    jax.jit(jax.grad(loss))(rates, y0)
    assert len(seen) == 1 and sum(seen[0]) == 3
