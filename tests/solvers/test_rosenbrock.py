"""Rosenbrock solvers: order conditions of the tableaux, observed orders, the stiff
Test Set problems against their published references, gradients under every
adjoint with closed-over values, backward time, events and dense output.

Compiles are few: each jitted solve below is shared by the tests that use it.
"""

import functools
import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import quick_params

import solverkit as sk
from benchmarks.problems import HIRES, OREGO, POLLU, ROBER, ROBER_1E11
from solverkit._solver._rosenbrock_tableau import (
    RODAS4,
    RODAS5P,
    ROS3P,
    ROSENBROCK23,
    RosenbrockTableau,
)


TABLEAUX = {
    "Rosenbrock23": ROSENBROCK23,
    "Ros3P": ROS3P,
    "Rodas4": RODAS4,
    "Rodas5P": RODAS5P,
}
# name -> (order, embedded order, dense-output order or None for Hermite, L-stable)
ORDERS = {
    "Rosenbrock23": (2, 3, 2, True),
    "Ros3P": (3, 2, None, False),
    "Rodas4": (4, 3, 3, True),
    "Rodas5P": (5, 4, 4, True),
}
SOLVERS = {name: getattr(sk, name) for name in TABLEAUX}


# --- Order conditions of ROW methods (Hairer & Wanner II, IV.7, Table 7.1) ---------


@functools.cache
def trees(order: int) -> tuple:
    """Rooted trees with `order` vertices, each a sorted tuple of its subtrees."""
    if order == 1:
        return ((),)
    out = set()
    for sizes in _partitions(order - 1, order - 1):
        for children in itertools.product(*[trees(k) for k in sizes]):
            out.add(tuple(sorted(children)))
    return tuple(sorted(out))


def _partitions(n: int, largest: int):
    if n == 0:
        yield ()
        return
    for k in range(min(n, largest), 0, -1):
        for rest in _partitions(n - k, k):
            yield (k, *rest)


def size(t: tuple) -> int:
    return 1 + sum(size(u) for u in t)


def density(t: tuple) -> int:
    return size(t) * math.prod(density(u) for u in t)


