"""BDF: accuracy against the Test Set references and SciPy, step counts, fixed-step
order, dense output, events, vmap/jit/closures, mass matrices (DAEs), bad input, and
gradients against finite differences under every adjoint, with the dense and a
matrix-free linear solver.

Compiles are few: each jitted solve below is shared by the tests that use it.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_equations, FULL_MATRIX, full_matrix_only

import solverkit as sk
from benchmarks.problems import HIRES, ROBER, VDPOL
from solverkit._controller._norm import rms_norm
from solverkit._linear._linear_solver import AbstractLinearSolver, mass_matvec


pytestmark = pytest.mark.usefixtures("x64")


class MatrixFree(AbstractLinearSolver):
    """A test-only matrix-free linear solver: `linearise` keeps only the point,
    `solve` materialises `M - γhJ` there from Jacobian-vector products of the field
    it is given and solves densely."""

    def linearise(self, fn, x):
        return fn(x), x

    def factorise(self, jac, gamma_h, mass):
        return jac, jnp.asarray(gamma_h), mass

    def solve(self, factor, rhs, fn):
        x, gamma_h, mass = factor
        n = x.shape[0]
        cols = jax.vmap(lambda v: jax.jvp(fn, (x,), (v,))[1])(jnp.eye(n, dtype=x.dtype))
        matrix = jax.vmap(lambda c: mass_matvec(mass, c))(jnp.eye(n, dtype=x.dtype))
        matrix = matrix.T - gamma_h * cols.T
        return jnp.linalg.solve(matrix, rhs)


def _rober(k1):
    def vf(t, y, args):
        y1, y2, y3 = y[0], y[1], y[2]
        return jnp.stack(
            [
                -k1 * y1 + 1e4 * y2 * y3,
                k1 * y1 - 3e7 * y2 * y2 - 1e4 * y2 * y3,
                3e7 * y2 * y2,
            ]
        )

    return vf


def _rober_dae(k1):
    """ROBER with its conservation law `y1 + y2 + y3 = 1` as the third equation."""

    def vf(t, y, args):
        f = _rober(k1)(t, y, args)
        return f.at[2].set(y[0] + y[1] + y[2] - 1)

    return vf


_N = 6
_xs = np.linspace(0, 1, _N)
_X, _Y = np.meshgrid(_xs, _xs)
BRUSS_Y0 = np.stack([22 * _Y * (1 - _Y) ** 1.5, 27 * _X * (1 - _X) ** 1.5])


def _brusselator(alpha):
    """The 2-D Brusselator on a periodic 6×6 grid, diffusion `alpha`."""

    def lap(w):
        s = jnp.roll(w, 1, 0) + jnp.roll(w, -1, 0) + jnp.roll(w, 1, 1)
        return (s + jnp.roll(w, -1, 1) - 4 * w) * (_N - 1) ** 2

    def vf(t, y, args):
        u, v = y[0], y[1]
        du = 1.0 + u * u * v - 4.4 * u + alpha * lap(u)
        dv = 3.4 * u - u * u * v + alpha * lap(v)
        return jnp.stack([du, dv])

    return vf


def _solve(vf, solver, t1, y0, rtol, atol, **kwargs):
    kwargs.setdefault("max_steps", 100_000)
    return sk.diffeqsolve(
        sk.ODETerm(vf),
        solver,
        0.0,
        t1,
        None,
        y0,
        stepsize_controller=sk.PIDController(rtol=rtol, atol=atol),
        **kwargs,
    )


@functools.partial(jax.jit, static_argnames=("name", "solver"))
def _problem_solve(name, solver):
    problem = {"rober": ROBER, "hires": HIRES, "vdpol": VDPOL}[name]
    tol = {"rober": (1e-8, 1e-14), "hires": (1e-8, 1e-12), "vdpol": (1e-8, 1e-8)}
    return _solve(
        problem.field(1.0), solver, problem.t1, jnp.asarray(problem.y0), *tol[name]
    )


def _scipy_bdf(name):
    from scipy.integrate import solve_ivp

    problem = {"rober": ROBER, "hires": HIRES, "vdpol": VDPOL}[name]
    # Jitted: SciPy calls it thousands of times (its Jacobians by differences), and
    # the field's operations one by one cost milliseconds a call.
    vf = jax.jit(problem.field(1.0))
    out = solve_ivp(
        lambda t, y: np.asarray(vf(t, y, None)),
        (0.0, problem.t1),
        problem.y0,
        method="BDF",
        rtol=1e-8,
        atol={"rober": 1e-14, "hires": 1e-12, "vdpol": 1e-8}[name],
    )
    return out.y[:, -1], len(out.t) - 1


@pytest.mark.parametrize("name", ["rober", "hires", "vdpol"])
@pytest.mark.quick_cases("rober")
def test_stiff_test_set(name):
    """Against the Test Set's references, with about SciPy's BDF's step count."""
    problem = {"rober": ROBER, "hires": HIRES, "vdpol": VDPOL}[name]
    sol = _problem_solve(name, sk.BDF())
    assert sol.result == sk.RESULTS.successful
    y = np.asarray(sol.ys[-1])
    ref = problem.reference
    scale = np.abs(ref) + {"rober": 1e-12, "hires": 1e-8, "vdpol": 1e-4}[name]
    assert np.max(np.abs(y - ref) / scale) < 1e-4
    scipy_y, scipy_steps = _scipy_bdf(name)
    assert np.max(np.abs(y - scipy_y) / scale) < 1e-4
    steps = int(sol.stats["num_accepted_steps"])
    assert 0.5 * scipy_steps < steps < 1.5 * scipy_steps


