"""Snippets of diffrax scripts that used to break or differ on solverkit, each run on
both libraries and compared."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import float64

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


@pytest.mark.parametrize("steps", [False, pytest.param(True, marks=pytest.mark.slow)])
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


def test_scalar_zero_term_in_a_multiterm_as_diffrax():
    def solve(lib):
        terms = lib.MultiTerm(
            lib.ODETerm(lambda t, y, args: -y), lib.ODETerm(lambda t, y, args: 0)
        )
        return lib.diffeqsolve(
            terms, lib.Heun(), 0.0, 1.0, 0.1, jnp.array([1.0, 2.0])
        ).ys

    np.testing.assert_allclose(solve(sk), solve(diffrax), rtol=1e-6)


def test_nested_clip_controllers_take_python_float_times():
    term = sk.ODETerm(lambda t, y, args: -y)
    inner = sk.ClipStepSizeController(
        sk.PIDController(rtol=1e-6, atol=1e-6), step_ts=jnp.array([0.5])
    )
    clip = sk.ClipStepSizeController(inner, jump_ts=jnp.array([0.25]))
    y0 = jnp.array([1.0])
    tnext, state = clip.init(term, 0.0, 1.0, y0, 0.4, None, term.vf, 5)
    assert float(tnext) == 0.25  # clipped to the jump
    keep, t0, t1, made_jump, _, _ = clip.adapt_step_size(
        0.0, 0.25, y0, y0 * 0.8, None, y0 * 0.0, 5, state
    )
    assert bool(keep) and float(t0) == 0.25 and bool(made_jump)
    assert float(t1) <= 0.5  # clipped to the inner step time
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
        ours = jax.hessian(lambda p: loss(sk, p))(p)
        theirs = jax.hessian(lambda p: loss(diffrax, p))(p)
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
    np.testing.assert_allclose(jax.jacfwd(f)(1.0), -np.exp(-1.0), rtol=1e-4)
