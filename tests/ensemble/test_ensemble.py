"""`ensemble_solve`: a batch solved on lanes that are refilled from a queue gives
what `jax.vmap(diffeqsolve)` gives, to round-off, in the input order, whatever the
number of lanes; failures per trajectory; its reverse-mode gradients are those of
`jax.vmap(diffeqsolve)`; what it does not support raises."""

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only, skip_unless_full_matrix, tree_allclose

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")

N = 13  # a prime: no lane count below it divides it
T1 = 1.0
PID = sk.PIDController(rtol=1e-6, atol=1e-6)
TS = np.linspace(0.0, T1, 7)


def lorenz(t, y, args):
    rho = args["rho"]
    x, u, z = y[0], y[1], y[2]
    return jnp.stack(
        [args["sigma"] * (u - x), x * (rho - z) - u, x * u - (8.0 / 3.0) * z]
    )


TERM = sk.ODETerm(lorenz)


def inputs(n: int = N):
    y0 = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))
    # An array leaf per trajectory (rho spread over [0, 100]) and a shared Python
    # number.
    args = dict(rho=jnp.linspace(0.0, 100.0, n), sigma=10.0)
    return y0, args


def vmapped(y0, args, **kw):
    def one(y, rho):
        return sk.diffeqsolve(
            TERM, sk.Tsit5(), 0.0, T1, 1e-3, y, dict(rho=rho, sigma=10.0), **kw
        )

    return jax.jit(jax.vmap(one))(y0, args["rho"])


def ensemble(y0, args, **kw):
    return sk.ensemble_solve(TERM, sk.Tsit5(), 0.0, T1, 1e-3, y0, args, **kw)


def same(sol, ref, *, tol=1e-9):
    """`sol` (ensemble) equals `ref` (vmapped) to round-off, field by field."""
    # The same steps (the stats are equal) in float64: rounding of ~ steps · eps ·
    # e^(λ T1), λ < 2 for Lorenz (rho <= 100), ~ 1e3 · 2.2e-16 · 10 = 2e-12 << `tol`.
    assert tree_allclose(sol.ts, ref.ts, rtol=tol, atol=tol)
    assert tree_allclose(sol.ys, ref.ys, rtol=tol, atol=tol)
    assert tree_allclose(sol.t0, ref.t0) and tree_allclose(sol.t1, ref.t1)
    np.testing.assert_array_equal(sol.result.code, ref.result.code)
    for key in ("num_steps", "num_accepted_steps", "num_rejected_steps", "max_steps"):
        np.testing.assert_array_equal(sol.stats[key], ref.stats[key])


@functools.cache
def _reference_ts():
    y0, args = inputs()
    return vmapped(y0, args, saveat=sk.SaveAt(t0=True, ts=TS), stepsize_controller=PID)


@pytest.mark.parametrize("lanes", [4, 5, N, 32, None])
# Quick loop: the default lanes; a refill that does not divide N:
# test_refill_sizes_match_vmap[terminating_event-4-3].
@pytest.mark.quick_cases(dict(lanes=None))
def test_adaptive_ts_matches_vmap(lanes):
    # 4 and 5 lanes do not divide N; 32 > N is clipped to N; None is the default.
    if lanes == 4:
        skip_unless_full_matrix(
            "[5] (lanes that do not divide N) and "
            "test_refill_sizes_match_vmap[terminating_event-4-3] (4 lanes)"
        )
    y0, args = inputs()
    sol = ensemble(
        y0, args, saveat=sk.SaveAt(t0=True, ts=TS), stepsize_controller=PID,
        lanes=lanes,
    )  # fmt: skip
    ref = _reference_ts()
    assert ref.stats["num_steps"].min() < ref.stats["num_steps"].max()  # spread
    same(sol, ref)
    assert sol.stats["lanes"] == min(N, lanes or sk.default_lanes(N))
    assert sol.stats["lane_steps"] >= sol.stats["num_steps"].sum()


def test_under_jit_and_the_work_done():
    y0, args = inputs()
    solve = jax.jit(
        lambda y, a: sk.ensemble_solve(
            TERM, sk.Tsit5(), 0.0, T1, 1e-3, y, dict(rho=a, sigma=10.0),
            saveat=sk.SaveAt(t0=True, ts=TS), stepsize_controller=PID, lanes=3,
        )
    )  # fmt: skip
    sol = solve(y0, args["rho"])
    same(sol, _reference_ts())
    # 3 lanes, 13 trajectories: far less work than 13 lanes in lockstep.
    steps = np.asarray(sol.stats["num_steps"])
    assert sol.stats["lane_steps"] < N * steps.max()


