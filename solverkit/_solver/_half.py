"""`HalfSolver`: an error estimate for any solver, from two half steps."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._custom_types import Args, BoolScalarLike, DenseInfo, RealScalarLike, Y
from .._solution import Result, RESULTS
from .._term import AbstractTerm
from .._tolerances import Tolerances
from ._base import AbstractAdaptiveSolver, AbstractSolver, AbstractWrappedSolver


class HalfSolver(AbstractAdaptiveSolver, AbstractWrappedSolver):
    """Wraps a solver to give it an error estimate (diffrax's `HalfSolver`): each
    step is also taken as two half steps, and the error estimate is the
    difference `|y1_halves - y1_full|`. The step goes on from the two half steps,
    so it costs three steps of the wrapped solver; the dense output is the full
    step's. `isinstance(HalfSolver(s), type(s))` holds, as in diffrax.

    Use it with an adaptive controller for a solver without an error estimate of
    its own (`Euler`, `SemiImplicitEuler`, a user's solver).

    **Arguments:**

    - `solver`: the solver to wrap.
    """

    solver: AbstractSolver

    def __check_init__(self):
        if not isinstance(self.solver, AbstractSolver):
            raise TypeError(
                f"HalfSolver(solver): `solver` must be a solver, got {self.solver!r}."
            )

    @property
    def term_structure(self) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.solver.term_structure

    @property
    def interpolation_cls(self) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.solver.interpolation_cls

    def order(self, terms: AbstractTerm) -> int | None:
        return self.solver.order(terms)

    def error_order(self, terms: AbstractTerm) -> float | None:
        """The wrapped solver's order plus one (the local error of one step)."""
        order = self.solver.order(terms)
        return None if order is None else order + 1

    def bind_controller_tols(self, tolerances: Tolerances | None) -> "HalfSolver":
        return HalfSolver(self.solver.bind_controller_tols(tolerances))

    def revert(self, accepted: BoolScalarLike, new_state, old_state) -> PyTree:
        return self.solver.revert(accepted, new_state, old_state)

    def func(self, terms: AbstractTerm, t0: RealScalarLike, y0: Y, args: Args):
        return self.solver.func(terms, t0, y0, args)

    def init(self, terms: AbstractTerm, t0, t1, y0: Y, args: Args) -> PyTree:
        return self.solver.init(terms, t0, t1, y0, args)

    def step(self, terms, t0, t1, y0: Y, args: Args, solver_state, made_jump):
        """Two half steps, and one full step for the error estimate and the dense
        output (diffrax's `dense_info`, the wrapped solver's `step`'s)."""
        return _halves(
            self.solver.step, terms, t0, t1, y0, args, solver_state, made_jump
        )

    def loop_step(self, terms, t0, t1, y0: Y, args: Args, solver_state, made_jump):
        """`step`, with the wrapped solver's `loop_step` (its loop's `dense_info`)."""
        step = self.solver.loop_step
        return _halves(step, terms, t0, t1, y0, args, solver_state, made_jump)

    def interpolate(self, dense_info: DenseInfo, t0, t1, t) -> PyTree:
        return self.solver.interpolate(dense_info, t0, t1, t)


def _halves(step, terms, t0, t1, y0: Y, args: Args, state, made_jump):
    """`(y1, y_error, dense_info, state, result)` of a `HalfSolver` step, `step`
    being the wrapped solver's."""
    t_half = t0 + 0.5 * (t1 - t0)
    y_half, _, _, state_half, result1 = step(
        terms, t0, t_half, y0, args, state, made_jump
    )
    y1, _, _, state1, result2 = step(terms, t_half, t1, y_half, args, state_half, False)
    y1_full, _, dense_info, _, result3 = step(terms, t0, t1, y0, args, state, made_jump)
    y_error = jtu.tree_map(lambda a, b: jnp.abs(a - b), y1, y1_full)
    result = _first_failure(result1, _first_failure(result2, result3))
    return y1, y_error, dense_info, state1, result


def _first_failure(a: Result, b: Result) -> Result:
    """`a` if it is a failure, else `b` (diffrax's `update_result`)."""
    return RESULTS.where(a == RESULTS.successful, b, a)
