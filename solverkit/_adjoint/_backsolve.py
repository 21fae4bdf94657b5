"""`BacksolveAdjoint`: optimise-then-discretise, the continuous adjoint equations
solved backwards in time, as a `custom_vjp` whose operand is the whole `Problem`."""

import dataclasses
import functools
from typing import cast, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _loop
from .._closure._convert import closure_convert
from .._closure._raising import error_if
from .._controller._base import AbstractStepSizeController
from .._controller._norm import rms_norm
from .._custom_types import RealScalarLike, Y
from .._errors import UnsupportedError
from .._event import Timed
from .._linear._linear_solver import has_converted_callable
from .._loop import Outputs
from .._problem import Events, Problem
from .._solution import SUCCESS
from .._solver import AbstractRungeKutta, AbstractSolver
from .._term import ClosureTerm, MultiTerm, total_vf
from .._time import flip
from ._base import (
    AbstractAdjoint,
    custom_vjp,
    fill_zeros,
    parameters,
    run,
    zeros_cotangent,
)


# The adjoint system's vector field (a field and its vjp) is large. For an augmented
# state of at most this many numbers the backward solver's Runge-Kutta stages run in a
# loop, which compiles faster and runs as fast (measured: LV, 8 numbers per
# trajectory); for a large one (a neural ODE's parameter cotangents) the loop's
# stacked stages cost more than they save, so the stages stay unrolled.
_LOOP_STAGES_MAX_SIZE = 256


def _stages_in_a_loop(solver: AbstractSolver, state) -> AbstractSolver:
    """The backward solver, with its stages in a loop (`scan_kind="lax"`) for a small
    augmented `state`, unless the user chose its `scan_kind`."""
    # By type: a wrapper (`HalfSolver`) passes `isinstance` for what it wraps.
    if not issubclass(type(solver), AbstractRungeKutta):
        return solver
    assert isinstance(solver, AbstractRungeKutta)
    if solver.scan_kind is not None:
        return solver
    if sum(x.size for x in jtu.tree_leaves(state)) > _LOOP_STAGES_MAX_SIZE:
        return solver
    return dataclasses.replace(solver, scan_kind="lax")


def _augmented(tau: RealScalarLike, state, aux, part: int | None = None):
    """The adjoint system of `dy/dtau = g(tau, y, theta)` in the outer internal time:
    `dy = g`, `da = -a dg/dy`, `dtheta_bar = -a dg/dtheta`; for a `MultiTerm`, the
    part of it that comes from its term `part` (the parts sum to the whole)."""
    terms, args = aux
    y, a, _ = state
    theta, rest = eqx.partition((terms, args), parameters((terms, args)))

    def g(theta, y: Y):
        terms, args = eqx.combine(theta, rest)
        term = terms if part is None else terms.terms[part]
        return term.vf(tau, y, args)

    fy, pullback = jax.vjp(g, theta, y)
    g_theta, g_y = pullback(a)
    neg = lambda x: jtu.tree_map(jnp.negative, x)
    return fy, neg(g_y), neg(g_theta)


def adjoint_rms_seminorm(x) -> jax.Array:
    """A norm for the step-size controller of [`solverkit.BacksolveAdjoint`][] that
    measures only the state and its adjoint, not the parameter cotangents being
    accumulated: the backward solve then takes fewer steps (Kidger, Chen and Lyons,
    "Hey, that's not an ODE", ICML 2021). Use as `BacksolveAdjoint(
    stepsize_controller=PIDController(..., norm=adjoint_rms_seminorm))`.

    **Arguments:**

    - `x`: the augmented state `(y, a, parameter cotangents...)`.

    **Returns:**

    The RMS norm of `(y, a)`.
    """
    if not isinstance(x, tuple) or len(x) < 3:
        raise ValueError(
            "adjoint_rms_seminorm is a norm for the adjoint system of "
            "BacksolveAdjoint (a tuple (y, a, parameter cotangents)); got "
            f"{jtu.tree_structure(x)}."
        )
    return rms_norm((x[0], x[1]))


def _dot(a, b) -> jax.Array:
    leaves = [
        jnp.sum((x * y).real).astype(jnp.result_type(float))
        for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    ]
    return cast(jax.Array, sum(leaves)) if leaves else jnp.asarray(0.0)


def _solve_whole(problem: Problem) -> Outputs:
    carry, bufs = _loop.init(problem)
    return _loop.finish(problem, *run(problem, carry, bufs))