@pytest.mark.parametrize("max_order", [1, 2])
# Quick loop: test_stiff_test_set[rober].
@pytest.mark.slow
def test_fixed_step_order(max_order):
    """With a constant step the error falls as `dt^max_order` (linear problem)."""
    a = jnp.array([[-1.0, 2.0], [-2.0, -1.0]])
    y0 = jnp.array([1.0, 0.0])
    exact = jax.scipy.linalg.expm(2.0 * a) @ y0
    solver = sk.BDF(max_order=max_order, rtol=1e-10, atol=1e-10)
    errors = []
    for n in (200, 400, 800):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: a @ y), solver, 0.0, 2.0, 2.0 / n, y0
        )
        errors.append(float(jnp.max(jnp.abs(sol.ys[-1] - exact))))
    slopes = np.log2(np.asarray(errors[:-1]) / np.asarray(errors[1:]))
    assert np.all(np.abs(slopes - max_order) < 0.2), slopes


# The full suite; the quick loop solves with the default (NDF) form.
@pytest.mark.slow
def test_ndf_and_bdf_forms():
    """Both forms are accurate; `ndf=False` are the classical BDFs."""
    for ndf in (True, False):
        sol = _solve(
            lambda t, y, args: -y, sk.BDF(ndf=ndf), 5.0, jnp.ones(2), 1e-8, 1e-10
        )
        assert jnp.allclose(sol.ys[-1], jnp.exp(-5.0), rtol=1e-6)


@jax.jit
def _decay_dense(k):
    saveat = sk.SaveAt(ts=jnp.linspace(0.0, 3.0, 7), dense=True)
    return _solve(
        lambda t, y, args: -k * y,
        sk.BDF(),
        3.0,
        jnp.array([1.0, 2.0]),
        1e-9,
        1e-12,
        saveat=saveat,
    )


# Quick loop: test_stiff_test_set[rober].
@pytest.mark.slow
def test_saveat_ts_and_dense():
    sol = _decay_dense(1.5)
    ts = jnp.linspace(0.0, 3.0, 7)
    exact = jnp.exp(-1.5 * ts)[:, None] * jnp.array([[1.0, 2.0]])
    assert jnp.allclose(sol.ys, exact, rtol=1e-6, atol=1e-12)
    ts = jnp.array([0.1, 1.234, 2.99])
    dense = eqx.filter_jit(lambda s, ts: jax.vmap(s.evaluate)(ts))(sol, ts)
    for t, y in zip(ts, dense):
        assert jnp.allclose(y, jnp.exp(-1.5 * t) * jnp.array([1.0, 2.0]), rtol=1e-5)


# The full suite; the quick loop's events: tests/events/test_events.py.
@pytest.mark.slow
def test_event():
    """A zero crossing located through the dense output."""
    event = sk.Event(lambda t, y, args, **kw: y[0] - 0.5)
    sol = _solve(
        lambda t, y, args: -y, sk.BDF(), 5.0, jnp.ones(1), 1e-9, 1e-12, event=event
    )
    assert sol.result == sk.RESULTS.event_occurred
    assert jnp.allclose(sol.ts[-1], jnp.log(2.0), rtol=1e-6)


@jax.jit
def _rober_batch(scales, index):
    """Closes over a float array, an int index (vmapped) and a bool."""
    table = jnp.array([0.02, 0.04, 0.08])
    flag = jnp.array(True)

    def one(scale, i):
        k1 = jnp.where(flag, table[i] * scale, 0.0)
        return _solve(_rober(k1), sk.BDF(), 40.0, jnp.array([1.0, 0, 0]), 1e-7, 1e-12)

    return jax.vmap(one)(scales, index).ys[:, -1]


