"""A user's own solver, stepped as diffrax steps it.

diffrax hands a solver the user's terms, each wrapped in a `WrapTerm` whose `.term`
is the user's term object, so a solver may call any method of its own terms. A
solver written for diffrax gets the same here. What it would not get from diffrax:
its `init`, `step` and `func` are closure-converted once, with the user's terms
inside, so every value the terms and the solver close over (of every dtype) is an
explicit operand of the loop and of every custom derivative rule, as a vector
field's is. `vf` is evaluated only if the solver calls it: a term whose `vf` returns
`None` (one only its own solver understands) is accepted.

The built-in solvers never come here: they step `ClosureTerm`s (`_term.py`).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from ._closure._convert import Closure, closure_convert
from ._custom_types import Args, BoolScalarLike, DenseInfo, RealScalarLike, Y
from ._errors import UnsupportedError
from ._solver import AbstractSolver
from ._solver._base import AbstractWrappedSolver
from ._term import AbstractTerm, ClosureTerm, MultiTerm, ODETerm
from ._time import flip


_PROTOCOL = ("init", "step", "func")


def is_user_solver(solver: AbstractSolver) -> bool:
    """Whether `solver` defines how it uses its terms itself (its `init`, `step` or
    `func` is not solverkit's, or it asks for the user's terms, `steps_user_terms`),
    or wraps such a solver (`HalfSolver`)."""
    if solver.steps_user_terms:
        return True
    inner = getattr(solver, "solver", None)
    wrapper = type.__instancecheck__(AbstractWrappedSolver, solver)
    if wrapper and isinstance(inner, AbstractSolver) and is_user_solver(inner):
        return True
    return any(
        not getattr(getattr(type(solver), name), "__module__", "").startswith(
            "solverkit."
        )
        for name in _PROTOCOL
    )


class WrapTerm(AbstractTerm):
    """What a user's solver receives for each of the user's terms (diffrax's
    `WrapTerm`): the term, `.term`, seen in the loop's internal time `tau =
    direction * t`, which always increases."""

    term: AbstractTerm
    direction: Array | None  # None: forwards

    def vf(self, t: RealScalarLike, y: Y, args: Args) -> PyTree:
        return self.term.vf(flip(self.direction, t), y, args)

    def contr(self, t0: RealScalarLike, t1: RealScalarLike, **kwargs) -> PyTree:
        if self.direction is None:
            return self.term.contr(t0, t1, **kwargs)
        # The same interval in `t` (`tau = -t` backwards).
        control = self.term.contr(-jnp.asarray(t1), -jnp.asarray(t0), **kwargs)
        return jtu.tree_map(lambda c: self.direction * c, control)

    def prod(self, vf: PyTree, control: PyTree) -> PyTree:
        return self.term.prod(vf, control)

    def vf_prod(self, t: RealScalarLike, y: Y, args: Args, control: PyTree) -> PyTree:
        return self.term.vf_prod(flip(self.direction, t), y, args, control)


def _wrap(terms: AbstractTerm, direction: Array | None) -> AbstractTerm:
    """Each term that is not a `MultiTerm` in a `WrapTerm`, as diffrax wraps them."""
    return jtu.tree_map(
        lambda term: WrapTerm(term, direction),
        terms,
        is_leaf=lambda x: isinstance(x, AbstractTerm) and not isinstance(x, MultiTerm),
    )


def _arrays(tree: PyTree) -> PyTree:
    """Python-number leaves as arrays: a loop carries them so."""
    return jtu.tree_map(
        lambda x: jnp.asarray(x) if isinstance(x, (bool, int, float, complex)) else x,
        tree,
    )


class UserTerms(AbstractTerm):
    """A user's terms, converted for a user's solver: the solver's `init`, `step`
    and `func` with the terms inside, and (where the terms' `vf` gives `dy/dt`) the
    vector field for the parts of a solve that need it themselves
    (`BacksolveAdjoint`, `ImplicitAdjoint`)."""

    init: Closure  # (t0, t1, y0, args) -> solver state
    step: Closure  # (t0, t1, y0, args, solver state) -> the step's outputs
    func: Closure | None  # (t, y, args) -> `solver.func`
    rate: ClosureTerm | None  # dy/dtau, or None where `vf` does not give it
    why_func: str = eqx.field(static=True, default="")  # why `func` is None
    why_rate: str = eqx.field(static=True, default="")  # why `rate` is None
    ode: bool = eqx.field(static=True, default=True)  # the user's terms: an ODETerm

    @property
    def first_step_from_func(self) -> bool:
        return self.ode

    def vf(self, t: RealScalarLike, y: Y, args: Args) -> PyTree:
        if self.rate is None:
            raise UnsupportedError(
                "This solve needs the vector field itself (for BacksolveAdjoint or "
                "ImplicitAdjoint), but the terms' `vf` does not give dy/dt: "
                f"{self.why_rate} Use RecursiveCheckpointAdjoint() or DirectAdjoint()."
            )
        return self.rate.vf(t, y, args)

    def contr(self, t0: RealScalarLike, t1: RealScalarLike, **kwargs) -> Array:
        return jnp.asarray(t1) - jnp.asarray(t0)

    def prod(self, vf: PyTree, control: PyTree) -> PyTree:
        return jtu.tree_map(lambda v: v * control, vf)


class UserSolver(AbstractSolver):
    """A user's solver, stepping `UserTerms` through their converted functions.
    Given any other terms (`BacksolveAdjoint`'s adjoint equations, `ClosureTerm`s),
    it is the user's solver."""

    solver: AbstractSolver
    orders: tuple[Any, Any] = eqx.field(static=True)  # (order, error order)

    def order(self, terms: AbstractTerm) -> int:
        return self.orders[0]

    def error_order(self, terms: AbstractTerm) -> float | None:
        return self.orders[1]

    def init(self, terms, t0, t1, y0, args) -> PyTree:
        if isinstance(terms, UserTerms):
            return terms.init(t0, t1, y0, args)
        return self.solver.init(terms, t0, t1, y0, args)

    def step(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
        solver_state: PyTree,
        made_jump: BoolScalarLike,
    ):
        if isinstance(terms, UserTerms):
            return terms.step(t0, t1, y0, args, solver_state)
        return self.solver.step(terms, t0, t1, y0, args, solver_state, made_jump)

    def func(self, terms: AbstractTerm, t0: RealScalarLike, y0: Y, args: Args):
        if not isinstance(terms, UserTerms):
            return self.solver.func(terms, t0, y0, args)
        if terms.func is None:
            raise UnsupportedError(
                f"{type(self.solver).__name__}.func could not be evaluated, so the "
                f"first step can't be chosen automatically ({terms.why_func}): pass "
                "`dt0`."
            )
        return terms.func(t0, y0, args)

    def interpolate(self, dense_info: DenseInfo, t0, t1, t) -> PyTree:
        return self.solver.interpolate(dense_info, t0, t1, t)


def _try(convert: Callable[[], Any]) -> tuple[Any, str]:
    """`convert()`, or `None` and why not."""
    try:
        return convert(), ""
    except Exception as e:  # the solver may never need it: say why if it does
        return None, f"{type(e).__name__}: {e}"


def convert(
    solver: AbstractSolver,
    terms: AbstractTerm,
    rate: Callable[[], ClosureTerm],
    t0: Array,
    t1: Array,
    direction: Array | None,
    y0: Y,
    args: Args,
) -> tuple[UserSolver, UserTerms]:
    """A user's solver and terms, converted (times in internal time; `rate` converts
    the terms' vector field, raising where it can't)."""
    wrapped = _wrap(terms, direction)
    init = closure_convert(
        lambda t0, t1, y0, args: _arrays(solver.init(wrapped, t0, t1, y0, args)),
        t0,
        t1,
        y0,
        args,
    )
    state = init.out_struct
    step = closure_convert(
        lambda t0, t1, y0, args, state: solver.step(
            wrapped, t0, t1, y0, args, state, False
        ),
        t0,
        t1,
        y0,
        args,
        state,
    )
    func, why_func = _try(
        lambda: closure_convert(
            lambda t, y, args: solver.func(wrapped, t, y, args), t0, y0, args
        )
    )
    converted_rate, why_rate = _try(rate)
    user_terms = UserTerms(
        init, step, func, converted_rate, why_func, why_rate, isinstance(terms, ODETerm)
    )
    orders = (solver.order(wrapped), solver.error_order(wrapped))
    return UserSolver(solver, orders), user_terms
