"""Butcher tableaux of the explicit Runge--Kutta methods, as plain NumPy data.

One generic step function reads these; nothing here depends on JAX. Every tableau is
checked when it is built (`ButcherTableau.__post_init__`), and
`tests/solvers/test_tableau.py` proves the orders (order conditions on rooted trees, and
observed convergence).

Conventions, for a step of size `h` from `(t0, y0)` with stages `k_0 ... k_{s-1}`:

- `k_i = f(t0 + c[i] h, y0 + h Σ_j a[i, j] k_j)`, `y1 = y0 + h Σ_i b[i] k_i`;
- the error estimate is `h Σ_i b_err[i] k_i`, with `b_err = b - b_hat` for the
  embedded method `b_hat` (its sign never matters to a norm);
- dense output: `y(t0 + θh) = y0 + h Σ_i k_i Σ_j dense[i, j] θ**(j + 1)`.

The error estimates are the ones diffrax uses for the solver of the same name, so
step sequences agree with diffrax at equal tolerances. `DOPRI8` is the method diffrax
calls Dopri8 (Prince--Dormand RK8(7)13M).
"""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
from numpy.polynomial import polynomial as npoly


_TOL = 1e-12


def frozen(x: object, name: str, owner: str = "ButcherTableau") -> np.ndarray:
    """`x` as a read-only float64 array, checked finite (`owner.name` in the error):
    the coefficient arrays of every tableau class."""
    arr = np.array(x, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{owner}.{name} must be finite.")
    arr.setflags(write=False)
    return arr


def check(owner: str, ok: bool, what: str) -> None:
    """Raise `ValueError("owner: what.")` unless `ok`: the checks of every tableau
    class."""
    if not ok:
        raise ValueError(f"{owner}: {what}.")


def check_close(
    owner: str,
    value: np.ndarray | float,
    target: np.ndarray | float,
    what: str,
    tol: float = _TOL,
) -> None:
    """`check` that `value` equals `target` to within `tol`, elementwise."""
    err = float(np.max(np.abs(np.asarray(value) - target), initial=0.0))
    check(owner, err <= tol, f"{what} (off by {err:.3g})")


def _optionalfrozen(x: object, name: str) -> np.ndarray | None:
    return None if x is None else frozen(x, name)


def _check_shape(arr: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    if arr.shape != shape:
        raise ValueError(
            f"ButcherTableau.{name} has shape {arr.shape}; expected {shape}."
        )


_check_close = functools.partial(check_close, "ButcherTableau")


@dataclasses.dataclass(frozen=True)
class ButcherTableau:
    """An explicit Runge--Kutta method, with its error estimate and dense output.

    Arrays are float64 and read-only. Equality and hashing go by value, so a tableau
    can be static data of a jitted function.

    **Arguments:**

    - `c`: `(s,)` nodes, `c[0] == 0`.
    - `a`: `(s, s)` strictly lower triangular stage coefficients, row sums `c`.
    - `b`: `(s,)` weights of the propagated solution, summing to 1.
    - `b_err`: `(s,)` weights of the error estimate, `b - b_hat` for the embedded
        method `b_hat`; `None` if the method has none.
    - `order`: order of the propagated solution.
    - `embedded_order`: order of `b_hat`; `None` exactly when `b_err` is.
    - `fsal`: whether the last stage is `f(t0 + h, y1)` (`c[-1] == 1`,
        `a[-1] == b`), so that it is the next step's `k_0`.
    - `dense`: `(s, d)` coefficients of the dense output polynomial (see the
        module docstring); `None` to let the caller use cubic Hermite interpolation.

    **Raises:**

    `ValueError` naming the first inconsistency found.
    """

    c: np.ndarray
    a: np.ndarray
    b: np.ndarray
    b_err: np.ndarray | None
    order: int
    embedded_order: int | None
    fsal: bool
    dense: np.ndarray | None

    def __post_init__(self) -> None:
        for name in ("c", "a", "b"):
            object.__setattr__(self, name, frozen(getattr(self, name), name))
        for name in ("b_err", "dense"):
            value = _optionalfrozen(getattr(self, name), name)
            object.__setattr__(self, name, value)
        self._check_main()
        self._check_error_estimate()
        self._check_fsal()
        self._check_dense()

    @property
    def num_stages(self) -> int:
        """Number of main stages `s` (a FSAL stage included)."""
        return self.c.shape[0]

    def _check_main(self) -> None:
        if self.c.ndim != 1 or self.c.shape[0] < 1:
            raise ValueError("ButcherTableau.c must be a non-empty 1-D array.")
        s = self.c.shape[0]
        _check_shape(self.a, (s, s), "a")
        _check_shape(self.b, (s,), "b")
        if self.c[0] != 0:
            raise ValueError("ButcherTableau.c[0] must be 0 for an explicit method.")
        if np.any(np.triu(self.a) != 0):
            raise ValueError(
                "ButcherTableau.a must be strictly lower triangular (explicit method)."
            )
        _check_close(self.a.sum(axis=1), self.c, "row sums of `a` must equal `c`")
        _check_close(self.b.sum(), 1.0, "`b` must sum to 1")
        if isinstance(self.order, bool) or not isinstance(self.order, int):
            raise ValueError("ButcherTableau.order must be an int.")
        if self.order < 1:
            raise ValueError("ButcherTableau.order must be at least 1.")

    def _check_error_estimate(self) -> None:
        if (self.b_err is None) != (self.embedded_order is None):
            raise ValueError(
                "ButcherTableau.b_err and embedded_order must both be given or both "
                "be None."
            )
        if self.b_err is None or self.embedded_order is None:
            return
        _check_shape(self.b_err, self.b.shape, "b_err")
        _check_close(self.b_err.sum(), 0.0, "`b_err = b - b_hat` must sum to 0")
        order = self.embedded_order
        if isinstance(order, bool) or not isinstance(order, int):
            raise ValueError("ButcherTableau.embedded_order must be an int.")
        if not 1 <= order < self.order:
            raise ValueError(
                f"ButcherTableau.embedded_order must be in [1, order); got {order}."
            )

    def _check_fsal(self) -> None:
        if not self.fsal:
            return
        if self.c[-1] != 1:
            raise ValueError("A FSAL tableau needs c[-1] == 1.")
        _check_close(self.a[-1], self.b, "a FSAL tableau needs a[-1] == b")
        if self.b[-1] != 0:
            raise ValueError("A FSAL tableau needs b[-1] == 0.")

    def _check_dense(self) -> None:
        s = self.num_stages
        if self.dense is None:
            return
        if self.dense.ndim != 2 or self.dense.shape[0] != s:
            raise ValueError(
                f"ButcherTableau.dense has shape {self.dense.shape}; expected "
                f"({s}, degree)."
            )
        _check_close(
            self.dense.sum(axis=1), self.b, "dense output at θ=1 must reproduce `b`"
        )
        # Consistency (order 1): Σ_i b_i(θ) = θ for every θ.
        power_one = np.zeros(self.dense.shape[1])
        power_one[0] = 1.0
        _check_close(self.dense.sum(axis=0), power_one, "dense weights must sum to θ")

    def _key(self) -> tuple:
        arrays = (self.c, self.a, self.b, self.b_err, self.dense)
        return (
            tuple(None if x is None else (x.shape, x.tobytes()) for x in arrays),
            self.order,
            self.embedded_order,
            self.fsal,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ButcherTableau):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


# ---------------------------------------------------------------------------------
# Helpers to write tableaux the way papers print them.


def _lower(rows: Sequence[Sequence[float] | np.ndarray]) -> np.ndarray:
    """`(s, s)` strictly lower triangular matrix from rows 1 ... s-1 (row i has at
    most i entries)."""
    s = len(rows) + 1
    a = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        if len(row) > i:
            raise ValueError(f"Row {i} of a has {len(row)} entries; at most {i}.")
        a[i, : len(row)] = row
    return a


def _pad(x: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[: len(x)] = x
    return out


def _match_endpoint(dense: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Absorb the rounding of a dense output into its top power, so that its value
    at θ = 1 is `b` (padded with zeros) to the last bit."""
    dense = dense.copy()
    dense[:, -1] += _pad(b, dense.shape[0]) - dense.sum(axis=1)
    return dense


def _hermite_nested_dense(
    b: np.ndarray, last: int, tail: Sequence[np.ndarray], n: int
) -> np.ndarray:
    """Monomial coefficients of Hairer's nested dense output.

    The interpolant is `y0 + θ(F0 + (1-θ)(F1 + θ(F2 + (1-θ)(F3 + θ(F4 + ...)))))` with
    `F0 = y1 - y0`, `F1 = h k_0 - F0`, `F2 = 2 F0 - h (k_0 + k_last)`, and
    `F3, F4, ... = h Σ_i tail[j][i] k_i`; `k_last = f(t0 + h, y1)`.

    **Arguments:**

    - `b`: weights of `y1`.
    - `last`: index of the stage `f(t0 + h, y1)`.
    - `tail`: coefficient vectors of `F3, F4, ...` on the `n` stages.
    - `n`: number of stages, extra ones included.

    **Returns:**

    `(n, 3 + len(tail))` dense coefficients of powers `θ**1, θ**2, ...`.
    """
    e = np.eye(n)
    b = _pad(b, n)
    vectors = [b, e[0] - b, 2 * b - e[0] - e[last], *(_pad(v, n) for v in tail)]
    degree = len(vectors)
    dense = np.zeros((n, degree))
    weight = np.array([1.0])
    for j, vector in enumerate(vectors):
        factor = [0.0, 1.0] if j % 2 == 0 else [1.0, -1.0]  # θ, then 1 - θ
        weight = npoly.polymul(weight, factor)
        dense += np.outer(vector, _pad(weight, degree + 1)[1:])
    return _match_endpoint(dense, b)


# ---------------------------------------------------------------------------------
# Low order methods: no dense output of their own (the caller uses cubic Hermite).

EULER = ButcherTableau(
    c=np.array([0.0]),
    a=np.zeros((1, 1)),
    b=np.array([1.0]),
    b_err=None,
    order=1,
    embedded_order=None,
    fsal=False,
    dense=None,
)
"""Explicit Euler: 1 stage, order 1, no error estimate."""

# Heun, midpoint and Ralston each embed explicit Euler, b_hat = (1, 0).
HEUN = ButcherTableau(
    c=np.array([0.0, 1.0]),
    a=_lower([[1.0]]),
    b=np.array([1 / 2, 1 / 2]),
    b_err=np.array([1 / 2 - 1, 1 / 2]),
    order=2,
    embedded_order=1,
    fsal=False,
    dense=None,
)
"""Heun's method (explicit trapezoidal rule): order 2, embedded Euler."""

MIDPOINT = ButcherTableau(
    c=np.array([0.0, 1 / 2]),
    a=_lower([[1 / 2]]),
    b=np.array([0.0, 1.0]),
    b_err=np.array([0.0 - 1, 1.0]),
    order=2,
    embedded_order=1,
    fsal=False,
    dense=None,
)
"""Explicit midpoint method: order 2, embedded Euler."""

RALSTON = ButcherTableau(
    c=np.array([0.0, 2 / 3]),
    a=_lower([[2 / 3]]),
    b=np.array([1 / 4, 3 / 4]),
    b_err=np.array([1 / 4 - 1, 3 / 4]),
    order=2,
    embedded_order=1,
    fsal=False,
    dense=None,
)
"""Ralston's second order method (c2 = 2/3, minimal error bound), embedded Euler."""

_bosh3_b = np.array([2 / 9, 1 / 3, 4 / 9, 0.0])
_bosh3_b_hat = np.array([7 / 24, 1 / 4, 1 / 3, 1 / 8])
BOSH3 = ButcherTableau(
    c=np.array([0.0, 1 / 2, 3 / 4, 1.0]),
    a=_lower([[1 / 2], [0.0, 3 / 4], [2 / 9, 1 / 3, 4 / 9]]),
    b=_bosh3_b,
    b_err=_bosh3_b - _bosh3_b_hat,
    order=3,
    embedded_order=2,
    fsal=True,
    dense=None,
)
"""Bogacki--Shampine 3(2), FSAL (3 new stages a step).

P. Bogacki, L. F. Shampine, A 3(2) pair of Runge--Kutta formulas, Appl. Math. Lett.
2 (1989) 321--325.
"""

# ---------------------------------------------------------------------------------
# Tsitouras 5(4).

_tsit5_b = np.array(
    [
        0.09646076681806523,
        0.01,
        0.4798896504144996,
        1.379008574103742,
        -3.290069515436081,
        2.324710524099774,
        0.0,
    ]
)
_tsit5_b_hat = np.array(
    [
        0.09468075576583945,
        0.009183565540343254,
        0.4877705284247616,
        1.234297566930479,
        -2.7077123499835256,
        1.866628418170587,
        1 / 66,
    ]
)


def _tsit5_dense() -> np.ndarray:
    # Tsitouras (2011), the continuous extension b_i(θ) of degree 4, as printed
    # there in factored form: (scale, real roots, and (q, p) of a quadratic factor
    # θ² + p θ + q, or None). Every b_i(θ) has the root 0.
    factored = [
        (-1.0530884977290216, [0.0, 1.3299890189751412],
         [0.7139816917074209, -1.4364028541716351]),
        (0.1017, [0.0, 0.0], [1.2949852507374631, -2.1966568338249754]),
        (2.490627285651252793, [0.0, 0.0],
         [1.57803468208092486, -2.38535645472061657]),
        (-16.54810288924490272,
         [0.0, 0.0, 1.21712927295533244, 0.61620406037800089], None),
        (47.37952196281928122,
         [0.0, 0.0, 1.203071208372362603, 0.658047292653547382], None),
        (-34.87065786149660974, [0.0, 0.0, 1.2, 2 / 3], None),
        (2.5, [0.0, 0.0, 1.0, 0.6], None),
    ]  # fmt: skip
    dense = np.zeros((7, 4))
    for i, (scale, roots, quadratic) in enumerate(factored):
        poly = scale * npoly.polyfromroots(roots)
        if quadratic is not None:
            poly = npoly.polymul(poly, [quadratic[0], quadratic[1], 1.0])
        dense[i] = _pad(poly, 5)[1:]
    return _match_endpoint(dense, _tsit5_b)


TSIT5 = ButcherTableau(
    c=np.array([0.0, 0.161, 0.327, 0.9, 0.9800255409045097, 1.0, 1.0]),
    a=_lower(
        [
            [0.161],
            [-0.008480655492356989, 0.335480655492357],
            [2.8971530571054935, -6.359448489975075, 4.3622954328695815],
            [
                5.325864828439257,
                -11.748883564062828,
                7.4955393428898365,
                -0.09249506636175525,
            ],
            [
                5.86145544294642,
                -12.92096931784711,
                8.159367898576159,
                -0.071584973281401,
                -0.028269050394068383,
            ],
            _tsit5_b[:6],
        ]
    ),
    b=_tsit5_b,
    b_err=_tsit5_b - _tsit5_b_hat,
    order=5,
    embedded_order=4,
    fsal=True,
    dense=_tsit5_dense(),
)
"""Tsitouras 5(4), FSAL (6 new stages a step), with Tsitouras' 4th order dense
output (degree 4 in θ).

Ch. Tsitouras, Runge--Kutta pairs of order 5(4) satisfying only the first column
simplifying assumption, Comput. Math. Appl. 62 (2011) 770--775.
"""

# ---------------------------------------------------------------------------------
# Dormand--Prince 5(4).

_dopri5_b = np.array([35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0])
# The embedded 4th order weights are Shampine's (1986), as diffrax uses, rather than
# Dormand and Prince's original (5179/57600, ..., 1/40): same order, and so the same
# step sequences as diffrax.Dopri5 at equal tolerances.
_dopri5_b_hat = np.array(
    [1951 / 21600, 0.0, 22642 / 50085, 451 / 720, -12231 / 42400, 649 / 6300, 1 / 60]
)
# Shampine's continuous extension, in the nested form of Hairer's DOPRI5 code.
_dopri5_d = np.array(
    [
        -12715105075 / 11282082432,
        0.0,
        87487479700 / 32700410799,
        -10690763975 / 1880347072,
        701980252875 / 199316789632,
        -1453857185 / 822651844,
        69997945 / 29380423,
    ]
)
DOPRI5 = ButcherTableau(
    c=np.array([0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0]),
    a=_lower(
        [
            [1 / 5],
            [3 / 40, 9 / 40],
            [44 / 45, -56 / 15, 32 / 9],
            [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
            [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656],
            _dopri5_b[:6],
        ]
    ),
    b=_dopri5_b,
    b_err=_dopri5_b - _dopri5_b_hat,
    order=5,
    embedded_order=4,
    fsal=True,
    dense=_hermite_nested_dense(_dopri5_b, 6, [_dopri5_d], 7),
)
"""Dormand--Prince 5(4), FSAL (6 new stages a step), with Shampine's 4th order dense
output (degree 4 in θ) as in Hairer's DOPRI5 code.

J. R. Dormand, P. J. Prince, A family of embedded Runge--Kutta formulae, J. Comput.
Appl. Math. 6 (1980) 19--26. L. F. Shampine, Some practical Runge--Kutta formulas,
Math. Comp. 46 (1986) 135--150. E. Hairer, S. P. Nørsett, G. Wanner, Solving Ordinary
Differential Equations I, 2nd ed., Springer (1993), II.6.
"""

# ---------------------------------------------------------------------------------
# Prince--Dormand 8(7), "RK8(7)13M": what diffrax calls Dopri8.

_dopri8_b = np.array(
    [
        14005451 / 335480064,
        0.0,
        0.0,
        0.0,
        0.0,
        -59238493 / 1068277825,
        181606767 / 758867731,
        561292985 / 797845732,
        -1041891430 / 1371343529,
        760417239 / 1151165299,
        118820643 / 751138087,
        -528747749 / 2220607170,
        1 / 4,
        0.0,
    ]
)
_dopri8_b_hat = np.array(
    [
        13451932 / 455176623,
        0.0,
        0.0,
        0.0,
        0.0,
        -808719846 / 976000145,
        1757004468 / 5645159321,
        656045339 / 265891186,
        -3867574721 / 1518517206,
        465885868 / 322736535,
        53011238 / 667516719,
        2 / 45,
        0.0,
        0.0,
    ]
)
# Our own continuous extension (no extra stages): degree 6, order 5, C1 (b_i'(0) and
# b_i'(1) select k_0 and the FSAL stage), the remaining freedom spent on the least
# L2(θ) norm of the order-6 residuals. tests/solvers/test_tableau.py re-derives it.
_dopri8_dense = np.array(
    [
        [1.0, -6.672505835108914, 19.949960023830553,
         -30.00647779437049, 22.103583804534175, -6.33281270774379],
        [0.0] * 6,
        [0.0] * 6,
        [0.0] * 6,
        [0.0] * 6,
        [0.0, -7.342915926182902, 51.495456436595774,
         -120.6610216451859, 115.87462371364855, -39.42159490748678],
        [0.0, 10.653734568553936, -46.693539559147446,
         82.94899336221337, -66.99642947799303, 20.326553913574365],
        [0.0, 0.3735721731195852, 0.29847416345264904,
         9.005217962512157, -16.17908309143995, 7.2053294617590025],
        [0.0, 3.9303259852823538, -34.927501111835845,
         86.94196773084248, -89.38129375019358, 32.676741532090126],
        [0.0, -0.36998116324345887, 5.476018891365665,
         -16.486031792797522, 21.987309750005615, -9.946752654408009],
        [0.0, -1.341435710422456, 10.53165803122112,
         -28.848254606636853, 32.41640285636088, -12.600183088012573],
        [0.0, 5.028167145813702, -33.76922185762543,
         80.58771287007418, -81.40908598304406, 29.324318286028745],
        [0.0, -6.586873410233152, 46.491442798158246,
         -113.40078867233413, 115.17474259112613, -41.4285233067171],
        [0.0, 2.327912172421307, -18.852747816015285,
         49.91868258568269, -53.590770413004726, 20.19692347091602],
    ]
)  # fmt: skip
DOPRI8 = ButcherTableau(
    c=np.array(
        [
            0.0,
            1 / 18,
            1 / 12,
            1 / 8,
            5 / 16,
            3 / 8,
            59 / 400,
            93 / 200,
            5490023248 / 9719169821,
            13 / 20,
            1201146811 / 1299019798,
            1.0,
            1.0,
            1.0,
        ]
    ),
    a=_lower(
        [
            [1 / 18],
            [1 / 48, 1 / 16],
            [1 / 32, 0, 3 / 32],
            [5 / 16, 0, -75 / 64, 75 / 64],
            [3 / 80, 0, 0, 3 / 16, 3 / 20],
            [
                29443841 / 614563906,
                0,
                0,
                77736538 / 692538347,
                -28693883 / 1125000000,
                23124283 / 1800000000,
            ],
            [
                16016141 / 946692911,
                0,
                0,
                61564180 / 158732637,
                22789713 / 633445777,
                545815736 / 2771057229,
                -180193667 / 1043307555,
            ],
            [
                39632708 / 573591083,
                0,
                0,
                -433636366 / 683701615,
                -421739975 / 2616292301,
                100302831 / 723423059,
                790204164 / 839813087,
                800635310 / 3783071287,
            ],
            [
                246121993 / 1340847787,
                0,
                0,
                -37695042795 / 15268766246,
                -309121744 / 1061227803,
                -12992083 / 490766935,
                6005943493 / 2108947869,
                393006217 / 1396673457,
                123872331 / 1001029789,
            ],
            [
                -1028468189 / 846180014,
                0,
                0,
                8478235783 / 508512852,
                1311729495 / 1432422823,
                -10304129995 / 1701304382,
                -48777925059 / 3047939560,
                15336726248 / 1032824649,
                -45442868181 / 3398467696,
                3065993473 / 597172653,
            ],
            [
                185892177 / 718116043,
                0,
                0,
                -3185094517 / 667107341,
                -477755414 / 1098053517,
                -703635378 / 230739211,
                5731566787 / 1027545527,
                5232866602 / 850066563,
                -4093664535 / 808688257,
                3962137247 / 1805957418,
                65686358 / 487910083,
            ],
            [
                403863854 / 491063109,
                0,
                0,
                -5068492393 / 434740067,
                -411421997 / 543043805,
                652783627 / 914296604,
                11173962825 / 925320556,
                -13158990841 / 6184727034,
                3936647629 / 1978049680,
                -160528059 / 685178525,
                248638103 / 1413531060,
                0,
            ],
            _dopri8_b[:13],
        ]
    ),  # fmt: skip
    b=_dopri8_b,
    b_err=_dopri8_b - _dopri8_b_hat,
    order=8,
    embedded_order=7,
    fsal=True,
    dense=_match_endpoint(_dopri8_dense, _dopri8_b),
)
"""Prince--Dormand 8(7) "RK8(7)13M", FSAL (13 new stages a step): the method diffrax
calls Dopri8, with the same 7th order error estimate, so step sequences agree with
diffrax.Dopri8. Dense output: our own, order 5 (diffrax's is also of order 5).

P. J. Prince, J. R. Dormand, High order embedded Runge--Kutta formulae, J. Comput.
Appl. Math. 7 (1981) 67--75.
"""

TABLEAUX: dict[str, ButcherTableau] = {
    "Euler": EULER,
    "Heun": HEUN,
    "Midpoint": MIDPOINT,
    "Ralston": RALSTON,
    "Bosh3": BOSH3,
    "Tsit5": TSIT5,
    "Dopri5": DOPRI5,
    "Dopri8": DOPRI8,
}
"""Every tableau, by the name of its solver."""