# Quick loop: solvers/test_bdf_vmap.py::test_vmapped_solve_is_elementwise.
@pytest.mark.slow
def test_vmap_jit_closures():
    scales = jnp.array([1.0, 0.5, 2.0])
    index = jnp.array([1, 2, 0], jnp.int32)
    ys = _rober_batch(scales, index)
    for s, i, y in zip(scales, index, ys):
        k1 = float(jnp.array([0.02, 0.04, 0.08])[i] * s)
        one = _solve(_rober(k1), sk.BDF(), 40.0, jnp.array([1.0, 0, 0]), 1e-7, 1e-12)
        assert jnp.allclose(y, one.ys[-1], rtol=1e-6, atol=1e-12)


@jax.jit
def _rober_dae_solve(y0):
    solver = sk.BDF(mass_matrix=jnp.array([1.0, 1.0, 0.0]))
    return _solve(_rober_dae(0.04), solver, 40.0, y0, 1e-8, 1e-12, throw=False)


# The full suite; the quick loop solves DAEs in tests/solvers/test_dae.py.
@pytest.mark.slow
def test_mass_matrix_dae():
    """ROBER as an index-1 DAE (diagonal singular mass) agrees with the ODE."""
    sol = _rober_dae_solve(jnp.array([1.0, 0.0, 0.0]))
    assert sol.result == sk.RESULTS.successful
    ode = _solve(_rober(0.04), sk.BDF(), 40.0, jnp.array([1.0, 0, 0]), 1e-8, 1e-12)
    assert jnp.allclose(sol.ys[-1], ode.ys[-1], rtol=1e-5, atol=1e-11)
    assert jnp.allclose(jnp.sum(sol.ys[-1]), 1.0, atol=1e-12)


# The full suite; the quick loop's inconsistent DAE initial values:
# tests/solvers/test_dae.py.
@pytest.mark.slow
def test_inconsistent_initial_values():
    sol = _rober_dae_solve(jnp.array([1.0, 0.0, 0.5]))
    assert sol.result == sk.RESULTS.inconsistent_initial_values
    solver = sk.BDF(mass_matrix=jnp.array([1.0, 1.0, 0.0]))
    with pytest.raises(RuntimeError, match="nconsistent"):
        _solve(_rober_dae(0.04), solver, 1.0, jnp.array([1.0, 0, 0.5]), 1e-6, 1e-9)


# The full suite; the quick loop's mass matrices: tests/solvers/test_dae.py.
@pytest.mark.slow
def test_dense_mass_matrix():
    """`M y' = M f` with a full invertible `M` has the solution of `y' = f`."""
    m = jnp.array([[2.0, 1.0, 0.0], [0.5, 3.0, 0.2], [0.0, 0.3, 1.0]])
    vf = lambda t, y, args: m @ _rober(0.04)(t, y, args)
    sol = _solve(vf, sk.BDF(mass_matrix=m), 40.0, jnp.array([1.0, 0, 0]), 1e-8, 1e-12)
    ode = _solve(_rober(0.04), sk.BDF(), 40.0, jnp.array([1.0, 0, 0]), 1e-8, 1e-12)
    assert jnp.allclose(sol.ys[-1], ode.ys[-1], rtol=1e-5, atol=1e-11)


# The full suite; the quick loop's singular iteration matrix: tests/solvers/test_dae.py.
@pytest.mark.slow
@pytest.mark.parametrize(
    "linear_solver",
    [sk.DenseLinearSolver(), sk.SparseLinearSolver(np.tril(np.ones((3, 3), bool)))],
    ids=["dense", "sparse"],
)
def test_singular_iteration_matrix(linear_solver):
    """`M = diag(1, 1, 0)` with the algebraic equation `0 = 0·y3`: `M - cJ` is
    singular for every step size. The solve ends with `RESULTS.singular` after one
    step, as Rosenbrock's does (it used to shrink the step until `max_steps`), under
    `jit` and `vmap` over a closed-over rate and int index; a solve with a regular
    pencil (the third equation `0 = y3 - y1`) is unaffected."""
    rates = jnp.array([1.0, 2.0])

    def solve(scale, index, algebraic):
        def vf(t, y, args):
            rate = scale * rates[index]
            return jnp.stack([-rate * y[0], y[0] - y[1], algebraic * (y[2] - y[0])])

        solver = sk.BDF(
            mass_matrix=jnp.array([1.0, 1.0, 0.0]), linear_solver=linear_solver
        )
        return _solve(
            vf,
            solver,
            1.0,
            jnp.array([1.0, 0.0, 1.0]),
            1e-6,
            1e-9,
            throw=False,
            max_steps=1000,
        )

    batched = jax.jit(jax.vmap(solve, in_axes=(0, 0, None)))
    scales, indices = jnp.array([1.0, 0.5]), jnp.array([0, 1], jnp.int32)
    sol = batched(scales, indices, 0.0)
    assert np.all(sol.result == sk.RESULTS.singular)
    assert np.all(sol.stats["num_steps"] == 1)
    assert np.all(np.isfinite(sol.ys))
    regular = batched(scales, indices, 1.0)
    assert np.all(regular.result == sk.RESULTS.successful)
    # y1 = exp(-rate t) with rate = 1 for both; to the tolerance's order.
    np.testing.assert_allclose(regular.ys[:, -1, 0], np.exp(-1.0), rtol=1e-4)


