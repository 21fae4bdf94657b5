"""The linear solvers of the stiff solvers, through their protocol (`linearise`,
`factorise`, `solve`), against `DenseLinearSolver` on random banded and sparse
systems in float64: with each kind of mass matrix, under `jit`, `vmap` and `grad`;
wrong structures are detected and singular matrices give NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finite_difference, skip_unless_full_matrix

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

_N = 12


def _unused(x):
    raise AssertionError("a direct solver does not call `fn` in `solve`")


def _banded_matrix(n, lower, upper, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n))
    i, j = np.indices((n, n))
    a[(j - i > upper) | (i - j > lower)] = 0
    return a


def _field(matrix):
    """A nonlinear field whose Jacobian has `matrix`'s pattern: `A tanh(x) + p x`."""
    a = jnp.asarray(matrix)

    def fn(x, p=jnp.asarray(0.3)):
        return a @ jnp.tanh(x) + p * x

    return fn


def _masses(n, lower, upper):
    rng = np.random.default_rng(7)
    dense = _banded_matrix(n, lower, upper, seed=3) * 0.1 + np.eye(n)
    return [None, jnp.asarray(rng.uniform(0.5, 2.0, n)), jnp.asarray(dense)]


def _run(solver, fn, x, gamma_h, mass, rhs):
    value, jac = solver.linearise(fn, x)
    factor = solver.factorise(jac, gamma_h, mass)
    return value, solver.solve(factor, rhs, fn)


_run_jit = jax.jit(_run, static_argnums=(0, 1))


# The full suite; the quick loop's banded solver:
# linear/test_banded.py::test_grad_matches_dense_and_finite_differences[2-1].
@pytest.mark.slow
@pytest.mark.parametrize("lower,upper", [(1, 1), (2, 0), (0, 3), (2, 3)])
@pytest.mark.parametrize("mass_index", [0, 1, 2])
def test_banded_matches_dense(lower, upper, mass_index):
    fn = _field(_banded_matrix(_N, lower, upper))
    mass = _masses(_N, lower, upper)[mass_index]
    x = jnp.linspace(-1.0, 1.0, _N)
    rhs = jnp.cos(jnp.arange(_N, dtype=jnp.float64))
    solver = sk.BandedLinearSolver(lower, upper)
    value, sol = _run_jit(solver, fn, x, 0.7, mass, rhs)
    value_d, sol_d = _run(sk.DenseLinearSolver(), fn, x, 0.7, mass, rhs)
    # The same field evaluation: a few ulps apart.
    np.testing.assert_allclose(value, value_d, rtol=1e-13)
    # Two backward-stable LUs of M - γh J: each within n·cond·eps = 12 · 1.2e3 (the
    # largest condition number of these cases) · 2.2e-16 = 3e-12 of the solution.
    np.testing.assert_allclose(sol, sol_d, rtol=1e-10, atol=1e-12)


# Quick loop: linear/test_banded.py::test_vmap_over_matrices_and_rhs[2-1].
@pytest.mark.slow
def test_banded_vmap_over_rhs_and_point():
    fn = _field(_banded_matrix(_N, 1, 2))
    solver = sk.BandedLinearSolver(1, 2)
    xs = jnp.linspace(-1.0, 1.0, 3 * _N).reshape(3, _N)
    rhs = jnp.sin(jnp.arange(3 * _N, dtype=jnp.float64)).reshape(3, _N)

    def both(s, x, b):
        return _run(s, fn, x, 0.5, None, b)[1]

    batched = jax.jit(jax.vmap(both, in_axes=(None, 0, 0)), static_argnums=0)
    got = batched(solver, xs, rhs)
    want = jax.vmap(both, in_axes=(None, 0, 0))(sk.DenseLinearSolver(), xs, rhs)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _loss(solver, matrix):
    a = jnp.asarray(matrix)

    def loss(params):
        p, rhs = params[0], params[1:]

        def fn(x):  # closes over the differentiated `p`
            return a @ jnp.tanh(x) + p * x**2

        x = jnp.linspace(-1.0, 1.0, a.shape[0])
        return jnp.sum(_run(solver, fn, x, 0.1, None, rhs)[1] ** 2)

    return loss


