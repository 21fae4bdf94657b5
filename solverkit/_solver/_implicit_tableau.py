"""Tableaux of the diagonally implicit (ESDIRK) and additive IMEX Runge--Kutta
methods, as plain NumPy data.

Conventions for a step of size `h` from `(t0, y0)` with `s` stages. Each stage `i`
solves, for its value `z_i`,

    z_i = y0 + h Σ_{j<i} (a_ex[i, j] kE_j + a_im[i, j] kI_j) + h a_im[i, i] kI_i,

with `kI_j = f_implicit(t0 + c[j] h, z_j)` and `kE_j = f_explicit(t0 + c[j] h, z_j)`
(for a purely implicit method `a_ex` is `None` and `f_implicit` is the whole field).
Then `y1 = y0 + h Σ_i (b_ex[i] kE_i + b_im[i] kI_i)`, and the error estimate is
`h Σ_i (b_err_ex[i] kE_i + b_err_im[i] kI_i)`. Stage 0 is explicit
(`a_im[0, 0] == 0`, `c[0] == 0`), so `kI_0 = f(t0, y0)` comes from the previous step.

The initial guess of a stage's Newton iteration is `kI_i ≈ Σ_{j<i} predictor[i, j]
kI_j`: linear interpolation (or extrapolation) in `c` through the two earlier stages
closest in `c` (see `_predictor`).

Every tableau is checked when built; `tests/solvers/test_implicit.py` checks the order
conditions (B-series, and the coupling conditions of the additive methods).
"""

import dataclasses
import functools
from typing import Any

import numpy as np

from ._tableau import check_close, frozen


_TOL = 1e-10
_check_close = functools.partial(check_close, "ImplicitTableau", tol=_TOL)


def _predictor(c: np.ndarray) -> np.ndarray:
    """Rows of the Newton initial guess `kI_i ≈ Σ_j p[i, j] kI_j` (see module doc)."""
    s = c.shape[0]
    p = np.zeros((s, s))
    for i in range(1, s):
        if i == 1:
            p[1, 0] = 1.0
            continue
        order = sorted(range(i), key=lambda j: (abs(c[j] - c[i]), -j))
        j = order[0]
        if abs(c[j] - c[i]) < 1e-14:  # a stage at the same time: copy it
            p[i, j] = 1.0
            continue
        others = [m for m in order[1:] if abs(c[m] - c[j]) > 1e-14]
        if not others:
            p[i, j] = 1.0
            continue
        m = others[0]
        theta = (c[i] - c[j]) / (c[m] - c[j])
        if abs(theta) > 2.5:  # too far an extrapolation: hold the nearest value
            p[i, j] = 1.0
            continue
        p[i, j] = 1.0 - theta
        p[i, m] = theta
    return p


