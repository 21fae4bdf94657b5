"""Large stiff benchmark problems (10^3 to 3·10^4 unknowns) with sparse Jacobians.

Each problem is given three ways, all from the same parameters:

- `field(params)`: a JAX vector field `(t, y, args) -> dy/dt` that closes over
  `params` (a dict of JAX arrays), for solverkit and diffrax;
- `np_field`: the same field in NumPy, `(t, y_flat) -> dy_flat`, for SciPy's
  `solve_ivp`;
- `sparsity()`: the Jacobian's sparsity pattern as a `scipy.sparse.csr_matrix` on the
  ravelled state (`solve_ivp(..., jac_sparsity=...)`), with its lower and upper
  bandwidths in `bandwidths`.

The problems:

- `bruss2d-N`: the 2-D Brusselator reaction-diffusion system of Hairer and Wanner,
  *Solving Ordinary Differential Equations II*, §IV.10 (BRUSS, 2-D form):
  `u_t = 1 + u²v - 4.4u + α Δu + f(x, y, t)`, `v_t = 3.4u - u²v + α Δv` on the unit
  square, initial values `u = 22 y (1 - y)^{3/2}`, `v = 27 x (1 - x)^{3/2}`, and the
  source `f = 5` in the disc of radius 0.1 about (0.3, 0.6) for `t >= 1.1`. Here the
  boundary is zero-flux (Neumann, mirrored ghost cells) rather than periodic, so that
  the Jacobian is banded, and `α = 0.1`; cell-centred grid of `N x N` cells, the
  state `(N, N, 2)` (u and v of a cell side by side), `2N²` unknowns. Its
  preconditioner (`bruss_preconditioner`) splits reaction from diffusion:
  `(I - γh D)^{-1} (I - γh R)^{-1}`, the reaction's `2 x 2` blocks per cell in closed
  form and the diffusion exactly, by the 2-D DCT-II that diagonalises the zero-flux
  Laplacian.
- `rober-blocks-M`: `M` independent copies of Robertson's reaction (Robertson 1966;
  the Test Set's ROBER), copy `i` with `k1 = 0.04 · 2^{u_i}`, `k3 = 10^4 · 2^{-u_i}`,
  `u_i` evenly spaced in [-1, 1]; state `(M, 3)`, a block-diagonal Jacobian.
- `burgers-N`: viscous Burgers' equation `u_t + (u²/2)_x = ν u_xx` on (0, 1),
  `u(0) = u(1) = 0`, `ν = 0.01`, `u(x, 0) = sin(2πx) + 0.5 sin(πx)`, on `N` interior
  points (central differences of the flux), a tridiagonal Jacobian.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import scipy.sparse as sps


@dataclasses.dataclass(frozen=True)
class LargeProblem:
    """One large stiff problem (see the module docstring).

    - `name`: e.g. `bruss2d-32`.
    - `size`: the number of unknowns `n`.
    - `y0`: initial value (float64 NumPy, the pytree's shape).
    - `t1`: final time (`t0 = 0`).
    - `params`: NumPy parameters the fields close over.
    - `field`: `params -> vector_field(t, y, args)` (JAX).
    - `np_field`: `(t, y_flat) -> dy_flat` (NumPy, for SciPy).
    - `sparsity`: `() -> scipy.sparse.csr_matrix`, the `(n, n)` Jacobian pattern.
    - `bandwidths`: `(lower, upper)` of the ravelled Jacobian.
    - `error_floor`: the error is `max_i |y_i - ref_i| / (|ref_i| + error_floor)`.
    - `atol_factor`: `atol = atol_factor * rtol`.
    - `preconditioner`: `None`, or `params -> p(v, point, gamma_h)`, an approximate
      `(I - γh J(point))^{-1} v` for `KrylovLinearSolver` (the `krylov-pc` configs),
      specific to the problem (the Brusselator's: `bruss_preconditioner`, operator
      splitting with an exact DCT solve of the diffusion).
    """

    name: str
    size: int
    y0: np.ndarray
    t1: float
    params: dict
    field: Callable[[dict], Callable]
    np_field: Callable[[float, np.ndarray], np.ndarray]
    sparsity: Callable[[], sps.csr_matrix]
    bandwidths: tuple[int, int]
    error_floor: float
    atol_factor: float
    preconditioner: Callable[[dict], Callable] | None = None


def relative_error(y, reference, floor: float) -> float:
    """`max_i |y_i - ref_i| / (|ref_i| + floor)` on the ravelled states."""
    y = np.asarray(y, dtype=np.float64).ravel()
    reference = np.asarray(reference, dtype=np.float64).ravel()
    return float(np.max(np.abs(y - reference) / (np.abs(reference) + floor)))


def _pattern_from_stencil(n: int, rows: list[np.ndarray], cols: list[np.ndarray]):
    r = np.concatenate(rows)
    c = np.concatenate(cols)
    ok = (c >= 0) & (c < n)
    data = np.ones(int(ok.sum()), dtype=np.int8)
    return sps.csr_matrix((data, (r[ok], c[ok])), shape=(n, n))


# --- 2-D Brusselator ---------------------------------------------------------------


def _bruss_grid(n: int):
    x = (np.arange(n) + 0.5) / n
    xx, yy = np.meshgrid(x, x, indexing="ij")  # [i, j] = (x_i, y_j)
    return xx, yy


def _bruss_params(n: int, alpha: float = 0.1) -> dict:
    xx, yy = _bruss_grid(n)
    disc = ((xx - 0.3) ** 2 + (yy - 0.6) ** 2 <= 0.1**2).astype(np.float64)
    return {"alpha": np.float64(alpha), "dx2": np.float64((1.0 / n) ** 2), "disc": disc}


def _neumann_laplacian(u, pad):
    """The 5-point Laplacian (without the `1/dx²`) with mirrored ghost cells."""
    p = pad(u, 1, mode="edge")
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4.0 * u


def bruss_field(params: dict) -> Callable:
    """The 2-D Brusselator on the state `(N, N, 2)`, closing over `params`
    (`alpha`, the diffusion coefficient, may be a traced value)."""
    alpha = jnp.asarray(params["alpha"])
    dx2 = jnp.asarray(params["dx2"])
    disc = jnp.asarray(params["disc"])

    def vector_field(t, y, args):
        u, v = y[..., 0], y[..., 1]
        lap_u = _neumann_laplacian(u, jnp.pad)
        lap_v = _neumann_laplacian(v, jnp.pad)
        source = jnp.where(t >= 1.1, 5.0, 0.0) * disc
        uuv = u * u * v
        du = 1.0 + uuv - 4.4 * u + (alpha / dx2) * lap_u + source
        dv = 3.4 * u - uuv + (alpha / dx2) * lap_v
        return jnp.stack([du, dv], axis=-1)

    return vector_field


def _bruss_np(params: dict, n: int):
    alpha, dx2, disc = params["alpha"], params["dx2"], params["disc"]

    def np_field(t, y):
        y = y.reshape(n, n, 2)
        u, v = y[..., 0], y[..., 1]
        source = (5.0 if t >= 1.1 else 0.0) * disc
        uuv = u * u * v
        du = 1.0 + uuv - 4.4 * u + (alpha / dx2) * _neumann_laplacian(u, np.pad)
        du = du + source
        dv = 3.4 * u - uuv + (alpha / dx2) * _neumann_laplacian(v, np.pad)
        return np.stack([du, dv], axis=-1).ravel()

    return np_field


def _bruss_sparsity(n: int) -> sps.csr_matrix:
    size = 2 * n * n
    idx = np.arange(size).reshape(n, n, 2)
    rows, cols = [], []
    for s in (0, 1):  # reaction: u and v of a cell couple
        for s2 in (0, 1):
            rows.append(idx[..., s].ravel())
            cols.append(idx[..., s2].ravel())
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):  # diffusion: same species
        i = np.arange(n)[:, None] + di
        j = np.arange(n)[None, :] + dj
        i, j = np.broadcast_arrays(np.clip(i, 0, n - 1), np.clip(j, 0, n - 1))
        for s in (0, 1):
            rows.append(idx[..., s].ravel())
            cols.append(idx[i, j, s].ravel())
    return _pattern_from_stencil(size, rows, cols)


def neumann_eigenvalues(n: int) -> np.ndarray:
    """The eigenvalues `λ_i + λ_j` (`λ_k = 2 cos(πk/n) - 2`) of the `n x n`
    cell-centred 5-point Laplacian with mirrored ghost cells (`_neumann_laplacian`,
    without the `1/dx²`), an `(n, n)` array ordered as the coefficients of the 2-D
    DCT-II, whose basis `cos(πk(i + 1/2)/n)` per direction are its eigenvectors."""
    lam = 2.0 * np.cos(np.pi * np.arange(n) / n) - 2.0
    return lam[:, None] + lam[None, :]


def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix, `C[k, i] = c_k cos(πk(i + 1/2)/n)` with
    `c_0 = sqrt(1/n)`, `c_k = sqrt(2/n)`: `C @ x` is `scipy.fft.dct(x, norm="ortho")`
    and `C.T` its inverse."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    c = np.where(k == 0, np.sqrt(1.0 / n), np.sqrt(2.0 / n))
    return c * np.cos(np.pi * k * (i + 0.5) / n)


def bruss_diffusion_solve(r, gamma_h, scale, eigenvalues, dct):
    """`(I - γh · scale · Δ)^{-1} r` for each species of `r` (`(N, N, 2)`) with the
    zero-flux Laplacian `Δ`: the orthonormal 2-D DCT-II diagonalises `Δ`
    (`eigenvalues = neumann_eigenvalues(N)`), so the solve is a DCT along both grid
    axes, a division and the inverse DCT; exact. `dct = dct_matrix(N)`: the
    transforms are matrix products (`O(N³)`, on CPU faster up to `N = 128` than
    `jax.scipy.fft.dctn`'s FFTs)."""
    denominator = 1.0 - gamma_h * scale * eigenvalues
    coefficients = jnp.einsum("bj,ajs->abs", dct, jnp.einsum("ai,ijs->ajs", dct, r))
    coefficients = coefficients / denominator[..., None]
    return jnp.einsum("jb,ajs->abs", dct, jnp.einsum("ia,ijs->ajs", dct, coefficients))


def bruss_reaction_solve(r, point, gamma_h):
    """`(I - γh R(point))^{-1} r`, `R` the reaction's Jacobian, a `2 x 2` block per
    cell (`r`, `point`: `(..., 2)`), by Cramer's rule."""
    u, w = point[..., 0], point[..., 1]
    a11 = 1.0 - gamma_h * (2.0 * u * w - 4.4)
    a12 = -gamma_h * u * u
    a21 = -gamma_h * (3.4 - 2.0 * u * w)
    a22 = 1.0 + gamma_h * u * u
    det = a11 * a22 - a12 * a21
    x0 = (a22 * r[..., 0] - a12 * r[..., 1]) / det
    x1 = (a11 * r[..., 1] - a21 * r[..., 0]) / det
    return jnp.stack([x0, x1], axis=-1)


def bruss_preconditioner(params: dict, order: str = "reaction-first") -> Callable:
    """Operator splitting of `I - γh J = I - γh (R + D)`, `R` the reaction's Jacobian
    (a `2 x 2` block per cell) and `D = α/dx² Δ` the diffusion:
    `P^{-1} = (I - γh D)^{-1} (I - γh R)^{-1}` (`order="reaction-first"`: the
    reaction's blocks solved first) or `(I - γh R)^{-1} (I - γh D)^{-1}`
    (`"diffusion-first"`). The diffusion solve is exact and fast (a 2-D DCT, see
    `bruss_diffusion_solve`), so `P` differs from `I - γh J` only by
    `γh² R D`: GMRES needs a few iterations whatever `γh α/dx²`.
    `params["alpha"]` may be traced.

    Returns `p(v, point, gamma_h)` on the ravelled state, for
    `KrylovLinearSolver(preconditioner=p)`."""
    if order not in ("reaction-first", "diffusion-first"):
        raise ValueError(
            f"order: expected 'reaction-first' or 'diffusion-first', got {order!r}"
        )
    scale = jnp.asarray(params["alpha"]) / jnp.asarray(params["dx2"])
    n = np.shape(params["disc"])[0]
    eigenvalues = neumann_eigenvalues(n)
    dct_n = dct_matrix(n)

    def apply(v, point, gamma_h):
        r = v.reshape(n, n, 2)
        y = point.reshape(n, n, 2)
        lam = jnp.asarray(eigenvalues, dtype=r.dtype)
        gh = jnp.asarray(gamma_h, dtype=r.dtype)
        s = scale.astype(r.dtype)
        c = jnp.asarray(dct_n, dtype=r.dtype)
        if order == "reaction-first":
            x = bruss_diffusion_solve(bruss_reaction_solve(r, y, gh), gh, s, lam, c)
        else:
            x = bruss_reaction_solve(bruss_diffusion_solve(r, gh, s, lam, c), y, gh)
        return x.reshape(v.shape)

    return apply


def brusselator(n: int) -> LargeProblem:
    """The 2-D Brusselator on `n x n` cells (`2n²` unknowns), `t` in [0, 11.5]."""
    xx, yy = _bruss_grid(n)
    y0 = np.stack([22.0 * yy * (1 - yy) ** 1.5, 27.0 * xx * (1 - xx) ** 1.5], axis=-1)
    params = _bruss_params(n)
    return LargeProblem(
        name=f"bruss2d-{n}",
        size=2 * n * n,
        y0=y0,
        t1=11.5,
        params=params,
        field=bruss_field,
        np_field=_bruss_np(params, n),
        sparsity=lambda: _bruss_sparsity(n),
        bandwidths=(2 * n, 2 * n),
        error_floor=1e-3,
        atol_factor=1.0,
        preconditioner=bruss_preconditioner,
    )


# --- ROBER, many independent copies -------------------------------------------------


def _rober_params(copies: int) -> dict:
    u = np.linspace(-1.0, 1.0, copies)
    return {
        "k1": 0.04 * 2.0**u,
        "k2": np.full(copies, 3e7),
        "k3": 1e4 * 2.0**-u,
    }


def rober_field(params: dict) -> Callable:
    """`M` Robertson reactions on the state `(M, 3)`, closing over the rates."""
    k1, k2, k3 = (jnp.asarray(params[k]) for k in ("k1", "k2", "k3"))

    def vector_field(t, y, args):
        y1, y2, y3 = y[:, 0], y[:, 1], y[:, 2]
        r1 = k1 * y1
        r2 = k2 * y2 * y2
        r3 = k3 * y2 * y3
        return jnp.stack([-r1 + r3, r1 - r2 - r3, r2], axis=-1)

    return vector_field


def _rober_np(params: dict, copies: int):
    k1, k2, k3 = params["k1"], params["k2"], params["k3"]

    def np_field(t, y):
        y = y.reshape(copies, 3)
        r1 = k1 * y[:, 0]
        r2 = k2 * y[:, 1] ** 2
        r3 = k3 * y[:, 1] * y[:, 2]
        return np.stack([-r1 + r3, r1 - r2 - r3, r2], axis=-1).ravel()

    return np_field


def _rober_sparsity(copies: int) -> sps.csr_matrix:
    block = sps.csr_matrix(np.ones((3, 3), dtype=np.int8))
    return sps.csr_matrix(sps.block_diag([block] * copies))


def rober_blocks(copies: int) -> LargeProblem:
    """`copies` Robertson reactions (`3 copies` unknowns), `t` in [0, 1e5]."""
    y0 = np.zeros((copies, 3))
    y0[:, 0] = 1.0
    params = _rober_params(copies)
    return LargeProblem(
        name=f"rober-blocks-{copies}",
        size=3 * copies,
        y0=y0,
        t1=1e5,
        params=params,
        field=rober_field,
        np_field=_rober_np(params, copies),
        sparsity=lambda: _rober_sparsity(copies),
        bandwidths=(2, 2),
        error_floor=1e-10,
        atol_factor=1e-4,
    )


# --- 1-D viscous Burgers --------------------------------------------------------------


def burgers_field(params: dict) -> Callable:
    """Burgers' equation on `N` interior points, closing over `nu` and `dx`."""
    nu = jnp.asarray(params["nu"])
    dx = jnp.asarray(params["dx"])

    def vector_field(t, y, args):
        p = jnp.pad(y, 1)  # u = 0 on the boundary
        flux = (p[2:] ** 2 - p[:-2] ** 2) / (4.0 * dx)
        return nu * (p[2:] - 2.0 * y + p[:-2]) / (dx * dx) - flux

    return vector_field


def _burgers_np(params: dict):
    nu, dx = params["nu"], params["dx"]

    def np_field(t, y):
        p = np.pad(y, 1)
        return nu * (p[2:] - 2.0 * y + p[:-2]) / (dx * dx) - (
            p[2:] ** 2 - p[:-2] ** 2
        ) / (4.0 * dx)

    return np_field


def _tridiagonal_pattern(n: int) -> sps.csr_matrix:
    i = np.arange(n)
    return _pattern_from_stencil(n, [i, i, i], [i - 1, i, i + 1])


def burgers(n: int) -> LargeProblem:
    """Burgers' equation on `n` interior points, `t` in [0, 0.5]."""
    dx = 1.0 / (n + 1)
    x = dx * np.arange(1, n + 1)
    params = {"nu": np.float64(0.01), "dx": np.float64(dx)}
    return LargeProblem(
        name=f"burgers-{n}",
        size=n,
        y0=np.sin(2 * np.pi * x) + 0.5 * np.sin(np.pi * x),
        t1=0.5,
        params=params,
        field=burgers_field,
        np_field=_burgers_np(params),
        sparsity=lambda: _tridiagonal_pattern(n),
        bandwidths=(1, 1),
        error_floor=1e-3,
        atol_factor=1.0,
    )


BUILDERS: dict[str, Callable[[], LargeProblem]] = {
    "bruss2d-32": lambda: brusselator(32),
    "bruss2d-128": lambda: brusselator(128),
    "rober-blocks-3334": lambda: rober_blocks(3334),
    "burgers-1000": lambda: burgers(1000),
    "burgers-10000": lambda: burgers(10000),
}
QUICK_BUILDERS: dict[str, Callable[[], LargeProblem]] = {
    "bruss2d-8": lambda: brusselator(8),
    "rober-blocks-34": lambda: rober_blocks(34),
    "burgers-100": lambda: burgers(100),
}


def problem(name: str) -> LargeProblem:
    """The problem called `name` (a key of `BUILDERS` or `QUICK_BUILDERS`, or any
    `bruss2d-N`, `rober-blocks-M`, `burgers-N`)."""
    kind, _, size = name.rpartition("-")
    builders = {
        "bruss2d": brusselator,
        "rober-blocks": rober_blocks,
        "burgers": burgers,
    }
    if kind not in builders or not size.isdigit():
        raise ValueError(
            f"problem {name!r}: expected bruss2d-N, rober-blocks-M or burgers-N"
        )
    return builders[kind](int(size))
