"""The band LU (`solverkit._linear._banded`): by rows for narrow bands, by panels for
wide ones; against a dense solve on random banded matrices whose small diagonal forces
row interchanges, in float32 and float64, under `vmap`, and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solverkit._linear._banded import (
    _BLOCKED_FROM,
    _BLOCKED_TO,
    band_lu,
    band_lu_solve,
    BandLU,
    BlockedBandLU,
    dense_to_bands,
)


def _matrix(n, lower, upper, seed=0):
    """Random banded, with a tiny diagonal (partial pivoting must interchange) where
    it has both sub- and super-diagonals; triangular ones diagonally dominant."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n))
    i, j = np.indices((n, n))
    a[(j - i > upper) | (i - j > lower)] = 0
    if lower and upper:
        a[i == j] *= 1e-3
    else:
        a[i == j] = lower + upper + 2
    return a


_CASES = [  # (n, lower, upper): by rows, then by panels (n not a multiple of nb)
    (1, 0, 0),
    (7, 1, 1),
    (40, 3, 0),
    (40, 0, 4),
    (90, 33, 5),
    (100, 40, 40),
    (70, 2, 35),
    (300, 130, 1),
]


def _solver(lower):
    return jax.jit(lambda bands, rhs: band_lu_solve(band_lu(bands, lower), rhs))


# Jitted (each case a few compiles; op by op, `band_lu` and `dense_to_bands` were
# ~55 small compiles a case).
_bands = jax.jit(dense_to_bands, static_argnums=(1, 2))


@pytest.mark.parametrize("n, lower, upper", _CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
# Quick loop: every shape in float64; float32 once unblocked and once blocked.
# Quick loop: each dtype once, and a band wider than the blocks.
# Quick loop: one case (float64: test_grad_matches_dense_and_finite_differences).
@pytest.mark.quick_cases("float32-7-1-1")
def test_matches_dense(n, lower, upper, dtype):
    with jax.enable_x64(dtype == "float64"):
        a = _matrix(n, lower, upper)
        b = np.random.default_rng(1).normal(size=n)
        bands = _bands(jnp.asarray(a, dtype), lower, upper)
        lu = jax.eval_shape(lambda bands: band_lu(bands, lower), bands)
        blocked = _BLOCKED_FROM <= max(lower, upper) <= _BLOCKED_TO
        assert isinstance(lu, BlockedBandLU if blocked else BandLU)
        x = _solver(lower)(bands, jnp.asarray(b, dtype))
        assert x.dtype == jnp.dtype(dtype)
        expected = np.linalg.solve(a, b)
        tol = 1e-10 if dtype == "float64" else 2e-3
        scale = np.linalg.cond(a) * np.max(np.abs(expected))
        assert np.max(np.abs(np.asarray(x, np.float64) - expected)) < tol * scale


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("lower, upper", [(2, 1), (33, 33)])
@pytest.mark.quick_cases("2-1")
def test_vmap_over_matrices_and_rhs(lower, upper):
    n, k = 80, 3
    mats = np.stack([_matrix(n, lower, upper, seed=s) for s in range(k)])
    rhs = np.random.default_rng(2).normal(size=(k, n))
    bands = jax.jit(jax.vmap(lambda m: dense_to_bands(m, lower, upper)))(mats)
    x = jax.vmap(_solver(lower))(bands, jnp.asarray(rhs))
    expected = np.linalg.solve(mats, rhs[..., None])[..., 0]
    np.testing.assert_allclose(np.asarray(x), expected, rtol=1e-8, atol=1e-8)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "lower, upper", [(2, 1), pytest.param(33, 34, marks=pytest.mark.slow)]
)
def test_grad_matches_dense_and_finite_differences(lower, upper):
    n = 75
    a = jnp.asarray(_matrix(n, lower, upper) + 3 * np.eye(n))
    b = jnp.asarray(np.random.default_rng(3).normal(size=n))
    w = jnp.asarray(np.random.default_rng(4).normal(size=n))
    solve = _solver(lower)

    def loss_band(p):
        m = a + p[0] * jnp.diag(jnp.arange(n) / n) + p[1] * jnp.eye(n, k=-lower)
        return w @ solve(dense_to_bands(m, lower, upper), b * p[2])

    def loss_dense(p):
        m = a + p[0] * jnp.diag(jnp.arange(n) / n) + p[1] * jnp.eye(n, k=-lower)
        return w @ jnp.linalg.solve(m, b * p[2])

    p = jnp.asarray([0.3, -0.2, 1.1])
    # One jitted program for the gradient and the differences' values.
    both = jax.jit(jax.value_and_grad(loss_band))
    g = both(p)[1]
    dense = jax.jit(jax.grad(loss_dense))(p)
    np.testing.assert_allclose(g, dense, rtol=1e-9, atol=1e-10)
    eps = 1e-6
    fd = [
        (both(p.at[i].add(eps))[0] - both(p.at[i].add(-eps))[0]) / (2 * eps)
        for i in range(3)
    ]
    np.testing.assert_allclose(g, np.asarray(fd), rtol=1e-6, atol=1e-8)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("lower", [1, 33])
@pytest.mark.quick_cases("1")
def test_singular_gives_nan(lower):
    n = 70
    a = _matrix(n, lower, lower)
    a[:, 5] = 0  # an empty column
    x = _solver(lower)(_bands(jnp.asarray(a), lower, lower), jnp.ones(n))
    assert np.all(np.isnan(np.asarray(x)))