_KRYLOV = sk.KrylovLinearSolver(rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    "solver",
    [
        sk.BandedLinearSolver(2, 1),
        _KRYLOV,
        sk.KrylovLinearSolver(
            "bicgstab",
            rtol=1e-13,
            atol=1e-14,
            preconditioner=sk.BandedLinearSolver(2, 1, check=False),
        ),
    ],
    ids=["banded", "gmres", "bicgstab-preconditioned"],
)
@pytest.mark.slow
def test_grad_against_dense_and_finite_differences(solver):
    matrix = _banded_matrix(_N, 2, 1)
    params = jnp.concatenate([jnp.array([0.3]), jnp.cos(jnp.arange(_N) * 1.0)])
    grad = jax.jit(jax.grad(_loss(solver, matrix)))(params)
    grad_dense = jax.jit(jax.grad(_loss(sk.DenseLinearSolver(), matrix)))(params)
    # A forward and a transposed solve, each within n·cond·eps ~ 3e-12 (cond ~ 1e3).
    np.testing.assert_allclose(grad, grad_dense, rtol=1e-9, atol=1e-11)
    fd = finite_difference(jax.jit(_loss(solver, matrix)), params)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)


# The full suite; the quick loop's banded solver: linear/test_banded.py.
@pytest.mark.slow
def test_banded_wrong_bandwidth_is_detected():
    fn = _field(_banded_matrix(_N, 2, 2))
    x = jnp.zeros(_N)
    with pytest.raises(Exception, match="outside these bands"):
        jax.jit(sk.BandedLinearSolver(1, 1).linearise, static_argnums=0)(fn, x)
    # The right bandwidths pass; unchecked, no error.
    jax.jit(sk.BandedLinearSolver(2, 2).linearise, static_argnums=0)(fn, x)
    sk.BandedLinearSolver(1, 1, check=False).linearise(fn, x)


# The full suite; the quick loop's banded solver: linear/test_banded.py.
@pytest.mark.slow
def test_banded_mass_outside_bands_is_detected():
    solver = sk.BandedLinearSolver(1, 1)
    _, jac = solver.linearise(_field(_banded_matrix(_N, 1, 1)), jnp.zeros(_N))
    with pytest.raises(Exception, match="mass matrix has entries outside"):
        solver.factorise(jac, jnp.asarray(0.5), jnp.ones((_N, _N)))
    with pytest.raises(ValueError, match="`mass` must be None"):
        solver.factorise(jac, jnp.asarray(0.5), jnp.ones(_N + 1))


def test_banded_bad_arguments():
    with pytest.raises(ValueError, match="`lower` must be an int"):
        sk.BandedLinearSolver(-1, 1)
    with pytest.raises(ValueError, match="`fn\\(x\\)` must have the shape"):
        sk.BandedLinearSolver(1, 1).linearise(lambda x: x[:2], jnp.zeros(4))


# The full suite; the quick loop's banded solver: linear/test_banded.py.
@pytest.mark.slow
def test_banded_singular_gives_nan():
    matrix = np.diag(np.arange(_N, dtype=np.float64))  # J[0, 0] = 0
    solver = sk.BandedLinearSolver(1, 1)

    @jax.jit  # one program (op by op: ~39 compiles)
    def solve(matrix, mass):
        _, jac = solver.linearise(lambda x: matrix @ x, jnp.ones(_N))
        factor = solver.factorise(jac, jnp.asarray(-1.0), mass)
        return solver.solve(factor, jnp.ones(_N), _unused)

    # M - γh J with M = diag(e_0 ...): row 0 vanishes.
    mass = jnp.asarray(np.arange(_N) > 0, jnp.float64)
    assert np.all(np.isnan(solve(jnp.asarray(matrix), mass)))


