"""Tableaux of the Rosenbrock (Rosenbrock-Wanner, ROW) methods, as plain NumPy data.

A ROW method with `s` stages, in its standard form (Hairer & Wanner, *Solving
Ordinary Differential Equations II*, IV.7, (7.4)), for a step of size `h` from
`(t0, y0)` with `J = ∂f/∂y(t0, y0)` and `f_t = ∂f/∂t(t0, y0)`:

    k_i = h f(t0 + α_i h, y0 + Σ_{j<i} α_ij k_j) + h J Σ_{j<=i} γ_ij k_j
          + γ_i h² f_t,                    y1 = y0 + Σ b_i k_i,

with `γ_ii = γ` for every stage, `α_i = Σ_j α_ij` and `γ_i = Σ_{j<=i} γ_ij`.

The step is computed in the transformed variables `u_i = Σ_j γ_ij k_j` (ibid.,
(7.25)), which need no product with `J`:

    (I - γ h J) u_i = γ h f(t0 + c_i h, y0 + Σ_{j<i} a_ij u_j)
                      + γ Σ_{j<i} C_ij u_j + γ d_i h² f_t,
    y1 = y0 + Σ m_i u_i,

with `a = α Γ⁻¹`, `C = diag(1/γ) - Γ⁻¹`, `m = b Γ⁻¹`, `c_i = α_i`, `d_i = γ_i`. One LU
factorisation of `I - γ h J` serves every stage.

`RosenbrockTableau` holds the transformed form (as the methods' authors publish it);
`RosenbrockTableau.standard()` recovers `(α, Γ, b, b̂)`, on which
`tests/solvers/test_rosenbrock.py` checks the order conditions of ROW methods.

Dense output: `y(t0 + θh) = y0 + Σ_i u_i Σ_p dense[i, p] θ**(p + 1)`; `dense` is
`None` for cubic Hermite interpolation.
"""

import dataclasses
import functools
from typing import Any

import numpy as np

from ._tableau import check, check_close, frozen


_check = functools.partial(check, "RosenbrockTableau")
_check_close = functools.partial(check_close, "RosenbrockTableau")