# Quick loop: test_kernel_fixed.py::test_max_steps_and_nonfinite_result.
@pytest.mark.slow
def test_fixed_steps_and_step_saves():
    y0, args = inputs()
    kw = dict(saveat=sk.SaveAt(t1=True, steps=True), max_steps=120)
    sol = sk.ensemble_solve(TERM, sk.Tsit5(), 0.0, T1, 0.01, y0, args, lanes=4, **kw)
    ref = jax.jit(
        jax.vmap(
            lambda y, rho: sk.diffeqsolve(
                TERM, sk.Tsit5(), 0.0, T1, 0.01, y, dict(rho=rho, sigma=10.0), **kw
            )
        )
    )(y0, args["rho"])
    same(sol, ref)
    assert np.all(np.asarray(sol.stats["num_steps"]) == 100)


# Quick loop: test_adaptive_ts_matches_vmap[None].
@pytest.mark.slow
def test_backwards_pytree_state_and_saveat_fn():
    # A dict state, integrated from 1 back to 0, saving a function of it.
    y0, args = inputs(6)
    y0 = dict(a=y0[:, :2], b=y0[:, 2])

    def field(t, y, rho):  # a rotation at rate rho, and a decay
        a = y["a"]
        return dict(a=rho * jnp.stack([a[1], -a[0]]), b=-0.5 * y["b"] * t)

    saveat = sk.SaveAt(ts=TS[::-1], fn=lambda t, y, args: y["a"].sum() + t)
    kw = dict(saveat=saveat, stepsize_controller=PID)
    term = sk.ODETerm(field)
    sol = sk.ensemble_solve(
        term, sk.Tsit5(), T1, 0.0, -1e-3, y0, args["rho"] / 10, lanes=4, **kw
    )
    ref = jax.jit(
        jax.vmap(
            lambda y, a: sk.diffeqsolve(term, sk.Tsit5(), T1, 0.0, -1e-3, y, a, **kw)
        )
    )(y0, args["rho"] / 10)
    same(sol, ref)


# The full suite; the quick loop's failed solve, raised and not:
# solve/test_errors.py::test_throw_under_jit_and_vmap.
@pytest.mark.slow
def test_failed_trajectories_throw_false_and_true():
    y0, args = inputs()
    kw = dict(stepsize_controller=PID, max_steps=60)
    ref = vmapped(y0, args, throw=False, **kw)
    codes = np.asarray(ref.result.code)
    failed = codes == sk.RESULTS.max_steps_reached.code
    assert failed.any() and not failed.all()
    sol = ensemble(y0, args, throw=False, lanes=4, **kw)
    same(sol, ref)
    with pytest.raises(RuntimeError, match="maximum number of solver steps"):
        jax.block_until_ready(ensemble(y0, args, throw=True, lanes=4, **kw).ys)


def test_zero_length_and_one_trajectory():
    y0, args = inputs(1)
    sol = sk.ensemble_solve(TERM, sk.Tsit5(), 0.5, 0.5, 0.01, y0, args)
    np.testing.assert_array_equal(sol.ys, y0[:, None])
    assert sol.stats["num_steps"].tolist() == [0]


# Quick loop: solve/test_progress.py::test_text_progress_meter_under_jit_and_grad.
@pytest.mark.slow
def test_progress_meter_counts_trajectories(capsys):
    y0, args = inputs()
    meter = sk.TextProgressMeter(minimum_increase=0.1)
    sol = ensemble(y0, args, stepsize_controller=PID, progress_meter=meter, lanes=4)
    jax.block_until_ready(sol.ys)
    lines = re.findall(r"([\d.]+)%", capsys.readouterr().out)
    values = [float(v) for v in lines]
    assert values[0] == 0.0 and values[-1] == 100.0
    assert values == sorted(values) and len(values) > 2


# Quick loop: solve/test_progress.py::test_text_progress_meter_under_jit_and_grad.
@pytest.mark.slow
def test_progress_meter_lockstep(capsys):
    # As many lanes as trajectories: the vmapped single solve's meter (the slowest
    # trajectory's time), from 0% to 100%, the solution that of jax.vmap.
    y0, args = inputs()
    meter = sk.TextProgressMeter(minimum_increase=0.1)
    sol = ensemble(y0, args, stepsize_controller=PID, progress_meter=meter, lanes=N)
    jax.block_until_ready(sol.ys)
    values = [float(v) for v in re.findall(r"([\d.]+)%", capsys.readouterr().out)]
    assert values[0] == 0.0 and values[-1] == 100.0 and values == sorted(values)
    assert sol.stats["refill"] == 0
    ref = ensemble(y0, args, stepsize_controller=PID, lanes=N)
    np.testing.assert_array_equal(sol.ys, ref.ys)


# --- Gradients ----------------------------------------------------------------------
#
# Reverse mode against `jax.grad` of the same loss through `jax.vmap(diffeqsolve)`.
# The vector field closes over a differentiated float (`scale`) and an integer index
# (`j`) that an outer `jax.vmap` batches, and picks a weight per trajectory with an
# integer of `args` (`k`); 4 lanes for 13 trajectories, so lanes are refilled.