def elementary_weight(t: tuple, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Φ(t) over the stages of a ROW method: a vertex with one child takes
    `β = α + Γ` (diagonal included), a vertex with several children takes `α`."""
    if not t:
        return np.ones(alpha.shape[0])
    if len(t) == 1:
        return beta @ elementary_weight(t[0], alpha, beta)
    return math.prod(alpha @ elementary_weight(u, alpha, beta) for u in t)


def residual(tab: RosenbrockTableau, weights: np.ndarray, q: int, theta=1.0) -> float:
    """Largest `|w·Φ(t) - θ^q / γ(t)|` over the trees with `q` vertices."""
    alpha, gamma_matrix, _, _ = tab.standard()
    beta = alpha + gamma_matrix
    return max(
        abs(weights @ elementary_weight(t, alpha, beta) - theta**q / density(t))
        for t in trees(q)
    )


def test_tree_counts():
    assert [len(trees(n)) for n in range(1, 7)] == [1, 1, 2, 4, 9, 20]


def _exact_order(tab, weights, order, theta=1.0):
    for q in range(1, order + 1):
        assert residual(tab, weights, q, theta) < 1e-12, (q, theta)
    assert residual(tab, weights, order + 1, theta) > 1e-6, ("order too low", theta)


@pytest.mark.parametrize("name", TABLEAUX)
def test_order_conditions(name):
    tab = TABLEAUX[name]
    order, embedded, dense, _ = ORDERS[name]
    _, _, b, b_hat = tab.standard()
    _exact_order(tab, b, order)
    _exact_order(tab, b_hat, embedded)
    assert tab.order == order and tab.embedded_order == embedded
    if dense is not None:
        coeffs = tab.dense_standard()
        for theta in (0.3, 0.5, 0.8):
            weights = coeffs @ theta ** np.arange(1, coeffs.shape[1] + 1)
            for q in range(1, dense + 1):
                assert residual(tab, weights, q, theta) < 1e-11, (q, theta)


@pytest.mark.parametrize("name", TABLEAUX)
def test_stability_at_infinity(name):
    """`R(∞) = 1 - b B⁻¹ 1` with `B = α + Γ`: zero for the L-stable methods, and
    `|R(∞)| < 1` (A-stable ROS3P: 1 - √3 ≈ -0.73)."""
    tab = TABLEAUX[name]
    alpha, gamma_matrix, b, _ = tab.standard()
    ones = np.ones(tab.num_stages)
    r_inf = 1 - b @ np.linalg.solve(alpha + gamma_matrix, ones)
    if ORDERS[name][3]:
        assert abs(r_inf) < 1e-12
    else:
        assert abs(r_inf - (1 - math.sqrt(3))) < 1e-12


def test_tableau_validation():
    with pytest.raises(ValueError, match="row sums of Γ"):
        RosenbrockTableau(
            gamma=RODAS4.gamma,
            a=RODAS4.a,
            C=RODAS4.C,
            c=RODAS4.c,
            d=np.array(RODAS4.d) + 0.1,
            m=RODAS4.m,
            m_err=RODAS4.m_err,
            order=4,
            embedded_order=3,
        )


# --- Observed order: one jitted solve per solver, the step size as data -------------


def _convergence_field(t, y, args):
    """A linear non-autonomous component (`f_t` matters) and a nonlinear one:
    exact solution `(cos t + e^{-2t}, tan t)` from `(2, 0)`."""
    lam = -2.0
    return jnp.stack([lam * (y[0] - jnp.cos(t)) - jnp.sin(t), 1 + y[1] ** 2])


def _exact(t):
    return np.array([np.cos(t) + np.exp(-2 * t), np.tan(t)])


@functools.cache
def _fixed_step_solve(name):
    @jax.jit
    def solve(dt):
        sol = sk.diffeqsolve(
            sk.ODETerm(_convergence_field),
            SOLVERS[name](),
            0.0,
            1.0,
            dt,
            jnp.array([2.0, 0.0]),
            max_steps=64,
        )
        return sol.ys[-1]

    return solve


# (solve/test_integrate.py checks Rosenbrock23's order in the quick loop.)
@pytest.mark.parametrize("name", quick_params(TABLEAUX, ["Ros3P", "Rodas5P"]))
def test_convergence_order(name, x64):
    order = ORDERS[name][0]
    solve = _fixed_step_solve(name)
    steps = [4, 8, 16, 32] if order >= 4 else [8, 16, 32, 64]
    errors = np.array([np.abs(np.asarray(solve(1.0 / n)) - _exact(1.0)) for n in steps])
    for component in range(2):
        slope = np.polyfit(np.log(steps), np.log(errors[:, component]), 1)[0]
        assert -slope > order - 0.3, (component, -slope, errors[:, component])


# --- Stiff Test Set problems against their published references ---------------------


@functools.cache
def _stiff_solve(name, problem_name):
    problem = {p.name: p for p in (ROBER, HIRES, OREGO, POLLU)}[problem_name]

    @jax.jit
    def solve(t1, rtol, atol):
        sol = sk.diffeqsolve(
            sk.ODETerm(problem.field(1.0)),
            SOLVERS[name](),
            0.0,
            t1,
            1e-6,
            jnp.asarray(problem.y0),
            stepsize_controller=sk.PIDController(rtol=rtol, atol=atol),
            max_steps=20_000,
        )
        return sol.ys[-1], sol.stats["num_steps"]

    return solve


def _relative_error(y, reference):
    return float(
        np.max(np.abs(np.asarray(y) - reference) / (np.abs(reference) + 1e-10))
    )


@pytest.mark.parametrize(
    "name, problem, rtol, atol, tol",
    quick_params(
        [
            ("Rodas5P", ROBER, 1e-10, 1e-14, 1e-8),
            ("Rodas5P", HIRES, 1e-10, 1e-14, 1e-8),
            ("Rodas4", OREGO, 1e-9, 1e-12, 1e-6),
            ("Rodas4", POLLU, 1e-9, 1e-14, 1e-6),
        ],
        quick=[("Rodas5P", ROBER, 1e-10, 1e-14, 1e-8)],  # shares test_rober_to_1e11's
    ),
    ids=lambda x: getattr(x, "name", None),
)
def test_stiff_reference(name, problem, rtol, atol, tol, x64):
    y1, steps = _stiff_solve(name, problem.name)(problem.t1, rtol, atol)
    assert _relative_error(y1, problem.reference) < tol
    assert int(steps) < 20_000


def test_rober_to_1e11(x64):
    """The Test Set's own ROBER end point, t = 1e11 (same compiled solve as t = 1e5)."""
    y1, _ = _stiff_solve("Rodas5P", "rober")(1e11, 1e-10, 1e-20)
    np.testing.assert_allclose(np.asarray(y1), ROBER_1E11, rtol=1e-6)


@pytest.mark.slow
def test_float32():
    """ROBER in float32 (the default), loose tolerance."""
    y0 = jnp.asarray(ROBER.y0, jnp.float32)
    sol = sk.diffeqsolve(
        sk.ODETerm(ROBER.field(1.0)),
        sk.Rodas5P(),
        0.0,
        ROBER.t1,
        1e-6,
        y0,
        stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-8),
    )
    assert sol.ys.dtype == jnp.float32
    assert _relative_error(sol.ys[-1], ROBER.reference) < 1e-2


# --- Gradients: closed-over params of every dtype, under vmap, every adjoint --------


