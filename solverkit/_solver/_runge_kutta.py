"""Explicit Runge-Kutta solvers: one generic step reading a Butcher tableau."""

from typing import Any, ClassVar, TYPE_CHECKING

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .._custom_types import Args, BoolScalarLike, DenseInfo, RealScalarLike, Y
from .._term import AbstractTerm, MultiTerm, MultiTermStructure
from ._base import AbstractAdaptiveSolver, AbstractSolver, axpy, successful
from ._local_interpolation import (
    AbstractLocalInterpolation,
    dense_weights,
    LocalLinearInterpolation,
    step_fraction,
    ThirdOrderHermitePolynomialInterpolation,
)
from ._multi_tableau import (
    ButcherTableau as DiffraxTableau,
    general_step,
    MultiButcherTableau,
    rows_of,
)
from ._tableau import (
    BOSH3,
    ButcherTableau,
    DOPRI5,
    DOPRI8,
    EULER,
    HEUN,
    MIDPOINT,
    RALSTON,
    TSIT5,
)


if TYPE_CHECKING:  # pyright reads `eqx.AbstractClassVar` as an instance field
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class AbstractRungeKutta(AbstractSolver):
    """An explicit Runge-Kutta method defined by its `tableau`.

    The solver state is the vector field at the current point, so the first stage is
    never evaluated twice (first-same-as-last for FSAL tableaux; for the others the
    evaluation at the end of a step is the next step's first stage, and dense output
    uses it).
    """

    tableau: AbstractClassVar[ButcherTableau]
    # How the stages are computed, as in diffrax: `None` (solverkit's default) unrolls
    # them, so the vector field is traced once per stage; "lax", "checkpointed" or
    # "bounded" compute them in one loop over the stages (diffrax's loop kinds; here
    # one `fori_loop`, which both modes of autodiff go through), so the vector field
    # is traced and compiled once: slower to run for a cheap field, faster to compile
    # for a large one. `BacksolveAdjoint` sets "lax" on its backward solver for small
    # adjoint systems.
    scan_kind: str | None = eqx.field(default=None, static=True)

    def __init_subclass__(cls, **kwargs):
        # A user's subclass on a tableau in diffrax's form: each term is stepped
        # through its own `vf`/`prod`; a `MultiButcherTableau` takes a `MultiTerm`
        # of as many terms.
        super().__init_subclass__(**kwargs)
        tableau = cls.__dict__.get("tableau")
        if isinstance(tableau, _DIFFRAX_FORMS):
            cls.steps_user_terms = True
            multi = isinstance(tableau, MultiButcherTableau)
            if multi and "term_structure" not in cls.__dict__:
                parts = (AbstractTerm,) * len(tableau.tableaus)
                cls.term_structure = MultiTermStructure(parts)

    def __check_init__(self):
        if self.scan_kind not in _SCAN_KINDS:
            raise ValueError(
                f"`scan_kind` must be one of {_SCAN_KINDS}, got {self.scan_kind!r}."
            )

    def order(self, terms: AbstractTerm) -> int | None:
        if isinstance(self.tableau, _DIFFRAX_FORMS):
            return None  # a subclass says (diffrax's default)
        return self.tableau.order

    def error_order(self, terms: AbstractTerm) -> float | None:
        if isinstance(self.tableau, _DIFFRAX_FORMS):
            return self.order(terms)  # diffrax's default
        if self.tableau.embedded_order is None:
            return None
        return min(self.tableau.order, self.tableau.embedded_order) + 1

    def init(
        self,
        terms: AbstractTerm,
        t0: RealScalarLike,
        t1: RealScalarLike,
        y0: Y,
        args: Args,
    ):
        """The vector field at `(t0, y0)`: the first stage of the first step (`None`
        for terms whose `vf` is expensive: diffrax's rule, no first-same-as-last)."""
        if terms.is_vf_expensive(t0, t1, y0, args):
            return None
        return terms.vf(t0, y0, args)

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
        """One step, with diffrax's `dense_info`: `dict(y0=, y1=)` for a first-order
        method, else `dict(y0=, y1=, k=)`, `k` the stage increments `h f_i` stacked on
        a leading axis of each leaf (shape `(stages, *y.shape)`), as
        `interpolation_cls(t0=, t1=, **dense_info)` takes them."""
        del made_jump
        if (
            isinstance(self.tableau, _DIFFRAX_FORMS)
            or isinstance(terms, MultiTerm)
            or solver_state is None
            or terms.is_vf_expensive(t0, t1, y0, args)
        ):
            return self._general_step(terms, t0, t1, y0, args, solver_state)
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        y1, y_error, ks, f1, result = self._stages(
            terms, t0, t1, y0, args, solver_state
        )
        if self.tableau.order == 1:
            return y1, y_error, dict(y0=y0, y1=y1), f1, result
        h = t1 - t0
        k = jtu.tree_map(lambda *f: jnp.stack(f) * h.astype(f[0].dtype), *ks)
        return y1, y_error, dict(y0=y0, y1=y1, k=k), f1, result

    def _general_step(self, terms, t0, t1, y0: Y, args: Args, solver_state):
        """`step` through each term's own `vf` and `prod` (`_multi_tableau.py`): for
        a `MultiButcherTableau`, a `MultiTerm`, an expensive `vf` or no state."""
        tableau = self.tableau
        multi = isinstance(tableau, MultiButcherTableau)
        if multi:
            if not isinstance(terms, MultiTerm) or len(terms.terms) != len(
                tableau.tableaus
            ):
                raise ValueError(
                    f"{type(self).__name__} has {len(tableau.tableaus)} tableaus: it "
                    f"takes a MultiTerm of as many terms, got {terms!r}."
                )
            tabs, parts = tableau.rows, terms.terms
        else:
            tabs, parts = (rows_of(tableau),), (terms,)
        keep = solver_state is not None and not terms.is_vf_expensive(t0, t1, y0, args)
        f0 = None
        if keep and solver_state is not None:
            f0 = list(solver_state) if multi else [solver_state]
        root = None
        if any(tab.implicit for tab in tabs):
            root = (self.root_finder, self.root_find_max_steps)  # pyright: ignore
        y1, y_error, ks, f1, result = general_step(
            tabs, parts, t0, t1, y0, args, f0, root, keep
        )
        stacked = [jtu.tree_map(lambda *k: jnp.stack(k), *kj) for kj in ks]
        state = None if f1 is None else (tuple(f1) if multi else f1[0])
        if multi:
            dense_info = dict(y0=y0, y1=y1, k=tuple(stacked))
        elif getattr(tableau, "order", None) == 1:  # a built-in first-order one
            dense_info = dict(y0=y0, y1=y1)
        else:
            dense_info = dict(y0=y0, y1=y1, k=stacked[0])
        return y1, y_error, dense_info, state, result

    def loop_step(
        self,
        terms: AbstractTerm,
        t0: Array,
        t1: Array,
        y0: Y,
        args: Args,
        solver_state: PyTree,
        made_jump: BoolScalarLike = False,
    ):
        """`step` as the loop takes it, with the stages left unstacked in `dense_info`
        (`fs`, the rates `f_i`) and, for the methods without their own dense output,
        the rates at both ends (`f0`, `f1`: the end's, the next step's first stage)."""
        del made_jump
        y1, y_error, ks, f1, result = self._stages(
            terms, t0, t1, y0, args, solver_state
        )
        if self.tableau.order == 1:  # linear between the steps, as diffrax
            info = dict(y0=y0, y1=y1)
        elif self.tableau.dense is None:
            info = dict(y0=y0, y1=y1, f0=ks[0], f1=f1)
        else:
            info = dict(y0=y0, y1=y1, fs=tuple(ks))
        return y1, y_error, info, f1, result

    def _stages(self, terms: AbstractTerm, t0, t1, y0: Y, args: Args, f0):
        """`(y1, y_error, ks, f1, result)`: the stage rates `ks` and the rate `f1` at
        the step's end (the next step's first stage)."""
        tab = self.tableau
        h = t1 - t0
        num_stages = len(tab.c)
        if self.scan_kind is not None:
            ks = _stages_in_a_loop(tab, terms, t0, h, y0, args, f0)
            if tab.fsal:  # the last stage's argument is the solution
                yi = axpy(y0, h, list(zip(tab.a[-1], ks)))
        else:
            ks = [f0]
            for i in range(1, num_stages):
                yi = axpy(y0, h, list(zip(tab.a[i, :i], ks)))
                ks.append(terms.vf(t0 + float(tab.c[i]) * h, yi, args))
        if tab.fsal:
            y1 = yi  # pyright: ignore
            f1 = ks[-1]
        else:
            y1 = axpy(y0, h, list(zip(tab.b, ks)))
            f1 = terms.vf(t1, y1, args)
        if tab.b_err is None:
            y_error = None
        else:
            zero = jtu.tree_map(jnp.zeros_like, y0)
            y_error = axpy(zero, h, list(zip(tab.b_err, ks)))
        return y1, y_error, ks, f1, successful

    def interpolate(
        self,
        dense_info: DenseInfo,
        t0: Array,
        t1: Array,
        t: RealScalarLike,
    ):
        """The dense output at `t`, from `step`'s or `loop_step`'s `dense_info`."""
        if "fs" in dense_info:
            h = jnp.asarray(t1) - jnp.asarray(t0)
            theta = step_fraction(jnp.asarray(t0), jnp.asarray(t1), t)

            def leaf(y0: Y, *fs):
                w = dense_weights(self.tableau.dense, theta, y0.dtype)
                acc = sum(w[i] * f for i, f in enumerate(fs))
                return y0 + h.astype(y0.dtype) * acc

            return jtu.tree_map(leaf, dense_info["y0"], *dense_info["fs"])
        if "f0" in dense_info:
            cls = ThirdOrderHermitePolynomialInterpolation
        else:  # diffrax's form, from `step`
            cls = self.interpolation_cls or _interpolation_for(
                self.tableau, type(self).__name__
            )
        return cls(t0=t0, t1=t1, **dense_info).evaluate(t)

    def interpolator(self, dense_info: DenseInfo, t0: Array, t1: Array):
        """The dense output of the step `[t0, t1]` as a function of `t`: with the
        loop's `dense_info` and the tableau's own dense output, the polynomial in
        `θ` with its coefficients (sums over the stages, `sum_i dense[i, j] f_i`)
        computed once, so that each evaluation is Horner's rule on them (an
        event's search evaluates it a dozen times a step: the stage weights' own
        polynomials at each `θ` cost several times as much). Else `interpolate`."""
        # (`fs` only where the tableau is solverkit's, with its `dense`: as
        # `interpolate` reads it.)
        dense = self.tableau.dense if "fs" in dense_info else None
        if dense is None:
            return super().interpolator(dense_info, t0, t1)
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = t1 - t0
        dense = np.asarray(dense)

        def coefficients(y0: Y, *fs):
            return [
                sum(float(dense[i, j]) * f for i, f in enumerate(fs) if dense[i, j])
                for j in range(dense.shape[1])
            ]

        coeffs = jtu.tree_map(coefficients, dense_info["y0"], *dense_info["fs"])

        def leaf(y0: Y, cs, theta):
            theta = theta.astype(y0.dtype)
            acc = cs[-1]
            for c in cs[-2::-1]:
                acc = c + theta * acc
            return y0 + h.astype(y0.dtype) * (theta * acc)

        def at(t: RealScalarLike) -> PyTree:
            theta = step_fraction(t0, t1, t)
            # (`coeffs` has a list where `y0` has a leaf.)
            return jtu.tree_map(
                lambda y0, cs: leaf(y0, cs, theta), dense_info["y0"], coeffs
            )

        return at


