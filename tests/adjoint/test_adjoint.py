"""Gradients through `diffeqsolve`: `RecursiveCheckpointAdjoint` against
`DirectAdjoint`, finite differences and analytic derivatives (float64); forward mode
through `DirectAdjoint`; few checkpoints; and every way of holding a value in the
vector field under `jit`, `vmap`, `grad`, `vmap(grad)` and `grad(vmap)`."""

import functools

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import (
    assert_tree_allclose,
    count_compiles,
    finite_difference,
    FULL_MATRIX,
    quick_params,
)

import solverkit as sk
from solverkit._adjoint import _schedule


pytestmark = pytest.mark.usefixtures("x64")


RCA = sk.RecursiveCheckpointAdjoint()
DIRECT = sk.DirectAdjoint()

# --- Lotka-Volterra: gradients w.r.t. y0, args and t1 --------------------------------


def _lotka_volterra(t, y, args):
    a, b, c, d = args[0], args[1], args[2], args[3]
    return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])


_SAVE_TS = np.array([0.5, 1.0, 1.7])


def _lv_loss(params, adjoint, closed=False):
    """The parameters go through `args`, or (`closed=True`) are closed over."""
    y0, args, t1 = params
    if closed:
        vf, args = (lambda t, y, _: _lotka_volterra(t, y, params[1])), None
    else:
        vf = _lotka_volterra
    sol = sk.diffeqsolve(
        sk.ODETerm(vf),
        sk.Tsit5(),
        0.0,
        t1,
        0.05,
        y0,
        args,
        saveat=sk.SaveAt(ts=jnp.asarray(_SAVE_TS), t1=True),
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint,
        max_steps=512,
    )
    weights = jnp.arange(1.0, 5.0)[:, None]
    return jnp.sum(weights * sol.ys**2)


_lv_value = jax.jit(lambda p: _lv_loss(p, RCA))
_lv_grad_rca = jax.jit(jax.grad(lambda p: _lv_loss(p, RCA, closed=True)))
_lv_grad_direct = jax.jit(jax.grad(lambda p: _lv_loss(p, DIRECT)))


def _lv_params():
    return (jnp.array([1.0, 0.5]), jnp.array([1.1, 0.4, 0.9, 0.6]), jnp.asarray(2.0))


@pytest.mark.slow
def test_gradients_agree_across_adjoints_and_finite_differences():
    # Checkpointed adjoint with the parameters closed over, direct adjoint with them
    # in `args`, and finite differences: all agree.
    params = _lv_params()
    g_rca = _lv_grad_rca(params)
    g_direct = _lv_grad_direct(params)
    # The same discrete solve (same steps) differentiated two ways: they differ by
    # float64 rounding (eps 2e-16) accumulated over ~10^2 steps forward and back, and
    # amplified by the loss's conditioning; 1e-9 leaves a margin of 10^3 or more.
    assert_tree_allclose(g_rca, g_direct, rtol=1e-9, atol=1e-12)
    # Finite differences of the forward solve, leaf by leaf.
    flat, unflatten = jax.flatten_util.ravel_pytree(params)
    value = jax.jit(lambda x: _lv_value(unflatten(x)))  # (unflatten op by op: 14)
    fd = finite_difference(value, flat, eps=1e-5)
    np.testing.assert_allclose(jax.flatten_util.ravel_pytree(g_rca)[0], fd, rtol=1e-5)
    # d/dt1 of the loss is 2 * 4 * y(t1) . f(t1, y(t1)) (only the t1 row moves).
    y0, args, t1 = params
    sol = sk.diffeqsolve(
        sk.ODETerm(_lotka_volterra),
        sk.Tsit5(),
        0.0,
        t1,
        0.05,
        y0,
        args,
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        max_steps=512,
    )
    y1 = sol.ys[-1]
    dt1 = 8 * jnp.dot(y1, _lotka_volterra(t1, y1, args))
    np.testing.assert_allclose(g_rca[2], dt1, rtol=1e-6)


@pytest.mark.slow
def test_grad_under_jit_does_not_recompile():
    params = _lv_params()
    _lv_grad_rca(params)
    new = jtu.tree_map(lambda x: x * 1.01, params)
    with count_compiles() as counter:
        jax.block_until_ready(_lv_grad_rca(new))
    assert counter.count == 0