def _sparse_matrix(kind, seed=0):
    """A random (12, 12) matrix whose pattern takes each path of SparseLinearSolver."""
    rng = np.random.default_rng(seed)
    if kind == "blocks":  # four 3x3 blocks, shuffled
        a = np.kron(np.eye(4), np.ones((3, 3))) * rng.normal(size=(_N, _N))
        perm = rng.permutation(_N)
        return a[perm][:, perm]
    if kind == "banded":  # a ring (periodic tridiagonal) of 12, shuffled
        i, j = np.indices((_N, _N))
        ring = (np.abs(i - j) <= 1) | (np.abs(i - j) == _N - 1)
        perm = rng.permutation(_N)
        return (ring * rng.normal(size=(_N, _N)))[perm][:, perm]
    a = rng.normal(size=(_N, _N))  # "dense": about half the entries
    return np.where(rng.uniform(size=(_N, _N)) < 0.5, a, 0) + 3 * np.eye(_N)


# Quick loop: test_solve_tangent_transposes[0-sparse-dense].
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["blocks", "banded", "dense"])
@pytest.mark.parametrize("mass_index", [0, 1, 2])
def test_sparse_matches_dense(kind, mass_index):
    matrix = _sparse_matrix(kind)
    solver = sk.SparseLinearSolver(matrix != 0)
    assert solver.kind == kind
    fn = _field(matrix)
    mass = _masses(_N, 0, 0)[mass_index]
    if mass is not None and mass.ndim == 2:  # a mass matrix within the pattern
        mass = mass + 0.1 * jnp.asarray(matrix)
    x = jnp.linspace(-1.0, 1.0, _N)
    rhs = jnp.cos(jnp.arange(_N, dtype=jnp.float64))
    value, sol = _run_jit(solver, fn, x, 0.7, mass, rhs)
    value_d, sol_d = _run(sk.DenseLinearSolver(), fn, x, 0.7, mass, rhs)
    # The same field evaluation: a few ulps apart.
    np.testing.assert_allclose(value, value_d, rtol=1e-13)
    # Two backward-stable LUs of M - γh J: each within n·cond·eps = 12 · 1.2e3 (the
    # largest condition number of these cases) · 2.2e-16 = 3e-12 of the solution.
    np.testing.assert_allclose(sol, sol_d, rtol=1e-10, atol=1e-12)


# Quick loop: test_solve_tangent_transposes[0-sparse-dense].
@pytest.mark.slow
def test_sparse_vmap_over_rhs_and_point():
    matrix = _sparse_matrix("blocks")
    fn = _field(matrix)
    xs = jnp.linspace(-1.0, 1.0, 3 * _N).reshape(3, _N)
    rhs = jnp.sin(jnp.arange(3 * _N, dtype=jnp.float64)).reshape(3, _N)

    def both(s, x, b):
        return _run(s, fn, x, 0.5, None, b)[1]

    for kind in ("blocks", "banded"):
        solver = sk.SparseLinearSolver(_sparse_matrix(kind) != 0 | (matrix != 0))
        got = jax.jit(jax.vmap(both, in_axes=(None, 0, 0)), static_argnums=0)(
            solver, xs, rhs
        )
        want = jax.vmap(both, in_axes=(None, 0, 0))(sk.DenseLinearSolver(), xs, rhs)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# Quick loop: test_solve_tangent_transposes[0-sparse-dense].
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["blocks", "banded"])
def test_sparse_grad_against_dense_and_finite_differences(kind):
    matrix = _sparse_matrix(kind)
    solver = sk.SparseLinearSolver(matrix != 0)
    params = jnp.concatenate([jnp.array([0.3]), jnp.cos(jnp.arange(_N) * 1.0)])
    grad = jax.jit(jax.grad(_loss(solver, matrix)))(params)
    grad_dense = jax.jit(jax.grad(_loss(sk.DenseLinearSolver(), matrix)))(params)
    # A forward and a transposed solve, each within n·cond·eps ~ 3e-12 (cond ~ 1e3).
    np.testing.assert_allclose(grad, grad_dense, rtol=1e-9, atol=1e-11)
    fd = finite_difference(jax.jit(_loss(solver, matrix)), params)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)


def test_sparse_wrong_pattern_is_detected():
    matrix = _sparse_matrix("banded")
    pattern = matrix != 0
    i, j = np.argwhere(pattern & ~np.eye(_N, dtype=bool))[0]
    pattern[i, j] = False  # drop one off-diagonal nonzero
    fn = _field(matrix)
    with pytest.raises(Exception, match="outside the sparsity pattern"):
        jax.jit(sk.SparseLinearSolver(pattern).linearise, static_argnums=0)(
            fn, jnp.zeros(_N)
        )
    sk.SparseLinearSolver(pattern, check=False).linearise(fn, jnp.zeros(_N))


