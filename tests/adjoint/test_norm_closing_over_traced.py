"""A step-size controller's norm that closes over traced values (`Traced`).

The checkpointed adjoint evaluates the solver step from one traced program
(`solverkit._closure._traced.Traced`). A norm closing over a value of an enclosing
trace puts that tracer among the program's constants; such programs used to be
dropped, so that every use of the step traced it (and the norm) again: 113 traces of
the norm against 15 in a vmapped BDF gradient (tests/solvers/test_bdf.py::
test_controller_norms, 18.6 against 4.1 s of tracing). Now they are kept: the norm
is traced as often as a plain one, and the values are those of the norm closing over
concrete values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk
from solverkit._controller._norm import rms_norm


pytestmark = pytest.mark.usefixtures("x64")


def _counting(factor, calls: list):
    """The norm `factor * rms_norm`, counting its traces in `calls`."""

    def norm(x):
        calls.append(None)
        return factor * rms_norm(x)

    return norm


def _gradient(rate, norm):
    """`d y(1) / d rate` of `y' = -rate y`, `y(0) = (1, 2)` (Tsit5, the checkpointed
    adjoint: its backward pass evaluates the step's kept program), with `norm`."""

    def loss(rate):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -rate * y),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.array([1.0, 2.0]),
            stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-7, norm=norm),
            max_steps=32,
        )
        return jnp.sum(sol.ys[-1])

    return jax.grad(loss)(rate)


_TABLE = np.array([1.0, 2.0, 4.0])


def _concrete(rate, factor) -> np.ndarray:
    """The gradient with a norm of a Python float: no tracer closed over."""
    return np.asarray(jax.jit(lambda r: _gradient(r, _counting(factor, [])))(rate))


def test_norm_closing_over_traced_values_is_traced_once():
    """Under `jit` and `vmap`, a norm closes over a batched float (a `vmap` tracer)
    and an int of the `jit` (a table's index), through the checkpointed backward
    pass; it is traced as often as a norm closing over a Python float, and the
    gradients are those of the norm of concrete values, element by element."""
    rates, scales = jnp.array([0.5, 1.5]), jnp.array([1.0, 3.0])
    traced_calls: list = []

    @jax.jit
    def traced(rates, scales, index):
        factor = lambda s: s * jnp.asarray(_TABLE)[index]  # noqa: E731
        one = lambda r, s: _gradient(r, _counting(factor(s), traced_calls))  # noqa: E731
        return jax.vmap(one)(rates, scales)

    got = traced(rates, scales, jnp.int32(1))
    plain_calls: list = []
    jax.jit(jax.vmap(lambda r: _gradient(r, _counting(2.0, plain_calls))))(rates)
    assert len(traced_calls) == len(plain_calls)
    for k in range(2):
        # The norm of concrete values, one element at a time: the same steps, so the
        # same gradient up to round-off (and the exact one, -3 exp(-rate), to the
        # tolerance's order).
        want = _concrete(rates[k], float(scales[k]) * _TABLE[1])
        np.testing.assert_allclose(got[k], want, rtol=1e-10)
        np.testing.assert_allclose(got[k], -3 * np.exp(-rates[k]), rtol=1e-4)


def test_one_norm_object_in_separate_traces():
    """One norm object reads the traced scale its caller last stored: two `jit`s
    (two traces), and two solves in one trace, each with its own scale. Each solve
    binds its own trace's tracer (a kept program lives in one solve's trace): a
    stale tracer would raise, another solve's scale give that solve's steps (at 10x
    the tolerance another gradient, ~1e-6 relative)."""
    box: list = []

    def norm(x):
        return box[-1] * rms_norm(x)

    def gradient(rate, scale):
        box.append(scale)
        return _gradient(rate, norm)

    rate = jnp.asarray(0.5)
    first = jax.jit(gradient)(rate, jnp.asarray(1.0))
    second = jax.jit(lambda r, s: gradient(r, s))(rate, jnp.asarray(10.0))
    both = jax.jit(lambda r, s: (gradient(r, s), gradient(r, 10 * s)))(rate, 1.0)
    # The same steps as the norm of concrete values: round-off.
    want = [_concrete(rate, factor) for factor in (1.0, 10.0)]
    assert not np.allclose(want[0], want[1], rtol=1e-9, atol=0)  # other steps
    np.testing.assert_allclose([first, second], want, rtol=1e-10)
    np.testing.assert_allclose(both, want, rtol=1e-10)
