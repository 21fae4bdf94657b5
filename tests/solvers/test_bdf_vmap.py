"""BDF under `vmap` (ensembles): the difference array's algebra written row by row
(`_bdf_rows.py`) against its matrix form, no batched small matrix products, cumulative
sums or gathers in a vmapped solve (on a TPU each ran one trajectory at a time on
padded tiles), and float32 ensembles against float64 (Van der Pol, mu swept, several
dtypes closed over)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import float64, full_matrix_only
from jax.extend import core as jcore

import solverkit as sk
from solverkit._solver import _bdf_rows as rows
from solverkit._solver._bdf_formulas import coefficients


K = 5


def _interp_matrix(rho: float) -> np.ndarray:
    """Shampine & Reichelt's R(ρ), (K+1, K+1), as a dense NumPy matrix."""
    i = np.arange(K + 1)[:, None]
    j = np.arange(K + 1)[None, :]
    m = np.where(
        i == 0, 1.0, np.where(j == 0, 0.0, (i - 1 - rho * j) / np.maximum(i, 1))
    )
    return np.cumprod(m, axis=0)


@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_rows_match_the_matrix_forms(x64, order):
    rng = np.random.default_rng(order)
    D = rng.normal(size=(K + 3, 3))
    d = rng.normal(size=3)
    k = jnp.asarray(order)
    gamma, alpha, _ = coefficients(K, True)
    # Entries of R U are O(10) and sums of <= 36 products: 1e-12 is round-off.
    tol = dict(rtol=1e-12, atol=1e-12)
    for r in (0.25, 1.0, 1.7):
        ru = _interp_matrix(r) @ _interp_matrix(1.0)
        block = slice(0, order + 1)
        want = D.copy()
        want[block] = ru[block, block].T @ D[block]
        got = rows.rescale(jnp.asarray(D), k, jnp.asarray(r), K)
        np.testing.assert_allclose(got, want, **tol)
    want = D.copy()
    want[: order + 1] = np.cumsum(D[: order + 1][::-1], axis=0)[::-1] + d
    want[order + 1] = d
    want[order + 2] = d - D[order + 1]
    np.testing.assert_allclose(rows.update(jnp.asarray(D), jnp.asarray(d), k), want)
    y_pred, psi = rows.predict(jnp.asarray(D), k, gamma, alpha)
    np.testing.assert_allclose(y_pred, D[: order + 1].sum(0), **tol)
    want_psi = gamma[1 : order + 1] @ D[1 : order + 1] / alpha[order]
    np.testing.assert_allclose(psi, want_psi, **tol)
    x = -0.3
    weights = np.cumprod((x + np.arange(K)) / (np.arange(K) + 1))
    weights[order:] = 0
    got = rows.interpolation_weights(jnp.asarray(x), k, K)
    np.testing.assert_allclose(np.stack(got), weights, **tol)


def _vdp(t, y, args):
    span, index, flag = args  # mu = 10^(index / span): no gather in the field
    mu = jnp.where(flag, 10.0 ** (index.astype(span.dtype) / span), 1.0)
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def _batch(dtype, tol, n, t1):
    """A jitted, vmapped BDF solve of Van der Pol for `n` values of mu in [1, 10],
    log-spaced, closing over a float, an int32 index (vmapped) and a bool."""
    span = jnp.asarray(n - 1, dtype)
    flag = jnp.asarray(True)

    def one(index):
        sol = sk.diffeqsolve(
            sk.ODETerm(_vdp), sk.BDF(), dtype(0), dtype(t1), dtype(1e-3),
            jnp.asarray([2.0, 0.0], dtype), (span, index, flag),
            stepsize_controller=sk.PIDController(rtol=tol, atol=tol),
            max_steps=20_000,
        )  # fmt: skip
        return sol.ys[-1], sol.stats["num_steps"]

    return jax.jit(jax.vmap(one)), jnp.arange(n, dtype=jnp.int32)


def _primitives(jaxpr, out, inside=False):
    """The primitives inside loops (the steps; outside, JAX 0.12 reads a saved row
    of one element by a gather)."""
    for eqn in jaxpr.eqns:
        if inside:
            out.append(eqn.primitive.name)
        loop = inside or eqn.primitive.name == "while"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    _primitives(sub.jaxpr, out, loop)
                elif isinstance(sub, jcore.Jaxpr):
                    _primitives(sub, out, loop)
    return out


def test_vmapped_solve_is_elementwise():
    """A vmapped BDF solve of a field without products has no dot product, no
    cumulative sum or product and no gather in its loops: all of BDF's own work is
    element-wise (before `_bdf_rows`: 3 batched (6, 6) products, 2 cumulative ops,
    5 gathers a step)."""
    fn, index = _batch(jnp.float32, 1e-5, 4, 1.0)
    names = _primitives(jax.make_jaxpr(fn)(index).jaxpr, [])
    bad = {"dot_general", "cumsum", "cumprod", "cummax", "gather", "argmax"}
    assert not bad & set(names), sorted(bad & set(names))


# `SOLVERKIT_FULL_MATRIX=1` only (2.5 CPU s): a float32 BDF Van der Pol ensemble
# against float64, accuracy and step counts, is tests/linear/test_small_linalg.py::
# test_stiff_vdp_ensemble_float32_against_float64[solver2] (BDF).
@pytest.mark.slow
@full_matrix_only(
    "test_small_linalg.py::test_stiff_vdp_ensemble_float32_against_float64 (BDF)"
)
def test_float32_ensemble_against_float64():
    """Float32 BDF at rtol = atol = 1e-5 on 8 Van der Pol trajectories: as accurate
    as float64 at the same tolerance, in about as many steps (no step-size collapse
    or stuck order from rounding)."""
    n, t1, tol = 8, 6.0, 1e-5
    with float64():
        fn, index = _batch(jnp.float64, 1e-11, n, t1)
        ref = np.asarray(fn(index)[0])
        fn, index = _batch(jnp.float64, tol, n, t1)
        y64, steps64 = (np.asarray(x) for x in fn(index))
    fn, index = _batch(jnp.float32, tol, n, t1)
    y32, steps32 = (np.asarray(x) for x in fn(index))
    err32 = np.abs(y32 - ref).max(axis=1)
    err64 = np.abs(y64 - ref).max(axis=1)
    # Float32 adds rounding of ~eps32 |y| a step, amplified at most like the
    # truncation error the tolerance allows: within 3x float64's error, plus
    # 1e3 eps32 (|y| <= ~3 over ~1e3 steps).
    bound = 3 * err64 + 1e3 * np.finfo(np.float32).eps * 3
    assert np.all(err32 <= bound), (err32, err64)
    assert np.all(steps32 <= 1.2 * steps64 + 10), (steps32, steps64)