@pytest.mark.slow
def test_forward_mode_through_direct_adjoint():
    # jax.jacfwd (a vmap of jax.jvp) w.r.t. y0, args and t1 at once, against the
    # reverse-mode gradient.
    params = _lv_params()
    jac = jax.jit(jax.jacfwd(lambda p: _lv_loss(p, DIRECT)))(params)
    # Same discrete solve, forward against reverse mode: rounding only (see above).
    assert_tree_allclose(jac, _lv_grad_rca(params), rtol=1e-9, atol=1e-12)


# --- Few checkpoints ------------------------------------------------------------------


def _euler_solve(theta, adjoint, max_steps, t1, dt):
    """Euler steps of y' = -theta y (sin t + 1.5) from y0 = (1, 2)."""
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -args * y * (jnp.sin(t) + 1.5)),
        sk.Euler(),
        0.0,
        t1,
        dt,
        jnp.array([1.0, 2.0]),
        theta,
        adjoint=adjoint,
        max_steps=max_steps,
    )


def _euler_final(theta, adjoint, max_steps=40):
    # 37 Euler steps.
    sol = _euler_solve(theta, adjoint, max_steps, 3.7, 0.1)
    return jnp.sum(sol.ys[-1] ** 2)


def _euler_reference_grad(theta, n=37, dt=0.1):
    """Forward-mode derivative of the same 37 Euler steps, by hand."""
    y, dy = np.array([1.0, 2.0]), np.zeros(2)
    for i in range(n):
        s = np.sin(i * dt) + 1.5
        y, dy = y - dt * theta * s * y, dy - dt * s * (y + theta * dy)
    return 2 * np.dot(y, dy)


@pytest.mark.parametrize(
    "checkpoints, max_steps",
    quick_params(
        [
            # (slots, buffer) of the layout, and the stride 37 steps end with:
            (1, 40),  # (2, 20): stride 32 > buffer, chunks recomputed from a checkpoint
            (3, 40),  # (4, 10): stride 16 > buffer
            (8, 40),  # (8, 5): stride 8 > buffer
            (40, 40),  # (40, 1): every step stored, nothing recomputed
            (None, 40),  # (40, 1): the default (at least 128 slots, at most max_steps)
            (3, None),  # (4, 4): no bound on the steps
        ],
        quick=[(1, 40)],
    ),
)
def test_few_checkpoints(checkpoints, max_steps):
    adjoint = sk.RecursiveCheckpointAdjoint(checkpoints=checkpoints)
    grad = eqx.filter_jit(jax.grad(_euler_final))
    got = grad(jnp.asarray(0.7), adjoint, max_steps)
    # The reference differentiates the same 37 Euler steps in closed form: rounding
    # of 37 steps forward and back, ~1e-14 in float64.
    np.testing.assert_allclose(got, _euler_reference_grad(0.7), rtol=1e-12)


def _force_layout(monkeypatch, layout) -> list:
    """Make `RecursiveCheckpointAdjoint` use `layout`; returns the list of layouts
    used, to assert that the solve was traced with it."""
    used = []
    monkeypatch.setattr(
        _schedule,
        "layout",
        lambda *_: used.append(layout) or _schedule.Layout(*layout),
    )
    return used


@pytest.mark.parametrize(
    "layout, max_steps",
    quick_params(
        [
            # (slots, buffer, mid) for the 37 steps: stride, and steps per mid
            # checkpoint. Each case its own `max_steps`, so that `diffeqsolve`'s jit
            # cache retraces.
            ((4, 4, 4), 41),  # stride 16 > buffer; 4 per mid checkpoint
            ((2, 4, 8), 42),  # stride 32; 4 per mid checkpoint
            ((4, 2, 3), 43),  # stride 16; 6 per mid checkpoint > buffer: pieces
            ((8, 8, 2), 44),  # stride 8 = buffer: mid checkpoints compiled in, not used
        ],
        quick=[((4, 2, 3), 43)],
    ),
)
# Quick loop: test_few_checkpoints[1-40].
@pytest.mark.slow
def test_mid_checkpoints(layout, max_steps, monkeypatch):
    used = _force_layout(monkeypatch, layout)
    grad = eqx.filter_jit(jax.grad(_euler_final))
    got = grad(jnp.asarray(0.7), RCA, max_steps)
    assert used
    # As in `test_few_checkpoints`: rounding of 37 Euler steps.
    np.testing.assert_allclose(got, _euler_reference_grad(0.7), rtol=1e-12)


