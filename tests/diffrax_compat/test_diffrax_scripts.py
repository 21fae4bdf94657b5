"""Snippets of diffrax scripts that used to break or differ on solverkit, each run on
both libraries and compared."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import float64, full_matrix_only

import solverkit as sk


def _euler_event(lib, steps: bool, root_finder):
    sol = lib.diffeqsolve(
        lib.ODETerm(lambda t, y, args: -y / 2),
        lib.Euler(),
        0.0,
        5.0,
        1.0,
        jnp.array(1.0),
        event=lib.Event(lambda t, y, args, **kw: t - 3.5, root_finder=root_finder),
        saveat=lib.SaveAt(steps=steps, t1=not steps),
    )
    return sol.ts, sol.ys


@pytest.mark.parametrize(
    "steps",
    [
        False,
        # With `SOLVERKIT_FULL_MATRIX=1` only: the linear dense output located by the
        # event as diffrax does is [False]'s (another save mode).
        pytest.param(True, marks=full_matrix_only("[False] (the same event location)")),
    ],
)
# Quick loop: diffrax_compat/test_dense_info.py::test_dense_info_is_diffraxs[Tsit5].
@pytest.mark.slow
def test_euler_dense_output_is_linear_as_diffrax(steps):
    with float64():
        ts, ys = _euler_event(sk, steps, None)
        theirs = _euler_event(diffrax, steps, optx.Newton(rtol=1e-10, atol=1e-10))
        finite = np.isfinite(np.asarray(ts))
        np.testing.assert_allclose(ts[finite], theirs[0][finite], rtol=1e-9)
        np.testing.assert_allclose(ys[finite], theirs[1][finite], rtol=1e-9)
        assert float(ys[finite][-1]) == pytest.approx(0.09375)


def test_integer_vector_field_output_as_diffrax():
    def solve(lib):
        return lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: jnp.array([1, 1])),
            lib.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.array([0.0, 1.0]),
        ).ys

    np.testing.assert_allclose(solve(sk), solve(diffrax), rtol=1e-6)


# The full suite (a comparison with diffrax); the quick loop's MultiTerm:
# solve/test_integrate.py::test_convergence_order[KenCarp3-3-True].
@pytest.mark.slow
def test_scalar_zero_term_in_a_multiterm_as_diffrax():
    def solve(lib):
        terms = lib.MultiTerm(
            lib.ODETerm(lambda t, y, args: -y), lib.ODETerm(lambda t, y, args: 0)
        )
        return lib.diffeqsolve(
            terms, lib.Heun(), 0.0, 1.0, 0.1, jnp.array([1.0, 2.0])
        ).ys

    np.testing.assert_allclose(solve(sk), solve(diffrax), rtol=1e-6)


# The full suite; the quick loop's clip controller:
# solve/test_controllers.py::test_clip_steps_land_on_step_ts_and_jump_ts[False].
@pytest.mark.slow
def test_nested_clip_controllers_take_python_float_times():
    """Called by hand with Python-float times, nested clip controllers take diffrax's
    steps to the ulp: a step ends one ulp before a jump, the next starts one after."""
    y0 = jnp.array([1.0])
    ends = {}
    for lib in (diffrax, sk):
        term = lib.ODETerm(lambda t, y, args: -y)
        inner = lib.ClipStepSizeController(
            lib.PIDController(rtol=1e-6, atol=1e-6), step_ts=jnp.array([0.5])
        )
        clip = lib.ClipStepSizeController(inner, jump_ts=jnp.array([0.25]))
        tnext, state = clip.init(term, 0.0, 1.0, y0, 0.4, None, term.vf, 5)
        keep, t0, t1, made_jump, _, _ = clip.adapt_step_size(
            0.0, tnext, y0, y0 * 0.8, None, y0 * 0.0, 5, state
        )
        ends[lib] = (float(tnext), bool(keep), float(t0), float(t1), bool(made_jump))
    assert ends[sk] == ends[diffrax]
    assert np.float32(ends[sk][0]) == np.nextafter(np.float32(0.25), np.float32(0))
    assert ends[sk][3] <= 0.5  # clipped to the inner step time
    term = sk.ODETerm(lambda t, y, args: -y)
    inner = sk.ClipStepSizeController(
        sk.PIDController(rtol=1e-6, atol=1e-6), step_ts=jnp.array([0.5])
    )
    clip = sk.ClipStepSizeController(inner, jump_ts=jnp.array([0.25]))
    sol = sk.diffeqsolve(
        term, sk.Tsit5(), 0.0, 1.0, 0.1, y0, stepsize_controller=clip, max_steps=64
    )
    np.testing.assert_allclose(sol.ys[-1], np.exp(-1.0), rtol=1e-5)


@pytest.mark.slow
def test_hessian_with_scan_kind_as_diffrax():
    with float64():

        def loss(lib, p):
            vf = lambda t, y, args: -args[0] * y + args[1] * jnp.sin(t)
            sol = lib.diffeqsolve(
                lib.ODETerm(vf),
                lib.Tsit5(scan_kind="bounded"),
                0.0,
                1.0,
                0.1,
                jnp.array([1.0, 2.0]),
                p,
                stepsize_controller=lib.PIDController(rtol=1e-8, atol=1e-8),
            )
            return jnp.sum(sol.ys[-1] ** 2)

        p = jnp.array([0.7, 0.3])
        # Jitted: op by op, each library's Hessian was ~20 compiles.
        ours = jax.jit(jax.hessian(lambda p: loss(sk, p)))(p)
        theirs = jax.jit(jax.hessian(lambda p: loss(diffrax, p)))(p)
        np.testing.assert_allclose(ours, theirs, rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="scan_kind"):
        sk.Tsit5(scan_kind="unrolled")


def test_forward_mode_name():
    f = lambda k: sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -k * y),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.array([1.0]),
        adjoint=sk.ForwardMode(),
    ).ys[-1, 0]
    jac = jax.jit(jax.jacfwd(f))  # one program (op by op: ~20 compiles)
    np.testing.assert_allclose(jac(1.0), -np.exp(-1.0), rtol=1e-4)


def _dense_errors(lib, name: str, steps, reference):
    """Max error of the dense output between step ends (at 0.37 of each step) of
    fixed-step solves with each step size in `steps`."""
    fe = lambda t, y, args: 0.5 * jnp.stack([jnp.sin(t), jnp.cos(2 * t)])  # noqa: E731
    fi = lambda t, y, args: jnp.array([[-0.5, 1.0], [-1.0, -0.5]]) @ y  # noqa: E731
    imex = name.startswith("KenCarp")
    terms = (
        lib.MultiTerm(lib.ODETerm(fe), lib.ODETerm(fi))
        if imex
        else lib.ODETerm(lambda t, y, args: fe(t, y, args) + fi(t, y, args))
    )
    solver = getattr(lib, name)(root_finder=optx.Newton(rtol=1e-11, atol=1e-11))
    size = round(2 / min(steps))

    # One program for every step size (`h` an operand): the errors at `size` points
    # (0.37 + k) h, those past t1 = 2 clipped to it and dropped below.
    @jax.jit
    def errors_at(h):
        sol = lib.diffeqsolve(
            terms,
            solver,
            0.0,
            2.0,
            h,
            jnp.array([1.0, 0.0]),
            saveat=lib.SaveAt(dense=True),
            max_steps=100,
        )
        ts = jnp.minimum((jnp.arange(size) + 0.37) * h, 2.0)
        return jnp.abs(jax.vmap(sol.evaluate)(ts) - reference(ts))

    errors = []
    for h in steps:
        within = np.asarray(errors_at(jnp.asarray(h)))[: round(2 / h)]
        errors.append(float(np.max(within)))
    return np.array(errors)


# [KenCarp3], [KenCarp4] with `SOLVERKIT_FULL_MATRIX=1` only: the same Hermite
# interpolant as [KenCarp5]'s. [Kvaerno5] too (an ESDIRK method): its dense info is
# diffrax's (test_dense_info.py::test_implicit_dense_info_is_diffraxs[Kvaerno5]), so
# is its interpolant.
_DENSE_COVER = full_matrix_only("[KenCarp5] (the same interpolant)")
_ESDIRK_DENSE_COVER = full_matrix_only(
    "test_dense_info.py::test_implicit_dense_info_is_diffraxs[Kvaerno5] (diffrax's "
    "dense info, so its interpolant) and [KenCarp5] (the order of that interpolant)"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("KenCarp3", marks=_DENSE_COVER),
        pytest.param("KenCarp4", marks=_DENSE_COVER),
        "KenCarp5",
        pytest.param("Kvaerno5", marks=_ESDIRK_DENSE_COVER),
    ],
)
def test_implicit_dense_output_order_as_diffrax(name):
    """Dense output between step ends converges at diffrax's order, with an error no
    larger (diffrax uses the KenCarp methods' own interpolants, solverkit cubic
    Hermite from the step's ends and slopes: measured orders 3, 4, 4 for KenCarp3/4/5
    in both, errors 0.67, 1.01, 0.83 of diffrax's at h = 0.1)."""
    with float64():
        exact = sk.diffeqsolve(
            sk.ODETerm(
                lambda t, y, args: (
                    0.5 * jnp.stack([jnp.sin(t), jnp.cos(2 * t)])
                    + jnp.array([[-0.5, 1.0], [-1.0, -0.5]]) @ y
                )
            ),
            sk.Dopri8(),
            0.0,
            2.0,
            1e-3,
            jnp.array([1.0, 0.0]),
            saveat=sk.SaveAt(dense=True),
            stepsize_controller=sk.PIDController(rtol=1e-13, atol=1e-13),
        )
        reference = jax.vmap(exact.evaluate)
        steps = (0.1, 0.05)
        ours = _dense_errors(sk, name, steps, reference)
        theirs = _dense_errors(diffrax, name, steps, reference)
        order = lambda e: np.log2(e[0] / e[1])  # noqa: E731
        assert order(ours) >= order(theirs) - 0.1, (ours, theirs)
        assert np.all(ours <= 1.05 * theirs), (ours, theirs)
