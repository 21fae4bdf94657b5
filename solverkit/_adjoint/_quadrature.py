"""The backward solve's step of `BacksolveAdjoint` for many parameters: their
cotangents integrated as a quadrature over the stages of the state and its adjoint.

The adjoint system is `dy = g`, `da = -a dg/dy`, `dtheta_bar = -a dg/dtheta`, in
the backward solve's internal time. `theta_bar` is read by nothing on the right, so
an explicit Runge-Kutta step of the whole system is the step of `(y, a)` and, for
`theta_bar`, the weighted sums `h sum_i b_i k_i` (the increment) and
`h sum_i b_err_i k_i` (its error estimate) of its stage rates. Taken stage by stage,
each stage's rate is a parameter cotangent per trajectory, which under `jax.vmap`
is an `(N, P)` array written by every stage and read by each sum. Here the stages
of `(y, a)` are taken first, and the two sums are the gradients of
`sum_i w_i <a_i, g(t_i, y_i; theta)>` over every stage point at once: the
per-stage cotangents are never formed.
"""

from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._solver import AbstractRungeKutta
from .._solver._base import (
    AbstractAdaptiveSolver,
    AbstractSolver,
    AbstractWrappedSolver,
)
from .._solver._tableau import ButcherTableau
from .._term import AbstractTerm, ClosureTerm, MultiTerm
from ._base import parameters


class _StateAndAdjoint:
    """The adjoint system restricted to `(y, a)`, in the backward solve's internal
    time `t` (forward time `direction * t`): `direction * (g, -a dg/dy)`, with
    `args` the forward problem's `(terms, args)`. Its own vector-Jacobian product,
    with respect to `y` only (the whole system's, with respect to the parameters
    too, is as large to compile as the field's reverse mode). Records the points
    `(t, (y, a))` it is evaluated at, in order."""

    def __init__(self, direction):
        self.direction, self.points = direction, []

    def is_vf_expensive(self, t0, t1, ya, args) -> bool:
        del t0, t1, ya, args
        return False

    def vf(self, t, ya, args):
        self.points.append((t, ya))
        (y, a), (terms, fwd_args), d = ya, args, self.direction
        fy, pull_back = jax.vjp(lambda y: terms.vf(d * t, y, fwd_args), y)
        (gy,) = pull_back(a)
        flip = lambda x, like: (d * x).astype(like.dtype)  # noqa: E731
        return jtu.tree_map(flip, fy, y), jtu.tree_map(lambda x, a: -flip(x, a), gy, a)


def applies(solver, terms: AbstractTerm) -> bool:
    """Whether `QuadratureStep` can take the backward solve's steps: an explicit
    Runge-Kutta method of the built-in form, stages unrolled, on one term."""
    if not issubclass(type(solver), AbstractRungeKutta) or isinstance(terms, MultiTerm):
        return False
    return (
        isinstance(solver.tableau, ButcherTableau)
        and solver.tableau.b_err is not None
        and solver.scan_kind is None
    )


class QuadratureStep(AbstractAdaptiveSolver, AbstractWrappedSolver):
    """`solver`'s step of the adjoint system `(y, a, theta_bar)`, with `theta_bar`
    as a quadrature (see the module). `terms` is the adjoint system's `ClosureTerm`
    in the backward solve's internal time, `args` the forward problem's `(terms,
    args)`."""

    solver: AbstractSolver  # an `AbstractRungeKutta` (`applies`)

    @property
    def _rk(self) -> AbstractRungeKutta:
        return cast(AbstractRungeKutta, self.solver)

    def order(self, terms: AbstractTerm) -> int | None:
        return self.solver.order(terms)

    def error_order(self, terms: AbstractTerm) -> float | None:
        return self.solver.error_order(terms)

    def revert(self, accepted, new_state, old_state):
        return self.solver.revert(accepted, new_state, old_state)

    def init(self, terms, t0, t1, y0, args):
        assert isinstance(terms, ClosureTerm)
        y, a, _ = y0
        part = cast(AbstractTerm, _StateAndAdjoint(terms.direction))
        return self.solver.init(part, t0, t1, (y, a), args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del made_jump
        assert isinstance(terms, ClosureTerm)
        y, a, theta_bar = y0
        part = _StateAndAdjoint(terms.direction)
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        tab = self._rk.tableau
        ya1, ya_error, _, f1, result = self._rk._stages(
            cast(AbstractTerm, part), t0, t1, (y, a), args, solver_state
        )
        assert ya_error is not None  # (`applies`: an embedded estimate)
        num = len(tab.c)  # stage 0 at the start; then the stages' own evaluations
        points = [(t0, (y, a))] + part.points[: num - 1]
        h = t1 - t0
        assert tab.b_err is not None  # (`applies`)
        incr, error = _weighted_cotangents(terms, points, args, (tab.b, tab.b_err), h)
        theta_bar1 = jtu.tree_map(jnp.add, theta_bar, incr)
        y_error = (*ya_error, error)
        info = dict(y0=y0, y1=(*ya1, theta_bar1))
        return (*ya1, theta_bar1), y_error, info, f1, result

    def loop_step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        return self.step(terms, t0, t1, y0, args, solver_state, made_jump)


def _weighted_cotangents(terms: ClosureTerm, points, args, weights, h):
    """For each weight vector `w` of `weights`, `h sum_i w_i k_i`: the sum of the
    parameter cotangent rates `k_i` at the stage `points`, as one gradient over
    every point. `k_i` is the adjoint system's parameter part: in its internal time
    `t` (forward time `flip(direction, t)`), `-direction * (-a_i dg/dtheta)`."""
    direction = terms.direction
    assert direction is not None  # the backward solve's
    theta, rest = eqx.partition(args, parameters(args))
    ts = jnp.stack([t for t, _ in points])
    ys = jtu.tree_map(lambda *x: jnp.stack(x), *[ya[0] for _, ya in points])
    adjoints = jtu.tree_map(lambda *x: jnp.stack(x), *[ya[1] for _, ya in points])

    def fields(theta):
        fwd_terms, fwd_args = eqx.combine(theta, rest)
        vf = lambda t, y: fwd_terms.vf(direction * t, y, fwd_args)  # noqa: E731
        return jax.vmap(vf)(ts, ys)

    _, pull_back = jax.vjp(fields, theta)
    out = []
    for w in weights:
        # k_i = direction^2 a_i dg/dtheta = a_i dg/dtheta (direction = -1).
        scale = jnp.asarray(w, ts.dtype) * h
        ct = jtu.tree_map(
            lambda x: x * scale.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype),
            adjoints,
        )
        (d_theta,) = pull_back(ct)
        out.append(d_theta)
    return tuple(out)
