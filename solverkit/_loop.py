"""The step loop: step, accept or reject, save, detect events.

Knows nothing of adjoints: an adjoint supplies the function that runs
`body(problem, carry)` while `cond(problem, carry)` holds (see `_adjoint/_base.py`).
Every user value reaches the loop through `Problem` (`_problem.py`), an explicit
operand. What a step saves is written by `_save.py`; events act through one interface
(`_event/_extension.py`: `start`, `init`, `step_end`, `after_step`, `finish`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from . import _event, _save
from ._closure._loops import while_loop
from ._closure._unvmap import batched_like, unvmap_any, unvmap_max
from ._closure._vma_eval import union_of_axes, vary
from ._custom_types import Y
from ._errors import concrete
from ._problem import adaptive, Buffers, Carry, Problem, StepOut
from ._reduce import all_true, and_all
from ._remat import replayed
from ._select import where
from ._solution import RESULTS, SUCCESS
from ._tree import tree_where
from ._user_solver import UserSolver


_MAX_STEPS = int(RESULTS.max_steps_reached.code)
_NONFINITE = int(RESULTS.nonfinite.code)
_MAX_EVENTS = int(RESULTS.max_events_reached.code)
_ACCUMULATED = int(RESULTS.events_accumulated.code)
_INCONSISTENT = int(RESULTS.inconsistent_initial_values.code)
_SINGULAR = int(RESULTS.singular.code)


def _all_finite(tree) -> Array:
    return and_all([all_true(jnp.isfinite(x)) for x in jtu.tree_leaves(tree)])


def batch_like(sources, tree):
    """`tree`, unchanged in value, but batched under `vmap` wherever `sources` or
    `tree` is (and inside `shard_map` varying over the manual axes they do).

    With adaptive steps every part of a loop's carry depends on the state, so the loop
    body batches all of it (with fixed steps, the state and what follows from it).
    Batching it from the start lets `vmap` of the loop settle which parts are batched
    in one pass over the body instead of several, which shortens tracing (most of all
    for the nested loops of the backward passes).
    """
    # One primitive that lowers to nothing (a select of `x` or `x` on a predicate
    # read from every source, as before, cost ~5% of a gradient's trace). Inside
    # `shard_map` the tree also varies over every manual axis a source does, as the
    # body's outputs will.
    tree = batched_like(tree, sources)
    axes = union_of_axes(sources)
    return vary(tree, axes) if axes else tree


def init(problem: Problem) -> tuple[Carry, Buffers]:
    """The loop's initial carry and save buffers."""
    saves_from = problem  # saves at `t0` show `y0`, before any event there
    start = _event.start(problem)  # after a `TimedEvent` at `t0`
    problem = dataclasses.replace(problem, y0=start.y0)
    terms, t0, y0, args = problem.terms, problem.t0, problem.y0, problem.args
    func = problem.solver.func  # called as func(terms, t, y, args)
    tnext, controller_state = problem.controller.loop_init(
        terms, t0, problem.t1, y0, problem.dt0, args, func, problem.error_order
    )
    tnext = jnp.minimum(jnp.asarray(tnext, t0.dtype), problem.t1)
    solver_state, controller_state = _initial_states(problem, controller_state)
    if start.at_t0 is not None and problem.resume is not None:  # made anew there
        fresh = problem.solver.init(terms, t0, problem.t1, y0, args)
        solver_state = tree_where(start.at_t0, fresh, solver_state)
    events = _event.init(problem, solver_state)
    zero = jnp.asarray(0, jnp.int32)
    carry = Carry(
        t=t0,
        tnext=tnext,
        y=y0,
        solver_state=solver_state,
        controller_state=controller_state,
        num_steps=zero,
        num_accepted=zero,
        num_rejected=zero,
        result=events.result,
        cond_values=events.cond_values,
        event_mask=events.event_mask,
        last=events.last,
        continuing=events.continuing,
        timed_index=start.timed_index,
    )
    if adaptive(problem):
        carry = batch_like(problem, carry)
    else:  # fixed steps: times and counters stay unbatched; the state and what
        # follows from it are batched from the start, as the body would batch them
        sources = (problem.terms, y0, args)
        y, state, result = batch_like(sources, (y0, solver_state, carry.result))
        carry = carry._replace(y=y, solver_state=state, result=result)
    return carry, _save.init_buffers(saves_from, solver_state)


