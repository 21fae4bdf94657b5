"""Dense output: the solution between the steps of a solve."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._custom_types import RealScalarLike
from .._select import where
from .._solver import AbstractSolver
from .._time import flip


class DenseInterpolation(eqx.Module):
    """The solution of a solve at any time in `[t0, t1]`, from each accepted step's
    own dense output (cubic Hermite for solvers without one).

    Made by `diffeqsolve(..., saveat=SaveAt(dense=True))`; use
    `Solution.evaluate` / `Solution.derivative`.
    """

    ts: Array  # internal times of the step boundaries, padded with inf
    infos: PyTree  # per-step dense information, stacked
    num_steps: Array  # number of accepted steps
    direction: Array | None
    solver: AbstractSolver
    y0: PyTree  # returned when no step was taken (t0 == t1)
    # The end of the interval each step's information covers where it is not the
    # next boundary (a step cut short at an event's occurrence); None: all are.
    ends: Array | None = None

    def _evaluate(self, t: RealScalarLike) -> PyTree:
        tau = flip(self.direction, t)
        tau = jnp.asarray(tau, self.ts.dtype)
        last = jnp.maximum(self.num_steps - 1, 0)
        index = jnp.clip(jnp.searchsorted(self.ts, tau, side="left") - 1, 0, last)
        info = jtu.tree_map(
            lambda b: lax.dynamic_index_in_dim(b, index, keepdims=False), self.infos
        )
        end = self.ts[index + 1] if self.ends is None else self.ends[index]
        t1 = where(self.num_steps == 0, self.ts[0], end)
        y = self.solver.interpolate(info, self.ts[index], t1, tau)
        return jtu.tree_map(lambda a, b: where(self.num_steps == 0, b, a), y, self.y0)

    def evaluate(self, t0: RealScalarLike, t1: RealScalarLike | None = None) -> PyTree:
        """`y(t0)`, or `y(t1) - y(t0)` when `t1` is given."""
        with jax.numpy_dtype_promotion("standard"):  # see `diffeqsolve`
            if t1 is not None:
                return jtu.tree_map(
                    lambda a, b: a - b, self._evaluate(t1), self._evaluate(t0)
                )
            return self._evaluate(t0)

    def derivative(self, t: RealScalarLike) -> PyTree:
        """`dy/dt` at `t`."""
        with jax.numpy_dtype_promotion("standard"):
            t = jnp.asarray(t, self.ts.dtype)
            _, dy = jax.jvp(self._evaluate, (t,), (jnp.ones_like(t),))
            return dy