def test_sparse_bad_arguments():
    with pytest.raises(ValueError, match="must be a boolean"):
        sk.SparseLinearSolver(np.ones((3, 3)))
    with pytest.raises(ValueError, match="must be square"):
        sk.SparseLinearSolver(np.ones((3, 4), bool))
    solver = sk.SparseLinearSolver(np.eye(3, dtype=bool))
    with pytest.raises(ValueError, match=r"must have shape \(3,\)"):
        solver.linearise(lambda x: x, jnp.zeros(4))


# The full suite; the quick loop's sparse solver:
# test_solve_tangent_transposes[0-sparse-dense].
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["blocks", "banded", "dense"])
def test_sparse_singular_gives_nan(kind):
    matrix = _sparse_matrix(kind)
    solver = sk.SparseLinearSolver(matrix != 0)

    @jax.jit  # one program (op by op: up to 55 compiles)
    def solve():
        _, jac = solver.linearise(_field(matrix), jnp.zeros(_N))
        factor = solver.factorise(jnp.zeros_like(jac), jnp.asarray(0.5), jnp.zeros(_N))
        return solver.solve(factor, jnp.ones(_N), _unused)

    assert np.all(np.isnan(solve()))


def _laplacian_2d(m):
    i, j = np.indices((m * m, m * m))
    xi, yi, xj, yj = i // m, i % m, j // m, j % m
    return np.abs(xi - xj) + np.abs(yi - yj) <= 1


def test_colours():
    tridiagonal = np.abs(np.subtract.outer(np.arange(50), np.arange(50))) <= 1
    assert sk.SparseLinearSolver(tridiagonal).n_colours == 3
    assert sk.SparseLinearSolver(_laplacian_2d(10)).n_colours <= 5
    blocks = np.kron(np.eye(20, dtype=bool), np.ones((3, 3), bool))
    solver = sk.SparseLinearSolver(blocks)
    assert (solver.n_colours, solver.kind, solver.block) == (3, "blocks", 3)


def test_sparse_accepts_scipy():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    matrix = _sparse_matrix("banded")
    solver = sk.SparseLinearSolver(scipy_sparse.csr_matrix(matrix))
    reference = sk.SparseLinearSolver(matrix != 0)
    np.testing.assert_array_equal(solver.rows, reference.rows)
    np.testing.assert_array_equal(solver.cols, reference.cols)


_PRECONDITIONERS = {
    "none": None,
    "banded": sk.BandedLinearSolver(2, 2, check=False),
    "callable": lambda v, point, gamma_h: v / (1 + gamma_h),
}


# Quick loop: each method, each preconditioner, each kind of mass at least once.
@pytest.mark.quick_cases("0-none-gmres", "2-banded-bicgstab", "2-callable-gmres")
@pytest.mark.parametrize("method", ["gmres", "bicgstab"])
@pytest.mark.parametrize("preconditioner", sorted(_PRECONDITIONERS))
@pytest.mark.parametrize("mass_index", [0, 2])
def test_krylov_matches_dense(method, preconditioner, mass_index):
    fn = _field(_banded_matrix(_N, 2, 2))
    mass = _masses(_N, 2, 2)[mass_index]
    x = jnp.linspace(-1.0, 1.0, _N)
    rhs = jnp.cos(jnp.arange(_N, dtype=jnp.float64))
    solver = sk.KrylovLinearSolver(
        method, rtol=1e-13, atol=1e-14, preconditioner=_PRECONDITIONERS[preconditioner]
    )
    value, sol = _run_jit(solver, fn, x, 0.7, mass, rhs)
    value_d, sol_d = _run(sk.DenseLinearSolver(), fn, x, 0.7, mass, rhs)
    np.testing.assert_allclose(value, value_d, rtol=1e-13)  # the same evaluation
    # A residual of 1e-13 relative, times cond(M - γh J) <= 9 here: 1e-12.
    np.testing.assert_allclose(sol, sol_d, rtol=1e-9, atol=1e-11)