@dataclasses.dataclass(frozen=True, eq=False)
class ImplicitTableau:
    """An ESDIRK method, or an additive (IMEX) pair with an ESDIRK implicit part.

    Equality and hashing go by identity (each tableau is a module-level constant).

    **Arguments:**

    - `c`: `(s,)` nodes, `c[0] == 0`.
    - `a_im`: `(s, s)` lower triangular implicit coefficients, `a_im[0, 0] == 0`.
    - `b_im`: `(s,)` implicit weights.
    - `b_err_im`: `(s,)` implicit error weights `b_im - b_hat_im`.
    - `order`, `embedded_order`: orders of the solution and of the embedded method.
    - `a_ex`, `b_ex`, `b_err_ex`: the explicit part of an additive method (strictly
        lower triangular `a_ex`); `None` for an implicit method.
    - `stage_order_c`: whether the rows of `a_ex` must also sum to `c` (always true
        here; kept as a check).

    **Raises:**

    `ValueError` naming the first inconsistency found.
    """

    # The arrays: any array-likes, stored as read-only float64 arrays.
    c: Any
    a_im: Any
    b_im: Any
    b_err_im: Any
    order: int
    embedded_order: int
    a_ex: Any = None
    b_ex: Any = None
    b_err_ex: Any = None
    predictor: np.ndarray = dataclasses.field(init=False, repr=False)  # `_predictor`

    def __post_init__(self) -> None:
        for name in ("c", "a_im", "b_im", "b_err_im", "a_ex", "b_ex", "b_err_ex"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, frozen(value, name, "ImplicitTableau"))
        s = self.c.shape[0]
        for name, shape in (("a_im", (s, s)), ("b_im", (s,)), ("b_err_im", (s,))):
            if getattr(self, name).shape != shape:
                raise ValueError(f"ImplicitTableau.{name} must have shape {shape}.")
        if self.c[0] != 0 or self.a_im[0, 0] != 0:
            raise ValueError("ImplicitTableau: stage 0 must be explicit at t0.")
        if np.any(np.triu(self.a_im, k=1) != 0):
            raise ValueError("ImplicitTableau.a_im must be lower triangular.")
        if np.any(self.a_im.diagonal()[1:] <= 0):
            raise ValueError("ImplicitTableau: the diagonal of a_im must be > 0.")
        _check_close(self.a_im.sum(axis=1), self.c, "rows of a_im must sum to c")
        _check_close(self.b_im.sum(), 1.0, "b_im must sum to 1")
        _check_close(self.b_err_im.sum(), 0.0, "b_err_im must sum to 0")
        if not 1 <= self.embedded_order < self.order or self.order < 1:
            if not (self.order == 1 and self.embedded_order == 1):
                raise ValueError("ImplicitTableau: bad order / embedded_order.")
        if (self.a_ex is None) != (self.b_ex is None) or (self.a_ex is None) != (
            self.b_err_ex is None
        ):
            raise ValueError("ImplicitTableau: give all of a_ex, b_ex, b_err_ex.")
        if self.a_ex is not None:
            assert self.b_ex is not None and self.b_err_ex is not None
            if self.a_ex.shape != (s, s) or np.any(np.triu(self.a_ex) != 0):
                raise ValueError("ImplicitTableau.a_ex must be strictly lower (s, s).")
            _check_close(self.a_ex.sum(axis=1), self.c, "rows of a_ex must sum to c")
            _check_close(self.b_ex.sum(), 1.0, "b_ex must sum to 1")
            _check_close(self.b_err_ex.sum(), 0.0, "b_err_ex must sum to 0")
        object.__setattr__(
            self,
            "predictor",
            frozen(_predictor(self.c), "predictor", "ImplicitTableau"),
        )

    @property
    def num_stages(self) -> int:
        return self.c.shape[0]

    @property
    def imex(self) -> bool:
        return self.a_ex is not None

    @property
    def stiffly_accurate(self) -> bool:
        """Whether `y1` is the last stage's value (implicit method, `a_im[-1] == b`)."""
        return not self.imex and self.implicit_stiffly_accurate

    @property
    def implicit_stiffly_accurate(self) -> bool:
        """Whether the implicit tableau alone is stiffly accurate (`c[-1] == 1`,
        `a_im[-1] == b_im`): then the last stage's slope `kI_{s-1}` is the implicit
        field at the last stage's value, to the Newton residual divided by `γh`."""
        return self.c[-1] == 1 and bool(
            np.all(np.abs(self.a_im[-1] - self.b_im) < 1e-15)
        )

    @property
    def diagonals(self) -> tuple[float, ...]:
        """The distinct diagonal values of the implicit stages (one LU each)."""
        return tuple(sorted({float(g) for g in self.a_im.diagonal()[1:]}))


def _lower(rows, diagonal) -> np.ndarray:
    """`(s, s)` lower triangular matrix from rows 1 ... s-1 below the diagonal and the
    diagonal values of rows 1 ... s-1."""
    s = len(rows) + 1
    a = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        a[i, : len(row)] = row
        a[i, i] = diagonal[i - 1] if np.ndim(diagonal) else diagonal
    return a


def _strict(rows) -> np.ndarray:
    s = len(rows) + 1
    a = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        a[i, : len(row)] = row
    return a


def _root_near(coeffs, guess: float) -> float:
    """The real root of the polynomial (highest power first) nearest `guess`, to the
    last bit (Newton polish of `np.roots`)."""
    roots = np.roots(coeffs)
    x = float(roots[np.argmin(np.abs(roots - guess))].real)
    for _ in range(3):
        x -= np.polyval(coeffs, x) / np.polyval(np.polyder(coeffs), x)
    return x


# ---------------------------------------------------------------------------------
# Implicit Euler: z1 = y0 + h f(t0 + h, z1); the error estimate is the difference to
# the trapezoidal rule (with the stage values at hand), `h/2 (f(z1) - f(y0))`.