def _like(name: str, passed: PyTree, fresh: PyTree) -> PyTree:
    """`passed` (a state returned by an earlier solve), checked against the state
    this solve would start from, `fresh`, and cast to its dtypes."""
    passed_leaves, passed_tree = jtu.tree_flatten(passed)
    fresh_leaves, fresh_tree = jtu.tree_flatten(fresh)
    if passed_tree != fresh_tree:
        raise ValueError(
            f"`{name}` does not fit this solve: expected the structure {fresh_tree} "
            f"(what `SaveAt({name}=True)` returns for the same solver and "
            f"controller), got {passed_tree}."
        )
    out = []
    for i, (p, f) in enumerate(zip(passed_leaves, fresh_leaves)):
        p = jnp.asarray(p)
        f = f if isinstance(f, jax.ShapeDtypeStruct) else jnp.asarray(f)
        if p.shape != f.shape or not jnp.can_cast(p.dtype, f.dtype, "same_kind"):
            raise ValueError(
                f"`{name}` does not fit this solve: its leaf {i} should have shape "
                f"{f.shape} and dtype {f.dtype}, got shape {p.shape} and dtype "
                f"{p.dtype}."
            )
        out.append(p.astype(f.dtype))
    return jtu.tree_unflatten(passed_tree, out)


def _initial_states(problem: Problem, controller_state: PyTree):
    """The solver's and the controller's states to start from: made anew, or (to
    continue an earlier solve) the ones passed to `diffeqsolve`. A solver state is
    made anew anyway where the earlier solve ended at a jump (`made_jump`)."""
    terms, t0, y0, args = problem.terms, problem.t0, problem.y0, problem.args
    solver = problem.solver
    fresh = lambda: solver.init(terms, t0, problem.t1, y0, args)  # noqa: E731
    resume = problem.resume
    if resume is None:
        return fresh(), controller_state
    if resume.controller_state is not None:
        passed = _like("controller_state", resume.controller_state, controller_state)
        controller_state = problem.controller.resume(passed, controller_state)
    if resume.solver_state is None:
        return fresh(), controller_state
    passed = _like("solver_state", resume.solver_state, jax.eval_shape(fresh))
    jump = resume.made_jump
    known = concrete(jump)
    if jump is None or (known is not None and not known.any()):
        return passed, controller_state
    return tree_where(jump, fresh(), passed), controller_state


def cond(problem: Problem, carry: Carry) -> Array:
    """Whether the loop goes on.

    With a fixed step sequence (`ConstantStepSize`, `StepTo`) and no events, a
    non-finite value does not stop the loop early: it is recorded in `result` and the
    solve runs on to `t1`. Then nothing the loop tests depends on the state, so under
    `vmap` the time and the step counters stay unbatched, which makes each step
    cheaper.
    """
    going = carry.t < problem.t1
    if problem.max_steps is not None:
        going = going & (carry.num_steps < problem.max_steps)
    if not adaptive(problem) and problem.event.conds is None:
        return going
    return going & (carry.result == SUCCESS)


# A proposed step end this close to `t1` (in units of `t1`'s spacing, at least 1)
# lands on `t1` exactly, so that no sliver of a step is left to take.
_LANDING_ULPS = 100


def _lands_on_t1(problem: Problem, t: Array) -> Array:
    """Whether a proposed step end `t` is close enough to `t1` to land on it."""
    spacing = jnp.finfo(t.dtype).eps * jnp.maximum(1, jnp.abs(problem.t1))
    return t >= problem.t1 - _LANDING_ULPS * spacing