WEIGHTS = np.array([0.8, 1.0, 1.3])
K = np.arange(N) % 3  # an integer leaf of `args`, one per trajectory
GRAD_SAVEAT = sk.SaveAt(t0=True, ts=TS)


def weighted_lorenz(scale, j):
    def field(t, y, args):
        sigma = 10.0 * scale * jnp.asarray(WEIGHTS)[j] * jnp.asarray(WEIGHTS)[args["k"]]
        x, u, z = y[0], y[1], y[2]
        return jnp.stack([sigma * (u - x), x * (args["rho"] - z) - u, x * u - z])

    return sk.ODETerm(field)


def grad_inputs():
    y0, args = inputs()
    y0 = y0 + 0.01 * jnp.arange(N)[:, None]  # a different start for each
    return y0, args["rho"], jnp.asarray(1.1), jnp.arange(2)  # j = 0 and 1


def ensemble_ys(term, y0, args, adjoint, **kw):
    return sk.ensemble_solve(
        term, sk.Tsit5(), 0.0, T1, 1e-3, y0, args, stepsize_controller=PID,
        lanes=4, adjoint=adjoint, **kw
    ).ys  # fmt: skip


def vmapped_ys(term, y0, args, adjoint, **kw):
    def one(y, a):
        return sk.diffeqsolve(
            term, sk.Tsit5(), 0.0, T1, 1e-3, y, a, stepsize_controller=PID,
            adjoint=adjoint, **kw
        ).ys  # fmt: skip

    return jax.vmap(one)(y0, args)


@functools.cache
def loss_gradient(solve, adjoint=sk.RecursiveCheckpointAdjoint(), outer=True):
    """`jit` of the gradient of a loss on `ys` w.r.t. `y0`, `rho` and `scale`,
    vmapped over `j` (`outer`) or at `j = 1`."""

    def loss(y0, rho, scale, j):
        ys = solve(
            weighted_lorenz(scale, j), y0, dict(rho=rho, k=K), adjoint,
            saveat=GRAD_SAVEAT,
        )  # fmt: skip
        return jnp.sum(jnp.sin(ys) * jnp.arange(1.0, 4.0)[None, None])

    grad = jax.grad(loss, argnums=(0, 1, 2))
    if outer:
        return jax.jit(jax.vmap(grad, in_axes=(None, None, None, 0)))
    return jax.jit(lambda y0, rho, scale, js: grad(y0, rho, scale, js[1]))


def assert_gradients_agree(got, want, rtol=1e-10):
    """`got` equals `want` to round-off, relative to the whole gradient's scale.

    Both run the same steps with the operations in another order, so they differ by
    float64 rounding (eps 2e-16) accumulated over the steps of the forward and
    backward solves: 5e-13 of the gradient's largest element in
    `test_gradient_per_trajectory_times`, under `rtol` = 1e-10 by a margin of 200.
    The scale is the largest element of all leaves together, not of each element:
    an element near 0 (d/dt1 when `ts` saves at t1 is of the order of the solver's
    tolerance times that scale) carries the rounding of the large terms that cancel
    in it, not a rounding relative to itself."""
    got, want = [np.asarray(g) for g in got], [np.asarray(w) for w in want]
    scale = max(np.max(np.abs(w)) for w in want)
    for g, w in zip(got, want, strict=True):
        assert np.all(np.isfinite(w)) and np.max(np.abs(w)) > 0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


# Quick loop: ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-
# lockstep].
@pytest.mark.slow
def test_gradient_matches_vmap():
    got = loss_gradient(ensemble_ys)(*grad_inputs())
    want = loss_gradient(vmapped_ys)(*grad_inputs())
    assert_gradients_agree(got, want)
    # The two values of `j` give different gradients: the index is not lost.
    assert not np.allclose(got[2][0], got[2][1])


# [direct] with `SOLVERKIT_FULL_MATRIX=1` only: DirectAdjoint differentiates the
# discrete solve that test_gradient_matches_vmap's checkpointed adjoint does.
@pytest.mark.slow
@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(sk.BacksolveAdjoint(), id="backsolve"),
        pytest.param(
            sk.DirectAdjoint(),
            id="direct",
            marks=full_matrix_only("test_gradient_matches_vmap (the same solve)"),
        ),
    ],
)
def test_gradient_other_adjoints(adjoint):
    got = loss_gradient(ensemble_ys, adjoint, outer=False)(*grad_inputs())
    want = loss_gradient(vmapped_ys, adjoint, outer=False)(*grad_inputs())
    assert_gradients_agree(got, want, rtol=1e-9)


