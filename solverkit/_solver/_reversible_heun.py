"""`ReversibleHeun`: an algebraically reversible second-order method."""

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._custom_types import Args, BoolScalarLike, RealScalarLike, Y
from .._term import AbstractTerm
from ._base import AbstractAdaptiveSolver, successful
from ._local_interpolation import LocalLinearInterpolation


class ReversibleHeun(AbstractAdaptiveSolver):
    """The reversible Heun method (Kidger et al., 2021): second order, with an
    error estimate, and algebraically reversible. Its state carries a second copy of
    the solution, `yhat`, besides the vector field. Linear dense output.
    """

    interpolation_cls = LocalLinearInterpolation

    def order(self, terms: AbstractTerm) -> int:
        return 2

    def error_order(self, terms: AbstractTerm) -> float:
        return 2

    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
    ):
        del t1
        return y0, terms.vf(t0, y0, args)

    def step(
        self,
        terms: AbstractTerm,
        t0: Array,
        t1: Array,
        y0: Y,
        args: Args,
        solver_state: PyTree,
        made_jump: BoolScalarLike = False,
    ):
        del made_jump
        yhat0, f0 = solver_state
        h = jnp.asarray(t1) - jnp.asarray(t0)  # Python-float times called by hand
        cast = lambda x: h.astype(x.dtype)
        yhat1 = jtu.tree_map(lambda y, z, f: 2 * y - z + cast(y) * f, y0, yhat0, f0)
        f1 = terms.vf(t1, yhat1, args)
        y1 = jtu.tree_map(lambda y, a, b: y + cast(y) / 2 * (a + b), y0, f0, f1)
        y_error = jtu.tree_map(lambda a, b: cast(a) / 2 * (b - a), f0, f1)
        return y1, y_error, dict(y0=y0, y1=y1), (yhat1, f1), successful
