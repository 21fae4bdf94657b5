"""`LeapfrogMidpoint`: the explicit two-step midpoint (leapfrog) method."""

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._custom_types import Args, BoolScalarLike, RealScalarLike, Y
from .._term import AbstractTerm
from ._base import AbstractSolver, successful
from ._local_interpolation import LocalLinearInterpolation


class LeapfrogMidpoint(AbstractSolver):
    """The leapfrog (explicit midpoint) method `y_{n+1} = y_{n-1} + (t_{n+1} -
    t_{n-1}) f(t_n, y_n)`, started by an Euler step: second order, no error estimate
    (use `ConstantStepSize`). Its state is the previous point. Linear dense output.
    """

    interpolation_cls = LocalLinearInterpolation

    def order(self, terms: AbstractTerm) -> int:
        return 2

    def error_order(self, terms: AbstractTerm) -> None:
        return None

    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
    ):
        del terms, t1, args
        return t0, y0

    def step(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
        solver_state: PyTree,
        made_jump: BoolScalarLike = False,
    ):
        del made_jump
        t_prev, y_prev = solver_state
        f0 = terms.vf(t0, y0, args)
        span = jnp.asarray(t1) - jnp.asarray(t_prev)  # Python floats by hand
        y1 = jtu.tree_map(lambda a, f: a + span.astype(a.dtype) * f, y_prev, f0)
        return y1, None, dict(y0=y0, y1=y1), (t0, y0), successful