# The full suite (errors that compile a solve first).
@pytest.mark.slow
def test_forward_mode_and_second_reverse_raise():
    y0, rho, scale, _ = grad_inputs()

    def loss(scale):
        return ensemble_ys(
            weighted_lorenz(scale, 1), y0, dict(rho=rho, k=K), None, max_steps=64
        ).sum()

    # Raised before anything is compiled. (Under `jax.jit` JAX raises its own
    # error for forward mode through a `custom_vjp`, when compiling.)
    with pytest.raises(ValueError, match=r"reverse-mode.*jax\.vmap\(diffeqsolve\)"):
        jax.jvp(loss, (scale,), (scale,))
    with pytest.raises(ValueError, match=r"ensemble_solve can't .* twice .*jacfwd"):
        jax.make_jaxpr(jax.grad(jax.grad(loss)))(scale)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(saveat=sk.SaveAt(dense=True)), r"dense.*jax\.vmap\(diffeqsolve\)"),
        # What the adjoint does not support, as `diffeqsolve` says it.
        (
            dict(
                adjoint=sk.BacksolveAdjoint(),
                event=sk.Event(lambda t, y, args, **kw: y[0] - 0.5),
            ),
            "BacksolveAdjoint.*events",
        ),
        (dict(adjoint=sk.DirectAdjoint(), max_steps=None), "DirectAdjoint"),
    ],
)
def test_unsupported_options_raise(kw, match):
    y0, args = inputs(4)
    with pytest.raises(ValueError, match=match) as info:
        ensemble(y0, args, **kw)
    assert isinstance(info.value, NotImplementedError)


@pytest.mark.parametrize(
    "y0, args, lanes, match",
    [
        (np.ones((4, 3)), dict(rho=np.ones(5), sigma=1.0), None, "same leading"),
        (np.ones((4, 3)), dict(rho=np.ones(()), sigma=1.0), None, "scalar"),
        (np.ones((4, 3)), dict(rho=np.ones(4), sigma=1.0), 0, "positive"),
        (np.ones((0, 3)), dict(rho=np.ones(0), sigma=1.0), None, "at least one"),
    ],
)
def test_bad_batches_raise(y0, args, lanes, match):
    with pytest.raises(ValueError, match=match):
        ensemble(y0, args, lanes=lanes)


def test_default_lanes():
    assert sk.default_lanes(4096, "cpu") == 256
    assert sk.default_lanes(100, "cpu") == 64
    assert sk.default_lanes(10, "cpu") == 10
    # On an accelerator: the lockstep loop (refill measured slower on a TPU).
    assert sk.default_lanes(4096, "gpu") == 4096
    assert sk.default_lanes(2**14, "tpu") == 2**14
    assert sk.default_lanes(2**20 + 1, "gpu") == 2**20 + 1


# --- Per-trajectory times -------------------------------------------------------------
#
# `t0`, `t1` of shape (N,) and `SaveAt(ts=...)` of shape (N, T) against
# `jax.vmap(diffeqsolve)` with the same times batched; 4 lanes for 13 trajectories.

T0S = np.linspace(0.0, 0.3, N)
T1S = np.linspace(0.5, T1, N)
# Seven save times per trajectory, from its t0 to its t1 (exactly).
TSS = T0S[:, None] + (T1S - T0S)[:, None] * np.linspace(0.0, 1.0, 7)[None]
TSS[:, 0], TSS[:, -1] = T0S, T1S


def vmapped_times(t0, t1, y0, rho, ts, term=TERM, **kw):
    saveat = sk.SaveAt(ts=ts) if ts is not None else sk.SaveAt(t1=True)

    def one(t0, t1, y, rho, ts):
        s = sk.SaveAt(ts=ts) if ts is not None else saveat
        return sk.diffeqsolve(
            term, sk.Tsit5(), t0, t1, None, y, dict(rho=rho, sigma=10.0),
            saveat=s, stepsize_controller=PID, **kw
        )  # fmt: skip

    axes = lambda x: None if x is None or np.ndim(x) == 0 else 0  # noqa: E731
    ts_axis = None if ts is None or np.ndim(ts) == 1 else 0
    in_axes = (axes(t0), axes(t1), 0, 0, ts_axis)
    return jax.vmap(one, in_axes=in_axes)(t0, t1, y0, rho, ts)


def ensemble_times(t0, t1, y0, rho, ts, term=TERM, **kw):
    saveat = sk.SaveAt(ts=ts) if ts is not None else sk.SaveAt(t1=True)
    return sk.ensemble_solve(
        term, sk.Tsit5(), t0, t1, None, y0, dict(rho=rho, sigma=10.0),
        saveat=saveat, stepsize_controller=PID, lanes=4, **kw
    )  # fmt: skip


