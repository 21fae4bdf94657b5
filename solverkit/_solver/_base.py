"""`AbstractSolver`: the narrow contract every solver fulfils."""

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.lax import Precision
from jaxtyping import PyTree

from .._custom_types import Args, BoolScalarLike, DenseInfo, RealScalarLike, Y
from .._solution import Result, RESULTS
from .._term import AbstractTerm
from .._tolerances import Tolerances
from .._tree import tree_where


def axpy(y: Y, h, terms, row=None) -> Y:
    """`y + h Σ c_i k_i` leafwise, for `terms = [(c_i, k_i), ...]`: the linear
    combination of every Runge-Kutta-type step.

    Each weight `c_i` is either a number (a Python or NumPy float; zeros are skipped),
    weighting `k_i`, a pytree of `y`'s structure; or a NumPy array of per-stage
    weights, for `k_i` stacked along a leading stage axis (summed by one
    `tensordot`): a vector, or a matrix whose traced `row` is used. Pairs with a
    `None` are skipped. The step `h` is cast to each leaf's dtype, so float32 states
    stay float32 under float64 time; with `h=None` the terms are added to `y` one by
    one, unscaled.
    """
    terms = [
        (c, k)
        for c, k in terms
        if c is not None and k is not None and not (np.ndim(c) == 0 and c == 0)
    ]
    if not terms:
        return y

    def leaf(y_leaf, *ks):
        acc = y_leaf if h is None else None
        for (c, _), k in zip(terms, ks):
            if np.ndim(c) == 0:
                term = float(c) * k
            else:
                w = jnp.asarray(c, y_leaf.dtype)
                w = w if row is None else w[row]
                term = jnp.tensordot(w, k, axes=1, precision=Precision.HIGHEST)
            acc = term if acc is None else acc + term
        if h is None:
            return acc
        assert acc is not None  # `terms` is not empty
        return y_leaf + jnp.asarray(h, dtype=y_leaf.dtype) * acc

    return jtu.tree_map(leaf, y, *[k for _, k in terms])


class _SolverMeta(type(eqx.Module)):
    # diffrax's contract for wrappers (`AbstractWrappedSolver`): `isinstance(w, C)`
    # holds for a wrapper `w` whose wrapped `w.solver` is a `C`, so that e.g.
    # `HalfSolver(Euler())` counts as an `Euler`. The engine's own type tests go by
    # `type(solver)` where the wrapper must not pass for what it wraps.
    def __instancecheck__(cls, obj):
        if type.__instancecheck__(cls, obj):
            return True
        inner = getattr(obj, "solver", None)
        return (
            type.__instancecheck__(AbstractWrappedSolver, obj)
            and inner is not None
            and isinstance(inner, cls)
        )


# Given to `class` by keyword, so that pyright still sees a dataclass (as diffrax).
_META = dict(metaclass=_SolverMeta)


