"""The element-wise dense path for small systems (`_linalg.SMALL_MAX`): unrolled
Gauss-Jordan inverses and matrix-vector products, against LAPACK/LU, under jit,
vmap and grad, and that a batch of them lowers to element-wise work only (no LU
custom call, triangular solve or dot product, which a TPU runs slowly).

The path is taken up to `SMALL_MAX` unknowns here on every backend, as on a TPU
(`_elementwise_up_to_small_max`); a CPU takes it up to 2 (`_linalg.small_max`,
`test_cpu_takes_lu_from_three_unknowns`)."""

import collections
import re

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest
from helpers import count_equations, finite_difference, float64

import solverkit as sk
from solverkit._linear import _linalg
from solverkit._linear._linalg import _mul, invert, small_inverse, SMALL_MAX
from solverkit._linear._linear_solver import DenseLinearSolver


@pytest.fixture(autouse=True)
def _elementwise_up_to_small_max(monkeypatch):
    """The element-wise path up to `SMALL_MAX` unknowns, as a TPU takes it."""
    monkeypatch.setattr(_linalg, "_SMALL_MAX_ON", {})


def test_cpu_takes_lu_from_three_unknowns(monkeypatch):
    """On a CPU, 3 unknowns take LU (XLA:CPU compiles their unrolled elimination
    slower, `_linalg._SMALL_MAX_ON`), 2 the element-wise path."""
    monkeypatch.setattr(_linalg, "_SMALL_MAX_ON", {"cpu": 2})
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    for n, lu in ((2, False), (3, True)):
        jaxpr = jax.make_jaxpr(_linalg.inverse)(jnp.eye(n)).jaxpr
        assert (count_equations(jaxpr, "lu") > 0) == lu, n