@pytest.mark.parametrize(
    "t0, t1, ts",
    [
        (T0S, T1S, TSS),  # all per trajectory
        (0.0, T1S, np.linspace(0.0, 0.5, 5)),  # shared ts inside every [t0, t1]
        # With `SOLVERKIT_FULL_MATRIX=1` only: a per-trajectory t0 is [all]'s.
        pytest.param(
            T0S, T1, None, marks=full_matrix_only("[all] (per-trajectory t0 and t1)")
        ),  # per-trajectory t0, shared t1, saved at t1
        (0.3 * T1S, 0.0, None),  # backwards (not far: backwards Lorenz blows up)
    ],
    ids=["all", "t1-shared-ts", "t0", "backwards"],
)
# Quick loop: per-trajectory save times:
# ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep].
@pytest.mark.slow
def test_per_trajectory_times_match_vmap(t0, t1, ts):
    y0, args = inputs()
    got = jax.jit(ensemble_times)(t0, t1, y0, args["rho"], ts)
    want = jax.jit(vmapped_times)(t0, t1, y0, args["rho"], ts)
    same(got, want, tol=1e-10)
    # Outside `jit` (times known before tracing) the same.
    same(ensemble_times(t0, t1, y0, args["rho"], ts), want, tol=1e-10)


# The full suite; the quick loop's per-trajectory save times:
# ensemble/test_ensemble_ts_grad.py::test_ensemble_equals_vmap[one-hot-rows-lockstep];
# its events: test_refill_sizes_match_vmap[terminating_event-4-3].
@pytest.mark.slow
def test_per_trajectory_times_with_events():
    y0, args = inputs()
    event = sk.Event(lambda t, y, args, **kw: y[0] - 0.5, direction=False)
    t1 = np.linspace(0.3, T1, N)
    got = ensemble_times(0.0, t1, y0, args["rho"], None, event=event)
    want = jax.jit(functools.partial(vmapped_times, event=event))(
        0.0, t1, y0, args["rho"], None
    )
    same(got, want, tol=1e-10)
    fired = np.asarray(got.result.code) == sk.RESULTS.event_occurred.code
    assert fired.any() and not fired.all()
    np.testing.assert_array_equal(got.event_mask, want.event_mask)


@pytest.mark.slow
def test_gradient_per_trajectory_times():
    # d/d(t0, t1, ts, y0) and a closed-over float, through `ys` at per-trajectory
    # save times. (The same w.r.t. `t1` through the saved final states alone, where
    # d ys(t1) / d t1 is the vector field: the trajectories that no event stops in
    # test_gradient_with_events_and_per_trajectory_t1.)
    y0, args = inputs()
    rho = args["rho"]

    def loss(solve, t0, t1, ts, y0, scale):
        def field(t, y, args):
            return lorenz(t, y, dict(rho=args["rho"], sigma=10.0 * scale))

        sol = solve(t0, t1, y0, rho, ts, term=sk.ODETerm(field))
        return jnp.sum(jnp.sin(sol.ys)) + jnp.sum(sol.ts**2)

    def adapt(solve):
        return lambda t0, t1, y0, rho, ts, term: solve(t0, t1, y0, rho, ts, term=term)

    args_ = (T0S, T1S, TSS, y0, 1.1)
    argnums = (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(functools.partial(loss, adapt(ensemble_times)), argnums))
    want = jax.jit(jax.grad(functools.partial(loss, adapt(vmapped_times)), argnums))
    assert_gradients_agree(got(*args_), want(*args_))


@pytest.mark.parametrize(
    "t0, t1, ts, match",
    [
        (0.0, np.ones(5), None, r"`t1` must be a scalar .* \(N,\) = \(13,\)"),
        (np.zeros((N, 1)), 1.0, None, r"`t0` must be a scalar .* got shape \(13, 1\)"),
        (0.0, 1.0, np.zeros((5, 3)), r"`saveat.ts` must have shape \(T,\) .* \(5, 3\)"),
        (0.0, np.full(N, 0.5), np.linspace(0, 1, 3), "between t0 and t1"),
        (0.0, np.where(np.arange(N) % 2, 1.0, -1.0), None, "one direction"),
    ],
    ids=["t1-shape", "t0-shape", "ts-shape", "ts-outside", "direction"],
)
def test_per_trajectory_bad_times_raise(t0, t1, ts, match):
    y0, args = inputs()
    with pytest.raises(ValueError, match=match):
        ensemble_times(t0, t1, y0, args["rho"], ts)