@pytest.mark.parametrize(
    "layout, max_steps",
    [
        # (slots, buffer, mid); 37 steps, all stored (stride 1): each chunk's carries
        # are copied from the store into the buffer, not recomputed.
        ((38, 5, 0), 45),  # the last chunk (35, 36) copies the store's last rows
        ((40, 50, 0), 46),  # the buffer has more rows than the store (41)
    ],
)
# Quick loop: [layout0-45].
@pytest.mark.quick_cases("layout0-45")
def test_every_step_stored_copied_into_the_buffer(layout, max_steps, monkeypatch):
    used = _force_layout(monkeypatch, layout)
    grad = eqx.filter_jit(jax.grad(_euler_final))
    got = grad(jnp.asarray(0.7), RCA, max_steps)
    assert used
    # The same float64 arithmetic as the hand-written derivative: rounding only.
    np.testing.assert_allclose(got, _euler_reference_grad(0.7), rtol=1e-12)


def test_default_layout_past_buffer_times_slots():
    # 4400 steps with max_steps 5000: (128 slots, 32 buffer, 2 mid checkpoints);
    # stride 64, so every segment is walked back from its mid checkpoints.
    assert _schedule.layout(5000, None) == _schedule.Layout(128, 32, 2)

    def final(theta):
        sol = _euler_solve(theta, RCA, 5000, 4.4, 0.001)
        return jnp.sum(sol.ys[-1] ** 2), sol.stats["num_steps"]

    got, steps = jax.jit(jax.grad(final, has_aux=True))(jnp.asarray(0.7))
    assert int(steps) == 4400
    want = _euler_reference_grad(0.7, n=4400, dt=0.001)
    # The same 4400 Euler steps in closed form: rounding grows with the steps,
    # 4400 x 2 x eps ~ 2e-12.
    np.testing.assert_allclose(got, want, rtol=1e-10)


def _batched_decay_grads(adjoint, max_steps=200):
    """Gradients of an ensemble whose members take different numbers of adaptive
    steps (12 to 63): w.r.t. a closed-over float, through a closed-over int
    index into a closed-over table, vmapped over both."""
    table = jnp.array([0.5, 3.0, 12.0, 30.0])

    def loss(rate, k):
        f = lambda t, y, args: -rate * table[k] * y * (1.2 + jnp.sin(3 * t))
        sol = sk.diffeqsolve(
            sk.ODETerm(f),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.array([1.0, -0.5]),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            adjoint=adjoint,
            max_steps=max_steps,
        )
        return jnp.sum(sol.ys[-1] ** 2), sol.stats["num_steps"]

    grad = jax.vmap(jax.grad(loss, has_aux=True))
    return jax.jit(grad)(jnp.array([1.0, 0.9, 1.1, 1.0]), jnp.arange(4))


@functools.cache
def _batched_decay_direct():
    return _batched_decay_grads(DIRECT)


@pytest.mark.slow
def test_checkpoints_under_vmap_with_different_step_counts():
    # Few slots: the stride doubles while the shortest solves have long finished.
    want, steps = _batched_decay_direct()
    assert len(set(np.asarray(steps).tolist())) == 4
    for adjoint in [RCA, sk.RecursiveCheckpointAdjoint(checkpoints=4)]:
        got, got_steps = _batched_decay_grads(adjoint)
        np.testing.assert_array_equal(got_steps, steps)
        # The same steps (checked above), differentiated two ways: rounding of at
        # most 63 steps forward and back, ~1e-14.
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, max_steps",
    [
        ((4, 4, 4), 201),  # 63 steps: stride 16, 4 per mid checkpoint
        ((4, 2, 3), 202),  # stride 16, 6 per mid checkpoint > buffer: pieces
    ],
)
def test_mid_checkpoints_under_vmap(layout, max_steps, monkeypatch):
    # Mid checkpoints of elements that finished earlier hold their final state; the
    # backward pass masks those steps. Own `max_steps`: see `test_mid_checkpoints`.
    want, steps = _batched_decay_direct()
    used = _force_layout(monkeypatch, layout)
    got, got_steps = _batched_decay_grads(RCA, max_steps)
    assert used
    np.testing.assert_array_equal(got_steps, steps)
    # Same steps: rounding only (see the test above).
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-14)


# --- Closed-over values of every kind, under every transformation --------------------


