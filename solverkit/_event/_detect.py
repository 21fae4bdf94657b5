"""Event conditions in the loop: their evaluation and detection after each step, and
the location of a crossing on a step's dense output (after the loop for an event
that stops the solve; `crossing`, inside the step, for one that continues)."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import optimistix as optx
from jaxtyping import Array, PyTree

from .._closure._convert import Closure
from .._closure._unvmap import unvmap_any
from .._custom_types import RealScalarLike, Y
from .._problem import Carry, dense_info_zeros, LastStep, Problem
from .._select import where
from .._solution import RESULTS
from .._time import flip
from .._tree import nograd, tree_where


def real_conds(problem: Problem) -> list[bool]:
    """For each event condition leaf: is it real-valued (True) or boolean (False)?"""
    return [
        not jnp.issubdtype(c.out_struct.dtype, jnp.bool_)
        for c in jtu.tree_leaves(
            problem.event.conds, is_leaf=lambda x: isinstance(x, Closure)
        )
    ]


def eval_conds(problem: Problem, tau: RealScalarLike, y: Y):
    """The event conditions at internal time `tau` and state `y`."""
    t = flip(problem.direction, tau)
    return jtu.tree_map(
        lambda c: c(t, y, problem.args),
        problem.event.conds,
        is_leaf=lambda x: isinstance(x, Closure),
    )


def fired(problem: Problem, before, after) -> PyTree:
    """Which conditions fired over a step: a boolean one when it is true, a real one
    when its sign changes (in its direction), as diffrax decides."""

    def leaf(b, a, direction: Array | None):
        if jnp.issubdtype(a.dtype, jnp.bool_):
            return a
        sb, sa = jnp.sign(b), jnp.sign(a)
        if direction is None:
            return sb != sa
        if direction:
            return (sb <= 0) & (sa > 0)
        return (sb > 0) & (sa <= 0)

    assert problem.event.directions is not None  # given with the conditions
    leaves, tree = jtu.tree_flatten(after)
    out = [
        leaf(b, a, d)
        for b, a, d in zip(jtu.tree_leaves(before), leaves, problem.event.directions)
    ]
    return jtu.tree_unflatten(tree, out)


def init_events(problem: Problem, solver_state: PyTree):
    """`(cond_values, event_mask, last)` at the start of the loop."""
    if problem.event.conds is None:
        return None, None, None
    cond_values = eval_conds(problem, problem.t0, problem.y0)
    # A boolean condition already true at t0 ends the solve there, before any step
    # (as in diffrax); a real-valued one needs a sign change first.
    event_mask = [
        jnp.asarray(False) if real else jnp.asarray(value)
        for real, value in zip(real_conds(problem), jtu.tree_leaves(cond_values))
    ]
    event_mask = jtu.tree_unflatten(jtu.tree_structure(cond_values), event_mask)
    last = None
    if any(real_conds(problem)) and not problem.event.continues:
        last = LastStep(problem.t0, dense_info_zeros(problem, solver_state))
    return cond_values, event_mask, last


class _Bracket(NamedTuple):
    a: Array
    b: Array
    ga: Array  # the sign of the condition at `a`
    x: Array  # the latest estimate
    done: Array  # 1 where converged (a float: the kernel selects no int32 on a TPU)
    count: Array


# A bound on the root finder's steps (it takes a handful on a smooth crossing).
_ROOT_MAX_STEPS = 100


def _finite(x):
    """`isfinite` as a comparison (NaN compares false), which every backend (Mosaic
    included) lowers."""
    return jnp.abs(x) < jnp.inf


def bracketed_root(g: Callable, a, b, ga, done, where: Callable = where):
    """A root of `g` in `[a, b]` (`ga`: the sign to take at `a`) by Newton's method
    kept inside a shrinking bracket (a step that would leave it bisects instead),
    from the secant point. It stops when a step moves less than a thousand ulps
    of the time (short of `g`'s rounding noise): after three to five evaluations
    on a smooth crossing, where 64 bisections took as many.
    Where `done` from the start, `a`. Not differentiated (see
    `_earliest_crossing`). The one search of the loop's terminating events and
    of the whole-solve kernel's (`_kernel/_event.py`, which passes its tile-wise
    `where`; elementwise, so it runs on a batch of brackets as on one)."""
    gb = g(b)
    secant = (a * gb - b * ga) / (gb - ga)
    ok = _finite(secant) & (secant > a) & (secant < b)
    x = where(ok, secant, (a + b) / 2)

    def narrow(s: _Bracket) -> _Bracket:
        gx, slope = jax.jvp(g, (s.x,), (jnp.ones_like(s.x),))
        like_a = jnp.sign(gx) == jnp.sign(s.ga)
        a, b = where(like_a, s.x, s.a), where(like_a, s.b, s.x)
        newton = s.x - gx / slope
        inside = _finite(newton) & (newton > a) & (newton < b)
        x = where(inside, newton, (a + b) / 2)
        # Near enough for the Newton step of `_earliest_crossing`, which follows,
        # to land on the root to rounding, even where the condition's slope is
        # small against its curvature (a grazing crossing); out of its noise.
        # (A Newton step that small ends the search even where it lands on an end
        # of the bracket, as it does at the root: not a bisection then.)
        tol = 1000 * jnp.finfo(x.dtype).eps * jnp.maximum(jnp.abs(a), jnp.abs(b))
        small = _finite(newton) & (jnp.abs(newton - s.x) <= tol)
        converged = (gx == 0) | small
        done = converged | (jnp.abs(x - s.x) <= tol) | (b - a <= tol)
        x = where(converged, s.x, x)
        old = s.done != 0
        return _Bracket(
            where(old, s.a, a),
            where(old, s.b, b),
            s.ga,
            where(old, s.x, x),
            where(old, s.done, done.astype(s.done.dtype)),
            s.count + 1,
        )

    start = _Bracket(a, b, ga, where(done, a, x), done.astype(a.dtype), jnp.int32(0))
    end = lax.while_loop(
        lambda s: jnp.any(s.done < 0.5) & (s.count < _ROOT_MAX_STEPS),
        narrow,
        start,
    )
    return end.x


def locate(problem: Problem, carry: Carry):
    """For a fired real-valued condition, find the crossing on the last step's dense
    output. The event time is differentiable by the implicit function theorem."""
    if carry.last is None:
        return carry.t, carry.y
    tstart, info = carry.last
    tend = carry.t
    event = carry.result == RESULTS.event_occurred.code
    mask = jtu.tree_leaves(carry.event_mask)
    t_star, located = _earliest_crossing(problem, tstart, tend, info, mask, event)
    # Only then is the last step's dense output meaningful (a boolean condition may
    # have fired at t0, before any step).
    y_star = problem.solver.interpolate(info, tstart, tend, t_star)
    y = tree_where(located, y_star, carry.y)
    return where(event, t_star, tend), y


def crossing(
    problem: Problem, t0: Array, t1: Array, info: PyTree, fired: PyTree, start: PyTree
):
    """The earliest crossing, over the step `[t0, t1]` with dense information
    `info`, of the (real-valued) conditions that `fired`, whose values at `t0` were
    `start`; differentiable by the implicit function theorem. `t1` where none
    fired."""
    t_star, _ = _earliest_crossing(
        problem,
        t0,
        t1,
        info,
        jtu.tree_leaves(fired),
        jnp.asarray(True),
        jtu.tree_leaves(start),
    )
    return t_star


def _cond_on(problem: Problem, closure, info, tstart, tend, tau):
    """A condition at `tau` along the dense output `info` of the step
    `[tstart, tend]`."""
    y = problem.solver.interpolate(info, tstart, tend, tau)
    return closure(flip(problem.direction, tau), y, problem.args)


def _earliest_crossing(problem: Problem, tstart, tend, info, mask, event, start=None):
    """`(t_star, located)`: the earliest root over `[tstart, tend]` of the real
    conditions whose `mask` is set (where `event`), else `tend`; and whether one
    was located. One Newton step at the root gives `t_star` the derivative of the
    implicit function theorem, `-(dg/dp) / (dg/dt)`.

    `start`: the conditions' values at `tstart` as the loop holds them: after an
    occurrence that left a condition at zero to within rounding, on the side it
    moves to (see `_continuing._side`), which the bisection takes as the sign at
    `tstart`, where the dense output's own value may lie on either side."""
    solver = problem.solver
    is_real = real_conds(problem)
    leaves = jtu.tree_leaves(
        problem.event.conds, is_leaf=lambda x: isinstance(x, Closure)
    )
    t_star = tend
    located = jnp.asarray(False)  # whether a real-valued condition fired
    starts = [None] * len(leaves) if start is None else start
    for closure, real, f, before in zip(leaves, is_real, mask, starts):
        if not real:
            continue

        def g(tau: RealScalarLike, closure=closure):
            y = solver.interpolate(info, tstart, tend, tau)
            return closure(flip(problem.direction, tau), y, problem.args)

        active = event & f
        a = lax.stop_gradient(where(active, tstart, tend - 1))
        b = lax.stop_gradient(tend)
        # The search is not differentiated (the Newton step below gives the
        # derivative), so it may stop when it has converged.
        fixed = nograd((problem, closure, info, tstart, tend))
        h = lambda tau, fixed=fixed: _cond_on(
            fixed[0], fixed[1], fixed[2], fixed[3], fixed[4], tau
        )
        ga = h(a) if before is None else before.astype(tend.dtype)
        if problem.event.root_finder is None:
            root = bracketed_root(h, a, b, ga, ~active)
        else:
            root = _optx_root(h, problem.event.root_finder, a, b, ga, ~active, before)
        root = lax.stop_gradient(where(active, root, tend))
        g_root, dg_dt = jax.jvp(g, (root,), (jnp.ones_like(root),))
        dg_dt = lax.stop_gradient(where(dg_dt == 0, 1, dg_dt))
        root = root - where(active, g_root / dg_dt.astype(root.dtype), 0)
        # Within the step (the clip moves the value by rounding only, not the
        # derivative).
        root = root + lax.stop_gradient(jnp.clip(root, a, b) - root)
        t_star = where(active, jnp.minimum(t_star, root), t_star)
        located = located | active
    return t_star, located