def _with_outputs(problem: Problem):
    """Forward rule whose residuals are the outputs themselves."""
    out = _solve_whole(problem)
    return out, out


class BacksolveAdjoint(AbstractAdjoint):
    """Optimise-then-discretise: solve the continuous adjoint equations backwards in
    time, in constant memory.

    Differentiates with respect to `y0`, `args`, **every floating-point value the
    vector field closes over**, `t0`, `t1` and `SaveAt(ts=...)`. Supports
    `SaveAt(t0=..., t1=..., ts=...)` with the default `fn`; no events, `steps` or
    `dense`. Gradients are accurate to about the solve's tolerance (not to machine
    precision, as with `RecursiveCheckpointAdjoint`). Reverse mode only.

    **Arguments:**

    - `solver`: solver for the backward solve (default: the forward one).
    - `stepsize_controller`: controller for the backward solve (default: the
        forward one).
    """

    solver: AbstractSolver | None = None
    stepsize_controller: AbstractStepSizeController | None = None
    discrete: ClassVar[bool] = False

    def check(self, problem: Problem) -> None:
        unsupported = []
        if len(problem.saves) != 1:
            unsupported.append("`SaveAt(subs=...)` with several SubSaveAts")
        if problem.saves_steps:
            unsupported.append("`saveat=SaveAt(steps=True)`")
        if problem.dense:
            unsupported.append("`saveat=SaveAt(dense=True)`")
        if problem.event.conds is not None or problem.event.timed is not None:
            unsupported.append(
                "events (`BacksolveAdjoint` is not compatible with events)"
            )
        if not all(save.saves_y for save in problem.saves):
            unsupported.append("`saveat=SaveAt(fn=...)`")
        self._solver(problem)  # a backward solver that can't take tolerances: raise
        if self.solver is None and has_converted_callable(problem.solver):
            raise UnsupportedError(
                "BacksolveAdjoint() solves the adjoint equations with the forward "
                "solver, but its KrylovLinearSolver's `preconditioner` is a function "
                "written for the forward state, not for the adjoint's augmented "
                "state: pass `BacksolveAdjoint(solver=...)` a solver without one (or "
                "with a linear solver as preconditioner), or use "
                "RecursiveCheckpointAdjoint()."
            )
        if unsupported:
            raise UnsupportedError(
                # diffrax's words, which name the options as they do
                "Cannot use `adjoint=BacksolveAdjoint()` with "
                + " or ".join(unsupported)
                + ": BacksolveAdjoint does not support them; use "
                "RecursiveCheckpointAdjoint() instead."
            )

    def _solver(self, problem: Problem) -> AbstractSolver:
        """The backward solver, with the tolerances it takes from a controller (an
        implicit solver's root finder) bound as for the forward solve."""
        if self.solver is None:
            return problem.solver  # bound already
        controller = self.stepsize_controller
        controller = problem.controller if controller is None else controller
        return self.solver.bind_controller_tols(controller.tolerances())

    def loop(self, problem: Problem) -> Outputs:
        def bwd(static, dynamic, out, ct_out):
            problem = eqx.combine(dynamic, static)
            return (self._backward(problem, out, ct_out.ys, _times_ct(ct_out)),)

        return custom_vjp(
            problem, _solve_whole, _with_outputs, bwd, adjoint="BacksolveAdjoint"
        )

    def _solve_back(
        self, problem: Problem, aux, state, ta: jax.Array, tb: jax.Array, jumps=None
    ):
        """Integrate the augmented state from internal time `ta` back to `tb`, in
        one loop, with `jumps` (a `Timed` in the backward solve's internal time, or
        `None`) applied where its steps land on them."""
        solver = _stages_in_a_loop(self._solver(problem), state)
        controller = problem.controller  # in the forward solve's internal time
        if self.stepsize_controller is not None:
            controller = self.stepsize_controller.to_internal(problem.direction)
        backwards = -jnp.ones_like(ta)
        neg_ta = flip(backwards, ta)

        def adjoint_term(part):
            augmented = functools.partial(_augmented, part=part)
            closure = closure_convert(augmented, neg_ta, state, aux)
            return ClosureTerm(closure, backwards)

        if isinstance(problem.terms, MultiTerm):  # the adjoint of each part
            parts = range(len(problem.terms.terms))
            terms = MultiTerm(*[adjoint_term(i) for i in parts])
        else:
            terms = adjoint_term(None)
        inner = Problem(
            solver=solver,
            controller=controller.to_internal(backwards),
            terms=terms,
            direction=backwards,
            args=aux,
            y0=state,
            t0=neg_ta,
            t1=flip(backwards, tb),
            dt0=problem.dt0,
            max_steps=problem.max_steps,
            event=Events(timed=jumps),
        )
        carry, _ = run(inner, *_loop.init(inner))
        failed = (carry.t < inner.t1) | (carry.result != SUCCESS)
        y = error_if(
            carry.y,
            failed,
            0,
            [
                "BacksolveAdjoint: the backward (adjoint) solve failed, so no gradient "
                "can be given. Increase `max_steps` or pass BacksolveAdjoint("
                "stepsize_controller=...) with looser tolerances. A problem that is "
                "unstable backwards in time (diffusion, stiff decay) can't be solved "
                "backwards at all: use RecursiveCheckpointAdjoint() instead."
            ],
        )
        return y

    def _backward(self, problem: Problem, out: Outputs, ct_ys, ct_times):
        """The cotangent of `problem` from those of the saved states `ct_ys` and
        times `ct_times`: the adjoint equations solved from the end back to `t0`,
        the cotangent of each saved state added to the adjoint where it was saved
        (and the state restarted from its saved forward value there)."""
        aux = (problem.terms, problem.args)
        theta, _ = eqx.partition(aux, parameters(aux))
        a, ct_T = _at_end(problem, out, ct_ys, ct_times)
        theta_bar = jtu.tree_map(jnp.zeros_like, theta)
        g = lambda tau, y: total_vf(problem.terms, tau, y, problem.args)
        (save,) = problem.saves
        ts, ct_ts, jumps, at_t0 = save.ts, None, None, None
        if ts is not None and ts.shape[0]:
            rows = slice(1 if save.t0 else 0, (1 if save.t0 else 0) + ts.shape[0])
            ys_ts = jtu.tree_map(lambda x: x[rows], out.ys)
            ct_ys_ts = jtu.tree_map(lambda x: x[rows], ct_ys)
            ct_ts = jax.vmap(lambda t, y, c: _dot(c, g(t, y)))(ts, ys_ts, ct_ys_ts)
            ct_ts = ct_ts.astype(ts.dtype)
            state = (out.y_end, a, theta_bar)
            jumps = _save_jumps(ts, ys_ts, ct_ys_ts, out.t_end, state, aux)
            # Saved at `t0`: past the backward solve's last jump, added after it.
            at_t0 = jtu.tree_map(lambda c: _sum_where(ts == problem.t0, c), ct_ys_ts)
        y, a, theta_bar = self._solve_back(
            problem, aux, (out.y_end, a, theta_bar), out.t_end, problem.t0, jumps
        )
        if at_t0 is not None:
            a = jtu.tree_map(jnp.add, a, at_t0)
        ct_t0 = -_dot(a, g(problem.t0, problem.y0))
        ct_rows, _ = ct_times
        if save.t0:
            ct_t0 = ct_t0 + ct_rows[0].astype(ct_t0.dtype)
            a = jtu.tree_map(jnp.add, a, _take(ct_ys, 0))
        return _cotangent(problem, aux, theta_bar, (a, ct_t0, ct_T), ct_ts, ct_rows)