IMPLICIT_EULER = ImplicitTableau(
    c=[0.0, 1.0],
    a_im=_lower([[0.0]], 1.0),
    b_im=[0.0, 1.0],
    b_err_im=[-0.5, 0.5],
    order=1,
    embedded_order=1,
)


# ---------------------------------------------------------------------------------
# Kværnø, "Singly diagonally implicit Runge-Kutta methods with an explicit first
# stage", BIT Numer. Math. 44 (2004) 489-502. Stiffly accurate ESDIRK pairs: the
# last stage is the solution, the one before it the embedded method (also stiffly
# accurate), so the error estimate is the difference of the last two stages.


def _kvaerno(rows, gamma, c, order) -> ImplicitTableau:
    a = _lower(rows, gamma)
    b = a[-1].copy()
    b_err = b - a[-2]
    return ImplicitTableau(
        c=c, a_im=a, b_im=b, b_err_im=b_err, order=order, embedded_order=order - 1
    )


def _kvaerno3() -> ImplicitTableau:
    # Method 3/2 (4 stages). γ is the root of 6γ³ - 18γ² + 9γ - 1 near 0.4359
    # (L-stability), printed as 0.43586652150 in the paper.
    g = _root_near([6.0, -18.0, 9.0, -1.0], 0.4358665215)
    a31 = (-4 * g**2 + 6 * g - 1) / (4 * g)
    a32 = (-2 * g + 1) / (4 * g)
    a41 = (6 * g - 1) / (12 * g)
    a42 = -1 / ((24 * g - 12) * g)
    a43 = (-6 * g**2 + 6 * g - 1) / (6 * g - 3)
    rows = [[g], [a31, a32], [a41, a42, a43]]
    return _kvaerno(rows, g, [0.0, 2 * g, 1.0, 1.0], 3)


def _kvaerno4() -> ImplicitTableau:
    # Method 4/3 (5 stages), the variant that advances with the 4th-order last
    # stage; γ ≈ 0.5728160625 is the root of 24γ⁴ - 96γ³ + 72γ² - 16γ + 1 making it
    # L-stable (the paper prints 0.5728160625).
    g = _root_near([24.0, -96.0, 72.0, -16.0, 1.0], 0.5728160625)

    def poly(*coeffs):
        return np.polyval(coeffs, g)

    q = poly(12, -6, 1)
    a31 = poly(144, -180, 81, -15, 1) * g / q**2
    a32 = poly(-36, 39, -15, 2) * g / q**2
    a41 = poly(-144, 396, -330, 117, -18, 1) / (12 * g**2 * poly(12, -9, 2))
    a42 = poly(72, -126, 69, -15, 1) / (12 * g**2 * poly(3, -1))
    a43 = (poly(-6, 6, -1) * q**2) / (12 * g**2 * poly(12, -9, 2) * poly(3, -1))
    a51 = poly(288, -312, 120, -18, 1) / (48 * g**2 * poly(12, -9, 2))
    a52 = poly(24, -12, 1) / (48 * g**2 * poly(3, -1))
    a53 = -(q**3) / (48 * g**2 * poly(3, -1) * poly(12, -9, 2) * poly(6, -6, 1))
    a54 = poly(-24, 36, -12, 1) / poly(24, -24, 4)
    rows = [[g], [a31, a32], [a41, a42, a43], [a51, a52, a53, a54]]
    c = [0.0, 2 * g, g + a31 + a32, 1.0, 1.0]
    return _kvaerno(rows, g, c, 4)


def _kvaerno5() -> ImplicitTableau:
    # Method 5/4 (7 stages), γ = 0.26, coefficients as printed in the paper (Table
    # of the 5/4 pair; also published in OrdinaryDiffEq.jl's SDIRK tableaux).
    g = 0.26
    rows = [
        [g],
        [0.13, 0.84033320996790809],
        [0.22371961478320505, 0.47675532319799699, -0.06470895363112615],
        [
            0.16648564323248321,
            0.10450018841591720,
            0.03631482272098715,
            -0.13090704451073998,
        ],
        [
            0.13855640231268224,
            0.0,
            -0.04245337201752043,
            0.02446657898003141,
            0.61943039072480676,
        ],
        [
            0.13659751177640291,
            0.0,
            -0.05496908796538376,
            -0.04118626728321046,
            0.62993304899016403,
            0.06962479448202728,
        ],
    ]
    c = _lower(rows, g).sum(axis=1)
    c[-2:] = 1.0  # the last two stages are at t0 + h (to rounding in the paper)
    return _kvaerno(rows, g, c, 5)