def _decay_final(theta, y0, t1=1.0):
    """y' = -theta y, with theta closed over; y(t1) = y0 exp(-theta t1)."""
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: -theta * y),
        sk.Tsit5(),
        0.0,
        t1,
        0.05,
        y0,
        max_steps=64,
    )
    return sol.ys[-1]


def test_vmap_grad_closed_over_float_and_t1_analytic():
    # d/dtheta y0 exp(-theta t1) = -t1 y0 exp(-theta t1), batched over theta and t1.
    thetas = jnp.array([0.5, 1.0, 2.0])
    t1s = jnp.array([0.5, 1.0, 1.5])
    grads = jax.jit(
        jax.vmap(jax.grad(lambda th, t1: _decay_final(th, jnp.asarray(3.0), t1)))
    )(thetas, t1s)
    th, t1 = np.asarray(thetas), np.asarray(t1s)
    np.testing.assert_allclose(grads, -3.0 * t1 * np.exp(-th * t1), rtol=1e-7)


class _Model(eqx.Module):
    """Everything a vector field can hold: a float being differentiated, a row of a
    parameter table chosen by an int, a bool mask, a PRNG key and an MLP."""

    theta: jax.Array
    table: jax.Array
    mlp: eqx.nn.MLP


def _rhs(t, y, theta, row, mask, noise, mlp):
    decay = -theta * row * y
    return jnp.where(mask, decay, 0.1 * y) + noise + 0.1 * mlp(y)


def _closed_solve(model, index, mask, key, y0, adjoint):
    row = model.table[index]  # an int (vmapped) picks a row: closed over
    noise = 0.1 * jax.random.normal(key, (2,))  # drawn from a closed-over key

    def vf(t, y, args):
        return _rhs(t, y, model.theta, row, mask, noise, model.mlp)

    sol = sk.diffeqsolve(
        sk.ODETerm(vf), sk.Heun(), 0.0, 1.0, 0.1, y0, adjoint=adjoint, max_steps=16
    )
    return sol.ys[-1]


def _args_solve(model, index, mask, key, y0, adjoint):
    # The reference: the same model, every value passed through `args`.
    args = (
        model.theta,
        model.table[index],
        mask,
        0.1 * jax.random.normal(key, (2,)),
        model.mlp,
    )
    sol = sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: _rhs(t, y, *args)),
        sk.Heun(),
        0.0,
        1.0,
        0.1,
        y0,
        args,
        adjoint=adjoint,
        max_steps=16,
    )
    return sol.ys[-1]


def _model_and_batch():
    model = _Model(
        theta=jnp.asarray(0.9),
        table=jnp.array([[1.0, 2.0], [0.5, 0.1], [3.0, 1.0]]),
        mlp=eqx.nn.MLP(2, 2, 8, 1, key=jax.random.key(0)),
    )
    batch = (
        jnp.array([2, 0, 1, 2]),
        jnp.array([[True, True], [True, False], [False, True], [True, True]]),
        jax.random.split(jax.random.key(1), 4),
        jnp.array([[1.0, 0.5], [0.2, 1.0], [1.0, 1.0], [-1.0, 0.3]]),
    )
    return model, batch


def _batched_loss(solve, adjoint):
    def loss(model, batch):
        ys = jax.vmap(lambda i, m, k, y0: solve(model, i, m, k, y0, adjoint))(*batch)
        return jnp.sum(ys**2)

    return loss


# The reference gradient: values through `args`, direct adjoint (shared, compiled once).
_reference_grad = eqx.filter_jit(eqx.filter_grad(_batched_loss(_args_solve, DIRECT)))


def test_jit_vmap_closed_over_everything():
    model, batch = _model_and_batch()
    closed = eqx.filter_jit(
        jax.vmap(lambda i, m, k, y0: _closed_solve(model, i, m, k, y0, RCA))
    )(*batch)
    reference = eqx.filter_jit(
        jax.vmap(lambda i, m, k, y0: _args_solve(model, i, m, k, y0, DIRECT))
    )(*batch)
    # The same solve with values closed over or passed in `args`: the same
    # arithmetic, equal up to rounding of a few ulps.
    np.testing.assert_allclose(closed, reference, rtol=1e-12)
    # The masks and rows matter: the batch elements differ from each other.
    assert len({tuple(np.round(np.asarray(r), 6)) for r in closed}) == 4