class AbstractSolver(eqx.Module, **_META):
    """Base class of the solvers: diffrax's protocol, used by the built-in solvers and
    by a user's own subclass alike.

    A subclass defines `step` and, unless it overrides `interpolate`,
    `interpolation_cls`; `order` (default `None`, as diffrax's), `init`, `func`,
    `error_order` and `term_structure` have defaults. A step never raises: it returns
    the new state, an error estimate, what dense output needs, and a result code.
    """

    # The terms the solver takes: a term class, or a tuple of them for a `MultiTerm`
    # (e.g. `MultiTerm[tuple[ODETerm, ODETerm]]` for an IMEX solver).
    term_structure: ClassVar[Any] = AbstractTerm
    # Builds the dense output of one step as `interpolation_cls(t0=, t1=,
    # **dense_info)` (see `_local_interpolation.py`).
    interpolation_cls: ClassVar[Callable[..., Any] | None] = None
    # Whether the solver is given the user's terms themselves (each in a `WrapTerm`)
    # rather than each term's converted `dy/dt`: for terms that are not each a rate
    # of the whole state (`SemiImplicitEuler`), or a step that needs each term's
    # `vf` and `prod` (a multi-tableau Runge-Kutta method). A user's own solver always
    # is (`_user_solver.is_user_solver`).
    steps_user_terms: ClassVar[bool] = False

    def order(self, terms: AbstractTerm) -> int | None:
        """Order of the solver for ODEs (`None`: not known, diffrax's default)."""
        del terms
        return None

    def error_order(self, terms: AbstractTerm) -> float | None:
        """Local order of the error estimate used by adaptive step sizes (diffrax's
        default: the solver's order)."""
        return self.order(terms)

    def bind_controller_tols(self, tolerances: Tolerances | None) -> "AbstractSolver":
        """This solver, with whatever it takes from the step-size controller filled
        in (an implicit solver's root-finder tolerances); called once by
        `diffeqsolve` before the solve, with `stepsize_controller.tolerances()`
        (`None` for a controller without tolerances). The default changes nothing."""
        del tolerances
        return self

    def revert(
        self, accepted: BoolScalarLike, new_state: PyTree, old_state: PyTree
    ) -> PyTree:
        """The state to go on from after a step: `new_state` where the step was
        `accepted`, else `old_state` (the default) or, for a solver that keeps a cache
        across a rejection (a Jacobian, a factorisation), `old_state` with the
        cache of `new_state`. Called by the step loop after every step."""
        return tree_where(accepted, new_state, old_state)

    def func(
        self, terms: AbstractTerm, t0: RealScalarLike, y0: Y, args: Args
    ) -> PyTree:
        """The vector field at `(t0, y0)`."""
        return terms.vf(t0, y0, args)

    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
    ) -> PyTree:
        """Initial solver state (default: none)."""
        del terms, t0, t1, y0, args
        return None

    @abc.abstractmethod
    def step(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
        solver_state: PyTree,
        made_jump: BoolScalarLike,
    ) -> tuple[Y, Y | None, PyTree, PyTree, Result]:
        """One step from `t0` to `t1`.

        **Returns:**

        `(y1, y_error, dense_info, solver_state, result)`; `y_error` is `None` for a
        solver without an error estimate.
        """

    def loop_step(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
        solver_state: PyTree,
        made_jump: BoolScalarLike,
    ) -> tuple[Y, Y | None, PyTree, PyTree, Result]:
        """`step` as `diffeqsolve`'s loop takes it: the same outputs, but `dense_info`
        in whatever form `interpolate` reads (a built-in solver may keep a cheaper
        form there than the one its `step` gives). Default: `step`."""
        return self.step(terms, t0, t1, y0, args, solver_state, made_jump)

    def interpolate(
        self,
        dense_info: DenseInfo,
        t0: RealScalarLike,
        t1: RealScalarLike,
        t: RealScalarLike,
    ) -> PyTree:
        """Evaluate the dense output of one step `[t0, t1]` at `t`."""
        if self.interpolation_cls is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no dense output: set its "
                "`interpolation_cls` (e.g. `LocalLinearInterpolation`) or override "
                "`interpolate`."
            )
        return self.interpolation_cls(t0=t0, t1=t1, **dense_info).evaluate(t)

    def interpolator(
        self, dense_info: DenseInfo, t0: RealScalarLike, t1: RealScalarLike
    ) -> Callable[[RealScalarLike], PyTree]:
        """The dense output of one step `[t0, t1]` as a function of `t`, for many
        evaluations on the same step (the search for an event's crossing): the
        same values as `interpolate` (to rounding), but a solver may compute what
        the evaluations share once, here. Default: `interpolate` at each `t`."""
        return lambda t: self.interpolate(dense_info, t0, t1, t)


successful = RESULTS.successful


class AbstractAdaptiveSolver(AbstractSolver):
    """Base class of the solvers with an embedded error estimate, which can be used
    with an adaptive controller such as `PIDController`."""


class AbstractWrappedSolver(AbstractSolver):
    """A solver that wraps another, `solver`, transparently to `isinstance`
    (diffrax's): `isinstance(wrapper, C)` holds when `wrapper.solver` is a `C`."""

    solver: eqx.AbstractVar[AbstractSolver]


class AbstractImplicitSolver(AbstractAdaptiveSolver):
    """Base class of the implicit solvers (diffrax's): each has a `root_finder` for
    its implicit stages and `root_find_max_steps`. The built-in ESDIRK and IMEX
    solvers are subclasses; so may a user's solver be, declaring both fields."""

    root_finder: eqx.AbstractVar[Any]
    root_find_max_steps: eqx.AbstractVar[int]