KVAERNO3 = _kvaerno3()
KVAERNO4 = _kvaerno4()
KVAERNO5 = _kvaerno5()


# ---------------------------------------------------------------------------------
# Additive (IMEX) methods: an explicit tableau for the non-stiff term and an ESDIRK
# tableau for the stiff term, on the same nodes.
#
# Kennedy & Carpenter, "Additive Runge-Kutta schemes for convection-diffusion-reaction
# equations", Appl. Numer. Math. 44 (2003) 139-181: ARK3(2)4L[2]SA (Table 3 of the
# paper's appendix), ARK4(3)6L[2]SA and ARK5(4)8L[2]SA, with the weights `b` shared by
# both parts and the embedded weights `b_hat` of the paper. (The later
# ARK5(4)8L[2]SAb of Kennedy & Carpenter 2019 is not used: KenCarp5 is the 2003
# method, as in diffrax.)


def _ark(gamma, c, a_ex_rows, a_im_rows, b, b_hat, order) -> ImplicitTableau:
    b, b_hat = np.asarray(b), np.asarray(b_hat)
    return ImplicitTableau(
        c=np.concatenate([[0.0], c]),
        a_im=_lower(list(a_im_rows) + [b[:-1]], gamma),
        b_im=b,
        b_err_im=b - b_hat,
        order=order,
        embedded_order=order - 1,
        a_ex=_strict(a_ex_rows),
        b_ex=b,
        b_err_ex=b - b_hat,
    )


def _kencarp3() -> ImplicitTableau:
    g = 1767732205903 / 4055673282236
    b = [
        1471266399579 / 7840856788654,
        -4482444167858 / 7529755066697,
        11266239266428 / 11593286722821,
        g,
    ]
    b_hat = [
        2756255671327 / 12835298489170,
        -10771552573575 / 22201958757719,
        9247589265047 / 10645013368117,
        2193209047091 / 5459859503100,
    ]
    a_ex = [
        [2 * g],
        [5535828885825 / 10492691773637, 788022342437 / 10882634858940],
        [
            6485989280629 / 16251701735622,
            -4246266847089 / 9704473918619,
            10755448449292 / 10357097424841,
        ],
    ]
    a_im = [[g], [2746238789719 / 10658868560708, -640167445237 / 6845629431997]]
    return _ark(g, [2 * g, 3 / 5, 1.0], a_ex, a_im, b, b_hat, 3)


def _kencarp4() -> ImplicitTableau:
    g = 1 / 4
    b = [82889 / 524892, 0, 15625 / 83664, 69875 / 102672, -2260 / 8211, g]
    b_hat = [
        4586570599 / 29645900160,
        0,
        178811875 / 945068544,
        814220225 / 1159782912,
        -3700637 / 11593932,
        61727 / 225920,
    ]
    a_ex = [
        [1 / 2],
        [13861 / 62500, 6889 / 62500],
        [
            -116923316275 / 2393684061468,
            -2731218467317 / 15368042101831,
            9408046702089 / 11113171139209,
        ],
        [
            -451086348788 / 2902428689909,
            -2682348792572 / 7519795681897,
            12662868775082 / 11960479115383,
            3355817975965 / 11060851509271,
        ],
        [
            647845179188 / 3216320057751,
            73281519250 / 8382639484533,
            552539513391 / 3454668386233,
            3354512671639 / 8306763924573,
            4040 / 17871,
        ],
    ]
    a_im = [
        [g],
        [8611 / 62500, -1743 / 31250],
        [5012029 / 34652500, -654441 / 2922500, 174375 / 388108],
        [
            15267082809 / 155376265600,
            -71443401 / 120774400,
            730878875 / 902184768,
            2285395 / 8070912,
        ],
    ]
    c = [1 / 2, 83 / 250, 31 / 50, 17 / 20, 1.0]
    return _ark(g, c, a_ex, a_im, b, b_hat, 4)