def _solver_step(problem: Problem, carry: Carry, t1: Array):
    """The solver's step from `carry.t` to `t1`. A step that ends at a jump of the
    vector field stops just short of it (so that no stage sees the far side), and the
    next step starts from the field evaluated just past it, in the direction of
    travel: on its far side however the field tests `t` (`t < s` or `t <= s`)."""
    solver, terms, args = problem.solver, problem.terms, problem.args
    controller = problem.controller
    if not controller.has_jumps:
        return solver.loop_step(
            terms, carry.t, t1, carry.y, args, carry.solver_state, False
        )
    at_jump = controller.ends_on_jump(carry.controller_state, t1)
    fixed = lax.stop_gradient(t1)
    below = fixed - jnp.nextafter(fixed, jnp.asarray(-jnp.inf, t1.dtype))
    above = jnp.nextafter(fixed, jnp.asarray(jnp.inf, t1.dtype)) - fixed
    t1_solve = where(at_jump, t1 - below, t1)
    y1, y_error, info, solver_state, result = solver.loop_step(
        terms, carry.t, t1_solve, carry.y, args, carry.solver_state, False
    )
    # Made anew only when some batch element ends on a jump (for BDF, a Jacobian).
    restart = lax.cond(
        unvmap_any(at_jump),
        lambda: tree_where(
            at_jump,
            solver.init(terms, t1 + above, problem.t1, y1, args),
            solver_state,
        ),
        lambda: solver_state,
    )
    return y1, y_error, info, restart, result


def solver_name(solver) -> str:
    """The name of the solver the user chose."""
    return type(solver.solver if isinstance(solver, UserSolver) else solver).__name__


def _solver_failed(result) -> Array | None:
    """Whether a solver's step failed (`None` where it can't: a constant success)."""
    code = concrete(result.code)
    if code is not None and code.shape == () and code == SUCCESS:
        return None
    return jnp.asarray(result.code) != SUCCESS


def _reject_failed(problem: Problem, failed, y_error: Y | None, y1: Y):
    """Under an adaptive controller a failed step (e.g. a Newton solve that did not
    converge) is rejected and the step shrinks: its error is infinite. An empty state
    (`y0=None`) has an empty error, as in diffrax."""
    if y_error is None and not jtu.tree_leaves(y1):
        return y_error
    if y_error is None:
        raise ValueError(
            f"{solver_name(problem.solver)} returns no error estimate (`y_error` is "
            "None), so it can't be used with an adaptive step-size controller: use "
            "ConstantStepSize."
        )
    if failed is None:
        return y_error
    return jtu.tree_map(lambda e: where(failed, jnp.inf, e), y_error)


def _step_result(
    problem: Problem, carry: Carry, accepted, finite, failed, solver_result, ctrl
) -> Array:
    """The solve's result code after a step: the first failure sticks; a step
    accepted with a non-finite state fails; a solver failure fails the solve unless
    an adaptive controller can retry it with a smaller step (it can't mend
    inconsistent initial values or a singular iteration matrix)."""
    result = jnp.asarray(ctrl.code, jnp.int32)
    if failed is not None:
        code = jnp.asarray(solver_result.code, jnp.int32)
        fatal = (
            failed
            if not adaptive(problem)
            else (code == _INCONSISTENT) | (code == _SINGULAR)
        )
        result = where(fatal, code, result)
    result = where(accepted & ~finite, _NONFINITE, result)
    return where(carry.result == SUCCESS, result, carry.result)


def _landing(accepted: Array, t0, t1, next_t1, t_end, lands: Array) -> Array:
    """The next step's end: a proposed end `next_t1` within `_LANDING_ULPS`
    spacings of the solve's end `t_end` lands on it (`lands`, from `_lands_on_t1`).
    A rejected step `[t0, t1]` whose retry would land there is retried on half of
    itself instead (as diffrax does the first time: it halves what is left), never
    on the end again: else a retry the controller shrank by less than the window is
    the same step, rejected again, until `max_steps` (float32: the window is ~2e-3
    at `t = 200`; VdP ensembles lost trajectories)."""
    retry = t0 + 0.5 * (t1 - t0)
    return where(lands, where(accepted, t_end, retry), next_t1)


class Replay(NamedTuple):
    """The discrete decisions of a step that the forward pass took, for a backward
    pass to take again where it recomputes the step (`step`'s `replay`)."""

    accepted: Array  # the controller's decision
    lands: Array | None = None  # whether the next step's end moved onto `t1`