def _two_norm(x):
    return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree_util.tree_leaves(x)))


def _max_norm(x):
    return jnp.max(
        jnp.stack([jnp.max(jnp.abs(v)) for v in jax.tree_util.tree_leaves(x)])
    )


def _copies(rate):
    """Prothero–Robinson, `y' = -rate (y - cos t) - sin t`, three identical copies:
    every error vector has equal entries."""

    def vf(t, y, args):
        return -rate * 1e3 * (y - jnp.cos(t)) - jnp.sin(t)

    return vf


_NORMS = {"rms": rms_norm, "two": _two_norm, "max": _max_norm}


@functools.partial(jax.jit, static_argnames="differentiate")
def _norm_steps(rates, problem, norm, tol, differentiate):
    """Accepted step times, states and (if `differentiate`) the gradient of a
    weighted sum of the states with respect to the closed-over rate, with
    `PIDController(rtol=tol, atol=tol * 1e-3, norm=norm)`, vmapped over the rate.

    One program for every case: the problem (`True`: ROBER, `False`: `_copies`),
    the norm (an index into `_NORMS`) and the tolerance are operands, the field and
    the norm the ones a select chooses (the same values, bit for bit, as a program
    for each case). The states and times come out of the gradient's forward pass
    (`has_aux`): no second forward program (12.9 -> 12.2 CPU s side by side). (A
    norm closing over a traced value is traced 113 times here, a plain one 15:
    about 4 of the program's 7 CPU s of tracing.)"""

    def norm_fn(x):
        values = [fn(x) for fn in _NORMS.values()]
        return jnp.select([norm == i for i in range(len(values))], values)

    def field(rate):
        rober, copies = _rober(rate), _copies(rate)
        return lambda t, y, args: jnp.where(
            problem, rober(t, y, args), copies(t, y, args)
        )

    y0 = jnp.where(problem, jnp.array([1.0, 0.0, 0.0]), jnp.ones(3))

    def run(rate):
        return sk.diffeqsolve(
            sk.ODETerm(field(rate)),
            sk.BDF(),
            0.0,
            1.0,
            1e-4,
            y0,
            saveat=sk.SaveAt(steps=True),
            stepsize_controller=sk.PIDController(
                rtol=tol, atol=tol * 1e-3, norm=norm_fn
            ),
            max_steps=256,
        )

    def loss(rate):
        sol = run(rate)
        weights = jnp.array([[1.0, 1e4, 1.0]])
        value = jnp.sum(jnp.where(jnp.isfinite(sol.ys), sol.ys, 0) * weights)
        return value, (sol.ts, sol.ys)

    if not differentiate:
        _, (ts, ys) = jax.vmap(loss)(rates)
        return ts, ys
    (_, (ts, ys)), grads = jax.vmap(jax.value_and_grad(loss, has_aux=True))(rates)
    return ts, ys, grads


# The full suite, under `jit` and `vmap`; the gradient (a vmapped BDF gradient: a
# ~15 CPU-second compile, shared by the four solves of both cases) with
# `SOLVERKIT_FULL_MATRIX=1` only: BDF's gradient is test_grad_rober's, vmapped
# tests/linear/test_linear_solver_grad.py::test_gradient's. The quick loop
# differentiates BDF in test_grad_rober and vmaps it in solvers/test_bdf_vmap.py.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["two", "max"])
def test_controller_norms(name):
    """BDF hands its step-size factor to the controller through `y_error`, which the
    controller measures in its own norm: the steps must be BDF's own choice in that
    norm. `two_norm = √n rms_norm`, so with the 2-norm at tolerance `√3 tol` (n = 3)
    the steps of ROBER must be those of the RMS norm at `tol` (BDF's own error
    measures scale alike); with equal entries `max_norm = rms_norm`, so on three
    copies of one equation the max norm must take the RMS norm's steps. Under `jit`,
    `vmap` over a closed-over rate (and `grad`, with `SOLVERKIT_FULL_MATRIX=1`).
    (The 2-norm used to see `√n` times the error: spurious rejections and smaller
    steps.)"""
    rober = name == "two"  # else three copies of Prothero-Robinson
    rates = jnp.array([0.04, 0.08]) if rober else jnp.array([1.0, 2.0])
    tol = 1e-3  # Newton's tolerance min(0.03, √rtol) is 0.03 at both tolerances
    index = list(_NORMS).index
    steps = functools.partial(_norm_steps, differentiate=FULL_MATRIX)
    want = steps(rates, rober, index("rms"), tol)
    if rober:
        got = steps(rates, rober, index("two"), tol * np.sqrt(3))
    else:
        got = steps(rates, rober, index("max"), tol)
    # The same arithmetic up to the rounding of √3 (or none): the same steps.
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-14)


