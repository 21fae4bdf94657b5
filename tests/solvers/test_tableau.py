"""The Butcher tableaux are right: validation, order conditions, observed convergence
of the solution, the embedded method and the dense output. NumPy only."""

import dataclasses
import functools
import math

import numpy as np
import pytest

from solverkit._solver._tableau import (
    ButcherTableau,
    DOPRI5,
    DOPRI8,
    HEUN,
    TABLEAUX,
)


# Order of each dense output (local error O(h^(order + 1)) at every θ in [0, 1]).
DENSE_ORDER = {"Tsit5": 4, "Dopri5": 4, "Dopri8": 5}
NAMES = list(TABLEAUX)
DENSE_NAMES = [name for name in NAMES if TABLEAUX[name].dense is not None]
EMBEDDED_NAMES = [name for name in NAMES if TABLEAUX[name].b_err is not None]


def test_dense_order_table_is_complete():
    assert set(DENSE_NAMES) == set(DENSE_ORDER)


# ---------------------------------------------------------------------------------
# Rooted trees and elementary weights (Butcher's order conditions).


@functools.cache
def trees(n: int) -> tuple[tuple, ...]:
    """Every rooted tree with `n` nodes, each a sorted tuple of its subtrees."""
    if n == 1:
        return ((),)
    found = set()

    def forests(m: int, smallest: tuple) -> list[tuple]:
        # Multisets of trees with `m` nodes in all, listed in non-decreasing order.
        if m == 0:
            return [()]
        out = []
        for k in range(1, m + 1):
            for t in trees(k):
                if (k, t) >= smallest:
                    out += [(t, *rest) for rest in forests(m - k, (k, t))]
        return out

    for forest in forests(n - 1, (0, ())):
        found.add(tuple(sorted(forest)))
    return tuple(sorted(found))


def test_tree_counts():
    # OEIS A000081.
    assert [len(trees(n)) for n in range(1, 10)] == [1, 1, 2, 4, 9, 20, 48, 115, 286]


def gamma(t: tuple) -> int:
    return (1 + sum(size(u) for u in t)) * math.prod(gamma(u) for u in t)


def size(t: tuple) -> int:
    return 1 + sum(size(u) for u in t)


def weights_fn(a: np.ndarray):
    """Elementary weights Φ(t) (a vector over stages) for the stage matrix `a`."""

    @functools.cache
    def phi(t: tuple) -> np.ndarray:
        out = np.ones(a.shape[0])
        for u in t:
            out = out * (a @ phi(u))
        return out

    return phi


def all_stages(tab: ButcherTableau) -> tuple[np.ndarray, np.ndarray]:
    """Stage matrix and nodes."""
    return tab.a, tab.c


def order_residuals(b: np.ndarray, a: np.ndarray, q: int, theta: float = 1.0):
    """Largest |b·Φ(t) - θ^q/γ(t)| over trees with q nodes."""
    phi = weights_fn(a)
    return max(abs(b @ phi(t) - theta**q / gamma(t)) for t in trees(q))


def check_exact_order(b: np.ndarray, a: np.ndarray, order: int, theta: float = 1.0):
    for q in range(1, order + 1):
        assert order_residuals(b, a, q, theta) < 1e-12, (q, theta)
    assert order_residuals(b, a, order + 1, theta) > 1e-7, ("order too low", theta)


def dense_weights(tab: ButcherTableau, theta: float) -> np.ndarray:
    assert tab.dense is not None
    return tab.dense @ theta ** np.arange(1, tab.dense.shape[1] + 1)


@pytest.mark.parametrize("name", NAMES)
def test_order_conditions(name):
    tab = TABLEAUX[name]
    check_exact_order(tab.b, tab.a, tab.order)
    if tab.b_err is not None:
        assert tab.embedded_order is not None
        check_exact_order(tab.b - tab.b_err, tab.a, tab.embedded_order)


@pytest.mark.parametrize("name", DENSE_NAMES)
@pytest.mark.parametrize("theta", [0.2, 0.5, 0.9])
def test_dense_order_conditions(name, theta):
    tab = TABLEAUX[name]
    a, _ = all_stages(tab)
    check_exact_order(dense_weights(tab, theta), a, DENSE_ORDER[name], theta)