def _sum_where(mask: jax.Array, rows: jax.Array) -> jax.Array:
    """The sum of the `rows` (along the first axis) where `mask` is true."""
    mask = mask.reshape(mask.shape + (1,) * (rows.ndim - 1))
    return jnp.sum(jnp.where(mask, rows, jnp.zeros_like(rows)), axis=0)


def _save_jumps(ts, ys_ts, ct_ys_ts, t_end, state, aux) -> Timed:
    """The saved times `ts` (internal time, non-decreasing) as jumps of the backward
    solve, in its internal time (`-ts`, increasing): at each, the cotangents of
    the states saved there are added to the adjoint, and the state restarts from
    its saved forward value. One loop through every saved time: the step size
    carries on across them, where a solve restarted at each (as a loop of
    segments) takes at least one step, a new first step and a new first
    evaluation in every segment (2-64-64-2 MLP neural ODE, `SaveAt(ts=16
    points)`, `jax.vmap` over 256 trajectories, float32, CPU: the gradient 136 ->
    82 ms; 28 ms with two save times). `state`: the augmented state at the end,
    for its structure."""
    # Times saved twice are one jump (a jump's time comes strictly after the one
    # before): the repeats move past the end, `inf`, where no step reaches.
    repeat = jnp.concatenate([ts[1:] == ts[:-1], jnp.zeros(1, bool)])
    times = jnp.sort(jnp.where(repeat, jnp.inf, -ts))

    def jump(t, state, aux):  # `t` in the forward solve's internal time
        del aux
        y, a, theta_bar = state
        here = ts == t
        first = jnp.argmax(here)
        # (In the state's dtypes: the saved rows' may be wider.)
        restart = lambda yt, x: jnp.where(here[first], yt[first].astype(x.dtype), x)  # noqa: E731
        y = jtu.tree_map(restart, ys_ts, y)
        add = lambda x, c: x + _sum_where(here, c).astype(x.dtype)  # noqa: E731
        return y, jtu.tree_map(add, a, ct_ys_ts), theta_bar

    effect = closure_convert(jump, t_end, state, aux)
    return Timed(times, None, effect, ())


