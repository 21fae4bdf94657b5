"""Explicit Runge-Kutta solvers: one generic step reading a Butcher tableau."""

import functools
from typing import Any, ClassVar, TYPE_CHECKING

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .._custom_types import Args, BoolScalarLike, DenseInfo, RealScalarLike, Y
from .._term import AbstractTerm
from ._base import AbstractAdaptiveSolver, AbstractSolver, axpy, successful
from ._local_interpolation import (
    AbstractLocalInterpolation,
    LocalLinearInterpolation,
    ThirdOrderHermitePolynomialInterpolation,
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

    def __check_init__(self):
        if self.scan_kind not in _SCAN_KINDS:
            raise ValueError(
                f"`scan_kind` must be one of {_SCAN_KINDS}, got {self.scan_kind!r}."
            )

    def order(self, terms: AbstractTerm) -> int:
        return self.tableau.order

    def error_order(self, terms: AbstractTerm) -> float | None:
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
        """The vector field at `(t0, y0)`: the first stage of the first step."""
        del t1
        return terms.vf(t0, y0, args)

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
        tab = self.tableau
        h = t1 - t0
        num_stages = len(tab.c)
        if self.scan_kind is not None:
            ks = _stages_in_a_loop(tab, terms, t0, h, y0, args, solver_state)
            if tab.fsal:  # the last stage's argument is the solution
                yi = axpy(y0, h, list(zip(tab.a[-1], ks)))
        else:
            ks = [solver_state]
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
        return y1, y_error, self._dense_info(y0, y1, ks, f1), f1, successful

    def _dense_info(self, y0: Y, y1: Y, ks, f1) -> dict:
        if self.tableau.order == 1:  # linear between the steps, as diffrax
            return dict(y0=y0, y1=y1)
        if self.tableau.dense is None:
            return dict(y0=y0, y1=y1, f0=ks[0], f1=f1)
        return dict(y0=y0, y1=y1, k=tuple(ks))

    def interpolate(
        self,
        dense_info: DenseInfo,
        t0: Array,
        t1: Array,
        t: RealScalarLike,
    ):
        if "k" in dense_info:
            cls = functools.partial(TableauInterpolation, tableau=self.tableau)
        elif "f0" in dense_info:
            cls = ThirdOrderHermitePolynomialInterpolation
        else:
            cls = LocalLinearInterpolation
        return cls(t0=t0, t1=t1, **dense_info).evaluate(t)


class TableauInterpolation(AbstractLocalInterpolation):
    """The dense output of a Runge-Kutta tableau with its own (`tableau.dense`):
    `y(t0 + θh) = y0 + h Σ_i k_i Σ_j dense[i, j] θ^(j+1)`.

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`, `y1`: the solution at its ends.
    - `k`: the stages `f_i` (a tuple of pytrees of `y0`'s structure), as the
        solver's `dense_info` gives them.
    - `tableau`: the `ButcherTableau`.
    """

    y0: PyTree
    y1: PyTree
    k: tuple
    tableau: ButcherTableau = eqx.field(static=True)

    def at(self, t: RealScalarLike) -> PyTree:
        h = jnp.asarray(self.t1) - jnp.asarray(self.t0)
        theta = self._theta(t)
        dense = self.tableau.dense
        assert dense is not None

        def leaf(y0: Y, *ks):
            th = jnp.asarray(theta, dtype=y0.dtype)
            # Each stage's weight, the polynomial `sum_j dense[i, j] theta^(j+1)`,
            # by Horner's rule: multiplications only (no float `power`), one pass.
            column = lambda j: jnp.asarray(np.asarray(dense)[:, j], dtype=y0.dtype)
            weights = column(-1)
            for j in range(dense.shape[1] - 2, -1, -1):
                weights = column(j) + th * weights
            weights = th * weights
            acc = sum(weights[i] * k for i, k in enumerate(ks))
            return y0 + jnp.asarray(h, dtype=y0.dtype) * acc

        return jtu.tree_map(leaf, self.y0, *self.k)


def _interpolation_for(tableau: ButcherTableau):
    """The `interpolation_cls` of the solver of `tableau`, matching the keys of its
    `dense_info` (see `AbstractRungeKutta._dense_info`)."""
    if tableau.order == 1:
        return LocalLinearInterpolation
    if tableau.dense is None:
        return ThirdOrderHermitePolynomialInterpolation
    return functools.partial(TableauInterpolation, tableau=tableau)


_SCAN_KINDS = (None, "lax", "checkpointed", "bounded")


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
    interpolation_cls: ClassVar[Any] = _interpolation_for(EULER)


class Heun(AbstractERK):
    """Heun's method: second order, with an embedded Euler error estimate."""

    tableau: ClassVar[ButcherTableau] = HEUN
    interpolation_cls: ClassVar[Any] = _interpolation_for(HEUN)


class Midpoint(AbstractERK):
    """Explicit midpoint method: second order, embedded Euler error estimate."""

    tableau: ClassVar[ButcherTableau] = MIDPOINT
    interpolation_cls: ClassVar[Any] = _interpolation_for(MIDPOINT)


class Ralston(AbstractERK):
    """Ralston's method: second order with minimal truncation error."""

    tableau: ClassVar[ButcherTableau] = RALSTON
    interpolation_cls: ClassVar[Any] = _interpolation_for(RALSTON)


class Bosh3(AbstractERK):
    """Bogacki-Shampine 3(2): third order, FSAL."""

    tableau: ClassVar[ButcherTableau] = BOSH3
    interpolation_cls: ClassVar[Any] = _interpolation_for(BOSH3)


class Tsit5(AbstractERK):
    """Tsitouras 5(4): fifth order, FSAL, with its own fourth-order dense output.
    A good default for non-stiff problems."""

    tableau: ClassVar[ButcherTableau] = TSIT5
    interpolation_cls: ClassVar[Any] = _interpolation_for(TSIT5)


class Dopri5(AbstractERK):
    """Dormand-Prince 5(4): fifth order, FSAL, fourth-order dense output."""

    tableau: ClassVar[ButcherTableau] = DOPRI5
    interpolation_cls: ClassVar[Any] = _interpolation_for(DOPRI5)


class Dopri8(AbstractERK):
    """Dormand-Prince 8(5,3): eighth order, for tight tolerances."""

    tableau: ClassVar[ButcherTableau] = DOPRI8
    interpolation_cls: ClassVar[Any] = _interpolation_for(DOPRI8)