def _grad_field(k, index, mask):
    """A stiff nonlinear field closing over a float `k` (differentiated), an int
    `index` and a bool `mask`."""

    def vector_field(t, y, args):
        rate = jnp.where(mask, 50.0 * k, k)
        forcing = jnp.zeros(2).at[index].set(jnp.sin(t))
        return jnp.stack([-rate * y[0] + y[1] ** 2, rate * y[0] - 3.0 * y[1]]) + forcing

    return vector_field


def _grad_loss(k, index, mask, adjoint, solver=sk.Ros3P, fixed=False):
    controller = (
        sk.ConstantStepSize() if fixed else sk.PIDController(rtol=1e-8, atol=1e-10)
    )
    sol = sk.diffeqsolve(
        sk.ODETerm(_grad_field(k, index, mask)),
        solver(),
        0.0,
        1.0,
        0.02,
        jnp.array([1.0, 0.5]),
        stepsize_controller=controller,
        adjoint=adjoint,
    )
    return jnp.sum(sol.ys[-1] ** 2)


_KS = np.array([0.5, 1.0, 2.0])
_INDEX = np.array([0, 1, 0], np.int32)
_MASK = np.array([True, False, False])


def _batch():
    return jnp.asarray(_KS), jnp.asarray(_INDEX), jnp.asarray(_MASK)


@functools.cache
def _vmapped_grad(adjoint_name, solver_name="Ros3P", fixed=False):
    """`jit(vmap(value_and_grad(loss)))` over `(k, index, mask)`."""
    loss = functools.partial(
        _grad_loss,
        adjoint=getattr(sk, adjoint_name)(),
        solver=SOLVERS[solver_name],
        fixed=fixed,
    )
    return jax.jit(jax.vmap(jax.value_and_grad(loss)))


@pytest.mark.slow
def test_grad_against_finite_differences(x64):
    """With fixed steps the gradient of the discrete solution must match finite
    differences of it closely (a Jacobian treated as constant would not). The
    differences use the values of the same compiled function."""
    fn = _vmapped_grad("RecursiveCheckpointAdjoint", "Ros3P", True)
    ks, index, mask = _batch()
    eps = 1e-6
    _, grads = fn(ks, index, mask)
    plus, _ = fn(ks + eps, index, mask)
    minus, _ = fn(ks - eps, index, mask)
    fd = (np.asarray(plus) - np.asarray(minus)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(grads), fd, rtol=1e-7, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize(
    "adjoint, rtol",
    [("DirectAdjoint", 1e-12), ("BacksolveAdjoint", 1e-4)],
)
def test_grad_between_adjoints(adjoint, rtol, x64):
    """Fixed steps: DirectAdjoint differentiates the same discrete solution.
    BacksolveAdjoint integrates the adjoint ODE, which rebuilds the state backwards
    in time: unstable for the stiff first member (rate 25), so only the others are
    compared."""
    want = _vmapped_grad("RecursiveCheckpointAdjoint", "Ros3P", True)(*_batch())[1]
    got = _vmapped_grad(adjoint, "Ros3P", True)(*_batch())[1]
    keep = slice(None) if adjoint == "DirectAdjoint" else slice(1, None)
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], rtol=rtol)


@pytest.mark.slow
def test_forward_mode_direct_adjoint(x64):
    """`jax.jvp` through DirectAdjoint agrees with reverse mode."""
    loss = functools.partial(
        _grad_loss,
        index=_INDEX[2],
        mask=_MASK[2],
        adjoint=sk.DirectAdjoint(),
        fixed=True,
    )
    _, tangent = jax.jit(lambda k: jax.jvp(loss, (k,), (jnp.ones_like(k),)))(
        jnp.asarray(_KS[2])
    )
    want = _vmapped_grad("DirectAdjoint", "Ros3P", True)(*_batch())[1][2]
    np.testing.assert_allclose(float(tangent), float(want), rtol=1e-10)


# --- Backward time, events, dense output, errors ------------------------------------