# Quick loop: the error tests of solve/test_errors.py.
@pytest.mark.slow
def test_bad_input():
    vf = lambda t, y, args: -y
    y0 = jnp.ones(2)
    with pytest.raises(ValueError, match="max_order"):
        sk.BDF(max_order=6)
    with pytest.raises(ValueError, match="newton_max_steps"):
        sk.BDF(newton_max_steps=0)
    with pytest.raises(ValueError, match="mass_matrix"):
        sk.BDF(mass_matrix=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="mass_matrix"):
        _solve(vf, sk.BDF(mass_matrix=jnp.ones(3)), 1.0, y0, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="I-controller"):
        sk.diffeqsolve(
            sk.ODETerm(vf),
            sk.BDF(),
            0.0,
            1.0,
            0.1,
            y0,
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6, pcoeff=0.3),
        )
    with pytest.raises(ValueError, match="tolerances"):
        sk.diffeqsolve(sk.ODETerm(vf), sk.BDF(), 0.0, 1.0, 0.1, y0)
    # With a fixed step and tolerances given, it runs.
    sol = sk.diffeqsolve(sk.ODETerm(vf), sk.BDF(rtol=1e-6, atol=1e-6), 0, 1, 0.01, y0)
    assert jnp.allclose(sol.ys[-1], jnp.exp(-1.0), rtol=1e-3)


# The full suite; the quick loop's ClipStepSizeController:
# tests/diffrax_compat/test_clip_step_ends.py.
@pytest.mark.slow
def test_clip_controller():
    controller = sk.ClipStepSizeController(
        sk.PIDController(rtol=1e-8, atol=1e-10), step_ts=jnp.array([0.5, 1.7])
    )
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -y),
        sk.BDF(),
        0.0,
        3.0,
        None,
        jnp.ones(1),
        stepsize_controller=controller,
    )
    assert jnp.allclose(sol.ys[-1], jnp.exp(-3.0), rtol=1e-6)


# --- gradients --------------------------------------------------------------------


def _rober_loss(k1, solver, adjoint, rtol=1e-8, y0=None):
    sol = _solve(
        _rober(k1),
        solver,
        10.0,
        jnp.array([1.0, 0, 0]) if y0 is None else y0,
        rtol,
        1e-3 * rtol,
        adjoint=adjoint,
    )
    return sol.ys[-1, 0] + 1e4 * sol.ys[-1, 1]


def _bruss_loss(alpha, solver, adjoint, rtol=1e-8):
    sol = _solve(
        _brusselator(alpha),
        solver,
        1.5,
        jnp.asarray(BRUSS_Y0),
        rtol,
        rtol,
        adjoint=adjoint,
    )
    return jnp.sum(sol.ys[-1, 0] ** 2)


def _central(f, x, eps):
    return (f(x + eps) - f(x - eps)) / (2 * eps)


@functools.partial(jax.jit, static_argnames=("solver", "adjoint"))
def _rober_grads(solver, adjoint, x, y0):
    """The gradient of ROBER's loss with respect to `k1` and to `y0`, one program:
    test_grad_rober reads the first, test_forward_mode_and_y0 the second."""
    loss = lambda x, y0: _rober_loss(x, solver, adjoint, y0=y0)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))(x, y0)


@functools.partial(jax.jit, static_argnames=("solver", "adjoint"))
def _bruss_grad(solver, adjoint, x):
    return jax.grad(lambda x: _bruss_loss(x, solver, adjoint))(x)


def _grad(problem, solver, adjoint, x):
    if problem == "rober":
        return _rober_grads(solver, adjoint, x, jnp.array([1.0, 0.0, 0.0]))[0]
    return _bruss_grad(solver, adjoint, x)


@jax.jit
def _rober_reference(x, y0):
    """ROBER's loss at rtol 1e-11 as a function of `k1` and `y0`, compiled once for
    the central differences in both."""
    return _rober_loss(x, sk.BDF(), sk.RecursiveCheckpointAdjoint(), 1e-11, y0)


@functools.cache
def _reference_loss(problem):
    """The loss at rtol 1e-11, jitted once: both evaluations of a central difference
    run one compiled solve (a jitted difference would compile the solve twice)."""
    if problem == "rober":
        return lambda x: _rober_reference(x, jnp.array([1.0, 0.0, 0.0]))
    loss = functools.partial(
        _bruss_loss, solver=sk.BDF(), adjoint=sk.RecursiveCheckpointAdjoint()
    )
    return jax.jit(lambda x: loss(x, rtol=1e-11))


def _fd(problem, x):
    eps = {"rober": 1e-5, "bruss": 1e-5}[problem]
    return _central(_reference_loss(problem), x, eps)