# The full suite (errors after a compile); the quick loop's errors:
# test_unsupported_options_raise.
@pytest.mark.slow
def test_per_trajectory_unsupported_raise():
    y0, args = inputs()
    # A condition that reads the `t1` it is passed would see one for every trajectory.
    event = sk.Event(lambda t, y, args, t1, **kw: t - 0.5 * t1)
    with pytest.raises(ValueError, match="cond_fn can't use its `t0`, `t1`"):
        ensemble_times(0.0, T1S, y0, args["rho"], None, event=event)
    with pytest.raises(ValueError, match="StepTo"):
        sk.ensemble_solve(
            TERM, sk.Tsit5(), 0.0, T1S, None, y0, args,
            stepsize_controller=sk.StepTo(np.linspace(0.0, 0.5, 4)),
        )  # fmt: skip
    # Directions known only at run time are checked then.
    mixed = jnp.where(jnp.arange(N) % 2 == 0, 0.2, -0.2)
    with pytest.raises(Exception, match="one direction"):
        jax.jit(lambda t1: ensemble_times(0.0, t1, y0, args["rho"], None).ys)(mixed)
    # `diffeqsolve` takes one row of save times.
    with pytest.raises(ValueError, match="1-D array.*ensemble_solve"):
        sk.diffeqsolve(
            TERM, sk.Tsit5(), 0.0, T1, 1e-3, y0[0], dict(rho=1.0, sigma=10.0),
            saveat=sk.SaveAt(ts=TSS),
        )  # fmt: skip


@pytest.mark.slow
def test_gradient_with_events_and_per_trajectory_t1():
    # Some trajectories stop where x falls back to 1/2, the others at their own t1:
    # the derivatives of the stopping times (`sol.t1`) and of the final states
    # w.r.t. a closed-over float, a per-trajectory float of `args`, each t1 (zero
    # where the event stopped it) and y0. (Two tests before, one with a shared t1:
    # one program each way now. A shared t1's gradient: test_gradient_matches_vmap.)
    y0, args = inputs()
    event = sk.Event(lambda t, y, args, **kw: y[0] - 0.5, direction=False)
    t1 = np.linspace(0.3, T1, N)

    def loss(solve, scale, rho, t1, y0):
        def field(t, y, args):
            return lorenz(t, y, dict(rho=args["rho"], sigma=10.0 * scale))

        sol = solve(0.0, t1, y0, rho, None, term=sk.ODETerm(field), event=event)
        return jnp.sum(sol.t1**2) + jnp.sum(jnp.cos(sol.ys)), sol.result.code

    def gradient(solve):
        grad = jax.grad(functools.partial(loss, solve), (0, 1, 2, 3), has_aux=True)
        return jax.jit(grad)

    got, code = gradient(ensemble_times)(1.0, args["rho"], t1, y0)
    want, _ = gradient(vmapped_times)(1.0, args["rho"], t1, y0)
    fired = np.asarray(code) == sk.RESULTS.event_occurred.code
    assert fired.any() and not fired.all()
    assert_gradients_agree(got, want)


@pytest.mark.slow
def test_per_trajectory_times_under_outer_vmap():
    # An outer `jax.vmap` over an integer index `j` that the vector field closes over
    # (a batch of ensembles), with per-trajectory t1 and save times.
    y0, args = inputs()

    def solve(how, j):
        return how(T0S, T1S, y0, args["rho"], TSS, term=weighted_lorenz(1.0, j)).ys

    def field_args(how):
        # `weighted_lorenz` reads `args["k"]`: give every trajectory k = 1.
        return lambda t0, t1, y0, rho, ts, term: how(
            t0, t1, y0, rho, ts, term=_with_k(term)
        )

    js = jnp.arange(2)
    got = jax.jit(jax.vmap(functools.partial(solve, field_args(ensemble_times))))(js)
    want = jax.jit(jax.vmap(functools.partial(solve, field_args(vmapped_times))))(js)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert not np.allclose(got[0], got[1])


def _with_k(term):
    field = term.vector_field
    return sk.ODETerm(lambda t, y, args: field(t, y, dict(args, k=1)))


# --- Every field of the `Solution`, for each feature ---------------------------------
#
# `ensemble_solve` returns what `jax.vmap(diffeqsolve)` returns: the same fields, the
# same structure (a field `None` in one is `None` in the other), the same values.


def _x_falls(t, y, args, **kwargs):
    return y[0] - 0.5


def _halve(t, y, args):  # an event's effect: x halved where it falls through 1/2
    return y.at[0].multiply(0.5)