def step(
    problem: Problem, carry: Carry, replay: Replay | None = None
) -> tuple[Carry, StepOut]:
    """One attempted step. Returns the new carry and what this step saves (with
    the decisions it took: `StepOut.accepted`, `StepOut.lands`).

    `replay`, where given, holds decisions to take instead of deciding again: a
    backward pass that recomputes a step replays the forward pass's. Another
    compilation of the step can round an error estimate (or a proposed step end)
    to the other side of its threshold; a pullback through the branch not taken is
    not that of the step taken, and a recomputation that decides otherwise leaves
    the forward pass's steps. A built-in controller then sizes the next step as
    after the replayed decision (so the steps agree to round-off); a controller of
    the user's own decides itself, and only its decision is replaced. A decision
    that is `True` whatever the state (a fixed step's) is kept (`_decision`)."""
    t0 = carry.t
    t1, t_timed = _event.step_end(problem, carry, jnp.minimum(carry.tnext, problem.t1))
    y1, y_error, info, solver_state, solver_result = _solver_step(problem, carry, t1)
    failed = _solver_failed(solver_result)
    if adaptive(problem):
        y_error = _reject_failed(problem, failed, y_error, y1)
    keep = None if replay is None else replay.accepted
    accepted, _, next_t1, _, controller_state, controller_result = (
        problem.controller.loop_adapt_step_size(
            t0,
            t1,
            carry.y,
            y1,
            problem.args,
            y_error,
            problem.error_order,
            carry.controller_state,
            **({} if keep is None else {"keep": keep}),
        )
    )
    accepted = replayed(jnp.asarray(_decision(accepted, keep)))
    finite = _all_finite(y1)
    result = _step_result(
        problem, carry, accepted, finite, failed, solver_result, controller_result
    )
    new = carry._replace(
        t=where(accepted, t1, t0),
        tnext=next_t1,
        y=tree_where(accepted, y1, carry.y),
        solver_state=problem.solver.revert(accepted, solver_state, carry.solver_state),
        controller_state=controller_state,
        num_steps=carry.num_steps + 1,
        num_accepted=carry.num_accepted + accepted.astype(jnp.int32),
        num_rejected=carry.num_rejected + (~accepted).astype(jnp.int32),
        result=result,
    )
    out = StepOut(accepted, t0, t1, y1, info)
    new, out = _event.after_step(problem, carry, new, out, finite, t_timed)
    # (Only now: an occurrence moves the next step with it.)
    lands = None if replay is None else replay.lands
    lands = replayed(_lands_on_t1(problem, new.tnext) if lands is None else lands)
    tnext = replayed(_landing(accepted, t0, t1, new.tnext, problem.t1, lands))
    return new._replace(tnext=tnext), out._replace(lands=lands)


def _decision(accepted, keep):
    """The step's decision: the controller's, or `keep` (the replayed one) where
    given, except where the controller's is `True` whatever the state (a fixed
    step): the forward pass accepted every step, and a replayed `True`, known only
    at run time, would turn each `where` of the step into a select and each select's
    pullback into two (vmapped fixed-step Lorenz gradient: the pullback's body
    1795 -> 1636 instructions of XLA's CPU program, 57 -> 33 selects)."""
    if keep is None:
        return accepted
    known = concrete(accepted)
    if known is not None and known.shape == () and bool(known):
        return True
    # `keep`, written as the controller's decision wherever the two agree (see
    # `PIDController.loop_adapt_step_size`).
    return where(accepted != keep, keep, accepted)


def body(
    problem: Problem,
    state: tuple[Carry, Buffers],
    active: Array | bool = True,
    differentiable: bool = False,
    stepper: Callable[[Problem, Carry], tuple[Carry, StepOut]] = step,
):
    """One iteration of the loop: a step (`stepper`, `step` itself or the same
    evaluated from its traced program), then its saves. Where `active` is False
    (a finished batch element) nothing changes."""
    new, bufs, _ = _body(problem, state, active, differentiable, stepper)
    return new, bufs


def _body(
    problem: Problem, state, active: Array | bool, differentiable=False, stepper=step
):
    """`body`, and the step's `StepOut` (its `accepted` masked by `active`)."""
    carry, bufs = state
    new, out = stepper(problem, carry)
    if active is not True:
        out = out._replace(accepted=out.accepted & active)
        new = tree_where(active, new, carry)
    ts_rows = "masked" if differentiable else "loop"
    return new, _save.write(problem, new, out, bufs, ts_rows), out