_EXACT = {
    "none": None,
    "banded": sk.BandedLinearSolver(1, 1, check=False),
    "dense": sk.DenseLinearSolver(),
}


def _zero_vectors_loss(s, params, k, which: str, rhs_kind: str):
    """A solve or tangent solve of `s` whose right-hand side is zero (`rhs_kind`
    "zero"), or one-hot at `k` (then the cotangent the transposed solve gets is zero
    off row `k`), for test_bicgstab_gradient_with_zero_vectors; the field closes
    over a float32 and the int `k`."""
    a = jnp.asarray(_banded_matrix(_N, 1, 1))
    w = jnp.asarray(1.5, jnp.float32)
    x = jnp.linspace(-1.0, 1.0, _N)
    p, scale = params[0], params[1]

    def fn(y):
        sink = p * w.astype(y.dtype) * y**2 * (jnp.arange(_N) == k)
        return a @ jnp.tanh(y) + sink

    one_hot = (jnp.arange(_N) == k).astype(x.dtype)
    _, jac = s.linearise(fn, x)
    factor = s.factorise(jac, jnp.asarray(0.1), None)
    if rhs_kind == "zero":
        out = getattr(s, which)(factor, scale * 0 * one_hot, fn)
        return jnp.sum(out**2)
    out = getattr(s, which)(factor, scale * one_hot, fn)
    return out[k] + jnp.sum(out**2)


# vmapped over the int `k`; jitted with the solver, `which` and `rhs_kind` static:
# the dense references are shared by the three preconditioners' cases.
_zero_vectors_grads = jax.jit(
    jax.vmap(jax.grad(_zero_vectors_loss, argnums=1), (None, None, 0, None, None)),
    static_argnums=(0, 3, 4),
)
_zero_vectors_value = jax.jit(_zero_vectors_loss, static_argnums=(0, 3, 4))