FEATURES = {
    "ts": dict(saveat=sk.SaveAt(t0=True, ts=TS), stepsize_controller=PID),
    "steps": dict(saveat=sk.SaveAt(t1=True, steps=True), max_steps=1200),
    "subs_fn": dict(
        saveat=sk.SaveAt(
            subs=[
                sk.SubSaveAt(ts=TS, fn=lambda t, y, args: y[0] * args["rho"]),
                sk.SubSaveAt(t1=True),
            ]
        ),
        stepsize_controller=PID,
    ),
    "states": dict(
        saveat=sk.SaveAt(
            t1=True, solver_state=True, controller_state=True, made_jump=True
        ),
        stepsize_controller=PID,
    ),
    "terminating_event": dict(
        event=sk.Event(_x_falls, direction=False), stepsize_controller=PID
    ),
    "continuing_event": dict(
        event=sk.Event(_x_falls, direction=False, effect=_halve, max_events=8),
        saveat=sk.SaveAt(ts=TS),
        stepsize_controller=PID,
    ),
    "timed_event": dict(
        event=sk.TimedEvent(np.array([0.25, 0.5]), amount=np.array([1.0, 0, 0])),
        saveat=sk.SaveAt(ts=TS),
        stepsize_controller=PID,
    ),
    "both_events": dict(
        event=(
            sk.Event(_x_falls, direction=False, effect=_halve, max_events=8),
            sk.TimedEvent(np.array([0.3]), amount=np.array([2.0, 0, 0])),
        ),
        stepsize_controller=PID,
    ),
}


def _fields(sol: sk.Solution) -> dict:
    """Every field of a `Solution` as leaves (`None` kept as a leaf), and the names
    of `stats` that `diffeqsolve` returns."""
    names = [f for f in sol.__dataclass_fields__ if f not in ("stats", "interpolation")]
    flat = lambda x: jax.tree_util.tree_flatten(x, is_leaf=lambda v: v is None)  # noqa: E731
    out = {name: flat(getattr(sol, name)) for name in names}
    out.update({f"stats[{k}]": ([sol.stats[k]], None) for k in _STATS})
    return out


_STATS = ("num_steps", "num_accepted_steps", "num_rejected_steps", "max_steps")


@functools.cache
def _feature_reference(feature: str) -> sk.Solution:
    """The vmapped solve of `FEATURES[feature]`, compiled once for the tests that
    compare against it (a Solution is immutable)."""
    y0, args = inputs()
    return vmapped(y0, args, **FEATURES[feature])


@pytest.mark.parametrize("feature", FEATURES)
# The full suite; the quick loop's ensemble events:
# test_refill_sizes_match_vmap[terminating_event-4-3].
@pytest.mark.slow
def test_every_field_matches_vmap(feature):
    if feature == "continuing_event":
        skip_unless_full_matrix(
            "[both_events] (every field with a continuing event) and "
            "test_refill_sizes_match_vmap[continuing_event-4-3] (this event's fields)"
        )
    if feature == "terminating_event":
        skip_unless_full_matrix(
            "[both_events] (every field with an event) and "
            "test_refill_sizes_match_vmap[terminating_event-4-3] (this event's fields)"
        )
    if feature == "timed_event":
        skip_unless_full_matrix("[both_events] (every field with a timed event)")
    kw = FEATURES[feature]
    y0, args = inputs()
    ref = _feature_reference(feature)
    sol = ensemble(y0, args, lanes=4, **kw)
    if feature.endswith("ing_event") or feature == "both_events":  # exercised
        assert ref.event_mask is not None or ref.events is not None
    if ref.events is not None:
        assert np.asarray(ref.events.num).max() > 0
    # test_events_match_vmap solved this case again: its checks are here now.
    if feature == "terminating_event":
        # A real-valued condition (located on the dense output) fires for some
        # trajectories only: x falls back to 1 / 2 after rising.
        fired = np.asarray(ref.result.code) == sk.RESULTS.event_occurred.code
        assert fired.any() and not fired.all()
    got, want = _fields(sol), _fields(ref)
    assert set(got) == set(want)
    for name in want:
        (g, g_tree), (w, w_tree) = got[name], want[name]
        if name.startswith("stats"):
            g_tree = w_tree  # a batch of max_steps against a static int
        assert g_tree == w_tree, name
        for a, b in zip(g, w):
            if b is None:
                assert a is None, name
                continue
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
            # Both take the same steps in float64, the states equal to round-off
            # (1e-9 on states of O(10) leaves room for reordering). The controller's
            # state holds the last error ratio, a difference of nearly equal stage
            # sums: its round-off relative to it is eps / rtol = 2e-10, amplified by
            # the controller's exponents and sums over the steps: 1e-5.
            tol = 1e-5 if name == "controller_state" else 1e-9
            b = np.broadcast_to(b, a.shape)
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)