@pytest.mark.parametrize("name", DENSE_NAMES)
def test_dense_is_c1(name):
    # Derivative at θ=0 is k_0 and at θ=1 is f(t0 + h, y1), the FSAL stage.
    tab = TABLEAUX[name]
    assert tab.dense is not None and tab.fsal
    powers = np.arange(1, tab.dense.shape[1] + 1)
    eye = np.eye(tab.dense.shape[0])
    np.testing.assert_allclose(tab.dense[:, 0], eye[0], atol=1e-12)
    np.testing.assert_allclose(tab.dense @ powers, eye[tab.num_stages - 1], atol=1e-12)


# ---------------------------------------------------------------------------------
# A tiny NumPy integrator. The solution and embedded method are checked on
# y' = y cos(t), y(0) = 1, y(t) = exp(sin(t)).


def vf(t, y):
    return y * np.cos(t)


def exact(t):
    return np.exp(np.sin(t))


def stages(tab: ButcherTableau, f, t0: float, y0, h: float) -> np.ndarray:
    """Every stage derivative k_i of one step."""
    a, c = all_stages(tab)
    k = np.zeros((len(c), *np.shape(y0)))
    for i in range(len(c)):
        k[i] = f(t0 + c[i] * h, y0 + h * np.tensordot(a[i, :i], k[:i], axes=1))
    return k


def max_error(tab: ButcherTableau, weights: np.ndarray, n: int) -> float:
    """Largest error over `n` steps of size 2π/n."""
    h, y, error = T1 / n, 1.0, 0.0
    for step in range(n):
        k = stages(tab, vf, step * h, y, h)
        y = y + h * (weights @ k[: tab.num_stages])
        error = max(error, abs(y - exact((step + 1) * h)))
    return error


def fitted_slope(hs, errors) -> float:
    return float(np.polyfit(np.log(hs), np.log(errors), 1)[0])


T1 = 2 * np.pi
# Step counts (for the solution, then for the embedded method) in each method's
# asymptotic range, errors about 1e-13 ... 1e-4. Tsit5 needs small steps: its
# principal error coefficients are deliberately tiny, so h^(p+2) terms dominate the
# error until h is below about 0.05.
STEPS = {
    "Euler": ([100, 200, 400, 800], None),
    "Heun": ([50, 100, 200, 400], [100, 200, 400, 800]),
    "Midpoint": ([50, 100, 200, 400], [100, 200, 400, 800]),
    "Ralston": ([50, 100, 200, 400], [100, 200, 400, 800]),
    "Bosh3": ([40, 80, 160, 320], [40, 80, 160, 320]),
    "Tsit5": ([200, 250, 300, 360], [110, 150, 210, 300]),
    "Dopri5": ([100, 140, 200, 280], [100, 140, 200, 280]),
    "Dopri8": ([15, 20, 28, 40], [15, 20, 28, 40, 56]),
}


def observed_order(tab: ButcherTableau, weights: np.ndarray, steps) -> float:
    ns = np.array(steps)
    errors = [max_error(tab, weights, int(n)) for n in ns]
    assert min(errors) > 1e-13, "errors down at rounding level: fit is meaningless"
    return fitted_slope(T1 / ns, errors)


def test_steps_table_is_complete():
    assert set(STEPS) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_convergence_order(name):
    tab = TABLEAUX[name]
    slope = observed_order(tab, tab.b, STEPS[name][0])
    assert abs(slope - tab.order) < 0.3, slope


@pytest.mark.parametrize("name", EMBEDDED_NAMES)
def test_embedded_convergence_order(name):
    tab = TABLEAUX[name]
    assert tab.b_err is not None and tab.embedded_order is not None
    slope = observed_order(tab, tab.b - tab.b_err, STEPS[name][1])
    assert abs(slope - tab.embedded_order) < 0.3, slope


# The dense output is checked on a nonlinear system, with the manufactured solution
# u(t) = (sin t, 1 + cos(t)/2): on the scalar linear y' = y cos(t) some of the
# interpolants' leading error terms vanish (Dopri8's shows h^7, not h^6, there).


def _g(y):
    return np.array([y[1] ** 2 - y[0] * y[1], np.sin(y[0]) - y[1] ** 3 / 3])


def _u(t):
    return np.array([np.sin(t), 1 + np.cos(t) / 2])


def _vf2(t, y):
    du = np.array([np.cos(t), -np.sin(t) / 2])
    return _g(y) + du - _g(_u(t))


