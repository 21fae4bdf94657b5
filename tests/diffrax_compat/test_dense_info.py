"""Built-in solvers' `step`, `dense_info` and `interpolation_cls` as diffrax's, used on
their own outside `diffeqsolve` (a library that builds its own interpolant from
`dense_info["k"]`). Each is compared with diffrax's on the same step: the keys, the
shapes, and the values to round-off."""

import functools

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from helpers import full_matrix_only

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

_EXPLICIT = ["Euler", "Heun", "Midpoint", "Ralston", "Bosh3", "Tsit5", "Dopri5"]
_ALL = _EXPLICIT + ["Dopri8"]
_T0, _T1 = 0.3, 0.55  # Python floats, as a user passes them
_A = np.array([[-0.5, 1.0, 0.0], [-1.0, -0.5, 0.2], [0.0, -0.2, -0.1]])


def _field():
    """A linear field `y' = A y` (on a dict state of two leaves, one 2-d) that closes
    over values of several dtypes: a float64 matrix, an int32 scale and a bool."""
    a = jnp.asarray(_A)
    two = jnp.asarray(2, jnp.int32)
    on = jnp.asarray(True)

    def f(t, y, args):
        del t, args
        flat = jnp.concatenate([y["a"], y["b"].reshape(-1)])
        d = jnp.where(on, a, 0.0) @ flat * (two // 2)
        return {"a": d[:1], "b": d[1:].reshape(2, 1)}

    return f


def _y0(scale=1.0):
    return {"a": jnp.array([1.0]) * scale, "b": jnp.array([[2.0], [-0.5]]) * scale}


def _step(lib, name, y0, jit=True):
    """The solver and its first step's outputs (the step jitted unless `jit=False`,
    for a caller that transforms it: one compile, not one per operation)."""
    step = _jitted_step if jit else _step_outputs
    return getattr(lib, name)(), step(lib, name, y0)


def _step_outputs(lib, name, y0):
    solver = getattr(lib, name)()
    term = lib.ODETerm(_field())
    state = solver.init(term, _T0, _T1, y0, None)
    return solver.step(term, _T0, _T1, y0, None, state, False)


_jitted_step = jax.jit(_step_outputs, static_argnums=(0, 1))


def _close(a, b, scale):
    # float64 round-off of a step's stage sums: at most ~100 ulps of the state's size.
    check = lambda x, y: np.testing.assert_allclose(x, y, atol=1e-13 * scale)  # noqa: E731
    jax.tree.map(check, a, b)


@pytest.mark.parametrize("name", _ALL)
@pytest.mark.quick_cases("Tsit5")
def test_dense_info_is_diffraxs(name):
    y0 = _y0()
    _, (y1, _, ours, _, _) = _step(sk, name, y0)
    _, (y1_ref, _, ref, _, _) = _step(diffrax, name, y0)
    assert set(ours) == set(ref)
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    shapes = lambda info: jax.tree.map(jnp.shape, info)  # noqa: E731
    assert shapes(ours) == shapes(ref)  # k: (stages, *y.shape) per leaf
    _close(ours, ref, 2.0)
    _close(y1, y1_ref, 2.0)


@pytest.mark.parametrize("name", _EXPLICIT)
# Quick loop: test_dense_info_is_diffraxs[Tsit5].
@pytest.mark.slow
def test_interpolation_cls_is_diffraxs(name):
    y0 = _y0()
    solver, (_, _, info, _, _) = _step(sk, name, y0)
    ref_solver, (_, _, ref_info, _, _) = _step(diffrax, name, y0)
    ours = solver.interpolation_cls(t0=_T0, t1=_T1, **info)
    ref = ref_solver.interpolation_cls(t0=_T0, t1=_T1, **ref_info)
    for t in np.linspace(_T0, _T1, 7):
        _close(ours.evaluate(t), ref.evaluate(t), 2.0)
        _close(solver.interpolate(info, _T0, _T1, t), ref.evaluate(t), 2.0)
    increment = jax.tree.map(jnp.subtract, ref.evaluate(_T1), ref.evaluate(_T0))
    _close(ours.evaluate(_T0, _T1), increment, 2.0)


def test_dopri8_interpolation_is_fifth_order():
    # solverkit's Dopri8 dense output is its own (not diffrax's coefficients): both are
    # of order 5, so each is within (h |A|)^6 |y| of the exact solution (constant ~1);
    # they differ from each other by about that much, not by round-off.
    y0 = _y0()
    solver, (_, _, info, _, _) = _step(sk, "Dopri8", y0)
    ours = solver.interpolation_cls(t0=_T0, t1=_T1, **info)
    flat0 = np.concatenate([np.ravel(y0["a"]), np.ravel(y0["b"])])
    bound = ((_T1 - _T0) * np.linalg.norm(_A, 2)) ** 6 * np.abs(flat0).max()
    for t in np.linspace(_T0, _T1, 7):
        exact = scipy.linalg.expm(_A * (t - _T0)) @ flat0
        got = ours.evaluate(t)
        got = np.concatenate([np.ravel(got["a"]), np.ravel(got["b"])])
        np.testing.assert_allclose(got, exact, atol=bound)


@pytest.mark.parametrize("name", ["Heun", "Tsit5"])
@pytest.mark.quick_cases("Tsit5")
def test_dense_info_under_jit_vmap_grad(name):
    # A batch of initial states; the interpolant at mid-step and its gradient with
    # respect to the initial state, against diffrax's.
    scales = jnp.array([0.5, 1.0, 2.0])
    mid = 0.5 * (_T0 + _T1)

    def value(lib, scale):
        solver, (_, _, info, _, _) = _step(lib, name, _y0(scale), jit=False)
        out = solver.interpolation_cls(t0=_T0, t1=_T1, **info).evaluate(mid)
        return jnp.sum(out["b"]) + jnp.sum(out["a"]), info["k"]

    # Both jitted: one program each, the values and the gradient (diffrax's, run
    # eagerly, was ~100 compiles).
    ours, ours_grad = _values_and_grads(functools.partial(value, sk), scales)
    ref, ref_grad = _values_and_grads(functools.partial(value, diffrax), scales)
    _close(ours, ref, 4.0)
    assert ours[1]["b"].shape == (3, len(ref[1]["b"][0]), 2, 1)
    _close(ours_grad, ref_grad, 4.0)


def _values_and_grads(value, scales):
    """`jax.vmap(value)(scales)` (a scalar and an aux) and, by `jax.vmap`, the
    scalar's gradient: one jitted program (the gradient's forward pass gives the
    values)."""
    return jax.jit(jax.vmap(jax.value_and_grad(value, has_aux=True)))(scales)


# Quick loop: test_dense_info_under_jit_vmap_grad[Tsit5].
@pytest.mark.slow
def test_loop_dense_output_unchanged_by_public_form():
    # The loop keeps its own form of `dense_info`; a solve's dense output still equals
    # the public step's interpolant on the first step (fixed step, so the same step).
    y0 = _y0()
    solver = sk.Tsit5()
    sol = sk.diffeqsolve(
        sk.ODETerm(_field()), solver, _T0, _T1, _T1 - _T0, y0,
        saveat=sk.SaveAt(dense=True),
    )  # fmt: skip
    _, (_, _, info, _, _) = _step(sk, "Tsit5", y0)
    interp = solver.interpolation_cls(t0=_T0, t1=_T1, **info)
    for t in np.linspace(_T0, _T1, 5):
        _close(sol.evaluate(t), interp.evaluate(t), 2.0)


@pytest.mark.parametrize("name", ["ReversibleHeun", "LeapfrogMidpoint"])
def test_two_state_solvers_step_by_hand_as_diffrax(name):
    # Python-float times (they failed with an AttributeError); two steps, so the
    # second uses the state the first returned.
    y0 = _y0()
    outs = []
    for lib in (sk, diffrax):
        solver, term = getattr(lib, name)(), lib.ODETerm(_field())
        state = solver.init(term, _T0, _T1, y0, None)
        y1, _, info, state, _ = solver.step(term, _T0, _T1, y0, None, state, False)
        t2 = _T1 + 0.2
        y2, _, info2, _, _ = solver.step(term, _T1, t2, y1, None, state, False)
        outs.append((info, info2, y2))
    assert jax.tree.structure(outs[0]) == jax.tree.structure(outs[1])
    _close(outs[0], outs[1], 2.0)


# --- Implicit and IMEX solvers ------------------------------------------------------

_ESDIRK = ["ImplicitEuler", "Kvaerno3", "Kvaerno4", "Kvaerno5"]
_IMEX = ["KenCarp3", "KenCarp4", "KenCarp5", "Sil3"]
# The root finders' tolerance (relative and absolute), for both libraries; with a
# linear implicit term the stages are exact after one iteration whatever it is.
_ROOT_TOL = 1e-10


def _stiff_field():
    """The implicit term: the linear field of `_field`, four times stiffer. Linear, so
    that each stage's chord iteration (with the exact Jacobian) lands on the root at
    its first iterate, and the two libraries' steps agree to round-off."""
    linear = _field()
    scale = jnp.asarray(4.0)
    return lambda t, y, args: jax.tree.map(lambda d: scale * d, linear(t, y, args))


def _slow_field():
    """The explicit term of an IMEX pair, closing over a float64 and an int32 value."""
    c, n = jnp.asarray(0.7), jnp.asarray(3, jnp.int32)
    return lambda t, y, args: jax.tree.map(lambda x: c * jnp.sin(n * x + t), y)


def _implicit_solver(lib, name):
    return getattr(lib, name)(root_finder=lib.VeryChord(rtol=_ROOT_TOL, atol=_ROOT_TOL))


def _implicit_step(lib, name, y0, t0=_T0, t1=_T1, jit=True):
    """The solver and its first step's outputs (jitted unless `jit=False`, as
    `_step`)."""
    step = _jitted_implicit_step if jit else _implicit_step_outputs
    return _implicit_solver(lib, name), step(lib, name, y0, t0, t1)


def _implicit_step_outputs(lib, name, y0, t0, t1):
    solver = _implicit_solver(lib, name)
    term = lib.ODETerm(_stiff_field())
    if name in _IMEX:
        term = lib.MultiTerm(lib.ODETerm(_slow_field()), term)
    # diffrax's implicit step needs array times (its closure conversion of the
    # stage equation rejects a Python float); solverkit's takes either.
    t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
    state = solver.init(term, t0, t1, y0, None)
    return solver.step(term, t0, t1, y0, None, state, False)


_jitted_implicit_step = jax.jit(_implicit_step_outputs, static_argnums=(0, 1))


def _close_steps(name, a, b, scale):
    # Round-off of the stage solves and sums (~100 ulps of the state's size), except
    # where the tableaux differ: diffrax's γ of Kvaerno3/4 is the paper's 10 printed
    # digits, solverkit's the exact root of the L-stability polynomial (they differ
    # by ~1e-11), which moves every stage by a few times that.
    tol = 1e-9 if name in ("Kvaerno3", "Kvaerno4") else 1e-13
    check = lambda x, y: np.testing.assert_allclose(x, y, atol=tol * scale)  # noqa: E731
    jax.tree.map(check, a, b)


# One solver a family in the full suite ([Kvaerno5], [KenCarp4], [Sil3]); the others
# with `SOLVERKIT_FULL_MATRIX=1` only (the same interpolants, other tableaux).
_IMPLICIT_KEPT = ("Kvaerno5", "KenCarp4", "Sil3")


@pytest.mark.parametrize(
    "name",
    [
        n
        if n in _IMPLICIT_KEPT
        else pytest.param(
            n,
            marks=full_matrix_only("[Kvaerno5] (ESDIRK), [KenCarp4] (KenCarp), [Sil3]"),
        )  # fmt: skip
        for n in _ESDIRK + _IMEX
    ],
)
# The full suite; the quick loop's dense info: test_dense_info_is_diffraxs[Tsit5].
@pytest.mark.slow
def test_implicit_dense_info_is_diffraxs(name):
    y0 = _y0()
    _, (y1, _, ours, _, result) = _implicit_step(sk, name, y0)
    _, (y1_ref, _, ref, _, _) = _implicit_step(diffrax, name, y0)
    assert int(result.code) == int(sk.RESULTS.successful.code)
    # (diffrax's VeryChord may flag this linear solve "diverged": after the exact
    # first iterate, two round-off increments can differ by a factor > 2.)
    assert set(ours) == set(ref)
    # KenCarp and Sil3: `k` is the pair (k_explicit, k_implicit), each stacked
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    shapes = lambda info: jax.tree.map(jnp.shape, info)  # noqa: E731
    assert shapes(ours) == shapes(ref)
    _close_steps(name, ours, ref, 2.0)
    _close_steps(name, y1, y1_ref, 2.0)


@pytest.mark.parametrize("name", _ESDIRK + _IMEX)
# Quick loop: test_dense_info_is_diffraxs[Tsit5].
@pytest.mark.slow
def test_implicit_interpolation_cls_is_diffraxs(name):
    y0 = _y0()
    solver, (_, _, info, _, _) = _implicit_step(sk, name, y0)
    ref_solver, (_, _, ref_info, _, _) = _implicit_step(diffrax, name, y0)
    ours = solver.interpolation_cls(t0=_T0, t1=_T1, **info)  # Python-float times
    ref = ref_solver.interpolation_cls(t0=_T0, t1=_T1, **ref_info)
    for t in np.linspace(_T0, _T1, 7):
        _close_steps(name, ours.evaluate(t), ref.evaluate(t), 2.0)
        ours_t = solver.interpolate(info, _T0, _T1, t)
        _close_steps(name, ours_t, ref.evaluate(t), 2.0)
    _close(ours.evaluate(_T0), y0, 2.0)
    increment = jax.tree.map(jnp.subtract, ours.evaluate(_T1), ours.evaluate(_T0))
    _close(ours.evaluate(_T0, _T1), increment, 2.0)


# The full suite (11 CPU s); the quick loop's dense output under jit, vmap and grad:
# test_dense_info_under_jit_vmap_grad[Tsit5].
@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        # The Hermite interpolant (Kvaerno5's) under jit, vmap and grad:
        # test_dense_info_under_jit_vmap_grad[Heun]; an IMEX step's dense output
        # under jit, vmap and grad: tests/solvers/test_implicit.py::
        # test_imex_events_dense_gradients_and_no_recompile (KenCarp4's values
        # against diffrax: test_implicit_dense_info_is_diffraxs[KenCarp4]).
        pytest.param(
            name,
            marks=full_matrix_only(
                "test_dense_info_under_jit_vmap_grad[Heun], tests/solvers/"
                "test_implicit.py::test_imex_events_dense_gradients_and_no_recompile"
            ),
        )
        for name in ("Kvaerno5", "KenCarp4")
    ],
)
def test_implicit_dense_info_under_jit_vmap_grad(name):
    # As for the explicit solvers: a batch of initial states, the interpolant at
    # mid-step and its gradient with respect to the initial state, against diffrax.
    scales = jnp.array([0.5, 1.0, 2.0])
    mid = 0.5 * (_T0 + _T1)

    def value(lib, scale):
        solver, (_, _, info, _, _) = _implicit_step(lib, name, _y0(scale), jit=False)
        out = solver.interpolation_cls(t0=_T0, t1=_T1, **info).evaluate(mid)
        return jnp.sum(out["b"]) + jnp.sum(out["a"]), info["k"]

    ours, ours_grad = _values_and_grads(functools.partial(value, sk), scales)
    ref, ref_grad = _values_and_grads(functools.partial(value, diffrax), scales)
    _close_steps(name, ours, ref, 4.0)
    _close_steps(name, ours_grad, ref_grad, 4.0)


