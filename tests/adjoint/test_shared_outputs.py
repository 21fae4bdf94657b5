"""Outputs of a solve shared by a `vmap` batch, in reverse mode.

With `ConstantStepSize` the step grid (and so `sol.ts`, `t1` and any part of the
state that the batched values do not reach) is the same for every element of a
`vmap`: unbatched. Each element's output still needs its own cotangent: a rule that
gives the whole batch's cotangent to every element counts it once per element (older
JAX did, silently: the gradient of `sum(ts)` over three solves came out 9, not 3), and
JAX >= 0.12 refuses such a rule. Checked here for `diffeqsolve` under `vmap` inside
`grad` and `vmap` of `grad`, and for `ensemble_solve(kernel=False)`, with a closed-over
float and a vmapped integer index, against `DirectAdjoint` (no custom rule: JAX's own
derivative of the same steps) and central differences; and `batched_like` itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit._closure._unvmap import batched_like


pytestmark = pytest.mark.usefixtures("x64")

TABLE = np.array([0.5, 1.0, 2.0])  # closed over, a row picked by a vmapped int
INDEX = np.array([2, 0, 1])
T1 = 0.95  # with dt0 = 0.1: ten steps, also for t1 +- the difference step below
SAVE = np.array([0.3, 0.6])


def _field(theta):
    def field(t, y, index):
        rate = jnp.asarray(TABLE)[index] * theta  # a float chosen by the int
        a, b = y
        # `b` does not depend on the batch: an unbatched part of the state.
        return -rate * a + jnp.sin(t), -0.5 * b

    return field


def _loss_of(sol):
    a, b = sol.ys
    return jnp.sum(a**2) + jnp.sum(b) + jnp.sum(sol.ts) + jnp.sum(sol.t1)


def _saveat():
    return sk.SaveAt(ts=jnp.asarray(SAVE), t1=True)


def _solve(theta, t1, index, adjoint):
    y0 = (jnp.asarray(1.0), jnp.asarray(2.0))
    return sk.diffeqsolve(
        sk.ODETerm(_field(theta)), sk.Tsit5(), 0.0, t1, 0.1, y0, index,
        saveat=_saveat(), stepsize_controller=sk.ConstantStepSize(), adjoint=adjoint,
    )  # fmt: skip


def _vmapped_loss(theta, t1, adjoint):
    sols = jax.vmap(lambda i: _solve(theta, t1, i, adjoint))(jnp.asarray(INDEX))
    return _loss_of(sols)


def _ensemble_loss(theta, t1):
    y0 = (jnp.ones(len(INDEX)), jnp.full(len(INDEX), 2.0))
    sols = sk.ensemble_solve(
        sk.ODETerm(_field(theta)), sk.Tsit5(), 0.0, t1, 0.1, y0, jnp.asarray(INDEX),
        saveat=_saveat(), stepsize_controller=sk.ConstantStepSize(), kernel=False,
    )  # fmt: skip
    return _loss_of(sols)


def _central(loss, theta, t1, h=1e-5):
    """The central differences of `loss` in `theta` and in `t1`."""
    d_theta = (loss(theta + h, t1) - loss(theta - h, t1)) / (2 * h)
    d_t1 = (loss(theta, t1 + h) - loss(theta, t1 - h)) / (2 * h)
    return np.array([d_theta, d_t1])


# Jitted once for the file: the tests that differentiate the same loss share them.
_grad = jax.jit(jax.grad(_vmapped_loss, argnums=(0, 1)), static_argnums=2)
_direct_loss = jax.jit(lambda th, t1: _vmapped_loss(th, t1, sk.DirectAdjoint()))


# The same steps differentiated by a custom rule and by JAX: round-off (values ~10).
SAME_STEPS = 1e-10
# Fixed steps: the discrete solve is smooth in theta and t1 (ten steps either side),
# so a central difference with h = 1e-5 is off by h^2 |f'''| ~ 1e-10 plus round-off
# ~1e-16 * 10 / h = 1e-10, relative to derivatives ~1-10.
CENTRAL = 1e-7


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(sk.RecursiveCheckpointAdjoint(), id="online"),
        pytest.param(
            sk.RecursiveCheckpointAdjoint(checkpoints=4),
            id="checkpoints",
            marks=[
                pytest.mark.slow,
                full_matrix_only(
                    "[online] (the shared outputs' cotangents); checkpoints under "
                    "vmap: adjoint/test_adjoint.py::"
                    "test_checkpoints_under_vmap_with_different_step_counts"
                ),
            ],
        ),
    ],
)
# Quick loop: grad of vmap:
# adjoint/test_adjoint.py::test_vmap_grad_closed_over_float_and_t1_analytic.
@pytest.mark.slow
def test_grad_of_vmapped_fixed_step_solves(adjoint):
    """`grad` over `vmap(diffeqsolve)`: the step grid is shared by the batch."""
    got = np.array(_grad(1.3, T1, adjoint))
    want = np.array(_grad(1.3, T1, sk.DirectAdjoint()))
    np.testing.assert_allclose(got, want, rtol=SAME_STEPS)
    np.testing.assert_allclose(got, _central(_direct_loss, 1.3, T1), rtol=CENTRAL)


# `SOLVERKIT_FULL_MATRIX=1` only: the shared outputs' cotangents are
# test_grad_of_vmapped_fixed_step_solves[online]'s and
# test_fixed_step_ensemble_gradient's (which also takes `vmap` of its `grad`);
# `vmap` of `grad` on the vmap route, tests/kernel/test_vmap_route.py's vmap_grad
# cells.
@pytest.mark.slow
@full_matrix_only(
    "test_grad_of_vmapped_fixed_step_solves[online], test_fixed_step_ensemble_gradient"
)
def test_vmap_of_grad_over_a_closed_over_float():
    """`vmap` over the closed-over float of `grad` of `vmap(diffeqsolve)` over the
    int index: batched twice, the grid by neither."""
    thetas = jnp.asarray([0.7, 1.3])

    def grads(adjoint):
        grad = jax.grad(_vmapped_loss, argnums=(0, 1))
        return np.array(jax.jit(jax.vmap(grad, in_axes=(0, None, None)),
                                static_argnums=2)(thetas, T1, adjoint))  # fmt: skip

    got = grads(sk.RecursiveCheckpointAdjoint())
    np.testing.assert_allclose(got, grads(sk.DirectAdjoint()), rtol=SAME_STEPS)
    for k, theta in enumerate(thetas):
        # A Python float, as above: the same program as the other tests'.
        want = np.array(_grad(float(theta), T1, sk.RecursiveCheckpointAdjoint()))
        np.testing.assert_allclose(got[:, k], want, rtol=SAME_STEPS)


# The full suite; the quick loop's ensemble gradient:
# ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep].
@pytest.mark.slow
def test_fixed_step_ensemble_gradient():
    """`ensemble_solve(kernel=False)` with fixed steps: its gradient, and under `vmap`
    over the closed-over float, against `vmap(diffeqsolve)` with `DirectAdjoint`."""
    # The differences' values from the gradient's program (one program, not two).
    both = jax.jit(jax.value_and_grad(_ensemble_loss, argnums=(0, 1)))
    grad = lambda theta, t1: both(theta, t1)[1]  # noqa: E731
    got = np.array(grad(1.3, T1))
    np.testing.assert_allclose(
        got, np.array(_grad(1.3, T1, sk.DirectAdjoint())), rtol=SAME_STEPS
    )
    np.testing.assert_allclose(got, _central(lambda *a: both(*a)[0], 1.3, T1),
                               rtol=CENTRAL)  # fmt: skip
    thetas = jnp.asarray([0.7, 1.3])
    batched = jax.jit(jax.vmap(jax.grad(_ensemble_loss, argnums=(0, 1)),
                               in_axes=(0, None)))(thetas, T1)  # fmt: skip
    for k, theta in enumerate(thetas):
        np.testing.assert_allclose(
            np.array(batched)[:, k], np.array(grad(float(theta), T1)), rtol=SAME_STEPS
        )


def test_batched_like():
    """The identity on every element; batched where anything is, under nested
    `vmap`, for float and int leaves; nothing batched: unchanged."""
    tree = {"f": jnp.arange(3.0), "i": jnp.asarray(7), "none": None}

    def f(x):
        out = batched_like(tree, x)
        return out["f"] * x, out["i"]

    fs, ints = jax.vmap(f)(jnp.asarray([1.0, 2.0]))
    np.testing.assert_array_equal(fs, [[0, 1, 2], [0, 2, 4]])
    np.testing.assert_array_equal(ints, [7, 7])
    nested = jax.vmap(jax.vmap(lambda x, y: batched_like(tree, (x, y))["i"],
                               in_axes=(None, 0)), in_axes=(0, None))  # fmt: skip
    assert nested(jnp.ones(2), jnp.ones(5)).shape == (2, 5)
    # `vmap` of `batched_like` inside a `grad` (its JVP): the identity.
    g = jax.vmap(jax.grad(lambda x: jnp.sum(batched_like(x * tree["f"], x) ** 2)))
    np.testing.assert_allclose(g(jnp.asarray([1.0, 2.0])), [10.0, 20.0])
    out = batched_like(tree, ())
    assert out["none"] is None and out["f"] is not None
    np.testing.assert_array_equal(jax.jit(lambda: batched_like(tree, ()))()["f"],
                                  tree["f"])  # fmt: skip