class AbstractTableauInterpolation(AbstractLocalInterpolation):
    """The dense output of a Runge-Kutta tableau with its own (`tableau.dense`), from
    diffrax's `dense_info`: `y(t0 + θh) = y0 + Σ_i k_i Σ_j dense[i, j] θ^(j+1)`. Each
    solver's subclass (its `interpolation_cls`) fixes the tableau.

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`, `y1`: the solution at its ends.
    - `k`: the stage increments `h f_i`, stacked on a leading axis of each leaf of
        `y0`'s structure (shape `(stages, *y.shape)`), as the solver's `step` gives
        them in `dense_info`.
    """

    tableau: AbstractClassVar[ButcherTableau]
    y0: PyTree
    y1: PyTree
    k: PyTree

    def at(self, t: RealScalarLike) -> PyTree:
        theta = self._theta(t)

        def leaf(y0, k):
            y0, k = jnp.asarray(y0), jnp.asarray(k)
            w = dense_weights(self.tableau.dense, theta, k.dtype)
            return y0 + jnp.tensordot(w, k, axes=1, precision=Precision.HIGHEST)

        return jtu.tree_map(leaf, self.y0, self.k)


def _interpolation_for(tableau: ButcherTableau, name: str):
    """The `interpolation_cls` that reads the `dense_info` of `step` for the method of
    `tableau` (diffrax's for each built-in method): linear for a first-order method,
    cubic Hermite from the first and last stages for one without its own dense output,
    else an `AbstractTableauInterpolation` of `tableau`, named
    `name + "Interpolation"`."""
    if tableau.order == 1:
        return LocalLinearInterpolation
    if tableau.dense is None:
        return ThirdOrderHermitePolynomialInterpolation.from_k
    namespace = dict(
        __module__=__name__,
        __qualname__=f"{name}Interpolation",
        __doc__=f"`{name}`'s dense output, from its `dense_info`.",
        __annotations__={"tableau": ClassVar[ButcherTableau]},
        tableau=tableau,
    )
    return type(f"{name}Interpolation", (AbstractTableauInterpolation,), namespace)