# Quick loop: test_adaptive_ts_matches_vmap[None].
@pytest.mark.slow
def test_float32_agrees_to_the_tolerance():
    # In float32 the two paths need not take the same steps: XLA compiles the
    # element-wise arithmetic of a batch differently for different batch sizes
    # (vector width, fused multiply-adds), so a lockstep batch of N and lanes of L
    # round differently, and the step-size controller turns a last-bit difference
    # into other steps (docs/ensembles.md). Each path then solves to the tolerance:
    # they agree to the global error, rtol * |y| grown by the flow over [0, 1]
    # (Lorenz's largest Lyapunov exponent for rho <= 100 is below 2: e^2 < 10).
    rtol = 1e-5
    controller = sk.PIDController(rtol=rtol, atol=rtol)
    with jax.enable_x64(False):
        y0 = jnp.tile(jnp.array([1.0, 0.0, 0.0], jnp.float32), (N, 1))
        args = dict(rho=jnp.linspace(0.0, 100.0, N, dtype=jnp.float32), sigma=10.0)
        kw = dict(saveat=sk.SaveAt(ts=TS), stepsize_controller=controller)
        ref = vmapped(y0, args, **kw)
        sol = ensemble(y0, args, lanes=4, **kw)
        assert sol.ys.dtype == ref.ys.dtype == jnp.float32
        scale = np.abs(np.asarray(ref.ys)).max(axis=(1, 2), keepdims=True)
        diff = np.abs(np.asarray(sol.ys) - np.asarray(ref.ys))
        assert np.all(diff <= 10 * 10 * rtol * scale)
        steps, ref_steps = sol.stats["num_steps"], ref.stats["num_steps"]
        assert np.all(np.abs(np.asarray(steps) - np.asarray(ref_steps)) <= 5)


# --- The refill: a buffer of `refill` lanes; lockstep where it can't pay -------------


@pytest.mark.parametrize("lanes,refill", [(4, 1), (4, 3), (5, 5), (3, None)])
@pytest.mark.parametrize("feature", ["continuing_event", "terminating_event"])
@pytest.mark.quick_cases("terminating_event-4-3")
def test_refill_sizes_match_vmap(lanes, refill, feature):
    # Any refill size (1: one lane at a time; 3 of 4 lanes; all lanes), with events
    # located as a refilled lane is finished: every field as the vmapped solve's.
    if feature == "continuing_event" and (lanes, refill) != (4, 3):
        skip_unless_full_matrix(
            "[terminating_event-*] (these refill sizes), [continuing_event-4-3] (a "
            "continuing event's rows refilled)"
        )
    kw = FEATURES[feature]
    y0, args = inputs()
    sol = ensemble(y0, args, lanes=lanes, refill=refill, **kw)
    ref = _feature_reference(feature)
    assert sol.stats["refill"] == (refill or 1)
    same(sol, ref)
    got, want = _fields(sol), _fields(ref)
    for name in ("event_mask", "events"):
        for a, b in zip(got[name][0], want[name][0]):
            if b is not None:
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


# Quick loop: test_adaptive_ts_matches_vmap[None].
@pytest.mark.slow
def test_lockstep_when_lanes_cover_the_batch():
    # N lanes or more: the lockstep loop, no refill (stats["refill"] == 0), each
    # lane stepping until the longest trajectory has finished.
    y0, args = inputs()
    kw = dict(saveat=sk.SaveAt(t0=True, ts=TS), stepsize_controller=PID)
    for lanes in (N, 2 * N):
        sol = ensemble(y0, args, lanes=lanes, **kw)
        same(sol, _reference_ts())
        assert sol.stats["refill"] == 0 and sol.stats["lanes"] == N
        assert sol.stats["lane_steps"] == N * np.max(sol.stats["num_steps"])
    assert ensemble(y0, args, lanes=4, **kw).stats["refill"] == 1


def _conds_in_loops(jaxpr, inside: bool = False) -> int:
    """The `cond`s inside `while` loops of a jaxpr, nested ones included."""
    found = 0
    for eqn in jaxpr.eqns:
        loop = eqn.primitive.name == "while"
        found += inside and eqn.primitive.name == "cond"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _conds_in_loops(sub, inside or loop)
    return found


# The full suite; the quick loop refills lanes in test_refill_sizes_match_vmap.
@pytest.mark.slow
def test_refill_stays_a_branch_under_vmap():
    # Under an outer vmap the refill's predicate is unbatched, so it stays a
    # `cond` (a select would run the refill on every iteration).
    y0, args = inputs()

    def solve(scale):
        sol = ensemble(y0 * scale, args, lanes=4, stepsize_controller=PID)
        return sol.ys

    scales = jnp.array([1.0, 0.5])
    jaxpr = jax.make_jaxpr(jax.vmap(solve))(scales)
    assert _conds_in_loops(jaxpr.jaxpr) >= 1
    ys = jax.vmap(solve)(scales)
    for k in range(2):  # the same steps: equal to round-off
        np.testing.assert_allclose(ys[k], solve(scales[k]), rtol=1e-9, atol=1e-9)


# Quick loop: test_bad_batches_raise.
@pytest.mark.slow
def test_bad_refill_raises():
    y0, args = inputs()
    with pytest.raises(ValueError, match="`refill` must be a positive int"):
        ensemble(y0, args, lanes=4, refill=0)
    with pytest.raises(TypeError, match="`refill` must be a positive int"):
        ensemble(y0, args, lanes=4, refill=1.5)
