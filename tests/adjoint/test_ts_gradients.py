"""Gradients through the rows saved at `SaveAt(ts=...)`.

`RecursiveCheckpointAdjoint` pulls back only the rows each step wrote, one at a time
(`_save.pull_back_ts`); `DirectAdjoint` differentiates every row of every step,
masked. The two run the same steps, so they agree to rounding; both are checked
against finite differences, under `vmap` with a vmapped integer index choosing a
closed-over float, several save times in one step, a `SubSaveAt.fn` that reads `t`,
`args` and a closed-over float, and derivatives with respect to the save times.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finite_difference, full_matrix_only

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

RCA = sk.RecursiveCheckpointAdjoint()
DIRECT = sk.DirectAdjoint()
TABLE = np.array([0.5, 1.0, 2.0, 4.0])  # closed over, a row picked by an int
# Dense save times: most steps (about 0.1 long) write two or three rows, some none.
TS = np.linspace(0.1, 1.95, 23)  # inside (0, t1): finite differences stay inside
TS_FN = np.array([0.05, 0.7, 1.3, 2.0])
INDEX = np.array([3, 0, 2, 1])  # vmapped: each element its own rate
ARGS = np.array([0.3, 0.5, 0.7, 0.9])
Y0 = np.array([[1.0, 0.5], [0.2, 1.0], [1.0, 1.0], [-1.0, 0.3]])


def _ys(theta, shift, ts, index, args, y0, adjoint):
    rate = jnp.asarray(TABLE)[index] * theta  # a float chosen by the int, closed over

    def field(t, y, args):
        return jnp.stack([-rate * y[0] + args * y[1], -y[0] + shift * jnp.sin(t)])

    saveat = sk.SaveAt(
        subs=(
            sk.SubSaveAt(ts=ts),
            sk.SubSaveAt(ts=TS_FN, fn=lambda t, y, args: args * y[0] ** 2 + theta * t),
            sk.SubSaveAt(t1=True),
        )
    )
    sol = sk.diffeqsolve(
        sk.ODETerm(field),
        sk.Tsit5(),
        0.0,
        2.0,
        0.1,
        y0,
        args,
        saveat=saveat,
        stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
        adjoint=adjoint,
        max_steps=128,
    )
    return sol.ys, sol.stats["num_steps"]


def _loss(theta, shift, ts, args, y0, adjoint):
    """Summed over the batch; `theta`, `shift` and `ts` shared, the rest per element."""

    def one(index, args, y0):
        (at_ts, at_fn, at_t1), _ = _ys(theta, shift, ts, index, args, y0, adjoint)
        weights = jnp.arange(1.0, 1.0 + ts.shape[0])[:, None]
        return jnp.sum(weights * at_ts**2) + jnp.sum(jnp.cos(at_fn)) + jnp.sum(at_t1)

    return jnp.sum(jax.vmap(one)(jnp.asarray(INDEX), args, y0))


def _inputs():
    return (jnp.asarray(0.8), jnp.asarray(0.6), jnp.asarray(TS))


@functools.cache
def _grad(adjoint):
    return jax.jit(jax.grad(functools.partial(_loss, adjoint=adjoint), (0, 1, 2, 3, 4)))


def _assert_close(got, want, rtol):
    """Leaf by leaf, relative to the largest element of all leaves (an element near
    zero carries the rounding of the large terms that cancel in it)."""
    scale = max(float(np.max(np.abs(w))) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def test_steps_write_several_rows_and_differ_between_elements():
    # What the tests below rely on: steps that write several rows (fewer steps than
    # rows), and elements that take different steps (so they write their rows in
    # different steps).
    theta, shift, ts = _inputs()

    def steps(index, args, y0):
        return _ys(theta, shift, ts, index, args, y0, RCA)[1]

    counts = jax.jit(jax.vmap(steps))(jnp.asarray(INDEX), ARGS, Y0)
    assert np.min(counts) < len(TS) and len(set(np.asarray(counts).tolist())) > 1


@pytest.mark.parametrize(
    "adjoint",
    [
        RCA,
        pytest.param(
            sk.RecursiveCheckpointAdjoint(checkpoints=4),
            id="recomputed",
            marks=full_matrix_only(
                "[default] (the rows pulled back); recomputed carries: "
                "adjoint/test_adjoint.py::test_mid_checkpoints, "
                "test_checkpoints_under_vmap_with_different_step_counts"
            ),
        ),
    ],
    ids=["default", "recomputed"],
)
# Quick loop: save-time gradients:
# ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep].
@pytest.mark.slow
def test_checkpointed_equals_direct(adjoint):
    # The same steps differentiated two ways (with 4 checkpoints, from carries
    # recomputed in chunks): float64 rounding over ~30 steps forward and back, and
    # 23 + 4 rows, ~1e-13 of the gradient's scale; 1e-9 leaves a wide margin.
    args = (*_inputs(), jnp.asarray(ARGS), jnp.asarray(Y0))
    got = _grad(adjoint)(*args)
    want = _grad(DIRECT)(*args)
    _assert_close(got, want, rtol=1e-9)
    d_ts = np.asarray(got[2])
    assert np.all(d_ts != 0)  # every save time has its own derivative


@pytest.mark.slow
def test_checkpointed_against_finite_differences():
    # Central differences with eps 1e-6 of a solve at rtol 1e-8: the discrete
    # solution's derivative differs from the difference quotient by the truncation
    # (~eps^2) and by the step sizes' own smooth dependence (both in the adjoint),
    # plus rounding 1e-16 / 1e-6; 1e-5 as the other adjoint tests.
    theta, shift, ts = _inputs()
    args, y0 = jnp.asarray(ARGS), jnp.asarray(Y0)
    got = _grad(RCA)(theta, shift, ts, args, y0)
    value = jax.jit(lambda x: _loss(x[0], x[1], x[2:], args, y0, RCA))
    flat = jnp.concatenate([theta[None], shift[None], ts])
    fd = finite_difference(value, flat, eps=1e-6)
    want = np.concatenate([[got[0]], [got[1]], got[2]])
    np.testing.assert_allclose(want, fd, rtol=1e-5, atol=1e-7 * np.max(np.abs(fd)))


@pytest.mark.slow
def test_vmap_of_grad_equals_grad_of_vmap():
    # Per element (the rows of each element pulled back in its own steps), summed.
    theta, shift, ts = _inputs()

    def per_element(index, args, y0):
        def loss(theta, shift, ts):
            (at_ts, at_fn, at_t1), _ = _ys(theta, shift, ts, index, args, y0, RCA)
            weights = jnp.arange(1.0, 1.0 + ts.shape[0])[:, None]
            return (
                jnp.sum(weights * at_ts**2) + jnp.sum(jnp.cos(at_fn)) + jnp.sum(at_t1)
            )

        return jax.grad(loss, (0, 1, 2))(theta, shift, ts)

    grads = jax.jit(jax.vmap(per_element))(jnp.asarray(INDEX), ARGS, Y0)
    summed = [np.sum(g, axis=0) for g in grads]
    want = _grad(DIRECT)(theta, shift, ts, jnp.asarray(ARGS), jnp.asarray(Y0))[:3]
    # Same steps, other adjoint and order of summation: rounding only.
    _assert_close(summed, want, rtol=1e-9)


# `ensemble_solve(kernel=False)`'s gradient through save times (2 lanes: refilled
# forwards, chunks backwards) against the vmapped solve's: tests/test_ensemble_ts_grad
# .py::test_ensemble_equals_vmap[*-shared-chunked] (and per-trajectory save times).


def _gradient_flops(num_ts: int) -> float | None:
    ts = jnp.linspace(0.1, 1.0, num_ts)

    def loss(k):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -k * y), sk.Tsit5(), 0.0, 1.0, 0.1,
            jnp.ones(2), saveat=sk.SaveAt(ts=ts), max_steps=64,
        )  # fmt: skip
        return jnp.sum(sol.ys)

    cost = jax.jit(jax.grad(loss)).lower(jnp.asarray(1.0)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return None if not cost or "flops" not in cost else float(cost["flops"])


# The full suite; the quick loop's SaveAt(ts) gradient:
# ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep].
@pytest.mark.slow
def test_backward_step_does_not_interpolate_at_every_save_time():
    # XLA counts a loop body's work once. A backward step that interpolated at all
    # `len(ts)` times (and masked the rows its step did not write) grows with them:
    # 4 -> 400 times multiplied the gradient's flops by 23. Pulling back only the
    # rows a step wrote leaves the loops unchanged: x1.5 (the rows outside the loop).
    few, many = _gradient_flops(4), _gradient_flops(400)
    if few is None or many is None:
        pytest.skip("XLA gives no flop count on this backend")
    assert many < 4 * few