_SCAN_KINDS = (None, "lax", "checkpointed", "bounded")
# Tableaux of a user's subclass written for diffrax: stepped through each term's
# `vf` and `prod` (`_multi_tableau.py`), on the user-solver path.
_DIFFRAX_FORMS = (MultiButcherTableau, DiffraxTableau)


class AbstractERK(AbstractRungeKutta, AbstractAdaptiveSolver):
    """An explicit Runge-Kutta method with an embedded error estimate."""


def _stages_in_a_loop(
    tab, terms: AbstractTerm, t0: RealScalarLike, h, y0: Y, args: Args, f0
) -> list:
    """The stages `k_0 ... k_{s-1}` computed by a `fori_loop` over stages, so that the
    vector field is traced and compiled once rather than once per stage. Slower to
    run for a cheap vector field, faster to compile for a large one (used for the
    adjoint system of `BacksolveAdjoint`)."""
    num_stages = len(tab.c)
    a = np.asarray(tab.a)
    c = np.asarray(tab.c)

    def body(i, stacked):
        def leaf(y: Y, k):
            coeffs = jnp.asarray(a, y.dtype)[i]
            step = jnp.tensordot(coeffs, k, axes=1, precision=Precision.HIGHEST)
            return y + jnp.asarray(h, y.dtype) * step

        yi = jtu.tree_map(leaf, y0, stacked)
        ti = t0 + jnp.asarray(c, h.dtype)[i] * h
        fi = terms.vf(ti, yi, args)
        return jtu.tree_map(lambda k, f: k.at[i].set(f), stacked, fi)

    stacked = jtu.tree_map(
        lambda f: jnp.zeros((num_stages,) + f.shape, f.dtype).at[0].set(f), f0
    )
    stacked = lax.fori_loop(1, num_stages, body, stacked)
    return [jtu.tree_map(lambda k: k[j], stacked) for j in range(num_stages)]


