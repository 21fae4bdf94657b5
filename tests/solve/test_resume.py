"""Continuing a solve from where an earlier one ended (`solver_state`,
`controller_state`, `made_jump`), as diffrax scripts integrate interval by interval:
compared with diffrax's chained solves, with one uninterrupted solve, and under
`jit`, `vmap` and `grad`."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finite_difference, float64, full_matrix_only

import solverkit as sk


def _field(t, y, args):
    return jnp.stack([y[1], -args * y[0] + 0.1 * jnp.sin(t)])


Y0 = np.array([1.0, 0.0])


def _chain(lib, k, *, solver=None, controller=None, adjoint=None, intervals=3):
    """Solve over [0, intervals] one unit interval at a time, each solve continuing
    the last. Returns the final state and the steps each solve took."""
    saveat = lib.SaveAt(
        t1=True, solver_state=True, controller_state=True, made_jump=True
    )
    kwargs = {} if adjoint is None else dict(adjoint=adjoint)
    y, states, steps = jnp.asarray(Y0), (None, None, None), []
    for i in range(intervals):
        sol = lib.diffeqsolve(
            lib.ODETerm(_field),
            solver or lib.Tsit5(),
            float(i),
            float(i + 1),
            0.05,
            y,
            k,
            saveat=saveat,
            stepsize_controller=controller or lib.PIDController(rtol=1e-8, atol=1e-10),
            solver_state=states[0],
            controller_state=states[1],
            made_jump=states[2],
            **kwargs,
        )
        y = sol.ys[-1]
        states = (sol.solver_state, sol.controller_state, sol.made_jump)
        steps.append(int(sol.stats["num_steps"]) if not _traced(sol) else None)
    return y, steps


def _traced(sol) -> bool:
    return isinstance(sol.stats["num_steps"], jax.core.Tracer)


def _one(k, solver=None, controller=None, t1=3.0):
    return sk.diffeqsolve(
        sk.ODETerm(_field),
        solver or sk.Tsit5(),
        0.0,
        t1,
        0.05,
        jnp.asarray(Y0),
        k,
        stepsize_controller=controller or sk.ConstantStepSize(),
    ).ys[-1]


@pytest.mark.parametrize(
    "solver",
    [
        "Tsit5",
        # With `SOLVERKIT_FULL_MATRIX=1` only: the controller's history and `dt0`
        # carried over as diffrax does are [Tsit5]'s (the same steps exactly).
        pytest.param(
            "Kvaerno5",
            marks=[pytest.mark.slow, full_matrix_only("[Tsit5] (the same carry-over)")],
        ),
    ],
)
# Quick loop: test_solver_state_is_used_and_made_jump_renews_it.
@pytest.mark.slow
def test_chained_solves_as_diffrax(solver):
    """The same steps as diffrax's chained solves: the controller's error history and
    the first step `dt0` carry over as in diffrax."""
    with float64():
        ours, our_steps = _chain(sk, 2.0, solver=getattr(sk, solver)())
        theirs, their_steps = _chain(diffrax, 2.0, solver=getattr(diffrax, solver)())
        if solver == "Tsit5":
            assert our_steps == their_steps
            # The same steps: equal up to float64 rounding over them (~1e-13).
            np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)
        else:  # root finders differ; the steps nearly agree
            assert np.abs(np.subtract(our_steps, their_steps)).max() <= 2
            # Other steps: each solution is within its global error of the true
            # one, some tens of the controller's rtol 1e-8 (atol 1e-10).
            np.testing.assert_allclose(ours, theirs, rtol=1e-7, atol=1e-9)


# The full suite; the quick loop resumes solves in
# test_solver_state_is_used_and_made_jump_renews_it.
@pytest.mark.slow
def test_chained_constant_steps_are_one_solve():
    """With steps on a common grid, the chained solves are one solve (the first-same-
    as-last slope carried over), to round-off, values and gradients alike."""
    with float64():
        controller = sk.ConstantStepSize()
        chained, _ = _chain(sk, 2.0, controller=controller)
        # The same steps and slopes: equal to a few ulps (float64 eps 2.2e-16).
        np.testing.assert_allclose(chained, _one(2.0), rtol=1e-14, atol=1e-15)

        def loss(k):
            return jnp.sum(_chain(sk, k, controller=controller)[0] ** 2)

        one = jax.grad(lambda k: jnp.sum(_one(k) ** 2))(2.0)
        np.testing.assert_allclose(jax.grad(loss)(2.0), one, rtol=1e-12)


def _resume_tsit5(solver_state, made_jump=None):
    first = sk.diffeqsolve(
        sk.ODETerm(_field),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.asarray(Y0),
        2.0,
        saveat=sk.SaveAt(t1=True, solver_state=True),
    )
    state = solver_state(first.solver_state)
    return first, sk.diffeqsolve(
        sk.ODETerm(_field),
        sk.Tsit5(),
        1.0,
        2.0,
        0.1,
        first.ys[-1],
        2.0,
        solver_state=state,
        made_jump=made_jump,
    ).ys[-1]


def test_solver_state_is_used_and_made_jump_renews_it():
    with float64():
        first, reused = _resume_tsit5(lambda s: s)
        _, fresh = _resume_tsit5(lambda s: None)
        # The stored slope is the one a fresh start computes: the same steps, equal
        # to rounding (a wrong slope, below, moves the result by 1e-3).
        np.testing.assert_allclose(reused, fresh, rtol=1e-13)
        # A wrong slope in the state changes the first step: it is used.
        wrong = lambda s: jax.tree_util.tree_map(lambda x: x + 1.0, s)  # noqa: E731
        _, perturbed = _resume_tsit5(wrong)
        assert np.abs(perturbed - fresh).max() > 1e-3
        # ... unless the earlier solve ended at a jump: then it is made anew.
        _, renewed = _resume_tsit5(wrong, made_jump=True)
        np.testing.assert_allclose(renewed, fresh, rtol=1e-13)
        _, traced = jax.jit(lambda m: _resume_tsit5(wrong, made_jump=m))(True)
        np.testing.assert_allclose(traced, fresh, rtol=1e-13)


@pytest.mark.slow
def test_chained_solves_under_jit_and_vmap():
    with float64():
        ks = jnp.array([1.5, 2.0, 3.0])
        batched = jax.vmap(lambda k: _chain(sk, k)[0])(ks)
        jitted = jax.jit(lambda k: _chain(sk, k)[0])(ks[1])
        for i, k in enumerate(ks):
            # vmap and jit run each element's own steps: rounding only.
            np.testing.assert_allclose(batched[i], _chain(sk, k)[0], rtol=1e-12)
        np.testing.assert_allclose(jitted, batched[1], rtol=1e-12)


_CHAINED_GRADIENT = (
    "[RecursiveCheckpointAdjoint] and test_adjoint.py::"
    "test_gradients_agree_across_adjoints_and_finite_differences"
)


# The full suite; the quick loop resumes solves in
# test_solver_state_is_used_and_made_jump_renews_it.
@pytest.mark.slow
@pytest.mark.parametrize(
    "adjoint",
    [
        sk.RecursiveCheckpointAdjoint(),
        # With `SOLVERKIT_FULL_MATRIX=1` only: the adjoints are compared with the
        # checkpointed one on other problems (adjoint/test_adjoint.py, the closure
        # matrix's direct and backsolve cells); chained solves' gradient is
        # [RecursiveCheckpointAdjoint]'s.
        pytest.param(
            sk.DirectAdjoint(),
            marks=[pytest.mark.slow, full_matrix_only(_CHAINED_GRADIENT)],
        ),
        pytest.param(
            sk.BacksolveAdjoint(),
            marks=[pytest.mark.slow, full_matrix_only(_CHAINED_GRADIENT)],
        ),
    ],
    ids=lambda a: type(a).__name__,
)
def test_gradient_through_chained_adaptive_solves(adjoint):
    """Through the carried states and the final states alike: against finite
    differences (and the discretise-then-optimise adjoints against each other)."""
    with float64():

        def loss(k, adjoint):
            return jnp.sum(_chain(sk, k, adjoint=adjoint)[0] ** 2)

        grad = jax.grad(loss)(2.0, adjoint)
        fd = finite_difference(lambda k: loss(k, sk.RecursiveCheckpointAdjoint()), 2.0)
        rtol = 1e-6 if isinstance(adjoint, sk.BacksolveAdjoint) else 1e-7
        np.testing.assert_allclose(grad, fd, rtol=rtol)
        if isinstance(adjoint, sk.DirectAdjoint):
            checkpointed = jax.grad(loss)(2.0, sk.RecursiveCheckpointAdjoint())
            np.testing.assert_allclose(grad, checkpointed, rtol=1e-12)


# Quick loop: test_solver_state_is_used_and_made_jump_renews_it.
@pytest.mark.slow
def test_states_that_do_not_fit_are_errors():
    first = sk.diffeqsolve(
        sk.ODETerm(_field),
        sk.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.asarray(Y0),
        2.0,
        saveat=sk.SaveAt(t1=True, solver_state=True, controller_state=True),
        stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-8),
    )

    def resume(solver=sk.Tsit5(), controller=None, **kwargs):
        return sk.diffeqsolve(
            sk.ODETerm(_field),
            solver,
            1.0,
            2.0,
            0.1,
            first.ys[-1],
            2.0,
            stepsize_controller=controller or sk.PIDController(rtol=1e-6, atol=1e-8),
            **kwargs,
        )

    with pytest.raises(ValueError, match="`solver_state` does not fit"):
        resume(sk.Kvaerno5(), solver_state=first.solver_state)
    with pytest.raises(ValueError, match="`controller_state` does not fit"):
        resume(
            controller=sk.ConstantStepSize(), controller_state=first.controller_state
        )
    with pytest.raises(ValueError, match="`made_jump` must be a boolean"):
        resume(solver_state=first.solver_state, made_jump=jnp.array([True, False]))