ADJOINTS = [sk.RecursiveCheckpointAdjoint(), sk.DirectAdjoint()]


# The matrix-free solver's gradient is test_grad_brusselator_matrix_free's;
# `SOLVERKIT_FULL_MATRIX=1` runs it on ROBER too (both adjoints).
_MATRIX_FREE = full_matrix_only("test_grad_brusselator_matrix_free")
# DirectAdjoint through BDF (a vmapped gradient against the checkpointed adjoint's
# and finite differences) is tests/linear/test_linear_solver_grad.py::test_gradient's
# BDF-sparse-banded-direct and tests/linear/test_krylov_grad.py::test_other_adjoints;
# `SOLVERKIT_FULL_MATRIX=1` runs it on ROBER and the Brusselator too.
_DIRECT = "linear/test_linear_solver_grad.py::test_gradient[BDF-sparse-banded-direct]"


@pytest.mark.parametrize(
    "adjoint",
    [ADJOINTS[0], pytest.param(ADJOINTS[1], marks=full_matrix_only(_DIRECT))],
    ids=lambda a: type(a).__name__,
)
@pytest.mark.parametrize(
    "linear_solver",
    [sk.DenseLinearSolver(), pytest.param(MatrixFree(), marks=_MATRIX_FREE)],
)
# Quick loop: one case.
@pytest.mark.quick_cases("linear_solver0-RecursiveCheckpointAdjoint")
def test_grad_rober(adjoint, linear_solver):
    x = jnp.asarray(0.04)
    g = _grad("rober", sk.BDF(linear_solver=linear_solver), adjoint, x)
    fd = _fd("rober", x)
    assert jnp.allclose(g, fd, rtol=2e-5), (g, fd)


# `SOLVERKIT_FULL_MATRIX=1` only (6.5 CPU s): the Brusselator's BDF
# gradient against finite differences is test_grad_brusselator_matrix_free (the same
# solve, its Newton matrix by a user's linear solver), the dense solver's BDF gradient
# test_grad_rober's and tests/linear/test_linear_solver_grad.py's reference (vmapped).
@pytest.mark.slow
@full_matrix_only("test_grad_brusselator_matrix_free and test_grad_rober")
@pytest.mark.parametrize(
    "adjoint",
    [ADJOINTS[0], pytest.param(ADJOINTS[1], marks=full_matrix_only(_DIRECT))],
    ids=lambda a: type(a).__name__,
)
def test_grad_brusselator(adjoint):
    """The 6×6 Brusselator: BDF's gradient against finite differences (and, with
    `SOLVERKIT_FULL_MATRIX=1`, Rodas5P's: a Rosenbrock method's adaptive-step
    gradient against finite differences is tests/linear/test_krylov_grad.py::
    test_rosenbrock_preconditioner_closing_over_parameters's dense reference and
    tests/solvers/test_dae.py::test_grad_wrt_mass_matrix_matches_fd[Rodas5P-*])."""
    x = jnp.asarray(0.02)
    g = _grad("bruss", sk.BDF(), adjoint, x)
    fd = _fd("bruss", x)
    assert jnp.allclose(g, fd, rtol=1e-5), (g, fd)
    if FULL_MATRIX:
        rodas = _grad("bruss", sk.Rodas5P(), sk.RecursiveCheckpointAdjoint(), x)
        assert jnp.allclose(g, rodas, rtol=1e-5), (g, rodas)


# `SOLVERKIT_FULL_MATRIX=1` only: BDF's gradient through a matrix-free linear solver
# is tests/linear/test_krylov_grad.py::test_bdf_krylov_gradient's, a user's linear
# solver's gradient tests/linear/test_implicit_linear_solver.py::
# test_grad_with_user_linear_solver_matches_fd's.
@pytest.mark.slow
@full_matrix_only(
    "tests/linear/test_krylov_grad.py::test_bdf_krylov_gradient, "
    "test_implicit_linear_solver.py::test_grad_with_user_linear_solver_matches_fd"
)
def test_grad_brusselator_matrix_free():
    x = jnp.asarray(0.02)
    g = _grad("bruss", sk.BDF(linear_solver=MatrixFree()), ADJOINTS[0], x)
    assert jnp.allclose(g, _fd("bruss", x), rtol=1e-5)