# The full suite; the quick loop's dense output: test_dense_info_is_diffraxs[Tsit5].
@pytest.mark.slow
def test_implicit_loop_dense_output_unchanged_by_public_form():
    # Kvaerno5 is stiffly accurate: the loop's cubic Hermite (slopes at both ends)
    # and the public one (`from_k`: first and last stages) are the same polynomial.
    y0 = _y0()
    solver = sk.Kvaerno5(root_finder=sk.VeryChord(rtol=_ROOT_TOL, atol=_ROOT_TOL))
    sol = sk.diffeqsolve(
        sk.ODETerm(_stiff_field()), solver, _T0, _T1, _T1 - _T0, y0,
        saveat=sk.SaveAt(dense=True),
    )  # fmt: skip
    _, (_, _, info, _, _) = _implicit_step(sk, "Kvaerno5", y0)
    interp = solver.interpolation_cls(t0=_T0, t1=_T1, **info)
    for t in np.linspace(_T0, _T1, 5):
        _close(sol.evaluate(t), interp.evaluate(t), 2.0)


# --- Rosenbrock and BDF (solverkit's own: not in diffrax 0.7.2) ----------------------


# Rosenbrock23 and Rodas4 with `SOLVERKIT_FULL_MATRIX=1` only: the four Rosenbrock
# methods share one interpolation class, which [Ros3P] and [Rodas5P] check.
_SAME_CLASS = full_matrix_only("[Ros3P] and [Rodas5P] (RosenbrockInterpolation)")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("Rosenbrock23", marks=_SAME_CLASS),
        "Ros3P",
        pytest.param("Rodas4", marks=_SAME_CLASS),
        "Rodas5P",
        "BDF",
    ],
)
# The full suite; the quick loop's dense output:
# test_dense_info_under_jit_vmap_grad[Tsit5].
@pytest.mark.slow
def test_own_solvers_interpolation_cls_from_step(name):
    # `interpolation_cls(t0=, t1=, **dense_info)` works on `step`'s output (a dict;
    # a NamedTuple before, which `**` rejects) and gives the loop's dense output.
    y0 = _y0()
    solver = getattr(sk, name)(
        **(dict(rtol=1e-10, atol=1e-10) if name == "BDF" else {})
    )
    term = sk.ODETerm(_stiff_field())

    @jax.jit  # one program, not a compile per operation
    def step(y0):
        state = solver.init(term, _T0, _T1, y0, None)
        return solver.step(term, _T0, _T1, y0, None, state, False)

    y1, _, info, _, _ = step(y0)
    assert isinstance(info, dict)
    interp = solver.interpolation_cls(t0=_T0, t1=_T1, **info)  # Python-float times
    sol = sk.diffeqsolve(
        term, solver, _T0, _T1, _T1 - _T0, y0, saveat=sk.SaveAt(dense=True)
    )
    _close(interp.evaluate(_T0), y0, 2.0)
    _close(interp.evaluate(_T1), y1, 2.0)
    for t in np.linspace(_T0, _T1, 5):
        _close(interp.evaluate(t), solver.interpolate(info, _T0, _T1, t), 2.0)
        _close(interp.evaluate(t), sol.evaluate(t), 2.0)
