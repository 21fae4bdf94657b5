"""Gradients of `ensemble_solve(kernel=False)` and `jax.vmap(diffeqsolve)` through
the rows at `SaveAt(ts=...)`, save times shared or one row per trajectory.

The rows a step writes and pulls back differ per trajectory. Read and written by
index under `vmap`, they are gathers and scatters with batched indices in every
step forwards and backwards: a serial loop over the batch on a TPU (the
ensemble's Lotka-Volterra gradient with 10 save times took 380 ms at N = 4096 and
grew linearly with N). On a TPU, up to `_save._COMPARE_ALL_MAX` save times, they
are one-hot selects now. Both paths run here (`path`: the TPU's forced, and this
backend's own): the structure test checks that the one-hot path's loops gather and
scatter by no per-trajectory index, the others that the gradients (`y0`, `args`, a
closed-over float, the save times) are those of `jax.vmap(diffeqsolve)` and of
finite differences. The vector field closes over a float32 table, an int row of it
chosen per trajectory through `args`, and a float64 parameter.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles, skip_unless_full_matrix
from jax.extend import core as jcore
from jax.flatten_util import ravel_pytree

import solverkit as sk
from solverkit import _save


pytestmark = pytest.mark.usefixtures("x64")

N, T = 5, 7  # distinct from each other and from the state's size (2)
TABLE = np.array([0.5, 1.0, 2.0, 4.0], np.float32)  # closed over; a row picked per
INDEX = np.array([3, 0, 2, 1, 2], np.int32)  # trajectory by an int in `args`
K = np.array([0.3, 0.5, 0.7, 0.9, 0.4])
Y0 = np.array([[1.0, 0.5], [0.2, 1.0], [1.0, 1.0], [-1.0, 0.3], [0.5, -0.5]])
# Inside (0, 2), so that finite differences stay inside; most steps (about 0.1-0.2
# long) write a row, some two, some none.
TS = np.linspace(0.15, 1.9, T)
# One row per trajectory: shifted, so that each writes its rows in other steps.
TS_ROWS = TS[None, :] - 0.01 * np.arange(N)[:, None]
CONTROLLER = sk.PIDController(rtol=1e-8, atol=1e-8)


def _field(theta):
    table = jnp.asarray(TABLE)  # float32, closed over

    def field(t, y, args):
        index, k = args
        rate = table[index].astype(theta.dtype) * theta
        return jnp.stack([-rate * y[0] + k * y[1], -y[0] + theta * jnp.sin(t)])

    return field


def _ensemble(theta, k, y0, ts, lanes):
    return sk.ensemble_solve(
        sk.ODETerm(_field(theta)), sk.Tsit5(), 0.0, 2.0, 0.1, y0,
        (jnp.asarray(INDEX), k), saveat=sk.SaveAt(ts=ts),
        stepsize_controller=CONTROLLER, kernel=False, lanes=lanes, max_steps=256,
    ).ys  # fmt: skip


def _vmapped(theta, k, y0, ts, lanes=None):
    del lanes

    def one(index, k, y0, ts):
        return sk.diffeqsolve(
            sk.ODETerm(_field(theta)), sk.Tsit5(), 0.0, 2.0, 0.1, y0, (index, k),
            saveat=sk.SaveAt(ts=ts), stepsize_controller=CONTROLLER, max_steps=256,
        ).ys  # fmt: skip

    in_axes = (0, 0, 0, 0 if ts.ndim == 2 else None)
    return jax.vmap(one, in_axes)(jnp.asarray(INDEX), k, y0, ts)


def _loss(theta, k, y0, ts, solve, lanes=None):
    ys = solve(theta, k, y0, ts, lanes)
    weights = jnp.arange(1.0, 1.0 + ys.shape[1])[None, :, None]
    return jnp.sum(weights * jnp.sin(ys))


def _inputs(ts):
    return jnp.asarray(0.8), jnp.asarray(K), jnp.asarray(Y0), jnp.asarray(ts)


@contextlib.contextmanager
def _rows_by(path: str):
    """Rows at the save times by one-hot selects (`"one-hot"`, the TPU's path) or by
    index (`"index"`), whatever this backend is; every trace inside (JAX's caches
    emptied on the way in and out, so that no trace of the other path is reused; kept
    where the path is already the active one)."""
    saved = getattr(_save, "ONE_HOT_BACKENDS", ())
    wanted = (jax.default_backend(),) if path == "one-hot" else ()
    if tuple(saved) == wanted:  # (every change empties the caches: no other trace)
        yield
        return
    _save.ONE_HOT_BACKENDS = wanted
    jax.clear_caches()
    try:
        yield
    finally:
        _save.ONE_HOT_BACKENDS = saved
        jax.clear_caches()


# Module scope: pytest runs every test of one path, then every test of the other, so
# that the caches are emptied once per path and the tests of a path share their
# compiled gradients (`_grad`), not once per test.
@pytest.fixture(params=["one-hot", "index"], scope="module")
def path(request):
    with _rows_by(request.param):
        yield request.param


@functools.cache
def _grad(solve, lanes, path):
    del path  # (a key of the cache: each path compiled on its own)
    loss = functools.partial(_loss, solve=solve, lanes=lanes)
    return jax.jit(jax.grad(loss, (0, 1, 2, 3)))


def _assert_close(got, want, rtol):
    """Leaf by leaf, relative to the largest element of all leaves."""
    scale = max(float(np.max(np.abs(w))) for w in want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


# The chunked gradients of each path, by save times: the two paths' are compared
# once both are in (`path` runs every case of one path, then of the other).
_CHUNKED: dict[tuple[str, str], list] = {}


# Quick loop: per-trajectory save times in the lockstep loop; shared ones, chunked:
# test_against_finite_differences[one-hot-shared].
@pytest.mark.quick_cases("one-hot-rows-lockstep")
@pytest.mark.parametrize("lanes", [2, N], ids=["chunked", "lockstep"])
@pytest.mark.parametrize("ts", [TS, TS_ROWS], ids=["shared", "rows"])
def test_ensemble_equals_vmap(path, ts, lanes):
    # Each trajectory takes the same steps both ways (the lane loop is the vmapped
    # loop, refilled): float64 rounding over ~20 steps forward and back, ~1e-13 of
    # the gradient's scale; 1e-9 leaves a wide margin. With 2 lanes the forward pass
    # refills and the backward pass runs in chunks.
    if ts.ndim == 1:
        skip_unless_full_matrix(
            "this test's [path-rows-*] (the lockstep loop's gradient, and the "
            "chunked one's, equal across the paths); shared save times: "
            "test_against_finite_differences[one-hot-shared] (chunked, one-hot) and "
            "ensemble/test_ensemble.py::test_gradient_matches_vmap (this backend's "
            "rows, 4 lanes for 13 trajectories, against jax.vmap(diffeqsolve))"
        )
    if path == "index" and lanes == N:
        skip_unless_full_matrix(
            "[index-rows-chunked] (the index path's rows against jax.vmap, refilled "
            "and chunked) and [one-hot-rows-lockstep] (the lockstep loop)"
        )
    inputs = _inputs(ts)
    got = _grad(_ensemble, lanes, path)(*inputs)
    want = _grad(_vmapped, None, path)(*inputs)
    _assert_close(got, want, rtol=1e-9)
    assert np.all(np.asarray(got[3]) != 0)  # every save time has its own derivative
    if lanes == 2:
        _assert_paths_equal(got, path, "rows" if ts.ndim == 2 else "shared")


def _assert_paths_equal(got, path, ts_id):
    """The paths' gradients (test_paths_equal, before it shared these programs):
    the same operations but for how a row is read and written (exactly, both), so
    equal to rounding (a sum of one row and zeros is exact; the rest is the order
    XLA fuses in)."""
    _CHUNKED[(path, ts_id)] = got
    other = _CHUNKED.get(("index" if path == "one-hot" else "one-hot", ts_id))
    if other is not None:
        _assert_close(got, other, rtol=1e-12)


# The programs of test_ensemble_equals_vmap[one-hot-rows-*]: compiled once for both.
@pytest.mark.parametrize("path", ["one-hot"], indirect=True)
@pytest.mark.parametrize(
    "solve, lanes",
    [(_ensemble, 2), (_ensemble, N), (_vmapped, None)],
    ids=["chunked", "lockstep", "vmap"],
)
@pytest.mark.quick_cases("lockstep-one-hot", "vmap-one-hot")
def test_jitted_gradient_second_call_does_not_compile(path, solve, lanes):
    # New values of every input (and a new closure over theta: `_field` builds one
    # per call) reuse the first call's program: no tracing into a new jit, no
    # compilation (a first-call cost a user would pay on every call).
    grad = _grad(solve, lanes, path)
    inputs = _inputs(TS_ROWS)
    jax.block_until_ready(grad(*inputs))
    new = jax.tree.map(lambda x: x * 0.97, inputs)
    with count_compiles() as counter:
        got = jax.block_until_ready(grad(*new))
    assert counter.count == 0
    assert all(np.all(np.isfinite(g)) for g in got)


# The full suite; the quick loop's gradient through the rows:
# test_ensemble_equals_vmap[one-hot-rows-lockstep] (against DirectAdjoint:
# tests/adjoint/test_ts_gradients.py, full suite).
@pytest.mark.slow
@pytest.mark.parametrize("ts", [TS, TS_ROWS], ids=["shared", "rows"])
def test_against_finite_differences(path, ts):
    # Central differences along 3 random directions of all inputs (theta, k, y0, ts)
    # at once, eps 1e-6, of a solve at rtol 1e-8: the quotient differs from the
    # discrete solution's derivative by the truncation (~eps^2), the rounding
    # (1e-16 / 1e-6) and the step sizes' smooth dependence on the inputs (which
    # reverse mode holds fixed: ~rtol); 1e-5 relative as the other adjoint tests.
    if path == "index":
        skip_unless_full_matrix(
            "test_against_finite_differences[one-hot-*] and the paths' gradients "
            "equal to 1e-12 (test_ensemble_equals_vmap[*-chunked])"
        )
    inputs = _inputs(ts)
    flat, unravel = ravel_pytree(inputs)
    value = jax.jit(lambda x: _loss(*unravel(x), solve=_ensemble, lanes=2))
    grad = ravel_pytree(_grad(_ensemble, 2, path)(*inputs))[0]
    eps = 1e-6
    for seed in range(3):
        v = jax.random.normal(jax.random.key(seed), flat.shape, flat.dtype)
        quotient = (float(value(flat + eps * v)) - float(value(flat - eps * v))) / (
            2 * eps
        )
        np.testing.assert_allclose(float(grad @ v), quotient, rtol=1e-5)


def _per_trajectory_row_ops(jaxpr, batch: int, rows: int) -> list[str]:
    """Gathers and scatters inside loops into an array with an axis of `rows` (the
    save times) by a per-trajectory index: their indices have the batch as leading
    axis, or (newer JAX) they have batching dimensions. (The field's own gather,
    `table[index]`, has no such axis.)"""
    found = []

    def walk(jaxpr, in_loop: bool):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if in_loop and (name == "gather" or name.startswith("scatter")):
                operand, shape = eqn.invars[0].aval, eqn.invars[1].aval.shape
                numbers = eqn.params["dimension_numbers"]
                batched = getattr(numbers, "operand_batching_dims", ())
                per_trajectory = batched or (shape and shape[0] == batch)
                if per_trajectory and rows in operand.shape:
                    found.append(f"{name} {operand.str_short()}")
            inner = in_loop or name in ("while", "scan")
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr, inner)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub, inner)

    walk(jaxpr, False)
    return found


@pytest.mark.parametrize("ts", [TS, TS_ROWS], ids=["shared", "rows"])
@pytest.mark.parametrize("solve", [_ensemble, _vmapped], ids=["ensemble", "vmap"])
# Quick loop: [one-hot-ensemble-rows].
@pytest.mark.quick_cases("one-hot-ensemble-rows")
def test_no_per_trajectory_gather_or_scatter_in_loops(path, solve, ts):
    # By index: 2-6 gathers and 2-3 scatters by a per-trajectory row in the loops of
    # the gradient (reading and writing a saved row, adding the cotangent of a save
    # time), each a serial loop over the batch on a TPU; one-hot: none.
    assert T <= _save._COMPARE_ALL_MAX
    loss = functools.partial(_loss, solve=solve, lanes=N)
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(*_inputs(ts)).jaxpr
    found = _per_trajectory_row_ops(jaxpr, N, T)
    assert (found == []) == (path == "one-hot"), found


@pytest.mark.slow
def test_many_save_times_by_index():
    # Past `_COMPARE_ALL_MAX` save times, rows are read and written by index on
    # every backend (a one-hot select would cost every row in every step): the
    # same gradients, and the same steps.
    many = np.linspace(0.05, 1.95, _save._COMPARE_ALL_MAX + 6)
    inputs = _inputs(many)
    with _rows_by("one-hot"):
        got = _grad(_ensemble, 2, "one-hot")(*inputs)
        want = _grad(_vmapped, None, "one-hot")(*inputs)
    _assert_close(got, want, rtol=1e-9)