def _matrices(n: int, count: int = 20, seed: int = 0) -> np.ndarray:
    """Random matrices whose pivots need swapping (a small leading entry), with a
    moderate condition number."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(count, n, n)) + 2 * np.eye(n)
    a[:, 0, 0] = 1e-3
    return a


def _inverse_tol(a: np.ndarray, dtype) -> float:
    # A backward-stable inverse errs by about cond(a) * n * eps, relative to |a^-1|.
    cond = np.linalg.cond(a).max()
    return 10 * a.shape[-1] * cond * float(jnp.finfo(dtype).eps)


@pytest.mark.parametrize("n", range(1, SMALL_MAX + 1))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_small_inverse_matches_numpy(n, dtype):
    a = _matrices(n)
    exact = np.linalg.inv(a)
    with float64():
        got = jax.jit(jax.vmap(small_inverse))(jnp.asarray(a, dtype))
        assert got.dtype == jnp.dtype(dtype)
        err = np.abs(np.asarray(got, np.float64) - exact).max() / np.abs(exact).max()
    assert err < _inverse_tol(a, dtype)


@pytest.mark.usefixtures("x64")
def test_small_inverse_batch_axes_and_vmap_agree():
    a = jnp.asarray(_matrices(3))
    inverse = jax.jit(small_inverse)  # (op by op: ~50 compiles)
    assert jnp.array_equal(inverse(a), jax.jit(jax.vmap(small_inverse))(a))
    assert jnp.array_equal(inverse(a[0]), inverse(a)[0])


def test_small_inverse_pivots():
    # No pivoting would divide by the zero leading entry.
    inverse = jax.jit(small_inverse)
    perm = jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert jnp.array_equal(inverse(perm), perm.T)
    a = jnp.array([[1e-30, 1.0], [1.0, 1.0]])
    assert jnp.allclose(inverse(a), jnp.array([[-1.0, 1.0], [1.0, 0.0]]))


@pytest.mark.parametrize("a", [[[0.0, 0.0], [0.0, 0.0]], [[1.0, 2.0], [2.0, 4.0]]])
def test_small_inverse_singular_is_not_finite(a):
    @jax.jit  # one program (op by op: ~37 compiles)
    def inverse_and_solve(a):
        jac = jnp.eye(2) - a  # so that I - 1 * jac = a
        factor = DenseLinearSolver().factorise(jac, jnp.asarray(1.0), None)
        x = DenseLinearSolver().solve(factor, jnp.ones(2), lambda y: y)
        return small_inverse(a), x

    inverse, x = inverse_and_solve(jnp.asarray(a))
    assert not np.all(np.isfinite(inverse))
    assert not np.all(np.isfinite(x))  # as with jnp.linalg.inv / LU


@pytest.mark.usefixtures("x64")
# Quick loop: test_dense_solve_grad_is_the_solves[3].
@pytest.mark.slow
def test_small_inverse_grad_matches_lu():
    a = jnp.asarray(_matrices(4, count=1)[0])
    w = jnp.asarray(np.random.default_rng(1).normal(size=(4, 4)))
    loss = jax.jit(lambda a: jnp.sum(w * small_inverse(a)))  # (op by op: ~35 compiles)
    mine = jax.jit(jax.grad(loss))(a)
    lu = jax.jit(jax.grad(lambda a: jnp.sum(w * jnp.linalg.inv(a))))(a)
    fd = finite_difference(loss, a)
    # Derivatives of a^-1 are a^-1 (.) a^-1: rounding grows like cond(a)^2 * eps.
    tol = 100 * np.linalg.cond(np.asarray(a)) ** 2 * 1e-16
    assert jnp.allclose(mine, lu, rtol=tol, atol=tol * jnp.abs(lu).max())
    assert jnp.allclose(mine, fd, rtol=1e-5, atol=1e-5 * jnp.abs(lu).max())


@pytest.mark.parametrize("n", [1, 3, SMALL_MAX, SMALL_MAX + 1])
def test_mul_matches_matmul(n):
    with float64():
        a = jnp.asarray(_matrices(n))
        v = jnp.asarray(np.random.default_rng(2).normal(size=(20, n)))
        exact = jnp.einsum("bij,bj->bi", a, v, precision="highest")
        assert jnp.allclose(jax.vmap(_mul)(a, v), exact, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [2, 5, SMALL_MAX + 1])
@pytest.mark.quick_cases(dict(n=5))  # the unrolled inverse, in both dtypes
def test_dense_solver_matches_lu(n, dtype):
    """Both sides of SMALL_MAX: `DenseLinearSolver` against LAPACK's LU solve."""
    with float64():
        jac = jnp.asarray(_matrices(n, count=8), dtype)
        b = jnp.asarray(np.random.default_rng(3).normal(size=(8, n)), dtype)
        gamma_h = jnp.asarray(0.3, dtype)
        ls = DenseLinearSolver()

        def solve(jac, b):
            factor = ls.factorise(jac, gamma_h, None)
            return ls.solve(factor, b, lambda y: y)

        got = jax.jit(jax.vmap(solve))(jac, b)
        matrix = jnp.eye(n, dtype=dtype)[None] - gamma_h * jac
        exact = jax.jit(jax.vmap(lambda m, b: jsl.lu_solve(jsl.lu_factor(m), b)))(
            matrix.astype(jnp.float64), b.astype(jnp.float64)
        )
        assert got.dtype == jnp.dtype(dtype)
        err = np.abs(np.asarray(got, np.float64) - np.asarray(exact)).max()
        tol = _inverse_tol(np.asarray(matrix, np.float64), dtype)
        assert err < tol * np.abs(np.asarray(exact)).max()