# `SOLVERKIT_FULL_MATRIX=1` only (a vmapped BDF gradient, 7.5 CPU s): BDF's gradient
# vmapped over a closed-over int index, against finite differences, is
# tests/linear/test_linear_solver_grad.py::test_gradient's dense reference (BDF, vmapped
# over the int `k` its field closes over) and tests/linear/test_krylov_grad.py's.
@pytest.mark.slow
@full_matrix_only("tests/linear/test_linear_solver_grad.py::test_gradient")
def test_grad_vmapped_index():
    """Gradient with respect to a closed-over float, vmapped over a closed-over int
    index."""
    table = jnp.array([0.02, 0.04, 0.08])

    @jax.jit
    def grads(x, index):
        def one(i):
            return jax.grad(
                lambda x: _rober_loss(
                    x * table[i], sk.BDF(), sk.RecursiveCheckpointAdjoint()
                )
            )(x)

        return jax.vmap(one)(index)

    index = jnp.array([0, 2], jnp.int32)
    g = grads(jnp.asarray(1.0), index)
    for i, gi in zip(index, g):
        f = lambda x: _rober_loss(
            x * table[i], sk.BDF(), sk.RecursiveCheckpointAdjoint(), 1e-11
        )
        assert jnp.allclose(gi, _central(f, 1.0, 1e-5), rtol=2e-5)


def _backsolve_loss(k, solver):
    sol = _solve(
        lambda t, y, args: -k * y,
        solver,
        3.0,
        jnp.ones(2),
        1e-8,
        1e-10,
        adjoint=sk.BacksolveAdjoint(),
    )
    return jnp.sum(sol.ys[-1])


# `SOLVERKIT_FULL_MATRIX=1` only (1.7 CPU s): BDF's BacksolveAdjoint gradient is
# tests/linear/test_linear_solver_grad.py::test_gradient[BDF-sparse-blocks-backsolve]
# (against the dense solver's and finite differences, vmapped).
@pytest.mark.slow
@full_matrix_only(
    "test_linear_solver_grad.py::test_gradient[BDF-sparse-blocks-backsolve]"
)
def test_backsolve():
    """BacksolveAdjoint: matches the exact gradient."""
    g = jax.jit(jax.grad(lambda k: _backsolve_loss(k, sk.BDF())))(1.5)  # one program
    assert jnp.allclose(g, -2 * 3.0 * jnp.exp(-4.5), rtol=1e-5)


# The full suite; the quick loop runs BacksolveAdjoint in tests/adjoint/test_adjoint.py.
@pytest.mark.slow
def test_backsolve_with_a_mass_matrix_raises():
    """BacksolveAdjoint with a mass matrix: a clear error."""
    with pytest.raises(ValueError, match="BacksolveAdjoint"):
        jax.grad(lambda k: _backsolve_loss(k, sk.BDF(mass_matrix=jnp.ones(2))))(1.5)


class _Counting(AbstractLinearSolver):
    """The dense solver, counting its Jacobians and factorisations at run time."""

    counts: dict = eqx.field(static=True)

    def _count(self, name):
        self.counts[name] += 1

    def linearise(self, fn, x):
        jax.debug.callback(
            lambda: self.counts.__setitem__("jac", self.counts["jac"] + 1)
        )
        return sk.DenseLinearSolver().linearise(fn, x)

    def factorise(self, jac, gamma_h, mass):
        jax.debug.callback(lambda: self._count("lu"))
        return sk.DenseLinearSolver().factorise(jac, gamma_h, mass)

    def solve(self, factor, rhs, fn):
        return sk.DenseLinearSolver().solve(factor, rhs, fn)


# The full suite; the quick loop's reuse: tests/linear/test_implicit_linear_solver.py.
@pytest.mark.slow
def test_jacobian_and_factor_reuse():
    """Far fewer Jacobians and factorisations than steps (CVODE's rules), and the
    counters in the state obey the limits."""
    counts = {"jac": 0, "lu": 0}
    solver = sk.BDF(linear_solver=_Counting(counts))
    sol = _solve(
        ROBER.field(1.0),
        solver,
        ROBER.t1,
        jnp.asarray(ROBER.y0),
        1e-6,
        1e-10,
        saveat=sk.SaveAt(t1=True, solver_state=True),
    )
    steps = int(sol.stats["num_steps"])
    print("steps", steps, "jacobians", counts["jac"], "factorisations", counts["lu"])
    # (One Jacobian at `init`; each eager `lax.cond` branch runs only when taken.)
    assert 1 <= counts["jac"] < steps / 5, (counts, steps)
    assert 1 <= counts["lu"] < steps / 2, (counts, steps)
    state = sol.solver_state
    assert int(state.cache.jac_age) <= 50 and int(state.cache.factor_age) <= 20