@pytest.mark.parametrize("name", DENSE_NAMES)
def test_dense_convergence_order(name):
    tab = TABLEAUX[name]
    hs = np.array([0.3, 0.2, 0.13, 0.09, 0.06])
    thetas = [0.2, 0.35, 0.5, 0.65, 0.8]
    errors = np.zeros(len(hs))
    for t0 in [0.5, 1.5, 2.5]:
        y0 = _u(t0)
        for n, h in enumerate(hs):
            k = stages(tab, _vf2, t0, y0, h)
            for theta in thetas:
                value = y0 + h * (dense_weights(tab, theta) @ k)
                error = np.max(np.abs(value - _u(t0 + theta * h)))
                errors[n] = max(errors[n], error)
            # At θ = 1 the interpolant is the step's solution.
            y1 = y0 + h * (tab.b @ k[: tab.num_stages])
            np.testing.assert_allclose(
                y0 + h * (dense_weights(tab, 1.0) @ k), y1, rtol=0, atol=1e-13
            )
    assert errors.min() > 1e-14
    slope = fitted_slope(hs, errors)
    assert abs(slope - (DENSE_ORDER[name] + 1)) < 0.3, slope


# ---------------------------------------------------------------------------------
# Structure and validation.


@pytest.mark.parametrize("name", NAMES)
def test_validation_passes(name):
    tab = TABLEAUX[name]
    again = dataclasses.replace(tab)
    assert again == tab and hash(again) == hash(tab)
    assert tab.c.dtype == np.float64 and not tab.a.flags.writeable
    assert tab.c.shape == tab.b.shape == (tab.num_stages,)


@pytest.mark.parametrize("name", NAMES)
def test_fsal(name):
    tab = TABLEAUX[name]
    if tab.fsal:
        assert tab.c[-1] == 1
        np.testing.assert_array_equal(tab.a[-1], tab.b)
        assert tab.b[-1] == 0
    else:
        # Not FSAL: the last stage is not f(t0 + h, y1).
        assert tab.c[-1] != 1 or not np.array_equal(tab.a[-1], tab.b)


def test_tableaux_are_distinct():
    assert len(set(TABLEAUX.values())) == len(TABLEAUX)


def _edit(tab: ButcherTableau, field: str, fn) -> dict:
    value = np.array(getattr(tab, field))
    fn(value)
    return {field: value}


def _set(index, value):
    def fn(array):
        array[index] = value

    return fn


