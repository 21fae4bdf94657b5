"""Rows of the checkpoint stacks and save buffers are read and written by
`_save.row_of`/`with_row`: `lax.dynamic_index_in_dim` and
`lax.dynamic_update_index_in_dim` without their `jit` (first calls: each `jit`
is a call that every transformation of a solve handles apart). The same operations:
the same values and gradients, bit for bit."""

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit import _save
from solverkit._adjoint import _stack


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.bool_])
def test_same_as_lax(dtype):
    buf = (jnp.arange(24).reshape(4, 3, 2) % 3).astype(dtype)
    value = jnp.ones((3, 2), dtype)
    for row in [0, 2, 3, -1, 7]:  # (out of range: clamped, as by lax)
        i = jnp.asarray(row, jnp.int32)
        got = jax.jit(_save.row_of)(buf, i)
        np.testing.assert_array_equal(got, lax.dynamic_index_in_dim(buf, i, 0, False))
        got = jax.jit(_save.with_row)(buf, i, value)
        want = lax.dynamic_update_index_in_dim(buf, value, i, 0)
        np.testing.assert_array_equal(got, want)
    # Under vmap, a row per batch element.
    rows = jnp.array([0, 3], jnp.int32)
    bufs = jnp.stack([buf, buf[::-1]])
    got = jax.vmap(_save.row_of)(bufs, rows)
    want = jax.vmap(lambda b, r: lax.dynamic_index_in_dim(b, r, 0, False))(bufs, rows)
    np.testing.assert_array_equal(got, want)


def _loss(rates, y0, saveat):
    index = jnp.asarray(1, jnp.int32)
    table = jnp.array([0.5, 1.0, 2.0], jnp.float32)

    def one(r, y):
        def field(t, y, args):
            a, b, c, d = r * table[index].astype(r.dtype)
            return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])

        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 3.0, 0.05, y, saveat=saveat,
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            max_steps=512, adjoint=sk.RecursiveCheckpointAdjoint(checkpoints=8),
        )  # fmt: skip
        return sol.ys

    return jnp.sum(jax.vmap(one)(rates, y0) ** 2)


_SAVES = {
    "t1": sk.SaveAt(t1=True),
    "ts": sk.SaveAt(ts=jnp.linspace(0.5, 3.0, 6)),
    "steps": sk.SaveAt(steps=True),
}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "save",
    [
        save
        if save == "ts"
        else pytest.param(save, marks=full_matrix_only("[ts] (every row operation)"))
        for save in _SAVES
    ],
)
# The full suite (each case compiles a gradient twice): [ts], whose pullback reads and
# writes the checkpoint stacks' and the saved rows' (the others with
# `SOLVERKIT_FULL_MATRIX=1`); the quick loop checks that the row operations are those
# of `lax` (test_same_as_lax).
@pytest.mark.slow
def test_gradient_bitwise(monkeypatch, save):
    # 8 checkpoint slots: the stacks' rows are recomputed and read back.
    rates = jnp.array([[1.5, 1.0, 3.0, 1.0], [1.2, 0.8, 2.5, 1.1]])
    y0 = jnp.array([[1.0, 1.0], [1.2, 0.9]])
    loss = lambda r, y: _loss(r, y, _SAVES[save])  # noqa: E731
    run = lambda: jax.jit(jax.grad(loss, (0, 1)))(rates, y0)  # noqa: E731
    got = run()
    calls = []

    def jitted_row_of(b, i):
        calls.append(1)
        return lax.dynamic_index_in_dim(b, i, 0, False)

    def jitted_with_row(b, i, v):
        calls.append(1)
        return lax.dynamic_update_index_in_dim(b, v, i, 0)

    for module in (_save, _stack):
        monkeypatch.setattr(module, "row_of", jitted_row_of)
        monkeypatch.setattr(module, "with_row", jitted_with_row)
    jax.clear_caches()
    want = run()
    assert calls  # (the old operations were traced)
    # The same operations on the values, but two programs, which XLA may fuse (and
    # round) differently: float64 round-off, which the step-size controller grows
    # (a last-bit change in a step's end moves the solve by its truncation error:
    # ~1e-10 relative here, 1e-9 measured at rtol 1e-10; `_checkpoint._refill`).
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=0)


def _jit_names(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit"):
            names.append(eqn.params["name"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(sub, "eqns"):
                    names += _jit_names(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    names += _jit_names(sub.jaxpr)
    return names


# Quick loop: test_same_as_lax[float32].
@pytest.mark.slow
def test_no_row_jits():
    # Fails on the old code (12 such calls in this gradient).
    rates = jnp.array([[1.5, 1.0, 3.0, 1.0], [1.2, 0.8, 2.5, 1.1]], jnp.float32)
    y0 = jnp.ones((2, 2), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda r, y: _loss(r, y, _SAVES["ts"])))(rates, y0)
    names = _jit_names(jaxpr.jaxpr)
    assert "dynamic_index_in_dim" not in names
    assert "dynamic_update_index_in_dim" not in names