class Progress(NamedTuple):
    """Host callbacks that drive the progress meter from the forward loop only."""

    start: Any  # carry -> meter state
    tick: Any  # (meter state, carry before, carry after) -> meter state
    done: Any  # carry -> None


def progress(problem: Problem) -> Progress | None:
    meter = problem.meter
    token = meter.start()
    if token is None:
        return None
    span = problem.t1 - problem.t0
    span = where(span == 0, 1, span)

    def fraction(carry):
        # The slowest batch element, unbatched.
        return -unvmap_max(-(carry.t - problem.t0) / span)

    def start(carry):
        f = jnp.minimum(fraction(carry), 0)
        meter.callback(token, f)
        return f  # the fraction last shown (unbatched)

    def tick(shown, before, after):
        f = fraction(after)
        shown = unvmap_max(shown)  # unbatched, also where the loop batched it
        show = meter.wants(unvmap_max(after.num_steps), shown, f) & (f < 1)
        lax.cond(show, lambda: meter.callback(token, f), lambda: None)
        return where(show, f, shown)

    def done(carry):
        # Depends on the final carry, so the host sees it after every tick.
        meter.callback(token, jnp.maximum(carry.t - carry.t, 0) + 1)

    return Progress(start, tick, done)


def run_while(
    problem: Problem,
    carry: Carry,
    bufs: Buffers,
    extra: PyTree = None,
    record: Callable[[PyTree, Carry, Carry, StepOut, Array], PyTree] | None = None,
    stepper: Callable[[Problem, Carry], tuple[Carry, StepOut]] = step,
) -> tuple[Carry, Buffers, PyTree]:
    """The loop as a plain `lax.while_loop` (not reverse-differentiable), with the
    progress meter.

    **Arguments:**

    - `problem`, `carry`, `bufs`: the solve and its initial state.
    - `extra`, `record`: more loop state, updated after each step as
        `record(extra, before, after, out, active)` from the carries before and
        after it and what it saves (`step`'s `StepOut`, masked by `active`): a
        checkpointing forward pass stores carries and the steps' decisions.
    - `stepper`: `step`, or the same evaluated from its traced program (see
        `body`).

    **Returns:**

    The final `(carry, bufs, extra)`.
    """
    meter = progress(problem)

    def loop_body(state, active):
        carry, bufs, extra, shown = state
        new, bufs, out = _body(problem, (carry, bufs), active, stepper=stepper)
        if record is not None:
            extra = record(extra, carry, new, out, active)
        if meter is not None:
            shown = meter.tick(shown, carry, new)
        return new, bufs, extra, shown

    shown = None if meter is None else meter.start(carry)
    init = (carry, bufs, extra, shown)
    carry, bufs, extra, _ = while_loop(lambda s: cond(problem, s[0]), loop_body, init)
    if meter is not None:
        meter.done(carry)
    return carry, bufs, extra


class Outputs(NamedTuple):
    t_end: Array
    y_end: PyTree
    ts: Any
    ys: Any
    carry: Carry
    bufs: Buffers
    result: Array


def finish(problem: Problem, carry: Carry, bufs: Buffers) -> Outputs:
    """Turn the final carry and buffers into the saved outputs (internal time)."""
    result = where(
        (carry.result == SUCCESS) & (carry.t < problem.t1), _MAX_STEPS, carry.result
    )
    t_end, y_end = _event.finish(problem, carry._replace(result=result))
    outs = [
        _save.finish_save(problem, save, buf, carry, t_end, y_end)
        for save, buf in zip(problem.saves, bufs.saves)
    ]
    ts = jtu.tree_unflatten(problem.save_tree, [o[0] for o in outs])
    ys = jtu.tree_unflatten(problem.save_tree, [o[1] for o in outs])
    if problem.dense:  # the first step boundary (never written by a step)
        assert bufs.dense_ts is not None  # `init_buffers` made it
        bufs = bufs._replace(dense_ts=bufs.dense_ts.at[0].set(problem.t0))
    return Outputs(t_end, y_end, ts, ys, carry, bufs, result)
