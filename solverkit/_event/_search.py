"""The search, inside a step, for the crossing of an event that continues: a
bracketing search on the step's dense output whose result always lies on the far
side of the crossing (the condition has crossed there), so that the state the
solve goes on from has crossed too and the next crossing can't be missed.

Newton's method from the secant point, kept inside the bracket (a bisection where
it would leave it), until its step is small; then a probe two ulps either side of
its last iterate, which closes the bracket on a smooth crossing; where it does
not, Illinois steps (regula falsi, the end kept twice running scaled down). Each
loop is bounded for each batch element, and under `vmap` it ends when every
element has converged or reached its bound (`_loop`).
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._closure._convert import Closure
from .._closure._unvmap import unvmap_any
from .._custom_types import RealScalarLike
from .._problem import Problem
from .._reduce import or_all
from .._select import where
from .._time import flip
from .._tree import nograd, tree_where
from ._detect import eval_conds, real_conds


# A bound on the iterations of each phase of the search.
_MAX_STEPS = 100


class _Bracket(NamedTuple):
    a: Array  # the condition has not crossed at `a` ...
    b: Array  # ... and has at `b`
    fa: Array  # the condition's values there (scaled, in the fallback)
    fb: Array
    x: Array  # Newton's next iterate
    near: Array  # whether `x` is within the tolerance of the crossing
    kept: Array  # int32: which end the last fallback step kept (0: a, 1: b)
    count: Array
    unit: Array  # an ulp of the step's times (of its larger end)


def _ulps(s: _Bracket, n: int) -> Array:
    """About `n` ulps of the step's times (at least `n`, at most `2n`): of its
    larger end, also where the crossing is near zero (at `t0 = 0`, say)."""
    return n * s.unit


def _narrowed(s: _Bracket) -> Array:
    """Where the bracket is a few ulps wide, or `b` is a root. (Within a few ulps
    after the crossing: a later one would be a bias that, at each bounce of a ball
    whose bounces accumulate, adds the speed of falling for that time: they would
    stop shrinking before they accumulate to the ulp.)"""
    return (s.b - s.a <= _ulps(s, 8)) | (s.fb == 0)


def _keep(s: _Bracket, x, fx, crossed) -> _Bracket:
    """`s` with `x` (value `fx`) as the end of its side, where it narrows it."""
    to_b = crossed & (x < s.b)
    to_a = ~crossed & (x > s.a)
    return s._replace(
        a=where(to_a, x, s.a),
        b=where(to_b, x, s.b),
        fa=where(to_a, fx, s.fa),
        fb=where(to_b, fx, s.fb),
    )


def _newton(g, sign_a, loose, s: _Bracket) -> _Bracket:
    """A step of Newton's method kept inside the bracket (else a bisection); `x`
    is near the crossing once the step is below `loose`: Newton's next step then
    lands on it to about an ulp."""
    fx, slope = jax.jvp(g, (s.x,), (jnp.ones_like(s.x),))
    s = _keep(s, s.x, fx, jnp.sign(fx) != sign_a)
    newton = s.x - fx / slope
    finite = jnp.isfinite(newton)
    inside = finite & (newton > s.a) & (newton < s.b)
    x = where(inside, newton, s.a + (s.b - s.a) / 2)
    # Near also where the small step lands on an end of the bracket: a crossing
    # within an ulp of `x` rounds it there (bisecting on would never be near),
    # and where the bracket is already narrower than such a step.
    near = (fx == 0) | (finite & (jnp.abs(newton - s.x) <= loose))
    near = near | (s.b - s.a <= loose)
    x = where(near, jnp.clip(where(finite, newton, s.x), s.a, s.b), x)
    return s._replace(x=x, near=near, count=s.count + 1)


def _probe(g, sign_a, s: _Bracket) -> _Bracket:
    """The condition two ulps either side of Newton's last iterate: where these
    bracket the crossing, the bracket is narrowed."""
    margin = _ulps(s, 2)
    for x in (s.x - margin, s.x + margin):
        x = jnp.clip(x, s.a, s.b)
        fx = g(x)
        s = _keep(s, x, fx, jnp.sign(fx) != sign_a)
    return s


def _fallback(g, sign_a, s: _Bracket) -> _Bracket:
    """A step of the Illinois search (Anderson-Bjorck's scaling): the end kept
    again has its value scaled down, so that both ends converge; an iterate at
    two ulps from either end, so that once `b` is that near the
    crossing the next closes the bracket. Derivative-free and always narrowing."""
    x = (s.a * s.fb - s.b * s.fa) / (s.fb - s.fa)
    x = where(jnp.isfinite(x), x, s.a + (s.b - s.a) / 2)
    margin = _ulps(s, 2)
    x = jnp.clip(x, s.a + margin, s.b - margin)
    fx = g(x)
    crossed = jnp.sign(fx) != sign_a
    scale = lambda m: where(m > 0, m, 0.5)  # noqa: E731
    fa = where(crossed & (s.kept == 0), s.fa * scale(1 - fx / s.fb), s.fa)
    fb = where(~crossed & (s.kept == 1), s.fb * scale(1 - fx / s.fa), s.fb)
    s = _keep(s._replace(fa=fa, fb=fb), x, fx, crossed)
    kept = where(crossed, 0, 1).astype(jnp.int32)
    return s._replace(kept=kept, count=s.count + 1)


def _loop(active, step, s: _Bracket) -> _Bracket:
    """`step` applied to `s` where `active(s)` (element-wise), until it is nowhere,
    at most `_MAX_STEPS` times for each element. The loop's predicate is one for
    the whole batch (`unvmap_any`), the bound included: under `vmap`, an element
    that reaches it stops as one that converged does. (A bound outside the
    `unvmap_any` never ended the loop where one element reached it while another,
    converged, kept its count below it: that element's `~near` kept the batch's
    predicate true and its bound kept its own, with nothing left to change.)"""

    def live(s: _Bracket) -> Array:
        return active(s) & (s.count < _MAX_STEPS)

    def body(s: _Bracket) -> _Bracket:
        new = step(s)
        return jtu.tree_map(lambda n, o: where(live(s), n, o), new, s)

    return lax.while_loop(lambda s: unvmap_any(live(s)), body, s)


def _search(g, a, b, fa, fb, done) -> Array:
    """The far end of a bracket `[a, b]` of a crossing of `g` (values `fa`, `fb`
    at its ends, `fb` crossed) narrowed to a few ulps; where `done` from the
    start, `b`. Newton's method from the secant point until its step is small
    (`loose`: the square root of an ulp times the step, short of which a smooth
    crossing's next Newton step lands within about an ulp), then a probe either
    side of its last iterate; where these do not bracket the crossing, a loop of
    Illinois steps. Not differentiated (see `crossing`)."""
    sign_a = jnp.sign(fa)
    secant = (a * fb - b * fa) / (fb - fa)
    x = where(jnp.isfinite(secant) & (secant > a) & (secant < b), secant, (a + b) / 2)
    zero = jnp.zeros_like(a, dtype=jnp.int32)
    unit = jnp.finfo(b.dtype).eps * jnp.maximum(jnp.abs(a), jnp.abs(b))
    s = _Bracket(a, b, fa, fb, x, done, zero - 1, zero, unit)
    loose = jnp.sqrt(_ulps(s, 1) * (b - a))

    s = _probe(
        g, sign_a, _loop(lambda s: ~s.near, partial(_newton, g, sign_a, loose), s)
    )
    s = _loop(
        lambda s: ~done & ~_narrowed(s),
        partial(_fallback, g, sign_a),
        s._replace(count=zero),
    )
    return s.b


def crossing(
    problem: Problem,
    t0: Array,
    t1: Array,
    info: PyTree,
    fired: PyTree,
    values: tuple[PyTree, PyTree],
) -> Array:
    """The earliest crossing, over the step `[t0, t1]` with dense information
    `info`, of the real-valued conditions that `fired`, whose values at `t0` and
    `t1` are `values` (at `t0` as the loop holds them: after an occurrence that
    left a condition at zero to within rounding, on the side it moves to). Never
    before the crossing on the dense output (the condition has crossed there); `t1`
    where none fired. Differentiable by the implicit function theorem: a Newton
    step at the crossing that changes its derivative, not its value."""
    starts, ends = (jtu.tree_leaves(v) for v in values)
    t_star = t1
    fixed = nograd((problem, info, t0, t1))
    for i, (real, f, fa, fb) in enumerate(
        zip(real_conds(problem), jtu.tree_leaves(fired), starts, ends)
    ):
        if not real:
            continue
        g = _on_step(fixed, i)
        a = lax.stop_gradient(where(f, t0, t1 - 1))
        b = lax.stop_gradient(t1)
        fa, fb = (lax.stop_gradient(v.astype(t1.dtype)) for v in (fa, fb))
        root = _at_crossing(_search(g, a, b, fa, fb, ~f), problem, info, t0, t1, i=i)
        t_star = where(f, jnp.minimum(t_star, root), t_star)
    return t_star


@eqx.filter_custom_jvp
def _at_crossing(root, problem: Problem, info, t0, t1, *, i: int):
    """`root`, a crossing of the condition `i` on the dense output `info` of the
    step `[t0, t1]` found without gradients, with the derivative of the exact
    crossing (implicit function theorem): `-(dg/dp) / (dg/dt)`. Nothing of it is
    computed unless it is differentiated."""
    return root


@_at_crossing.def_jvp
def _at_crossing_jvp(primals, tangents, *, i: int):
    root = lax.stop_gradient(primals[0])
    rest, t_rest = primals[1:], tangents[1:]
    is_none = lambda x: x is None  # noqa: E731
    diff = jtu.tree_map(
        lambda t, p: None if t is None else p, t_rest, rest, is_leaf=is_none
    )
    fixed = jtu.tree_map(
        lambda t, p: p if t is None else None, t_rest, rest, is_leaf=is_none
    )
    g = lambda tau, d: _on_step(eqx.combine(d, fixed), i)(tau)  # noqa: E731
    _, slope = jax.jvp(lambda tau: g(tau, diff), (root,), (jnp.ones_like(root),))
    _, dg = jax.jvp(lambda d: g(root, d), (diff,), (t_rest,))
    slope = lax.stop_gradient(where(slope == 0, 1, slope))
    return root, -(dg / slope).astype(root.dtype)


# The nudges of `settle`, in ulps of the step's times.
_NUDGES = (1, 2, 4, 8)


def settle(
    problem: Problem, t0, t1, info, fired, starts, y1, t
) -> tuple[Array, PyTree]:
    """The occurrence's time and state: `t`, a located crossing, and the state there
    on the step's dense output, where a condition that `fired` has crossed at that
    state as computed here; else `t` moved on a few ulps at a time towards `t1` until
    one has (at `t1` the step's end state `y1`, where all that fired have crossed).
    The search saw the crossing at `t`, but the same interpolation compiled
    elsewhere may round to the near side by an ulp: the state recorded, and that
    the solve goes on from, must have crossed. The nudges keep `t`'s
    derivative.

    **Arguments:** the step `[t0, t1]`, its dense information `info`, the conditions
    that `fired`, their values `starts` at `t0` (as the loop holds them), the step's
    end state `y1`, and `t`.

    **Returns:** the time and the state there."""
    reals = real_conds(problem)
    unit = jnp.finfo(t1.dtype).eps * jnp.maximum(jnp.abs(t0), jnp.abs(t1))

    def crossed(y, tau):
        values = jtu.tree_leaves(eval_conds(problem, tau, y))
        hits = [
            f & (jnp.sign(v) != jnp.sign(v0))
            for real, f, v, v0 in zip(
                reals, jtu.tree_leaves(fired), values, jtu.tree_leaves(starts)
            )
            if real
        ]
        return or_all(hits) if hits else jnp.ones_like(t1, dtype=bool)

    at = problem.solver.interpolator(info, t0, t1)  # as the search evaluates it
    y = at(t)
    real_fired = [f for real, f in zip(reals, jtu.tree_leaves(fired)) if real]
    if not real_fired:
        return t, y
    ok = crossed(y, t)

    def nudge(t, y, ok):
        for n in _NUDGES:
            tau = jnp.minimum(t + lax.stop_gradient(n * unit), t1)
            y_tau = at(tau)
            t, y = where(ok, t, tau), tree_where(ok, y, y_tau)
            ok = ok | crossed(y_tau, tau)
        return t, y, ok

    # Only where some batch element's state has not crossed (rounding: rare).
    lagging = unvmap_any(or_all(real_fired) & ~ok)
    t, y, ok = lax.cond(lagging, nudge, lambda *state: state, t, y, ok)
    t_end = jnp.minimum(t, t1) + lax.stop_gradient(t1 - jnp.minimum(t, t1))
    return where(ok, t, t_end), tree_where(ok, y, y1)


def _on_step(step: tuple, i: int) -> Callable[[RealScalarLike], Array]:
    """The condition `i` as a function of the time on the dense output of a step
    (`step`: `(problem, info, t0, t1)`), evaluated as the solver's `interpolator`
    does: what the evaluations share is computed once, outside the search's loops
    (for a Runge-Kutta method, its dense polynomial's coefficients; evaluating the
    stages' weight polynomials at each iterate made the search most of the cost
    of a step that found a crossing)."""
    problem, info, t0, t1 = step
    closure = jtu.tree_leaves(
        problem.event.conds, is_leaf=lambda x: isinstance(x, Closure)
    )[i]
    at = problem.solver.interpolator(info, t0, t1)
    return lambda tau: closure(flip(problem.direction, tau), at(tau), problem.args)