def _tpu_ops(fn, *args) -> collections.Counter:
    """The StableHLO operations of `fn` lowered for a TPU (no TPU needed)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    ops = collections.Counter(re.findall(r"stablehlo\.(\w+)", text))
    ops.update(re.findall(r"custom_call @(\w+)", text))
    return ops


def test_batched_small_solves_lower_to_elementwise_work():
    """A vmapped factorise + solve of 2x2 systems has no LU custom call, no
    triangular solve and no dot product (each slow on a TPU for tiny matrices)."""
    ls = DenseLinearSolver()

    def solve(jac, b):
        factor = ls.factorise(jac, jnp.asarray(0.5), None)
        return ls.solve(factor, b, lambda y: y)

    ops = _tpu_ops(jax.vmap(solve), jnp.ones((64, 2, 2)), jnp.ones((64, 2)))
    for op in ["custom_call", "triangular_solve", "dot_general", "while", "sort"]:
        assert ops[op] == 0, (op, ops)
    ops = _tpu_ops(
        jax.vmap(lambda j: invert(j, jnp.asarray(0.5)).inverse), jnp.ones((64, 3, 3))
    )
    assert ops["custom_call"] == ops["triangular_solve"] == 0, ops


def test_small_solve_reverse_mode_has_no_pads(monkeypatch):
    """The entries of a small matrix or vector are taken by one `unstack`, whose
    reverse mode stacks their cotangents back in one equation: a slice per entry
    was transposed to a padded copy each (the solves of a Rodas5P step were a
    quarter of its gradient's program). On a TPU the entries are sliced on purpose
    (`_linalg._SLICE_BACKENDS`, faster there), so the unstacked form is checked on
    every backend by taking no backend as a slicing one."""
    monkeypatch.setattr(_linalg, "_SLICE_BACKENDS", ())
    ls = DenseLinearSolver()

    def loss(jac, b):
        x = ls.solve(ls.factorise(jac, jnp.asarray(0.5), None), b, lambda y: y)
        return jnp.sum(x**2)

    grad = jax.grad(loss, argnums=(0, 1))
    jaxpr = jax.make_jaxpr(grad)(jnp.asarray(_matrices(3)[0]), jnp.ones(3)).jaxpr
    assert count_equations(jaxpr, "pad") == 0


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("n", [2, SMALL_MAX, SMALL_MAX + 1])
# Quick loop: the largest small inverse (the LU, n = 4, and n = 2 in the full suite).
@pytest.mark.quick_cases("3")
def test_dense_solve_grad_is_the_solves(n):
    """The refined solve's derivative is the solve's, `A^{-1} (db - dA x)`, the
    inverse not differentiated: against LU's gradient (to the rounding of two
    solves, `cond(A)^2 eps`) and finite differences; under `vmap`. Its reverse
    mode has no derivative of a pivot's reciprocal (the Gauss-Jordan inverse's
    derivatives were a sixth of a Rodas5P step's reverse mode)."""
    jac = jnp.asarray(_matrices(n, count=4))
    b = jnp.asarray(np.random.default_rng(4).normal(size=(4, n)))
    w = jnp.asarray(np.random.default_rng(5).normal(size=(n,)))
    ls = DenseLinearSolver()

    def loss(jac, b, gamma_h):
        factor = ls.factorise(jac, gamma_h, None)
        return jnp.sum(w * ls.solve(factor, b, lambda y: y))

    def exact(jac, b, gamma_h):
        matrix = jnp.eye(n) - gamma_h * jac
        return jnp.sum(w * jnp.linalg.solve(matrix, b))

    # Each a jitted program (op by op, the gradients were ~80 compiles).
    grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), (0, 0, None)))
    want = jax.jit(jax.vmap(jax.grad(exact, argnums=(0, 1, 2)), (0, 0, None)))
    got, ref = grad(jac, b, 0.3), want(jac, b, 0.3)
    matrices = np.eye(n)[None] - 0.3 * np.asarray(jac)
    tol = 100 * np.linalg.cond(matrices).max() ** 2 * 1e-16
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max())
    fd = finite_difference(jax.jit(lambda j: loss(j, b[0], 0.3)), jac[0])
    np.testing.assert_allclose(got[0][0], fd, rtol=1e-5, atol=1e-6)
    if n <= SMALL_MAX:
        jaxpr = jax.make_jaxpr(jax.grad(loss))(jac[0], b[0], 0.3).jaxpr
        primal = jax.make_jaxpr(loss)(jac[0], b[0], 0.3).jaxpr
        for name in ("div", "integer_pow"):
            assert count_equations(jaxpr, name) == count_equations(primal, name)


