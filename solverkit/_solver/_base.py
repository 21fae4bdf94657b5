"""`AbstractSolver`: the narrow contract every solver fulfils."""

import abc
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._select import where
from .._solution import RESULTS
from .._term import ODETerm


def axpy(y, h, terms):
    """`y + h * Σ c_i k_i` leafwise, for `terms = [(c_i, k_i), ...]` (zeros skipped).

    The time step `h` is cast to each leaf's dtype, so float32 states stay float32
    under float64 time.
    """
    terms = [(c, k) for c, k in terms if c != 0]
    if not terms:
        return y

    def leaf(y_leaf, *ks):
        acc = None
        for (c, _), k in zip(terms, ks):
            term = float(c) * k
            acc = term if acc is None else acc + term
        return y_leaf + jnp.asarray(h, dtype=y_leaf.dtype) * acc

    return jtu.tree_map(leaf, y, *[k for _, k in terms])


class AbstractSolver(eqx.Module):
    """Base class of solverkit's solvers.

    A step never raises: it returns the new state, an error estimate, what dense
    output needs, and a result code.
    """

    term_structure: ClassVar[Any] = ODETerm

    @abc.abstractmethod
    def order(self, terms) -> int:
        """Order of the solver for ODEs."""

    @abc.abstractmethod
    def error_order(self, terms) -> float | None:
        """Local order of the error estimate (`None` if there is none)."""

    def strong_order(self, terms) -> None:
        return None

    def bind_controller_tols(self, stepsize_controller) -> "AbstractSolver":
        """This solver, with whatever it takes from the step-size controller filled
        in (an implicit solver's root-finder tolerances); called once by
        `diffeqsolve` before the solve. The default changes nothing."""
        del stepsize_controller
        return self

    def func(self, terms, t0, y0, args) -> PyTree:
        """The vector field at `(t0, y0)`."""
        return terms.vf(t0, y0, args)

    def init(self, terms, t0, t1, y0, args) -> PyTree:
        """Initial solver state: the vector field at `(t0, y0)`."""
        del t1
        return terms.vf(t0, y0, args)

    @abc.abstractmethod
    def step(self, terms, t0, t1, y0, args, solver_state, made_jump=False):
        """One step from `t0` to `t1`.

        **Returns:**

        `(y1, y_error, dense_info, solver_state, result)`; `y_error` is `None` for a
        solver without an error estimate.
        """

    def interpolate(self, dense_info, t0, t1, t) -> PyTree:
        """Evaluate the dense output of one step `[t0, t1]` at `t` (cubic Hermite)."""
        h = t1 - t0
        theta = (t - t0) / where(h == 0, 1, h)
        return hermite(dense_info, h, theta)


def hermite(info, h, theta):
    """Cubic Hermite interpolation from `y0, y1, f0, f1` at fraction `theta`."""

    def leaf(y0, y1, f0, f1):
        th = jnp.asarray(theta, dtype=y0.dtype)
        hh = jnp.asarray(h, dtype=y0.dtype)
        h00 = (1 + 2 * th) * (1 - th) ** 2
        h10 = th * (1 - th) ** 2
        h01 = th**2 * (3 - 2 * th)
        h11 = th**2 * (th - 1)
        return h00 * y0 + h10 * hh * f0 + h01 * y1 + h11 * hh * f1

    return jtu.tree_map(leaf, info["y0"], info["y1"], info["f0"], info["f1"])


successful = RESULTS.successful


class AbstractAdaptiveSolver(AbstractSolver):
    """Base class of the solvers with an embedded error estimate, which can be used
    with an adaptive controller such as `PIDController`."""
