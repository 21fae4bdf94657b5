"""The stiff problems that the benchmarks and the tests share.

**Small stiff problems** (`PROBLEMS`: ROBER, HIRES, VDPOL, OREGO, POLLU), from the
Test Set for IVP Solvers, with their published reference solutions.

Source: F. Mazzia and C. Magherini, *Test Set for Initial Value Problem Solvers*,
release 2.4, University of Bari, 2008 (https://archimede.uniba.it/~testset/): the
problem definitions and the `solut` reference values of `rober.f`, `hires.f`,
`vdpol.f`, `orego.f` and `pollu.f` (computed there with RADAU5 in quadruple-like
precision). ROBER's benchmark end time 1e5 is not one of the Test Set's (which
integrates to 1e11); its reference at 1e5 is SciPy's Radau at rtol = 1e-13,
atol = 1e-20 (see `REFERENCE_NOTES`), and the published 1e11 value is `ROBER_1E11`.

Each problem's vector field is built by `problem.field(scale)`: a JAX function
`(t, y, args) -> dy/dt` that closes over its rate constants, one of which (`scaled`)
is multiplied by `scale`. An ensemble vmaps over `scale` in [0.5, 2]; `scale = 1` is
the published problem.

**Large stiff problems** (`BUILDERS`, `large_problem(name)`: 10^3 to 3·10^4 unknowns)
with sparse Jacobians.

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
class StiffProblem:
    """One stiff test problem.

    - `name`: short name.
    - `field`: `scale -> vector_field(t, y, args)`, closing over the rate constants.
    - `y0`: initial value (float64 NumPy).
    - `t1`: final time (`t0 = 0`).
    - `reference`: the solution at `t1` for `scale = 1`.
    - `scaled`: which rate constant `scale` multiplies.
    """

    name: str
    field: Callable[..., Callable]
    y0: np.ndarray
    t1: float
    reference: np.ndarray
    scaled: str


def _scaled(rates: np.ndarray, index: int, scale):
    """The rate constants with `rates[index]` multiplied by `scale` (a JAX value)."""
    rates = jnp.asarray(rates)
    return rates.at[index].multiply(jnp.asarray(scale, rates.dtype))


# --- ROBER: Robertson's chemical reaction (rober.f) ------------------------------

_ROBER_K = np.array([0.04, 3e7, 1e4])


def rober_field(scale=1.0):
    """ROBER: `k1 = 0.04` (scaled), `k2 = 3e7`, `k3 = 1e4`."""
    k = _scaled(_ROBER_K, 0, scale)

    def vector_field(t, y, args):
        y1, y2, y3 = y[0], y[1], y[2]
        r1 = k[0] * y1
        r2 = k[1] * y2 * y2
        r3 = k[2] * y2 * y3
        return jnp.stack([-r1 + r3, r1 - r2 - r3, r2])

    return vector_field


ROBER_1E11 = np.array(
    [0.2083340149701255e-07, 0.8333360770334713e-13, 0.9999999791665050]
)

ROBER = StiffProblem(
    name="rober",
    field=rober_field,
    y0=np.array([1.0, 0.0, 0.0]),
    t1=1e5,
    # SciPy Radau, rtol = 1e-13, atol = 1e-20 (see REFERENCE_NOTES).
    reference=np.array(
        [1.7865921142101646e-02, 7.2747514684372427e-08, 9.8213400611038104e-01]
    ),
    scaled="k1",
)


# --- HIRES: high irradiance responses of photomorphogenesis (hires.f) ---------------

_HIRES_K = np.array(
    [1.71, 0.43, 8.32, 0.0007, 8.75, 10.03, 0.035, 1.12, 1.745, 280.0, 0.69, 1.81]
)


def hires_field(scale=1.0):
    """HIRES, with the rate `280` (index 9) scaled."""
    k = _scaled(_HIRES_K, 9, scale)

    def vector_field(t, y, args):
        r = k[9] * y[5] * y[7]
        return jnp.stack(
            [
                -k[0] * y[0] + k[1] * y[1] + k[2] * y[2] + k[3],
                k[0] * y[0] - k[4] * y[1],
                -k[5] * y[2] + k[1] * y[3] + k[6] * y[4],
                k[2] * y[1] + k[0] * y[2] - k[7] * y[3],
                -k[8] * y[4] + k[1] * (y[5] + y[6]),
                -r + k[10] * y[3] + k[0] * y[4] - k[1] * y[5] + k[10] * y[6],
                r - k[11] * y[6],
                -r + k[11] * y[6],
            ]
        )

    return vector_field


HIRES = StiffProblem(
    name="hires",
    field=hires_field,
    y0=np.array([1.0, 0, 0, 0, 0, 0, 0, 0.0057]),
    t1=321.8122,
    reference=np.array(
        [
            0.7371312573325668e-3,
            0.1442485726316185e-3,
            0.5888729740967575e-4,
            0.1175651343283149e-2,
            0.2386356198831331e-2,
            0.6238968252742796e-2,
            0.2849998395185769e-2,
            0.2850001604814231e-2,
        ]
    ),
    scaled="k280",
)


# --- VDPOL: Van der Pol, mu = 1e3 (vdpol.f, unscaled time) ------------------------


def vdpol_field(scale=1.0):
    """Van der Pol `y1'' = mu (1 - y1²) y1' - y1`, `mu = 1e3` (scaled)."""
    mu = _scaled(np.array([1e3]), 0, scale)[0]

    def vector_field(t, y, args):
        return jnp.stack([y[1], mu * (1 - y[0] * y[0]) * y[1] - y[0]])

    return vector_field


VDPOL = StiffProblem(
    name="vdpol",
    field=vdpol_field,
    y0=np.array([2.0, 0.0]),
    t1=2000.0,
    reference=np.array([0.1706167732170469e1, -0.8928097010248125e-3]),
    scaled="mu",
)


# --- OREGO: the Oregonator (orego.f) ---------------------------------------------

_OREGO_K = np.array([77.27, 8.375e-6, 0.161])


def orego_field(scale=1.0):
    """OREGO, with `s = 77.27` fixed and `w = 0.161` (index 2) scaled."""
    k = _scaled(_OREGO_K, 2, scale)

    def vector_field(t, y, args):
        s, q, w = k[0], k[1], k[2]
        return jnp.stack(
            [
                s * (y[1] - y[0] * y[1] + y[0] - q * y[0] * y[0]),
                (-y[1] - y[0] * y[1] + y[2]) / s,
                w * (y[0] - y[2]),
            ]
        )

    return vector_field


OREGO = StiffProblem(
    name="orego",
    field=orego_field,
    y0=np.array([1.0, 2.0, 3.0]),
    t1=360.0,
    reference=np.array(
        [0.1000814870318523e1, 0.1228178521549917e4, 0.1320554942846706e3]
    ),
    scaled="w",
)


# --- POLLU: air pollution model (pollu.f) ------------------------------------------

_POLLU_K = np.array(
    [
        0.35,
        26.6,
        1.23e4,
        8.6e-4,
        8.2e-4,
        1.5e4,
        1.3e-4,
        2.4e4,
        1.65e4,
        9.0e3,
        0.022,
        1.2e4,
        1.88,
        1.63e4,
        4.8e6,
        3.5e-4,
        0.0175,
        1.0e8,
        4.44e11,
        1.24e3,
        2.1,
        5.78,
        0.0474,
        1.78e3,
        3.12,
    ]
)


# Reaction j (1-based, as in pollu.f) has rate r_j = k_j y_a y_b over its reactant
# species (a, b); 0 stands for "no second reactant".
_POLLU_REACTANTS = np.array(
    [
        (1, 0), (2, 4), (5, 2), (7, 0), (7, 0), (7, 6), (9, 0), (9, 6), (11, 2),
        (11, 1), (13, 0), (10, 2), (14, 0), (1, 6), (3, 0), (4, 0), (4, 0), (16, 0),
        (16, 0), (17, 6), (19, 0), (19, 0), (1, 4), (19, 1), (20, 0),
    ]
)  # fmt: skip
# dy_i/dt = Σ (gains) r_j - Σ (losses) r_j, species i = 1 ... 20 (pollu.f's feval).
_POLLU_BALANCE = [
    ((2, 3, 9, 11, 12, 22, 25), (1, 10, 14, 23, 24)),
    ((1, 21), (2, 3, 9, 12)),
    ((1, 17, 19, 22), (15,)),
    ((15,), (2, 16, 17, 23)),
    ((4, 4, 6, 7, 13, 20), (3,)),
    ((3, 18, 18), (6, 8, 14, 20)),
    ((13,), (4, 5, 6)),
    ((4, 5, 6, 7), ()),
    ((), (7, 8)),
    ((7, 9), (12,)),
    ((8, 11), (9, 10)),
    ((9,), ()),
    ((10,), (11,)),
    ((12,), (13,)),
    ((14,), ()),
    ((16,), (18, 19)),
    ((), (20,)),
    ((20,), ()),
    ((23, 25), (21, 22, 24)),
    ((24,), (25,)),
]


def _pollu_stoichiometry() -> np.ndarray:
    out = np.zeros((20, 25))
    for i, (gains, losses) in enumerate(_POLLU_BALANCE):
        for j in gains:
            out[i, j - 1] += 1
        for j in losses:
            out[i, j - 1] -= 1
    return out


_POLLU_S = _pollu_stoichiometry()


def pollu_field(scale=1.0):
    """POLLU, with `k1 = 0.35` (the photolysis rate, index 0) scaled."""
    k = _scaled(_POLLU_K, 0, scale)
    first = _POLLU_REACTANTS[:, 0] - 1
    second = np.where(_POLLU_REACTANTS[:, 1] == 0, 20, _POLLU_REACTANTS[:, 1] - 1)

    def vector_field(t, y, args):
        padded = jnp.concatenate([y, jnp.ones((1,), y.dtype)])
        rates = k.astype(y.dtype) * padded[first] * padded[second]
        return jnp.asarray(_POLLU_S, y.dtype) @ rates

    return vector_field


_POLLU_Y0 = np.zeros(20)
_POLLU_Y0[[1, 3, 6, 7, 8, 16]] = [0.2, 0.04, 0.1, 0.3, 0.01, 0.007]

POLLU = StiffProblem(
    name="pollu",
    field=pollu_field,
    y0=_POLLU_Y0,
    t1=60.0,
    reference=np.array(
        [
            0.5646255480022769e-01,
            0.1342484130422339e00,
            0.4139734331099427e-08,
            0.5523140207484359e-02,
            0.2018977262302196e-06,
            0.1464541863493966e-06,
            0.7784249118997964e-01,
            0.3245075353396018e00,
            0.7494013383880406e-02,
            0.1622293157301561e-07,
            0.1135863833257075e-07,
            0.2230505975721359e-02,
            0.2087162882798630e-03,
            0.1396921016840158e-04,
            0.8964884856898295e-02,
            0.4352846369330103e-17,
            0.6899219696263405e-02,
            0.1007803037365946e-03,
            0.1772146513969984e-05,
            0.5682943292316392e-04,
        ]
    ),
    scaled="k1",
)

PROBLEMS = {p.name: p for p in (ROBER, HIRES, VDPOL, OREGO, POLLU)}

REFERENCE_NOTES = {
    "rober": "t1 = 1e5: SciPy 1.17.1 solve_ivp(method='Radau', rtol=1e-13, "
    "atol=1e-20) with the exact Jacobian (agrees with rtol=1e-12 to 9e-14 "
    "relative); the Test Set's own reference is at t1 = 1e11 (ROBER_1E11), which "
    "the same SciPy settings reproduce to 1e-14.",
    "hires": "Test Set hires.f solut (RADAU5, rtol = atol = 1.1e-18).",
    "vdpol": "Test Set vdpol.f solut (RADAU, rtol = atol = 1.1e-18), mu = 1e3.",
    "orego": "Test Set orego.f solut (RADAU, rtol = 1.1e-18, atol = 1.1e-40).",
    "pollu": "Test Set pollu.f solut (RADAU5, rtol = atol = 1.1e-18).",
}



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


def rober_blocks_field(params: dict) -> Callable:
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
        field=rober_blocks_field,
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


def large_problem(name: str) -> LargeProblem:
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