def _kencarp5() -> ImplicitTableau:
    """KenCarp5's pair of tableaux (long only because it is the coefficient table of
    an eight-stage additive method)."""
    g = 41 / 200
    b = [
        -872700587467 / 9133579230613,
        0,
        0,
        22348218063261 / 9555858737531,
        -1143369518992 / 8141816002931,
        -39379526789629 / 19018526304540,
        32727382324388 / 42900044865799,
        g,
    ]
    b_hat = [
        -975461918565 / 9796059967033,
        0,
        0,
        78070527104295 / 32432590147079,
        -548382580838 / 3424219808633,
        -33438840321285 / 15594753105479,
        3629800801594 / 4656183773603,
        4035322873751 / 18575991585200,
    ]
    a_ex = [
        [41 / 100],
        [367902744464 / 2072280473677, 677623207551 / 8224143866563],
        [1268023523408 / 10340822734521, 0, 1029933939417 / 13636558850479],
        [
            14463281900351 / 6315353703477,
            0,
            66114435211212 / 5879490589093,
            -54053170152839 / 4284798021562,
        ],
        [
            14090043504691 / 34967701212078,
            0,
            15191511035443 / 11219624916014,
            -18461159152457 / 12425892160975,
            -281667163811 / 9011619295870,
        ],
        [
            19230459214898 / 13134317526959,
            0,
            21275331358303 / 2942455364971,
            -38145345988419 / 4862620318723,
            -1 / 8,
            -1 / 8,
        ],
        [
            -19977161125411 / 11928030595625,
            0,
            -40795976796054 / 6384907823539,
            177454434618887 / 12078138498510,
            782672205425 / 8267701900261,
            -69563011059811 / 9646580694205,
            7356628210526 / 4942186776405,
        ],
    ]
    a_im = [
        [g],
        [41 / 400, -567603406766 / 11931857230679],
        [683785636431 / 9252920307686, 0, -110385047103 / 1367015193373],
        [
            3016520224154 / 10081342136671,
            0,
            30586259806659 / 12414158314087,
            -22760509404356 / 11113319521817,
        ],
        [
            218866479029 / 1489978393911,
            0,
            638256894668 / 5436446318841,
            -1179710474555 / 5321154724896,
            -60928119172 / 8023461067671,
        ],
        [
            1020004230633 / 5715676835656,
            0,
            25762820946817 / 25263940353407,
            -2161375909145 / 9755907335909,
            -211217309593 / 5846859502534,
            # (The paper's denominator; diffrax 0.7.2 has 7827059040719, which
            # leaves the order conditions 2e-12 off.)
            -4269925059573 / 7827059040749,
        ],
    ]
    c = [
        41 / 100,
        2935347310677 / 11292855782101,
        1426016391358 / 7196633302097,
        92 / 100,
        24 / 100,
        3 / 5,
        1.0,
    ]
    return _ark(g, c, a_ex, a_im, b, b_hat, 5)


def _sil3() -> ImplicitTableau:
    # Whitaker & Kar, "Implicit-explicit Runge-Kutta methods for fast-slow wave
    # problems", Mon. Weather Rev. 141 (2013) 3426-3434: third order in the explicit
    # term, second in the implicit one; the diagonal is not constant (three LUs per
    # step). The error estimate is an embedded first-order pair (Heun-like), as in
    # diffrax.
    return ImplicitTableau(
        c=[0.0, 1 / 3, 2 / 3, 1.0],
        a_im=_lower(
            [[1 / 6], [1 / 3, 0.0], [3 / 8, 0.0, 3 / 8]], [1 / 6, 1 / 3, 1 / 4]
        ),
        b_im=[3 / 8, 0.0, 3 / 8, 1 / 4],
        b_err_im=[1 / 8, 0.0, -3 / 8, 1 / 4],
        order=2,
        embedded_order=1,
        a_ex=_strict([[1 / 3], [1 / 6, 1 / 2], [1 / 2, -1 / 2, 1.0]]),
        b_ex=[1 / 2, -1 / 2, 1.0, 0.0],
        b_err_ex=[0.0, 1 / 2, -1.0, 1 / 2],
    )


KENCARP3 = _kencarp3()
KENCARP4 = _kencarp4()
KENCARP5 = _kencarp5()
SIL3 = _sil3()