@pytest.mark.slow
def test_grad_vmap_closed_over_everything():
    model, batch = _model_and_batch()
    grad = eqx.filter_jit(eqx.filter_grad(_batched_loss(_closed_solve, RCA)))(
        model, batch
    )
    reference = _reference_grad(model, batch)
    # Same steps, other adjoint: rounding only, far below 1e-9.
    assert_tree_allclose(grad, reference, rtol=1e-9, atol=1e-12)
    assert float(jnp.abs(grad.theta)) > 1e-3
    # Row 2 is used unmasked; rows 0 and 1 each have one masked-out entry.
    nonzero = np.abs(np.asarray(grad.table)) > 1e-8
    np.testing.assert_array_equal(nonzero, [[True, False], [False, True], [True, True]])


@pytest.mark.slow
def test_vmap_grad_closed_over_everything():
    model, batch = _model_and_batch()

    def per_element(i, m, k, y0):
        def loss(model):
            return jnp.sum(_closed_solve(model, i, m, k, y0, DIRECT) ** 2)

        return eqx.filter_grad(loss)(model)

    grads = eqx.filter_jit(jax.vmap(per_element))(*batch)
    summed = jtu.tree_map(lambda g: jnp.sum(g, axis=0), grads)
    reference = _reference_grad(model, batch)
    # Same steps, other adjoint and order of summation: rounding only.
    assert_tree_allclose(
        eqx.filter(summed, eqx.is_inexact_array),
        eqx.filter(reference, eqx.is_inexact_array),
        rtol=1e-9,
        atol=1e-12,
    )


@pytest.mark.slow
def test_backsolve_same_under_jit_as_eager():
    # Under `jit`, Python-float times must still give a static time direction: a
    # traced one was once carried as a parameter of the adjoint system, whose
    # cotangent entered the error norm and changed the backward steps (1.4x as many
    # here, and a gradient off by 3e-5).
    p = jnp.array([1.5, 1.0, 3.0, 1.0]) * 1.105
    y0 = jnp.array([2.05, 1.0])

    def loss(p, y0):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: _lotka_volterra(t, y, p)),
            sk.Tsit5(),
            0.0,
            10.0,
            0.01,
            y0,
            stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-6),
            adjoint=sk.BacksolveAdjoint(),
        )
        return jnp.sum(sol.ys[-1] ** 2)

    eager = jax.grad(loss)(p, y0)
    jitted = jax.jit(jax.grad(loss))(p, y0)
    # The same backward steps eager and jitted: rounding only, where the bug this
    # guards against changed them (3e-5 at the solver's tolerance 1e-6).
    np.testing.assert_allclose(jitted, eager, rtol=1e-10)


# --- ImplicitAdjoint: steady states by the implicit function theorem --------------


def _steady(p, k, adjoint, event=True):
    """y' = (a - b y0², y0 - c_k y1): the steady state y0* = sqrt(a / b),
    y1* = y0* / c_k, with `c` a closed-over table indexed by an int `k`."""
    a, b = p
    table = jnp.array([2.0, 4.0])

    def vf(t, y, args):
        return jnp.stack([a - b * y[0] ** 2, y[0] - table[k] * y[1]])

    return sk.diffeqsolve(
        sk.ODETerm(vf),
        sk.Tsit5(),
        0.0,
        200.0,
        0.1,
        jnp.array([0.1, 0.0]),
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint,
        event=sk.Event(sk.steady_state_event()) if event else None,
    ).ys[-1]


def test_implicit_adjoint_steady_state_gradient():
    p = jnp.array([2.0, 0.5])
    weights = jnp.array([1.0, 3.0])
    loss = lambda p, k: jnp.dot(_steady(p, k, sk.ImplicitAdjoint()), weights)
    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(p, jnp.arange(2))
    # d y0*/da = 1 / (2 sqrt(ab)), d y0*/db = -sqrt(a) / (2 b^1.5); y1* = y0* / c_k.
    dy0 = np.array([1 / (2 * np.sqrt(2.0 * 0.5)), -np.sqrt(2.0) / (2 * 0.5**1.5)])
    expected = np.stack([dy0 * (1 + 3 / c) for c in (2.0, 4.0)])
    np.testing.assert_allclose(grads, expected, rtol=1e-6)
    # The same as differentiating the whole solve, and forward mode agrees.
    direct = jax.jit(  # (each derivative jitted: op by op, 12 compiles more)
        jax.grad(lambda p: jnp.dot(_steady(p, 0, sk.DirectAdjoint(), False), weights))
    )
    np.testing.assert_allclose(grads[0], direct(p), rtol=1e-6)
    jvp = jax.jit(lambda p, v: jax.jvp(lambda p: loss(p, 0), (p,), (v,)))
    _, tangent = jvp(p, jnp.array([1.0, 0.0]))
    np.testing.assert_allclose(tangent, expected[0, 0], rtol=1e-6)