# Quick loop: one case; the other solves, preconditioners and right-hand sides in the
# full suite.
@pytest.mark.parametrize("rhs_kind", ["zero", "one-hot"])
@pytest.mark.parametrize("preconditioner", sorted(_EXACT))
@pytest.mark.parametrize("which", ["solve", "solve_tangent"])
# Quick loop: test_solve_tangent_transposes[0-gmres].
@pytest.mark.slow
def test_bicgstab_gradient_with_zero_vectors(which, preconditioner, rhs_kind):
    """Reverse mode through BiCGStab where a right-hand side is zero: the forward
    one, and then the cotangent of the sum of squares that the transposed solve
    gets (a one-hot right-hand side: a cotangent that is zero off row `k`).
    lineax's BiCGStab divided 0/0 there (`α`), which gave NaN gradients through BDF
    and Rodas5P. Against the dense solver and central differences, under `jit`
    and `vmap` over a closed-over int, with a closed-over float32 and a
    differentiated float64."""
    if preconditioner != "none" and (which, rhs_kind) != ("solve_tangent", "one-hot"):
        skip_unless_full_matrix(
            "[*-none-*] (both solves, both right-hand sides, without a "
            "preconditioner) and [solve_tangent-dense-one-hot], "
            "[solve_tangent-banded-one-hot] (each preconditioner)"
        )
    solver = sk.KrylovLinearSolver(
        "bicgstab", rtol=1e-13, atol=1e-14, preconditioner=_EXACT[preconditioner]
    )
    params = jnp.array([0.7, 1.3])
    ks = jnp.array([0, 5, 11], jnp.int32)
    got = _zero_vectors_grads(solver, params, ks, which, rhs_kind)
    dense = sk.DenseLinearSolver()
    want = _zero_vectors_grads(dense, params, ks, which, rhs_kind)
    # BiCGStab's rtol 1e-13 times the condition number (< 1e3 here).
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
    for i, k in enumerate(ks):
        fd = finite_difference(
            lambda q: _zero_vectors_value(dense, q, k, which, rhs_kind), params
        )
        # Central differences with step 1e-6: O(1e-12) truncation, 1e-10 rounding.
        np.testing.assert_allclose(got[i], fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("which", ["solve", "solve_tangent"])
# Quick loop: linear/test_bruss_preconditioner.py::
# test_preconditioner_inverts_the_iteration_matrix[reaction-first].
@pytest.mark.slow
def test_bicgstab_exact_preconditioner(which):
    """A preconditioner that is the exact inverse: the first half step solves
    `(I - γh J) x = b` to the last bit, `s = 0`, where lineax's BiCGStab formed
    `ω = (t·s)/(t·t) = 0/0`. `f(y) = -2 p y`, `γh = 1/2`: `x = b / (1 + p)` and
    `∂x/∂p = -b / (1 + p)²`, at `p = 1` exact in binary; under `jit`, `vmap` over a
    closed-over int (the one-hot `b`) and `grad`."""
    solver = sk.KrylovLinearSolver(
        "bicgstab", rtol=1e-13, atol=1e-14, preconditioner=sk.DenseLinearSolver()
    )

    def solve(p, k):
        b = (jnp.arange(_N) == k).astype(p.dtype)
        fn = lambda y: -2 * p * y  # noqa: E731
        _, jac = solver.linearise(fn, jnp.ones(_N))
        factor = solver.factorise(jac, jnp.asarray(0.5), None)
        return getattr(solver, which)(factor, b, fn)

    ks = jnp.array([0, 7], jnp.int32)
    p = jnp.asarray(1.0)
    values = jax.jit(jax.vmap(solve, (None, 0)))(p, ks)
    derivatives = jax.jit(jax.vmap(jax.jacrev(solve), (None, 0)))(p, ks)
    one_hot = np.eye(_N)[np.asarray(ks)]
    np.testing.assert_array_equal(values, one_hot / 2)
    # Exact up to the solver's rtol.
    np.testing.assert_allclose(derivatives, -one_hot / 4, rtol=1e-13, atol=1e-14)


@pytest.mark.slow
def test_krylov_vmap_over_rhs_and_point():
    fn = _field(_banded_matrix(_N, 1, 2))
    xs = jnp.linspace(-1.0, 1.0, 3 * _N).reshape(3, _N)
    rhs = jnp.sin(jnp.arange(3 * _N, dtype=jnp.float64)).reshape(3, _N)

    def both(s, x, b):
        return _run(s, fn, x, 0.5, None, b)[1]

    got = jax.jit(jax.vmap(both, in_axes=(None, 0, 0)), static_argnums=0)(
        _KRYLOV, xs, rhs
    )
    want = jax.vmap(both, in_axes=(None, 0, 0))(sk.DenseLinearSolver(), xs, rhs)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


# The full suite; the quick loop's Krylov solver: test_krylov_matches_dense.
@pytest.mark.slow
def test_krylov_nonconvergence_and_singular_give_nan():
    fn = _field(_banded_matrix(_N, 2, 2))
    x = jnp.linspace(-1.0, 1.0, _N)
    rhs = jnp.ones(_N)
    too_few = sk.KrylovLinearSolver(rtol=1e-13, atol=1e-14, max_steps=2, restart=2)
    assert np.all(np.isnan(_run(too_few, fn, x, 0.7, None, rhs)[1]))
    # M - γh J = 0: singular.
    assert np.all(np.isnan(_run(_KRYLOV, lambda y: y, x, 1.0, None, rhs)[1]))


def test_krylov_bad_arguments():
    with pytest.raises(ValueError, match="`method` must be"):
        sk.KrylovLinearSolver("cg")
    with pytest.raises(ValueError, match="`preconditioner` must be"):
        sk.KrylovLinearSolver(preconditioner=3)  # pyright: ignore


@pytest.mark.parametrize(
    "solver",
    [
        sk.BandedLinearSolver(2, 1),
        sk.SparseLinearSolver(_banded_matrix(_N, 2, 1) != 0),
        _KRYLOV,
    ],
    ids=["banded", "sparse", "krylov"],
)
# Quick loop: test_solve_tangent_transposes[0-gmres]; closure/test_closure_matrix.py's
# cells.
@pytest.mark.slow
def test_closure_over_float_and_vmapped_int(solver):
    """The field closes over a differentiated float and a vmapped int index."""
    a = jnp.asarray(_banded_matrix(_N, 2, 1))
    x = jnp.linspace(-1.0, 1.0, _N)
    rhs = jnp.cos(jnp.arange(_N, dtype=jnp.float64))

    def loss(s, p, k):
        def fn(y):
            return a @ jnp.tanh(y) + p * y * (jnp.arange(_N) == k)

        return jnp.sum(_run(s, fn, x, 0.1, None, rhs)[1] ** 2)

    grads = jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, None, 0))
    ks = jnp.array([0, 5, 11], jnp.int32)
    got = jax.jit(grads, static_argnums=0)(solver, jnp.asarray(0.3), ks)
    want = grads(sk.DenseLinearSolver(), jnp.asarray(0.3), ks)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def _transpose_cases():
    """Every linear solver (each layout of `SparseLinearSolver`, each kind of Krylov
    preconditioner) with a matrix of its structure."""
    ring = _sparse_matrix("banded")
    return {
        "dense": (sk.DenseLinearSolver(), _banded_matrix(_N, 2, 1)),
        "banded": (sk.BandedLinearSolver(2, 1), _banded_matrix(_N, 2, 1)),
        **{
            f"sparse-{kind}": (sk.SparseLinearSolver(m != 0), m)
            for kind, m in ((k, _sparse_matrix(k)) for k in ("blocks", "banded"))
        },
        "sparse-dense": (sk.SparseLinearSolver(np.ones((_N, _N), bool)), ring),
        "gmres": (_KRYLOV, ring),
        "gmres-sparse": (
            sk.KrylovLinearSolver(
                rtol=1e-13,
                atol=1e-14,
                preconditioner=sk.SparseLinearSolver(ring != 0, check=False),
            ),
            ring,
        ),
        "bicgstab-blocks": (
            sk.KrylovLinearSolver(
                "bicgstab",
                rtol=1e-13,
                atol=1e-14,
                preconditioner=sk.SparseLinearSolver(
                    _sparse_matrix("blocks") != 0, check=False
                ),
            ),
            ring,
        ),
    }