@dataclasses.dataclass(frozen=True, eq=False)
class RosenbrockTableau:
    """A Rosenbrock method in transformed form (see the module docstring).

    Arrays are float64 and read-only; equality and hashing go by identity (every
    tableau is a module-level constant).

    **Arguments:**

    - `gamma`: the diagonal `γ` of `Γ`.
    - `a`: `(s, s)` strictly lower triangular, the stages' arguments.
    - `C`: `(s, s)` strictly lower triangular, the stages' couplings.
    - `c`: `(s,)` the stages' times, `c[0] == 0`.
    - `d`: `(s,)` the coefficients of `h² f_t`, `d[0] == γ`.
    - `m`: `(s,)` weights of the propagated solution.
    - `m_err`: `(s,)` weights of the error estimate, `m - m̂` for the embedded
        solution `m̂`.
    - `order`, `embedded_order`: orders of `m` and `m̂`.
    - `dense`: `(s, p)` dense-output coefficients, or `None` (cubic Hermite).
    """

    gamma: float
    # The arrays: any array-likes, stored as read-only float64 arrays.
    a: Any
    C: Any
    c: Any
    d: Any
    m: Any
    m_err: Any
    order: int
    embedded_order: int
    dense: Any = None

    def __post_init__(self) -> None:
        for name in ("a", "C", "c", "d", "m", "m_err"):
            object.__setattr__(
                self, name, frozen(getattr(self, name), name, "RosenbrockTableau")
            )
        if self.dense is not None:
            object.__setattr__(
                self, "dense", frozen(self.dense, "dense", "RosenbrockTableau")
            )
        object.__setattr__(self, "gamma", float(self.gamma))
        s = self.num_stages
        _check(self.c.shape == (s,) and self.c[0] == 0, "c must be (s,), c[0] == 0")
        for name in ("a", "C"):
            arr = getattr(self, name)
            _check(arr.shape == (s, s), f"{name} must be ({s}, {s})")
            _check(not np.any(np.triu(arr)), f"{name} must be strictly lower")
        for name in ("d", "m", "m_err"):
            _check(getattr(self, name).shape == (s,), f"{name} must be ({s},)")
        _check(self.gamma > 0, "gamma must be positive")
        alpha, gamma_matrix, _, _ = self.standard()
        _check_close(alpha.sum(axis=1), self.c, "row sums of α = a Γ must equal c")
        _check_close(
            gamma_matrix.sum(axis=1), self.d, "row sums of Γ must equal d", tol=1e-10
        )
        if self.dense is not None:
            _check(self.dense.ndim == 2 and self.dense.shape[0] == s, "dense is (s, p)")
            _check_close(
                self.dense.sum(axis=1),
                self.m,
                "dense output at θ = 1 must equal m",
                tol=1e-10,
            )

    @property
    def num_stages(self) -> int:
        return self.c.shape[0]

    def standard(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The standard form `(α, Γ, b, b̂)` of the method (float64 arrays)."""
        s = self.num_stages
        gamma_matrix = np.linalg.inv(np.eye(s) / self.gamma - self.C)
        alpha = self.a @ gamma_matrix
        b = self.m @ gamma_matrix
        b_hat = (self.m - self.m_err) @ gamma_matrix
        return alpha, gamma_matrix, b, b_hat

    def dense_standard(self) -> np.ndarray | None:
        """The dense-output coefficients on the standard stages `k` (not `u`)."""
        if self.dense is None:
            return None
        _, gamma_matrix, _, _ = self.standard()
        return gamma_matrix.T @ self.dense


def from_standard(
    alpha, gamma_matrix, b, b_hat, order: int, embedded_order: int, dense=None
) -> RosenbrockTableau:
    """A `RosenbrockTableau` from the standard form `(α, Γ, b, b̂)`; `dense` (if
    given) holds the dense-output coefficients on the standard stages `k`."""
    alpha = np.asarray(alpha, np.float64)
    gamma_matrix = np.asarray(gamma_matrix, np.float64)
    inv = np.linalg.inv(gamma_matrix)
    gamma = float(gamma_matrix[0, 0])
    s = alpha.shape[0]
    b, b_hat = np.asarray(b, np.float64), np.asarray(b_hat, np.float64)
    return RosenbrockTableau(
        gamma=gamma,
        a=np.tril(alpha @ inv, -1),
        C=np.tril(np.eye(s) / gamma - inv, -1),
        c=alpha.sum(axis=1),
        d=gamma_matrix.sum(axis=1),
        m=b @ inv,
        m_err=(b - b_hat) @ inv,
        order=order,
        embedded_order=embedded_order,
        dense=None if dense is None else inv.T @ np.asarray(dense, np.float64),
    )


def _lower(rows) -> np.ndarray:
    """`(s, s)` strictly lower triangular matrix from rows 2 ... s."""
    s = len(rows) + 1
    out = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        out[i, : len(row)] = row
    return out


def _rodas_dense(m: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Dense coefficients of the Rodas family's interpolant

        y(θ) = (1 - θ) y0 + θ y1 + θ (1 - θ) (w_1 + θ w_2 + θ² w_3 + ...),
        w_r = Σ_j h[r - 1, j] u_j,

    written as `y0 + Σ_j u_j Σ_p dense[j, p] θ^(p+1)`."""
    r, s = h.shape
    dense = np.zeros((s, r + 1))
    dense[:, 0] = m + h[0]
    for p in range(1, r):
        dense[:, p] = h[p] - h[p - 1]
    dense[:, r] = -h[r - 1]
    return dense


# ---------------------------------------------------------------------------------
# Rosenbrock23: Shampine & Reichelt, "The MATLAB ODE suite", SIAM J. Sci. Comput.
# 18(1):1-22, 1997, section 3 (the formulas of MATLAB's ode23s). With d = 1/(2 + √2),
# e32 = 6 + √2, W = I - h d J:
#   W k1 = F0 + h d T,             F0 = f(t0, y0)
#   W (k2 - k1) = F1 - k1,         F1 = f(t0 + h/2, y0 + h k1 / 2)
#   y1 = y0 + h k2
#   W k3 = F2 - e32 (k2 - F1) - 2 (k1 - F0) + h d T,   F2 = f(t1, y1)
#   error = h (k1 - 2 k2 + k3) / 6 (the third-order solution minus y1);
#   y(t0 + θh) = y0 + h (θ(1 - θ) k1 + θ(θ - 2d) k2) / (1 - 2d).
# Substituting F1 - k1 = W (k2 - k1) and F0 = W k1 - h d T into the third stage gives
# the standard ROW form below (stages h k_i), which is what is stored.

_D = 1 / (2 + np.sqrt(2))
_E32 = 6 + np.sqrt(2)

ROSENBROCK23 = from_standard(
    alpha=[[0, 0, 0], [0.5, 0, 0], [0, 1, 0]],
    gamma_matrix=[[_D, 0, 0], [-_D, _D, 0], [_D * (_E32 - 2), -_D * _E32, _D]],
    b=[0, 1, 0],
    b_hat=np.array([0, 1, 0]) + np.array([1, -2, 1]) / 6,
    order=2,
    embedded_order=3,
    dense=np.array([[1, -1], [-2 * _D, 1], [0, 0]]) / (1 - 2 * _D),
)

# ---------------------------------------------------------------------------------
# ROS3P: J. Lang & J. Verwer, "ROS3P - an accurate third-order Rosenbrock solver
# designed for parabolic problems", BIT 41(4):731-738, 2001, Table 5.1 (transformed
# form). γ = 1/2 + √3/6. Dense output: cubic Hermite.

ROS3P = RosenbrockTableau(
    gamma=7.886751345948129e-01,
    a=_lower([[1.267949192431123e00], [1.267949192431123e00, 0.0]]),
    C=_lower([[-1.607695154586736e00], [-3.464101615137755e00, -1.732050807568877e00]]),
    c=[0.0, 1.0, 1.0],
    d=[7.886751345948129e-01, -2.113248654051871e-01, -1.077350269189626e00],
    m=[2.0, 5.773502691896258e-01, 4.226497308103742e-01],
    m_err=np.array([2.0, 5.773502691896258e-01, 4.226497308103742e-01])
    - np.array([2.113248654051871e00, 1.0, 4.226497308103742e-01]),
    order=3,
    embedded_order=2,
)

# ---------------------------------------------------------------------------------
# Rodas4: E. Hairer & G. Wanner, Solving Ordinary Differential Equations II, 2nd ed.,
# Springer 1996, IV.7 (RODAS, Table 7.2), the coefficients of their code RODAS
# (rodas.f, METH = 1), including its third-order dense output (H21 ... H35).
# Stiffly accurate: stage 5 is evaluated at y0 + Σ a_5j u_j, stage 6 at that plus
# u_5, and y1 = that plus u_6; the error estimate is u_6.

_RODAS4_A5 = [
    1.221224509226641,
    6.019134481288629,
    12.53708332932087,
    -0.6878860361058950,
]
_RODAS4_H = np.array(
    [
        [
            10.12623508344586,
            -7.487995877610167,
            -34.80091861555747,
            -7.992771707568823,
            1.025137723295662,
            0.0,
        ],
        [
            -0.6762803392801253,
            6.087714651680015,
            16.43084320892478,
            24.76722511418386,
            -6.594389125716872,
            0.0,
        ],
    ]
)
_RODAS4_M = np.array(_RODAS4_A5 + [1.0, 1.0])

RODAS4 = RosenbrockTableau(
    gamma=0.25,
    a=_lower(
        [
            [1.544000000000000],
            [0.9466785280815826, 0.2557011698983284],
            [3.314825187068521, 2.896124015972201, 0.9986419139977817],
            _RODAS4_A5,
            _RODAS4_A5 + [1.0],
        ]
    ),
    C=_lower(
        [
            [-5.668800000000000],
            [-2.430093356833875, -0.2063599157091915],
            [-0.1073529058151375, -9.594562251023355, -20.47028614809616],
            [
                7.496443313967647,
                -10.24680431464352,
                -33.99990352819905,
                11.70890893206160,
            ],
            [
                8.083246795921522,
                -7.981132988064893,
                -31.52159432874371,
                16.31930543123136,
                -6.058818238834054,
            ],
        ]
    ),
    c=[0.0, 0.386, 0.21, 0.63, 1.0, 1.0],
    d=[0.25, -0.1043, 0.1035, -0.0362, 0.0, 0.0],
    m=_RODAS4_M,
    m_err=[0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    order=4,
    embedded_order=3,
    dense=_rodas_dense(_RODAS4_M, _RODAS4_H),
)

# ---------------------------------------------------------------------------------
# Rodas5P: G. Steinebach, "Construction of Rosenbrock-Wanner method Rodas5P and
# numerical benchmarks within the Julia Differential Equations package", BIT Numer.
# Math. 63:27, 2023, doi:10.1007/s10543-023-00967-x (its coefficients are published
# in transformed form, as they appear in Julia's OrdinaryDiffEq `Rodas5PTableau`),
# with the dense output of fourth order (H2*, H3*, H4*). Stiffly accurate: stage 7
# is evaluated at y0 + Σ a_6j u_j + u_6, stage 8 at that plus u_7, and y1 = that
# plus u_8; the error estimate is u_8.

_RODAS5P_A6 = [
    -7.502846399306121,
    2.561846144803919,
    -11.627539656261098,
    -0.18268767659942256,
    0.030198172008377946,
]
_RODAS5P_H = np.array(
    [
        [
            25.948786856663858,
            -2.5579724845846235,
            10.433815404888879,
            -2.3679251022685204,
            0.524948541321073,
            1.1241088310450404,
            0.4272876194431874,
            -0.17202221070155493,
        ],
        [
            -9.91568850695171,
            -0.9689944594115154,
            3.0438037242978453,
            -24.495224566215796,
            20.176138334709044,
            15.98066361424651,
            -6.789040303419874,
            -6.710236069923372,
        ],
        [
            11.419903575922262,
            2.8879645146136994,
            72.92137995996029,
            80.12511834622643,
            -52.072871366152654,
            -59.78993625266729,
            -0.15582684282751913,
            4.883087185713722,
        ],
    ]
)
_RODAS5P_M = np.array(_RODAS5P_A6 + [1.0, 1.0, 1.0])

RODAS5P = RosenbrockTableau(
    gamma=0.21193756319429014,
    a=_lower(
        [
            [3.0],
            [2.849394379747939, 0.45842242204463923],
            [-6.954028509809101, 2.489845061869568, -10.358996098473584],
            [
                2.8029986275628964,
                0.5072464736228206,
                -0.3988312541770524,
                -0.04721187230404641,
            ],
            _RODAS5P_A6,
            _RODAS5P_A6 + [1.0],
            _RODAS5P_A6 + [1.0, 1.0],
        ]
    ),
    C=_lower(
        [
            [-14.155112264123755],
            [-17.97296035885952, -2.859693295451294],
            [147.12150275711716, -1.41221402718213, 71.68940251302358],
            [
                165.43517024871676,
                -0.4592823456491126,
                42.90938336958603,
                -5.961986721573306,
            ],
            [
                24.854864614690072,
                -3.0009227002832186,
                47.4931110020768,
                5.5814197821558125,
                -0.6610691825249471,
            ],
            [
                30.91273214028599,
                -3.1208243349937974,
                77.79954646070892,
                34.28646028294783,
                -19.097331116725623,
                -28.087943162872662,
            ],
            [
                37.80277123390563,
                -3.2571969029072276,
                112.26918849496327,
                66.9347231244047,
                -40.06618937091002,
                -54.66780262877968,
                -9.48861652309627,
            ],
        ]
    ),
    c=[
        0.0,
        0.6358126895828704,
        0.4095798393397535,
        0.9769306725060716,
        0.4288403609558664,
        1.0,
        1.0,
        1.0,
    ],
    d=[
        0.21193756319429014,
        -0.42387512638858027,
        -0.3384627126235924,
        1.8046452872882734,
        2.325825639765069,
        0.0,
        0.0,
        0.0,
    ],
    m=_RODAS5P_M,
    m_err=[0.0] * 7 + [1.0],
    order=5,
    embedded_order=4,
    dense=_rodas_dense(_RODAS5P_M, _RODAS5P_H),
)