def _vdp(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


@pytest.mark.parametrize("solver", [sk.Rodas5P(), sk.Kvaerno5(), sk.BDF()])
# Quick loop: test_bdf_vmap.py::test_vmapped_solve_is_elementwise.
@pytest.mark.slow
def test_stiff_vdp_ensemble_float32_against_float64(solver):
    """A vmapped float32 Van der Pol ensemble (mu in [1, 100]) through the small
    path agrees with a float64 solve at a tight tolerance, and takes no more steps
    than float32 needs: no rejection loop."""

    @jax.jit
    def batch(mus, rtol):  # the tolerance an operand: one program per dtype
        def one(mu):
            dtype = mus.dtype
            y0 = jnp.asarray([2.0, 0.0], dtype)
            sol = sk.diffeqsolve(
                sk.ODETerm(_vdp), solver, jnp.asarray(0.0, dtype),
                jnp.asarray(20.0, dtype), jnp.asarray(1e-3, dtype), y0, mu,
                stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
                max_steps=20_000,
            )  # fmt: skip
            return sol.ys[-1], sol.stats["num_steps"]

        return jax.vmap(one)(mus)

    def solve(dtype, rtol, mus):
        return batch(mus.astype(dtype), jnp.asarray(rtol, dtype))

    with float64():
        mus = jnp.asarray(np.logspace(0, 2, 6))
        y32, steps32 = solve(jnp.float32, 1e-5, mus)
        y64, _ = solve(jnp.float64, 1e-10, mus)
        _, steps64 = solve(jnp.float64, 1e-5, mus)
    # The global error of a 1e-5 solve over a few relaxation oscillations (phase
    # errors at the fast transitions): ~1e-3 for Rodas5P, ~3e-2 for BDF (float64
    # alike); a float32 rejection loop or a wrong solve would exceed it or max_steps.
    assert np.abs(np.asarray(y32, np.float64) - np.asarray(y64)).max() < 0.1
    assert np.all(np.asarray(steps32) <= 1.2 * np.asarray(steps64) + 10)


# Quick loop: test_small_inverse_batch_axes_and_vmap_agree.
@pytest.mark.slow
def test_sliced_entries_as_unstacked(monkeypatch):
    """The entries taken by a slice each (on a TPU: `_linalg._SLICE_BACKENDS`, where
    the unstacked form ran Rodas5P 7% slower) are the unstacked ones: the same
    inverses and products bit for bit (data movement only) and the same gradients
    to rounding, under jit and vmap."""
    from solverkit._linear import _linalg

    a = jnp.asarray(_matrices(3, count=8), jnp.float32)
    v = jnp.asarray(np.random.default_rng(1).normal(size=(8, 3)), jnp.float32)

    def run():
        inv = jax.jit(jax.vmap(small_inverse))(a)
        prod = jax.jit(jax.vmap(_mul))(a, v)
        loss = lambda a, v: jnp.sum(_mul(small_inverse(a), v) ** 2)  # noqa: E731
        return inv, prod, jax.jit(jax.vmap(jax.grad(loss)))(a, v)

    unstacked = run()
    monkeypatch.setattr(_linalg, "_SLICE_BACKENDS", (jax.default_backend(),))
    jax.clear_caches()
    sliced = run()
    np.testing.assert_array_equal(unstacked[0], sliced[0])
    np.testing.assert_array_equal(unstacked[1], sliced[1])
    # Reverse mode sums the entries' cotangents in another order (one stack against
    # a padded copy per slice, added): float32 round-off of those sums (2 ulps
    # seen), times the matrices' conditioning (under 100 here).
    np.testing.assert_allclose(unstacked[2], sliced[2], rtol=1e-5, atol=1e-6)