# Quick loop: test_stiff_test_set[rober].
@pytest.mark.slow
def test_revert_keeps_the_cache_of_a_rejected_step():
    """A rejected step reverts the differences, the step size and the order, and
    keeps the step's Jacobian and factor (as SciPy's BDF does)."""
    solver, term = sk.BDF(rtol=1e-6, atol=1e-10), sk.ODETerm(_rober(0.04))

    @jax.jit  # one program (op by op: 97 compiles)
    def states(y0):
        old = solver.init(term, 0.0, 1.0, y0, None)
        *_, new, _ = solver.step(term, 0.0, 1e-3, y0, None, old, False)
        reverted = [solver.revert(jnp.asarray(b), new, old) for b in (False, True)]
        return old, new, *reverted

    old, new, rejected, accepted = states(jnp.array([1.0, 0.0, 0.0]))
    same = lambda a, b: all(  # noqa: E731
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    assert not same(new.cache, old.cache)  # the step made a factor
    assert same(rejected._replace(cache=None), old._replace(cache=None))
    assert same(rejected.cache, new.cache)
    assert same(accepted, new)


def test_difference_rows_reverse_mode_has_no_pads():
    """The rows of the difference array are taken by one `unstack` per function,
    whose reverse mode stacks their cotangents back in one equation: a slice per
    use was transposed to a padded copy of the array each, and made the rescaling,
    prediction and update most of BDF's gradient program."""
    from solverkit._solver import _bdf_rows as rows
    from solverkit._solver._bdf_formulas import coefficients

    gamma, alpha, _ = coefficients(5, True)
    order = jnp.asarray(3, jnp.int32)

    def loss(D, r, d):
        D = rows.rescale(D, order, r, 5)
        y_pred, psi = rows.predict(D, order, gamma, alpha)
        return jnp.sum(rows.update(D, d + y_pred + psi, order) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    D, d = jnp.arange(24.0).reshape(8, 3) / 10, jnp.ones(3)
    jaxpr = jax.make_jaxpr(grad)(D, jnp.asarray(0.7), d).jaxpr
    assert count_equations(jaxpr, "pad") == 0


# The full suite (a long solve, twice), as is what a rejection keeps
# (test_revert_keeps_the_cache_of_a_rejected_step).
@pytest.mark.slow
def test_rejected_steps_keep_their_jacobians(monkeypatch):
    """On Van der Pol (mu = 1000, many rejected steps) keeping the Jacobian and factor
    of a rejected step saves Jacobians; the solution stays as accurate."""

    def run(max_steps):
        counts = {"jac": 0, "lu": 0}
        sol = _solve(
            VDPOL.field(1.0),
            sk.BDF(linear_solver=_Counting(counts)),
            VDPOL.t1,
            jnp.asarray(VDPOL.y0),
            1e-6,
            1e-6,
            max_steps=max_steps,
        )
        jax.effects_barrier()
        return counts, sol

    kept, sol_kept = run(100_000)
    with monkeypatch.context() as m:  # every rejected step reverts everything
        m.setattr(sk.BDF, "revert", sk.AbstractSolver.revert)
        reverted, sol_reverted = run(100_001)  # (another `max_steps`: a new trace)
    print("kept", kept, sol_kept.stats, "reverted", reverted, sol_reverted.stats)
    assert int(sol_kept.stats["num_rejected_steps"]) > 10
    assert kept["jac"] < reverted["jac"], (kept, reverted)
    # Global error of a solve at rtol = atol = 1e-6 on this problem (the reference
    # is Hairer's): both within 1e-3 relative, the order of 1e3 local tolerances
    # accumulated over the solve's ~1,500 steps.
    for sol in (sol_kept, sol_reverted):
        np.testing.assert_allclose(sol.ys[-1], VDPOL.reference, rtol=1e-3, atol=1e-6)


# The full suite (a 10 CPU-second compile); ForwardMode's quick test is in
# tests/diffrax_compat/test_diffrax_scripts.py.
@pytest.mark.slow
def test_forward_mode_and_y0():
    """Forward mode (`ForwardMode`, `jax.jacfwd`) agrees with finite differences;
    the gradient with respect to `y0` with the reverse one. (Both forward-mode
    derivatives, wrt `k1` and `y0`, are one program, the reverse one
    test_grad_rober's; the finite differences are `_rober_reference`'s, compiled
    once.)"""

    def loss(x, y0, adjoint):
        return _rober_loss(x, sk.BDF(), adjoint, y0=y0)

    x, y0 = jnp.asarray(0.04), jnp.array([1.0, 0.0, 0.0])
    forward = jax.jit(jax.jacfwd(loss, argnums=(0, 1)), static_argnums=2)
    g, fwd = forward(x, y0, sk.ForwardMode())
    assert jnp.allclose(g, _fd("rober", x), rtol=2e-5), g
    # test_grad_rober's program (reverse mode, dense solver), compiled there.
    solver = sk.BDF(linear_solver=sk.DenseLinearSolver())
    rev = _rober_grads(solver, sk.RecursiveCheckpointAdjoint(), x, y0)[1]
    assert jnp.allclose(rev, fwd, rtol=1e-6, atol=1e-8), (rev, fwd)
    e = jnp.eye(3)[0] * 1e-6
    fd0 = (_rober_reference(x, y0 + e) - _rober_reference(x, y0 - e)) / 2e-6
    assert jnp.allclose(rev[0], fd0, rtol=1e-4), (rev[0], fd0)