# Quick loop: solve/test_integrate.py::test_backwards_against_analytic.
@pytest.mark.slow
def test_backwards_in_time(x64):
    solve = jax.jit(
        lambda t0, t1, y0: sk.diffeqsolve(
            sk.ODETerm(_convergence_field),
            sk.Rodas4(),
            t0,
            t1,
            None,
            y0,
            stepsize_controller=sk.PIDController(rtol=1e-9, atol=1e-12),
        ).ys[-1]
    )
    y1 = solve(0.0, 1.0, jnp.array([2.0, 0.0]))
    np.testing.assert_allclose(np.asarray(y1), _exact(1.0), rtol=1e-7)
    back = solve(1.0, 0.0, jnp.asarray(_exact(1.0)))
    np.testing.assert_allclose(np.asarray(back), [2.0, 0.0], atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Rodas4", "Ros3P"])
def test_event_and_dense_output(name, x64):
    """`y' = -y²` from 1 (solution `1/(1 + t)`) stops where `y = 1/2`, at `t = 1`,
    located on the dense output; the dense output matches the solution between
    steps. (Not a linear problem: ROS3P's error estimate vanishes on linear
    constant-coefficient problems, its embedded method having the same stability
    function.)"""

    def solve():
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -(y**2)),
            SOLVERS[name](),
            0.0,
            5.0,
            0.1,
            jnp.array([1.0]),
            saveat=sk.SaveAt(t1=True, dense=True),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-10),
            event=sk.Event(lambda t, y, args, **kw: y[0] - 0.5),
        )

    sol = jax.jit(solve)()
    assert sol.result == sk.RESULTS.event_occurred
    np.testing.assert_allclose(float(sol.ts[-1]), 1.0, rtol=1e-6)
    ts = jnp.linspace(0.05, 0.95, 7)
    dense = eqx.filter_jit(lambda s, ts: jax.vmap(s.evaluate)(ts))(sol, ts)[:, 0]
    np.testing.assert_allclose(np.asarray(dense), 1 / (1 + np.asarray(ts)), rtol=1e-6)


@pytest.mark.slow
def test_saveat_progress_key_and_throw(x64, capsys):
    """SaveAt ts and steps, a text progress meter, a PRNG key closed over (the
    rate is drawn from it), and max_steps reported or raised."""
    key = jax.random.PRNGKey(0)

    def vector_field(t, y, args):
        rate = 1.0 + jax.random.uniform(key)
        return -rate * y

    rate = 1.0 + float(jax.random.uniform(key))
    ts = jnp.linspace(0.1, 1.0, 4)

    def solve(max_steps, throw):
        return sk.diffeqsolve(
            sk.ODETerm(vector_field),
            sk.Rosenbrock23(),
            0.0,
            1.0,
            0.05,
            jnp.array([1.0, 2.0]),
            saveat=sk.SaveAt(subs=[sk.SubSaveAt(ts=ts), sk.SubSaveAt(steps=True)]),
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-9),
            progress_meter=sk.TextProgressMeter(),
            max_steps=max_steps,
            throw=throw,
        )

    sol = solve(256, True)
    at_ts, at_steps = sol.ys
    want = np.exp(-rate * np.asarray(ts))[:, None] * np.array([1.0, 2.0])
    np.testing.assert_allclose(np.asarray(at_ts), want, rtol=1e-4)
    accepted = int(sol.stats["num_accepted_steps"])
    assert np.all(np.isfinite(np.asarray(at_steps)[:accepted]))
    assert float(sol.ts[1][accepted - 1]) == 1.0
    assert "100.00%" in capsys.readouterr().out
    with pytest.raises(RuntimeError):
        solve(3, True)


# Quick loop: test_convergence_order[Rodas5P].
@pytest.mark.slow
def test_ros3p_error_estimate_blind_to_linear_part(x64):
    """ROS3P's published pair (Lang & Verwer 2001): `α21 + γ21 = 0`, so on
    `y' = Ay + bt + c` the first two stages agree and the estimate `(k1 - k2)/3`
    vanishes (not with a `t²` forcing); on these stages every second-order
    embedded method has weights ∝ (1, -1, 0). A property of the method
    (documented in `Ros3P`), pinned here."""
    alpha, gamma_matrix, b, b_hat = ROS3P.standard()
    assert abs(alpha[1, 0] + gamma_matrix[1, 0]) < 1e-14
    np.testing.assert_allclose(b - b_hat, [1 / 3, -1 / 3, 0], atol=1e-14)
    beta = (alpha + gamma_matrix - np.diag(np.diag(gamma_matrix))).sum(axis=1)
    conditions = np.stack([np.ones(3), beta])  # Σ e = 0, Σ e β = 0
    null = np.linalg.svd(conditions)[2][-1]
    np.testing.assert_allclose(np.abs(null / null[0]), [1, 1, 0], atol=1e-14)

    @jax.jit  # one program (op by op: 62 compiles)
    def estimates(a, y0, t0, t1):
        errors = []
        for square in (False, True):
            term = sk.ODETerm(
                lambda t, y, args: (
                    a @ y + jnp.stack([t**2 if square else 3 * t, 2.0 + 0 * t])
                )
            )
            solver = sk.Ros3P()
            state = solver.init(term, t0, t1, y0, None)
            errors.append(solver.step(term, t0, t1, y0, None, state, False)[1])
        return errors

    a = jnp.array([[-1.0, 0.5], [0.0, -100.0]])
    errors = estimates(a, jnp.array([1.0, 1.0]), jnp.asarray(0.0), jnp.asarray(0.1))
    assert float(jnp.max(jnp.abs(errors[0]))) < 1e-14
    assert float(jnp.max(jnp.abs(errors[1]))) > 1e-6