BAD = {
    "c0": (DOPRI5, lambda t: _edit(t, "c", _set(0, 0.1)), "c\\[0\\]"),
    "diagonal": (DOPRI5, lambda t: _edit(t, "a", _set((2, 2), 0.1)), "lower"),
    "row sum": (DOPRI5, lambda t: _edit(t, "c", _set(2, 0.31)), "row sums"),
    "b sum": (DOPRI5, lambda t: _edit(t, "b", _set(1, 0.1)), "sum to 1"),
    "b_err sum": (DOPRI5, lambda t: _edit(t, "b_err", _set(1, 0.1)), "sum to 0"),
    "b_err alone": (DOPRI5, lambda t: {"embedded_order": None}, "both"),
    "embedded order": (DOPRI5, lambda t: {"embedded_order": 5}, "embedded_order"),
    "shape": (DOPRI5, lambda t: {"b": t.b[:-1]}, "shape"),
    "fsal": (HEUN, lambda t: {"fsal": True}, "FSAL"),
    "fsal c": (
        DOPRI8,
        lambda t: (
            _edit(t, "a", _set((13, 5), t.a[13, 5] + 1e-3))
            | _edit(t, "c", _set(13, 1 + 1e-3))
        ),
        "FSAL",
    ),
    "dense end": (DOPRI5, lambda t: _edit(t, "dense", _set((2, 3), 0.0)), "θ=1"),
    "dense rows": (DOPRI5, lambda t: {"dense": t.dense[:-1]}, "dense"),
    "order": (DOPRI5, lambda t: {"order": 0}, "order"),
    "nan": (DOPRI5, lambda t: _edit(t, "b_err", _set(0, np.nan)), "finite"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_validation_rejects(case):
    tab, change, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(tab, **change(tab))


# ---------------------------------------------------------------------------------
# Provenance: the Dopri8 dense output is re-derived here, and the error estimates are
# diffrax's.


def derive_c1_dense(tab: ButcherTableau, order: int, degree: int) -> np.ndarray:
    """The continuous extension of `order` and `degree` using only the stages where
    `b` is nonzero (and the FSAL stage), with b_i'(0) = δ_i0 and b_i'(1) = δ_i,s-1,
    and the remaining freedom spent on the least L2(θ) norm of the residuals of the
    order-(order+1) conditions."""
    s = tab.num_stages
    used = [i for i in range(s) if tab.b[i] != 0 or i in (0, s - 1)]
    powers = np.arange(2, degree + 1)  # θ^1 is fixed: b_i'(0) = δ_i0
    phi = weights_fn(tab.a)

    def row(stage_values: np.ndarray, power_values: np.ndarray) -> np.ndarray:
        # Linear functional Σ_i Σ_p d[i, p] stage_values[i] power_values[p].
        return np.outer(stage_values[used], power_values).ravel()

    # Order conditions, power by power. The fixed θ^1 column e_0 meets those of
    # power 1 already: Φ_0(t) is 1 for the one-node tree and 0 for the others.
    rows, rhs = [], []
    for q in range(1, order + 1):
        for t in trees(q):
            for p in powers:
                rows.append(row(phi(t), (powers == p).astype(float)))
                rhs.append((p == q) / gamma(t))
    # b(1) = b and b'(1) = e_{s-1}, net of the fixed θ^1 column.
    for i in range(s):
        unit = np.eye(s)[i]
        rows.append(row(unit, np.ones(len(powers))))
        rhs.append(tab.b[i] - (i == 0))
        rows.append(row(unit, powers.astype(float)))
        rhs.append((i == s - 1) - (i == 0))
    m, r = np.array(rows), np.array(rhs)
    u, sv, vt = np.linalg.svd(m)
    rank = int(np.sum(sv > 1e-12 * sv[0]))
    x0 = vt[:rank].T @ ((u[:, :rank].T @ r) / sv[:rank])
    null = vt[rank:].T
    # Among those, the least squares of the order-(order+1) residuals over θ.
    nodes, quad = np.polynomial.legendre.leggauss(20)
    nodes, quad = (nodes + 1) / 2, quad / 2
    lrows, lrhs = [], []
    for t in trees(order + 1):
        for x, w in zip(nodes, quad):
            lrows.append(np.sqrt(w) * row(phi(t), x**powers))
            lrhs.append(np.sqrt(w) * (x ** (order + 1) / gamma(t) - x * phi(t)[0]))
    ell, g = np.array(lrows), np.array(lrhs)
    z = np.linalg.lstsq(ell @ null, g - ell @ x0, rcond=1e-10)[0]
    x = x0 + null @ z
    x = x + vt[:rank].T @ ((u[:, :rank].T @ (r - m @ x)) / sv[:rank])
    dense = np.zeros((s, degree))
    dense[0, 0] = 1.0
    dense[np.ix_(used, powers - 1)] = x.reshape(len(used), len(powers))
    return dense


def test_dopri8_dense_derivation():
    assert DOPRI8.dense is not None
    # Loose: the derivation is ill-conditioned in directions that barely change
    # the interpolant (its order-6 residual norm is what is minimised).
    np.testing.assert_allclose(derive_c1_dense(DOPRI8, 5, 6), DOPRI8.dense, atol=1e-6)


def _diffrax_tableau(name: str):
    diffrax = pytest.importorskip("diffrax")
    tab = getattr(diffrax, name).tableau
    s = len(tab.c) + 1
    a = np.zeros((s, s))
    for i, row in enumerate(tab.a_lower, start=1):
        a[i, : len(row)] = row
    return np.concatenate([[0.0], tab.c]), a, tab.b_sol, tab.b_error


@pytest.mark.parametrize("name", ["Heun", "Midpoint", "Ralston", "Bosh3", "Tsit5",
                                  "Dopri5", "Dopri8"])  # fmt: skip
def test_same_method_and_error_estimate_as_diffrax(name):
    c, a, b, b_err = _diffrax_tableau(name)
    tab = TABLEAUX[name]
    np.testing.assert_allclose(tab.c, c, rtol=0, atol=1e-15)
    np.testing.assert_allclose(tab.a, a, rtol=0, atol=1e-14)
    np.testing.assert_allclose(tab.b, b, rtol=0, atol=1e-15)
    assert tab.b_err is not None
    sign = np.sign(tab.b_err @ b_err)  # diffrax's sign is b_hat - b for some
    np.testing.assert_allclose(tab.b_err, sign * b_err, rtol=0, atol=1e-15)
