"""What a solve saves: `SaveAt` / `SubSaveAt` (t0, ts, t1, steps, fn, subs), dense
output, row layout as diffrax's, against analytic solutions."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from helpers import (
    assert_tree_allclose,
    quick_params,
    rotation,
    rotation_exact,
    ROTATION_PID,
    ROTATION_Y0,
    skip_unless_full_matrix,
    solve_rotation,
)

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


# Dense output at many times, compiled once (eager vmap would compile op by op).
_evaluate = eqx.filter_jit(lambda sol, ts: jax.vmap(sol.evaluate)(ts))


_derivative = eqx.filter_jit(lambda sol, ts: jax.vmap(sol.derivative)(ts))


def test_t0_ts_t1_and_dense():
    ts = jnp.array([0.0, 0.3, 1.0, 2.5, 3.0])
    sol = solve_rotation(sk.SaveAt(t0=True, ts=ts, t1=True, dense=True))
    expected_ts = np.concatenate([[0.0], np.asarray(ts), [3.0]])
    np.testing.assert_allclose(sol.ts, expected_ts)
    np.testing.assert_allclose(sol.ys, rotation_exact(expected_ts), atol=1e-8)
    assert float(sol.t0) == 0.0 and float(sol.t1) == 3.0
    # Dense output: every point, its derivative, and differences.
    grid = np.linspace(0.0, 3.0, 37)
    values = _evaluate(sol, jnp.asarray(grid))
    np.testing.assert_allclose(values, rotation_exact(grid), atol=1e-7)
    derivs = _derivative(sol, jnp.asarray(grid))
    np.testing.assert_allclose(
        derivs, np.stack([-np.sin(grid), -np.cos(grid)], -1), atol=1e-6
    )
    np.testing.assert_allclose(
        sol.evaluate(0.5, 2.0), rotation_exact(2.0) - rotation_exact(0.5), atol=1e-7
    )
    # The dense solution passes through the step ends exactly.
    np.testing.assert_allclose(sol.evaluate(3.0), sol.ys[-1], rtol=1e-12)


def test_default_saveat_is_t1():
    sol = solve_rotation(sk.SaveAt(t1=True))
    default = sk.diffeqsolve(
        sk.ODETerm(rotation),
        sk.Tsit5(),
        0.0,
        3.0,
        0.1,
        jnp.asarray(ROTATION_Y0),
        stepsize_controller=ROTATION_PID,
        max_steps=512,
    )
    assert sol.ts.shape == (1,) and sol.ys.shape == (1, 2)
    np.testing.assert_allclose(default.ys, sol.ys)
    np.testing.assert_allclose(sol.ys[0], rotation_exact(3.0), atol=1e-8)
    with pytest.raises(ValueError, match="dense"):
        sol.evaluate(1.0)


def test_steps_true_and_every_n():
    every = solve_rotation(sk.SaveAt(steps=True), max_steps=64)
    third = solve_rotation(sk.SaveAt(steps=3), max_steps=64)
    n = int(every.stats["num_accepted_steps"])
    assert every.ts.shape == (64,) and third.ts.shape == (64 // 3,)
    assert np.all(np.isfinite(np.asarray(every.ts[:n])))
    assert np.all(np.isinf(np.asarray(every.ts[n:])))
    assert np.all(np.isinf(np.asarray(every.ys[n:])))
    np.testing.assert_allclose(every.ts[n - 1], 3.0)
    assert np.all(np.diff(np.asarray(every.ts[:n])) > 0)
    np.testing.assert_allclose(every.ys[:n], rotation_exact(every.ts[:n]), atol=1e-8)
    # Every third accepted step: rows 2, 5, 8, ... of the every-step save.
    m = n // 3
    np.testing.assert_allclose(third.ts[:m], every.ts[2 : 3 * m : 3])
    np.testing.assert_allclose(third.ys[:m], every.ys[2 : 3 * m : 3])
    assert np.all(np.isinf(np.asarray(third.ts[m:])))


def test_fn_pytree_output():
    def fn(t, y, args):
        return {"energy": y[0] ** 2 + y[1] ** 2, "t": t, "first": y[:1]}

    ts = jnp.array([0.5, 1.5])
    sol = solve_rotation(sk.SaveAt(t0=True, ts=ts, t1=True, fn=fn))
    times = np.array([0.0, 0.5, 1.5, 3.0])
    np.testing.assert_allclose(sol.ts, times)
    expected = {
        "energy": np.ones(4),
        "first": rotation_exact(times)[:, :1],
        "t": times,
    }
    assert_tree_allclose(sol.ys, expected, atol=1e-8)


@pytest.mark.parametrize(
    "solver", [sk.Bosh3(), pytest.param(sk.Heun(), marks=pytest.mark.slow)]
)
def test_dense_hermite(solver):
    # Solvers without their own dense output interpolate by cubic Hermite.
    sol = solve_rotation(
        sk.SaveAt(dense=True),
        solver=solver,
        stepsize_controller=sk.PIDController(rtol=1e-7, atol=1e-7),
        max_steps=2048,
        t1=1.0,
    )
    grid = np.linspace(0.0, 1.0, 23)
    values = _evaluate(sol, jnp.asarray(grid))
    np.testing.assert_allclose(values, rotation_exact(grid), atol=1e-5)


@pytest.mark.slow
def test_dense_and_ts_backwards():
    ts = jnp.array([0.0, -1.0, -2.0])
    sol = solve_rotation(sk.SaveAt(ts=ts, dense=True), t1=-2.0, dt0=-0.1)
    np.testing.assert_allclose(sol.ts, ts)
    np.testing.assert_allclose(sol.ys, rotation_exact(ts), atol=1e-8)
    grid = np.linspace(-2.0, 0.0, 11)
    np.testing.assert_allclose(
        _evaluate(sol, jnp.asarray(grid)), rotation_exact(grid), atol=1e-7
    )
    np.testing.assert_allclose(
        _derivative(sol, jnp.array([-1.0]))[0],
        [-np.sin(-1.0), -np.cos(-1.0)],
        atol=1e-6,
    )


def test_unreached_ts_padded_with_inf():
    ts = jnp.array([0.5, 1.0, 2.9])
    sol = solve_rotation(
        sk.SaveAt(ts=ts, t1=True),
        stepsize_controller=sk.ConstantStepSize(),
        max_steps=12,
        throw=False,
    )
    assert sol.result == sk.RESULTS.max_steps_reached
    # 12 steps of 0.1 reach t = 1.2: ts 0.5 and 1.0 saved, 2.9 not. As in diffrax,
    # the final point follows the saved rows and the padding comes last.
    np.testing.assert_allclose(sol.ts[:3], [0.5, 1.0, 1.2])
    np.testing.assert_allclose(sol.ys[:3], rotation_exact([0.5, 1.0, 1.2]), atol=1e-8)
    assert np.isinf(float(sol.ts[3])) and np.all(np.isinf(np.asarray(sol.ys[3])))
    np.testing.assert_allclose(float(sol.t1), 1.2)


_LAYOUTS = {
    "ts+steps+t0+t1": lambda lib: lib.SaveAt(
        ts=jnp.array([0.25, 0.5]), steps=True, t0=True, t1=True
    ),
    "ts+steps=2+t1": lambda lib: lib.SaveAt(
        ts=jnp.array([0.25, 0.5]), steps=2, t1=True
    ),
    "steps+t1": lambda lib: lib.SaveAt(steps=True, t1=True),
    "steps=3+t1": lambda lib: lib.SaveAt(steps=3, t1=True),
    "steps=3": lambda lib: lib.SaveAt(steps=3),
    "subs": lambda lib: lib.SaveAt(
        subs=[
            lib.SubSaveAt(ts=jnp.array([0.1, 0.9]), t1=True, fn=lambda t, y, a: y[0]),
            {"steps": lib.SubSaveAt(steps=True, t0=True)},
        ]
    ),
}


# One of the twelve cases in the quick loop (`-m "not slow"`); each compiles two solves.
@pytest.mark.parametrize(
    "layout, event",
    quick_params(
        [(layout, event) for event in (False, True) for layout in _LAYOUTS],
        quick=[("steps=3", False)],
        ids=lambda case: f"{case[0]}-{'event' if case[1] else 'no-event'}",
    ),
)
# Quick loop: test_steps_true_and_every_n.
@pytest.mark.slow
def test_rows_laid_out_as_diffrax(layout, event):
    """Rows in time order (ts and step saves interleaved), the final point after
    them, padding last; an event removes rows past it."""
    import diffrax

    if not event and layout in ("ts+steps+t0+t1", "ts+steps=2+t1", "subs"):
        skip_unless_full_matrix(
            f"[{layout}-event] (the same rows, as diffrax's, cut at the event)"
        )
    if event and layout in ("steps+t1", "steps=3+t1", "steps=3"):
        skip_unless_full_matrix(
            "[ts+steps+t0+t1-event] (every step's rows cut at the event) and "
            "[ts+steps=2+t1-event] (every other step's), and this layout's "
            "[*-no-event]"
        )

    def run(lib):
        kw = {}
        if event:
            root = optx.Newton(rtol=1e-10, atol=1e-10)
            kw["event"] = lib.Event(lambda t, y, args, **_: y[0] - 0.55, root)
        sol = lib.diffeqsolve(
            lib.ODETerm(lambda t, y, args: -y),
            lib.Tsit5(),
            0.0,
            1.0,
            0.3,
            jnp.array([1.0, 2.0]),
            saveat=_LAYOUTS[layout](lib),
            max_steps=8,
            **kw,
        )
        return sol.ts, sol.ys

    (ts, ys), (ref_ts, ref_ys) = run(sk), run(diffrax)
    assert jax.tree.structure(ts) == jax.tree.structure(ref_ts)
    assert_tree_allclose(ts, ref_ts, atol=1e-6)
    assert_tree_allclose(ys, ref_ys, atol=1e-6)


@pytest.mark.slow
def test_subs_under_jit_vmap_grad():
    saveat = sk.SaveAt(
        subs=(sk.SubSaveAt(ts=jnp.linspace(0.0, 1.0, 5)), sk.SubSaveAt(t1=True))
    )

    def loss(k):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -k * y),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.asarray(1.0),
            saveat=saveat,
        )
        (_, ys_ts), (_, ys_t1) = zip(sol.ts, sol.ys)
        return jnp.sum(ys_ts) + ys_t1[0]

    ks = jnp.array([0.5, 1.0])
    grads = jax.jit(jax.vmap(jax.grad(loss)))(ks)
    ts = np.linspace(0.0, 1.0, 5)
    exact = [-np.sum(ts * np.exp(-k * ts)) - np.exp(-k) for k in (0.5, 1.0)]
    np.testing.assert_allclose(grads, exact, rtol=1e-6)


def test_vmap_over_save_times():
    @jax.jit
    @jax.vmap
    def at(ts):
        return solve_rotation(sk.SaveAt(ts=ts)).ys

    ts = jnp.array([[0.1, 0.2], [1.0, 2.9]])
    np.testing.assert_allclose(at(ts), rotation_exact(ts), atol=1e-8)


def test_saveat_subs_fields():
    sub = sk.SubSaveAt(ts=[0.5], t1=True)
    assert sk.SaveAt(subs=sub).subs is sub
    flat = sk.SaveAt(ts=[0.5], t1=True)
    assert isinstance(flat.subs, sk.SubSaveAt) and flat.t1 and flat.subs.t1
    assert_tree_allclose(flat.ts, jnp.array([0.5]))
    with pytest.raises(AttributeError, match="several"):
        _ = sk.SaveAt(subs=[sub, sub]).ts
