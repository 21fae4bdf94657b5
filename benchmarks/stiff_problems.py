"""Stiff benchmark problems from the Test Set for IVP Solvers, with their published
reference solutions.

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
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np


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
