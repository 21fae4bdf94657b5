"""The 2-D Brusselator's preconditioner of the large stiff benchmark
(`benchmarks/problems.py`): the zero-flux Laplacian diagonalised by the
DCT-II, the exact diffusion solve, and the operator splitting against the exact
`(I - γh J)^{-1}`, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.fft

import solverkit as sk
from benchmarks import problems


pytestmark = pytest.mark.usefixtures("x64")

N = 6
ORDERS = ("reaction-first", "diffusion-first")


def _laplacian_matrix(n: int) -> np.ndarray:
    """The `(n², n²)` matrix of `_neumann_laplacian` on one species, column by
    column."""
    columns = [
        problems._neumann_laplacian(e.reshape(n, n), np.pad).ravel()
        for e in np.eye(n * n)
    ]
    return np.stack(columns, axis=1)


def _point(n: int) -> np.ndarray:
    """A state with spatially varying u and v, so that the reaction's blocks
    differ from cell to cell."""
    rng = np.random.default_rng(0)
    return problems.brusselator(n).y0 + rng.uniform(0.5, 2.0, size=(n, n, 2))


def _jacobian(n: int, point: np.ndarray, params: dict) -> np.ndarray:
    field = problems.bruss_field(params)

    def flat(y):
        return field(0.0, y.reshape(n, n, 2), None).reshape(-1)

    return np.asarray(jax.jacfwd(flat)(jnp.asarray(point).reshape(-1)))


def test_dct_diagonalises_the_neumann_laplacian():
    laplacian = _laplacian_matrix(N)
    assert np.allclose(laplacian, laplacian.T)
    dct = problems.dct_matrix(N)
    np.testing.assert_allclose(dct @ dct.T, np.eye(N), atol=1e-14)
    x = np.random.default_rng(1).normal(size=N)
    expected = np.asarray(scipy.fft.dct(x, norm="ortho"))
    np.testing.assert_allclose(dct @ x, expected, atol=1e-14)
    # The 2-D transform is the Kronecker product (row-major ravelling of `[i, j]`).
    transform = np.kron(dct, dct)
    diagonal = transform @ laplacian @ transform.T
    eigenvalues = problems.neumann_eigenvalues(N)
    np.testing.assert_allclose(diagonal, np.diag(eigenvalues.ravel()), atol=1e-12)
    np.testing.assert_allclose(
        np.sort(np.linalg.eigvalsh(laplacian)), np.sort(eigenvalues.ravel()), atol=1e-12
    )


@pytest.mark.parametrize("gamma_h", [1e-3, 0.37, 50.0])
def test_diffusion_solve_is_exact(gamma_h):
    scale = 0.1 * N * N
    r = np.random.default_rng(2).normal(size=(N, N, 2))
    x = problems.bruss_diffusion_solve(
        jnp.asarray(r),
        gamma_h,
        scale,
        jnp.asarray(problems.neumann_eigenvalues(N)),
        jnp.asarray(problems.dct_matrix(N)),
    )
    matrix = np.eye(N * N) - gamma_h * scale * _laplacian_matrix(N)
    for s in (0, 1):
        expected = np.linalg.solve(matrix, r[..., s].ravel()).reshape(N, N)
        np.testing.assert_allclose(np.asarray(x[..., s]), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("order", ORDERS)
def test_preconditioner_inverts_the_iteration_matrix(order):
    """`P^{-1} (I - γh J) v ≈ v`: the splitting's error is `O(γh²)` (here about
    `10 γh²`); without diffusion (`α = 0`) the per-cell blocks are exact."""
    params = problems.brusselator(N).params
    point = _point(N)
    p = jax.jit(problems.bruss_preconditioner(params, order))
    v = np.random.default_rng(3).normal(size=2 * N * N)
    jac = _jacobian(N, point, params)

    def defect(gamma_h, p=p, jac=jac):
        matrix = np.eye(2 * N * N) - gamma_h * jac
        x = p(jnp.asarray(matrix @ v), jnp.asarray(point).reshape(-1), gamma_h)
        return np.max(np.abs(np.asarray(x) - v)) / np.max(np.abs(v))

    errors = [defect(g) for g in (1e-2, 1e-3, 1e-4)]
    assert errors[0] < 0.2, errors
    assert errors[1] < errors[0] / 30 and errors[2] < errors[1] / 30, errors
    assert errors[2] < 1e-4, errors

    no_diffusion = dict(params, alpha=np.float64(0.0))
    p0 = jax.jit(problems.bruss_preconditioner(no_diffusion, order))
    jac0 = _jacobian(N, point, no_diffusion)
    matrix0 = np.eye(2 * N * N) - 0.3 * jac0
    x0 = p0(jnp.asarray(matrix0 @ v), jnp.asarray(point).reshape(-1), 0.3)
    np.testing.assert_allclose(np.asarray(x0), v, rtol=0, atol=1e-12)


def test_preconditioner_traced_alpha_and_dtype():
    """`alpha` traced under `jit`, the preconditioner built inside; float32 stays
    float32."""
    base = problems.brusselator(N).params
    point = jnp.asarray(_point(N)).reshape(-1)
    v = jnp.asarray(np.random.default_rng(4).normal(size=2 * N * N))

    @jax.jit
    def apply(alpha, v, point):
        p = problems.bruss_preconditioner(dict(base, alpha=alpha))
        return p(v, point, 0.01)

    eager = problems.bruss_preconditioner(base)(v, point, 0.01)
    np.testing.assert_allclose(
        np.asarray(apply(jnp.asarray(0.1), v, point)), np.asarray(eager), rtol=1e-13
    )
    out32 = apply(
        jnp.asarray(0.1, jnp.float32), v.astype(jnp.float32), point.astype(jnp.float32)
    )
    assert out32.dtype == jnp.float32
    with pytest.raises(ValueError, match="order"):
        problems.bruss_preconditioner(base, "both")


@pytest.mark.slow
def test_bdf_with_the_preconditioner_matches_a_dense_newton():
    """End to end on 8 x 8 cells: BDF with preconditioned GMRES (few iterations)
    against BDF with dense Jacobians, the same tolerances."""
    problem = problems.brusselator(8)
    params = jax.tree_util.tree_map(jnp.asarray, problem.params)
    linear = sk.KrylovLinearSolver(
        "gmres", 1e-4, 1e-8, 50, 2, problems.bruss_preconditioner(problem.params)
    )

    def solve(solver):
        sol = sk.diffeqsolve(
            sk.ODETerm(problem.field(params)),
            solver,
            0.0,
            2.0,
            None,
            jnp.asarray(problem.y0),
            None,
            saveat=sk.SaveAt(t1=True),
            stepsize_controller=sk.PIDController(rtol=1e-7, atol=1e-7),
        )
        assert sol.ys is not None
        return np.asarray(sol.ys[-1])

    krylov = solve(sk.BDF(linear_solver=linear))
    dense = solve(sk.BDF())
    np.testing.assert_allclose(krylov, dense, rtol=1e-5, atol=1e-5)