class Euler(AbstractRungeKutta):
    """Explicit Euler: first order, no error estimate (use `ConstantStepSize`)."""

    tableau: ClassVar[ButcherTableau] = EULER
    interpolation_cls: ClassVar[Any] = _interpolation_for(EULER, "Euler")


class Heun(AbstractERK):
    """Heun's method: second order, with an embedded Euler error estimate."""

    tableau: ClassVar[ButcherTableau] = HEUN
    interpolation_cls: ClassVar[Any] = _interpolation_for(HEUN, "Heun")


class Midpoint(AbstractERK):
    """Explicit midpoint method: second order, embedded Euler error estimate."""

    tableau: ClassVar[ButcherTableau] = MIDPOINT
    interpolation_cls: ClassVar[Any] = _interpolation_for(MIDPOINT, "Midpoint")


class Ralston(AbstractERK):
    """Ralston's method: second order with minimal truncation error."""

    tableau: ClassVar[ButcherTableau] = RALSTON
    interpolation_cls: ClassVar[Any] = _interpolation_for(RALSTON, "Ralston")


class Bosh3(AbstractERK):
    """Bogacki-Shampine 3(2): third order, FSAL."""

    tableau: ClassVar[ButcherTableau] = BOSH3
    interpolation_cls: ClassVar[Any] = _interpolation_for(BOSH3, "Bosh3")


class Tsit5(AbstractERK):
    """Tsitouras 5(4): fifth order, FSAL, with its own fourth-order dense output.
    A good default for non-stiff problems."""

    tableau: ClassVar[ButcherTableau] = TSIT5
    interpolation_cls: ClassVar[Any] = _interpolation_for(TSIT5, "Tsit5")


class Dopri5(AbstractERK):
    """Dormand-Prince 5(4): fifth order, FSAL, fourth-order dense output."""

    tableau: ClassVar[ButcherTableau] = DOPRI5
    interpolation_cls: ClassVar[Any] = _interpolation_for(DOPRI5, "Dopri5")


class Dopri8(AbstractERK):
    """Dormand-Prince 8(5,3): eighth order, for tight tolerances."""

    tableau: ClassVar[ButcherTableau] = DOPRI8
    interpolation_cls: ClassVar[Any] = _interpolation_for(DOPRI8, "Dopri8")