def test_implicit_adjoint_rejects_saves_that_are_not_steady():
    with pytest.raises(ValueError, match="ImplicitAdjoint"):
        sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -y),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.array([1.0]),
            saveat=sk.SaveAt(ts=jnp.array([0.5, 1.0])),
            adjoint=sk.ImplicitAdjoint(),
        )


@pytest.mark.slow
def test_backsolve_with_an_implicit_backward_solver_takes_the_tolerances():
    # The backward solver's root finder takes the controller's tolerances, as the
    # forward solver's does (it used to receive the unbound placeholders and crash).
    def final(k, controller):
        return sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -k * y),
            sk.Tsit5(),
            0.0,
            1.0,
            0.1,
            jnp.asarray(1.0),
            stepsize_controller=controller,
            adjoint=sk.BacksolveAdjoint(solver=sk.Kvaerno5()),
        ).ys[-1]

    pid = sk.PIDController(rtol=1e-8, atol=1e-8)
    got = jax.grad(final)(jnp.asarray(2.0), pid)
    np.testing.assert_allclose(got, -np.exp(-2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="tolerances of its root finder"):
        final(jnp.asarray(2.0), sk.ConstantStepSize())


def _forced_decay_final(theta, adjoint):
    """`y(1)` of `y' = -theta[0] y + theta[1] sin(t)`, adaptive Tsit5 (two parameters,
    so the Hessian has off-diagonal terms)."""
    field = lambda t, y, args: -theta[0] * y + theta[1] * jnp.sin(t)
    return sk.diffeqsolve(
        sk.ODETerm(field),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.asarray(1.0),
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint,
    ).ys[-1]


@pytest.mark.slow
def test_hessians_both_ways_against_finite_differences():
    # Forward-over-reverse (`jax.hessian`) through every reverse-mode adjoint, and
    # reverse-over-reverse through DirectAdjoint, against central differences of the
    # gradient.
    # Each derivative one jitted program (eagerly, each call traced and ran its own
    # small programs: 47 compiles).
    theta = jnp.array([1.3, 0.7])
    grad = jax.jit(jax.grad(lambda x: _forced_decay_final(x, RCA)))
    fd = np.stack(
        [finite_difference(lambda x, i=i: grad(x)[i], theta, eps=1e-5) for i in (0, 1)]
    )
    # Forward-over-reverse through RecursiveCheckpointAdjoint and DirectAdjoint with
    # `SOLVERKIT_FULL_MATRIX=1` only: the default adjoint's is tests/diffrax_compat/
    # test_diffrax_scripts.py::test_hessian_with_scan_kind_as_diffrax's (against
    # diffrax); DirectAdjoint's second derivative, reverse over reverse below.
    adjoints = (RCA, DIRECT) if FULL_MATRIX else ()
    for adjoint in (sk.BacksolveAdjoint(), *adjoints):
        hessian = jax.jit(jax.hessian(lambda x: _forced_decay_final(x, adjoint)))
        np.testing.assert_allclose(hessian(theta), fd, rtol=1e-6, atol=1e-9)
    twice = jax.jit(jax.jacrev(jax.grad(lambda x: _forced_decay_final(x, DIRECT))))
    np.testing.assert_allclose(twice(theta), fd, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "adjoint", [RCA, sk.BacksolveAdjoint()], ids=["checkpoint", "backsolve"]
)
# Quick loop: the error tests of solve/test_errors.py.
@pytest.mark.slow
def test_reverse_over_reverse_says_what_to_use(adjoint):
    # Their backward passes are loops of data-dependent length: not differentiable in
    # reverse mode. The error names what is (not JAX's error about the loop).
    name = type(adjoint).__name__
    with pytest.raises(ValueError, match=rf"{name}.*jax\.jacfwd"):
        second = jax.grad(lambda x: jax.grad(_forced_decay_final)(x, adjoint)[0])
        second(jnp.array([1.3, 0.7]))