def _take(tree, i):
    return jtu.tree_map(lambda x: x[i], tree)


def _at_end(problem: Problem, out: Outputs, ct_ys, ct_times):
    """`(a, ct_T)`: the adjoint state at the end of the solve (the cotangent of the
    final save, if saved) and the cotangent of the end time."""
    (save,) = problem.saves
    rows_t0 = 1 if save.t0 else 0
    num_ts = 0 if save.ts is None else save.ts.shape[0]
    zeros_y = jtu.tree_map(jnp.zeros_like, problem.y0)
    ct_y1 = _take(ct_ys, rows_t0 + num_ts) if save.t1 else zeros_y
    T = out.t_end
    g = total_vf(problem.terms, T, out.y_end, problem.args) if save.t1 else None
    ct_T = _dot(ct_y1, g) if save.t1 else jnp.zeros_like(T)
    # The saved times are the inputs' own (t0, ts, t1 = the end): their
    # cotangents pass straight to those inputs, beside the states' through them.
    ct_rows, ct_end = ct_times
    ct_T = ct_T + ct_end.astype(ct_T.dtype)
    if save.t1:
        ct_T = ct_T + ct_rows[rows_t0 + num_ts].astype(ct_T.dtype)
    return ct_y1, ct_T


def _cotangent(problem: Problem, aux, theta_bar, ends, ct_ts, ct_rows) -> Problem:
    """The cotangent of `problem`: `ends = (a, ct_t0, ct_T)` on `y0`, `t0`, `t1`,
    `theta_bar` on the arrays of the terms and `args`, `ct_ts` (and the saved
    times' own cotangents, `ct_rows`) on `SaveAt.ts`; zeros elsewhere."""
    a, ct_t0, ct_T = ends
    (save,) = problem.saves
    rows_t0 = 1 if save.t0 else 0
    dynamic, _ = eqx.partition(problem, eqx.is_array)
    ct = jtu.tree_map(zeros_cotangent, dynamic)
    ct_aux = fill_zeros(theta_bar, eqx.partition(aux, eqx.is_array)[0])
    ct = eqx.tree_at(
        lambda p: (p.y0, p.t0, p.t1),
        ct,
        (a, ct_t0.astype(problem.t0.dtype), ct_T.astype(problem.t1.dtype)),
    )
    ct = _replace_subtrees(ct, ct_aux)
    if ct_ts is not None:
        num_ts = ct_ts.shape[0]
        ct_ts = ct_ts + ct_rows[rows_t0 : rows_t0 + num_ts].astype(ct_ts.dtype)
        ct = eqx.tree_at(lambda p: p.saves[0].ts, ct, ct_ts)
    return ct


def _times_ct(ct_out: Outputs) -> tuple[jax.Array, jax.Array]:
    """The cotangents of the saved times (one save: its rows) and of the end time,
    zeros where there are none."""
    (ct_rows,) = jtu.tree_leaves(ct_out.ts) or (jnp.zeros(0),)
    ct_end = ct_out.t_end
    return ct_rows, jnp.zeros(()) if ct_end is None else ct_end


def _replace_subtrees(ct, ct_aux):
    term, args = ct_aux
    ct = eqx.tree_at(lambda p: p.terms, ct, term, is_leaf=lambda x: x is None)
    return eqx.tree_at(lambda p: p.args, ct, args, is_leaf=lambda x: x is None)