# Iterations of an optimistix root finder locating an event in one step: far more
# than a Newton-type method needs on a smooth, bracketed crossing.
_EVENT_ROOT_MAX_STEPS = 64


def _optx_root(g, root_finder, a, b, ga, done, before):
    """A root of `g` in `[a, b]` by the user's optimistix `root_finder`, from the
    middle; where it fails (its result, a non-finite or out-of-bracket value, or,
    after an occurrence (`before` given), a root at `a`: the previous occurrence
    found again), the built-in bracketed search's (`bracketed_root`, with the sign
    `ga` at `a`), which always converges. Where `done` from the start, `a`."""
    sol = optx.root_find(
        lambda tau, _: g(tau),
        root_finder,
        (a + b) / 2,
        throw=False,
        max_steps=_EVENT_ROOT_MAX_STEPS,
    )
    root = sol.value
    window = 1000 * jnp.finfo(a.dtype).eps * jnp.maximum(jnp.abs(a), 1)
    failed = (
        (sol.result != optx.RESULTS.successful)
        | ~jnp.isfinite(root)
        | (root < a)
        | (root > b)
    )
    if before is not None:
        failed = failed | (root <= a + window)
    failed = failed & ~done
    return lax.cond(
        unvmap_any(failed),
        lambda: where(failed, bracketed_root(g, a, b, ga, ~failed), root),
        lambda: where(done, a, root),
    )