@pytest.mark.parametrize("name", sorted(_transpose_cases()))
@pytest.mark.parametrize("mass_index", [0, 1])
# Quick loop: each kind of linear solver once, without a mass matrix.
@pytest.mark.quick_cases("0-banded", "0-dense", "0-gmres", "0-sparse-dense")
def test_solve_tangent_transposes(name, mass_index):
    """`solve_tangent` is transposable in its right-hand side (reverse mode through
    BDF's implicit derivative and through a Krylov preconditioner transposes it):
    the transpose is `(M - γh J)^{-T}`, under `jit` and `vmap`. (A sparse solve once
    moved the right-hand side in by a scatter, which JAX cannot transpose.)"""
    if mass_index == 1 and name not in ("dense", "banded", "gmres", "sparse-blocks"):
        skip_unless_full_matrix(
            f"[0-{name}] (this solver's transpose) and [1-dense], [1-banded], "
            "[1-gmres], [1-sparse-blocks] (a mass matrix in each kind of solver)"
        )
    solver, matrix = _transpose_cases()[name]
    fn = _field(matrix)
    mass = _masses(_N, 0, 0)[mass_index]
    x = jnp.linspace(-1.0, 1.0, _N)
    cotangents = jnp.cos(jnp.arange(3 * _N, dtype=jnp.float64)).reshape(3, _N)

    def transposed(s, w):
        _, jac = s.linearise(fn, x)
        factor = s.factorise(jac, jnp.asarray(0.7), mass)
        solve = lambda b: s.solve_tangent(factor, b, fn)  # noqa: E731
        return jax.linear_transpose(solve, w)(w)[0]

    got = jax.jit(jax.vmap(transposed, in_axes=(None, 0)), static_argnums=0)(
        solver, cotangents
    )
    jac = jax.jacfwd(fn)(x)
    m = jnp.eye(_N) if mass is None else jnp.diag(mass)
    want = jnp.linalg.solve((m - 0.7 * jac).T, cotangents.T).T
    # Direct solves agree to rounding times the condition number (< 1e3 here);
    # Krylov ones to their rtol 1e-13, likewise amplified.
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
