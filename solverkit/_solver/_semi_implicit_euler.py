"""`SemiImplicitEuler`: the symplectic Euler method for a partitioned system."""

from typing import Any, ClassVar

import jax.tree_util as jtu
from jaxtyping import PyTree

from .._custom_types import Args, BoolScalarLike, RealScalarLike
from .._term import AbstractTerm
from ._base import AbstractSolver, successful
from ._local_interpolation import LocalLinearInterpolation


class SemiImplicitEuler(AbstractSolver):
    """Semi-implicit (symplectic) Euler for `y = (a, b)` with `da/dt = f(t, b)`,
    `db/dt = g(t, a)` (diffrax's): `a1 = a0 + h f(t0, b0)`, then
    `b1 = b0 + h g(t0, a1)`. First order, symplectic, no error estimate (wrap it in
    `HalfSolver` for adaptive steps); linear dense output.

    It takes a plain tuple of two terms, `diffeqsolve((ODETerm(f), ODETerm(g)),
    SemiImplicitEuler(), ..., y0=(a0, b0))`: `f` is called with `b` and returns
    `da/dt`, `g` with `a`, returning `db/dt`. Each term receives the part of the state
    it acts on, not the whole state, so the terms are stepped as diffrax steps them
    (closure-converted with the step, as a user's solver's are).
    """

    term_structure: ClassVar[Any] = (AbstractTerm, AbstractTerm)
    interpolation_cls: ClassVar[Any] = LocalLinearInterpolation
    # Its terms are not each `dy/dt` of the whole state: step them as given.
    steps_user_terms: ClassVar[bool] = True

    def order(self, terms: Any) -> int:
        return 1

    def init(self, terms: Any, t0, t1, y0: Any, args: Args) -> None:
        return None

    def step(
        self,
        terms: Any,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: tuple[PyTree, PyTree],
        args: Args,
        solver_state: None,
        made_jump: BoolScalarLike,
    ):
        """One step; `dense_info` is `dict(y0=, y1=)`."""
        del solver_state, made_jump
        term_a, term_b = terms
        a0, b0 = y0
        da = term_a.vf_prod(t0, b0, args, term_a.contr(t0, t1))
        a1 = jtu.tree_map(lambda x, d: x + d, a0, da)
        db = term_b.vf_prod(t0, a1, args, term_b.contr(t0, t1))
        b1 = jtu.tree_map(lambda x, d: x + d, b0, db)
        y1 = (a1, b1)
        return y1, None, dict(y0=y0, y1=y1), None, successful

    def func(self, terms: Any, t0: RealScalarLike, y0: tuple, args: Args) -> tuple:
        """`(da/dt, db/dt)` at `(t0, y0)`."""
        term_a, term_b = terms
        a0, b0 = y0
        return term_a.vf(t0, b0, args), term_b.vf(t0, a0, args)
