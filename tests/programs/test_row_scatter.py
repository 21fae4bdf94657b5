"""Rows written at a per-trajectory index (`SaveAt(steps=True)`, dense output), as on
a TPU (`_save.ROW_SCATTER_BACKENDS`: by indexing, a scatter over (batch, row) under
`vmap`, where the slices' scatter over (batch, row, column) ran as a serial loop over
the batch there, 13x slower than diffrax's rows): the same values and gradients as
the slices, under jit, vmap and grad."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk
from solverkit import _save


def _solve(rho, scale, k, throw=True, max_steps=256):
    """Lorenz with a closed-over float32 rate, float64 scale and int index. (A
    different `throw` or `max_steps` is another program: each variant below is
    traced anew, not taken from the caches of the one before.)"""
    table = jnp.array([1.0, 2.0, 3.0])

    def field(t, y, args):
        x, v, z = y[0], y[1], y[2]
        dy = [10.0 * (v - x), x * (rho - z) - v, x * v - table[k] / 3.0 * z]
        return jnp.stack(dy) * scale

    return sk.diffeqsolve(
        sk.ODETerm(field),
        sk.Tsit5(),
        0.0,
        0.5,
        1e-2,
        jnp.ones(3),
        stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
        saveat=sk.SaveAt(steps=True, dense=True),
        max_steps=max_steps,
        throw=throw,
    )


def _run(throw):
    rho = jnp.array([20.0, 28.0, 35.0], jnp.float32)
    ks = jnp.array([2, 1, 2], jnp.int32)

    @jax.jit
    @jax.vmap
    def values(rho, k):
        sol = _solve(rho, 1.0, k, throw)
        return sol.ts, sol.ys, sol.evaluate(0.3)

    @jax.jit
    @jax.vmap
    def grads(rho, k):
        def loss(rho, scale):
            ys = _solve(rho, scale, k, throw).ys
            return jnp.sum(jnp.where(jnp.isfinite(ys), ys, 0.0))

        return jax.grad(loss, argnums=(0, 1))(rho, 1.0)

    return values(rho, ks), grads(rho, ks)


# The full suite; the quick loop checks the scatters' form (below).
@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_rows_by_index_as_by_slices(monkeypatch):
    by_slices = _run(throw=True)
    monkeypatch.setattr(_save, "ROW_SCATTER_BACKENDS", (jax.default_backend(),))
    by_index = _run(throw=False)
    assert np.isfinite(np.asarray(by_slices[0][1])).sum() > 100  # rows were written
    # The same values written, to the rounding of the rest of the program, compiled
    # apart: the float32 rate's products round to ~6e-8 relative, grown by the
    # chaos over t = 0.5 (Lyapunov exponent ~1: under 2x) and through the gradient
    # (8e-9 seen); a row written in the wrong place differs by O(1).
    for a, b in zip(jax.tree.leaves(by_slices), jax.tree.leaves(by_index)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# Quick loop: programs/test_row_ops.py::test_same_as_lax[float32].
@pytest.mark.slow
def test_rows_by_index_have_whole_row_scatters(monkeypatch):
    """Under `vmap` the row writes scatter whole rows: over (batch, row) only, where
    the slices' scatters index (batch, row, column) (StableHLO as lowered)."""

    def row_scatters():
        solve = jax.vmap(lambda r: _solve(r, 1.0, 1, max_steps=128).ys)
        text = jax.jit(solve).lower(jnp.ones(4)).as_text()
        dims = []
        for op in text.split('"stablehlo.scatter"')[1:]:  # each op, to the next
            result = re.search(r"-> tensor<([^>]*)>", op)[1]
            if result.startswith("4x128x3x"):
                dims.append(
                    re.search(r"scatter_dims_to_operand_dims = \[([^\]]*)\]", op)[1]
                )
        return dims

    assert set(row_scatters()) == {"1, 2"}  # by slices (max_steps=128: traced anew)
    monkeypatch.setattr(_save, "ROW_SCATTER_BACKENDS", (jax.default_backend(),))
    jax.clear_caches()
    assert set(row_scatters()) == {"1"}
