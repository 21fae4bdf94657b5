"""Implicit (ESDIRK) and IMEX Runge--Kutta solvers: one generic step reading an
`ImplicitTableau`.

Per step: the Jacobian of the implicit term is the one carried in the solver state
(taken at the start of the step, so a rejected step's retry reuses it), one LU of
`I - γh J` serves every stage and every chord iteration, and each stage's root gets
exact derivatives from the implicit function theorem (`_root_finder.implicit_root`).
"""

from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._select import where
from .._solution import RESULTS
from ._base import AbstractAdaptiveSolver, axpy
from ._implicit_tableau import (
    IMPLICIT_EULER,
    ImplicitTableau,
    KVAERNO3,
    KVAERNO4,
    KVAERNO5,
)
from ._linalg import factorise, jacobian
from ._root_finder import (
    bind_tols,
    chord,
    DIVERGED,
    implicit_root,
    NOT_CONVERGED,
    optx_solve,
    Stage,
    SUCCESS,
    VeryChord,
    with_stepsize_controller_tols,
)


class ImplicitState(NamedTuple):
    """What a step starts from: the fields at `(t0, y0)`, and the implicit term's
    Jacobian there (`None` with an optimistix root finder, which takes its own)."""

    f_explicit: PyTree | None
    f_implicit: PyTree
    jac: Array | None
    eta: Array  # the chord iteration's convergence factor, carried between stages


def _nograd(tree):
    dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
    return eqx.combine(lax.stop_gradient(dynamic), static)


def _add(a, b):
    return jtu.tree_map(jnp.add, a, b)


class AbstractImplicitRK(AbstractAdaptiveSolver):
    """An ESDIRK (or IMEX additive) Runge--Kutta method read from its `tableau`."""

    tableau: ClassVar[ImplicitTableau]
    root_finder: Any = with_stepsize_controller_tols(VeryChord)()
    root_find_max_steps: int = 10

    def order(self, terms) -> int:
        return self.tableau.order

    def error_order(self, terms) -> float | None:
        return self.tableau.embedded_order + 1

    def bind_controller_tols(self, stepsize_controller) -> "AbstractImplicitRK":
        finder = bind_tols(self.root_finder, stepsize_controller, type(self).__name__)
        return eqx.tree_at(lambda s: s.root_finder, self, finder)

    def _terms(self, terms) -> tuple[Any, Any]:
        """`(explicit term or None, implicit term)`."""
        if not self.tableau.imex:
            return None, terms
        parts = getattr(terms, "terms", None)
        if parts is None or len(parts) != 2:
            raise ValueError(
                f"{type(self).__name__} is an IMEX solver: pass "
                "`terms=MultiTerm(ODETerm(explicit_field), ODETerm(implicit_field))`."
            )
        return parts[0], parts[1]

    def _uses_chord(self) -> bool:
        return isinstance(self.root_finder, VeryChord)

    def _start(self, terms, t, y, args, f_implicit=None) -> ImplicitState:
        ex, im = self._terms(terms)
        f_ex = None if ex is None else ex.vf(t, y, args)
        if f_implicit is None:
            f_implicit = im.vf(t, y, args)
        jac = None
        if self._uses_chord():
            vf = _nograd(im)
            jac, _ = jacobian(lambda s, x: vf.vf(s, x, _nograd(args)), *_nograd((t, y)))
        eta = jnp.asarray(1.0, jnp.result_type(*jtu.tree_leaves(y)))
        return ImplicitState(f_ex, f_implicit, jac, jnp.real(eta))

    def func(self, terms, t0, y0, args) -> PyTree:
        ex, im = self._terms(terms)
        f = im.vf(t0, y0, args)
        return f if ex is None else _add(ex.vf(t0, y0, args), f)

    def init(self, terms, t0, t1, y0, args) -> ImplicitState:
        del t1
        return self._start(terms, t0, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump=False):
        del made_jump
        tab = self.tableau
        ex, im = self._terms(terms)
        h = t1 - t0
        state: ImplicitState = solver_state
        lus = {}
        if self._uses_chord():
            jac = lax.stop_gradient(state.jac)
            lus = {g: factorise(jac, g * h) for g in tab.diagonals}
        k_im, k_ex = [state.f_implicit], [state.f_explicit]
        status = jnp.asarray(SUCCESS)
        eta = state.eta
        z = y0
        for i in range(1, tab.num_stages):
            ti = t1 if tab.c[i] == 1 else t0 + float(tab.c[i]) * h
            pairs = list(zip(tab.a_im[i, :i], k_im))
            if ex is not None:
                pairs += list(zip(tab.a_ex[i, :i], k_ex))  # pyright: ignore
            psi = axpy(y0, h, pairs)
            gamma = float(tab.a_im[i, i])
            guess = axpy(psi, gamma * h, list(zip(tab.predictor[i, :i], k_im)))
            stage = Stage(im, ti, psi, gamma * h, args)
            z, stage_status, eta = self._solve(stage, guess, lus.get(gamma), eta)
            status = where(status == SUCCESS, stage_status, status)
            z = implicit_root(z, stage)
            k_im.append(
                jtu.tree_map(
                    lambda zi, p: (zi - p) / jnp.asarray(gamma * h, zi.dtype), z, psi
                )
            )
            if ex is not None:
                k_ex.append(ex.vf(ti, z, args))
        return self._finish(terms, t1, y0, h, args, z, k_im, k_ex, status, eta)

    def _solve(self, stage, guess, lu, eta):
        if lu is None:
            z, status = optx_solve(
                self.root_finder,
                _nograd(stage),
                _nograd(guess),
                self.root_find_max_steps,
            )
            return z, status, eta
        eta0 = jnp.maximum(eta, jnp.finfo(eta.dtype).eps) ** 0.8
        return chord(
            self.root_finder,
            _nograd(stage),
            _nograd(guess),
            lu,
            eta0,
            self.root_find_max_steps,
        )

    def _finish(self, terms, t1, y0, h, args, z, k_im, k_ex, status, eta):
        tab = self.tableau
        imex = k_ex[0] is not None
        if tab.stiffly_accurate:
            y1 = z
            f_implicit1 = k_im[-1]  # = f(t1, y1) at the root
        else:
            pairs = list(zip(tab.b_im, k_im))
            if imex:
                pairs += list(zip(tab.b_ex, k_ex))  # pyright: ignore
            y1 = axpy(y0, h, pairs)
            f_implicit1 = None
        zero = jtu.tree_map(jnp.zeros_like, y0)
        pairs = list(zip(tab.b_err_im, k_im))
        if imex:
            pairs += list(zip(tab.b_err_ex, k_ex))  # pyright: ignore
        y_error = axpy(zero, h, pairs)
        ok = status == SUCCESS
        y_error = jtu.tree_map(lambda e: where(ok, e, jnp.inf), y_error)
        new_state = self._start(terms, t1, y1, args, f_implicit1)
        new_state = new_state._replace(eta=eta)
        f0 = k_im[0] if not imex else _add(k_ex[0], k_im[0])
        f1 = new_state.f_implicit
        if imex:
            f1 = _add(new_state.f_explicit, f1)
        dense_info = dict(y0=y0, y1=y1, f0=f0, f1=f1)
        result = RESULTS.where(
            status == DIVERGED,
            RESULTS.implicit_divergence,
            RESULTS.where(
                status == NOT_CONVERGED,
                RESULTS.implicit_nonconvergence,
                RESULTS.successful,
            ),
        )
        return y1, y_error, dense_info, new_state, result


class ImplicitEuler(AbstractImplicitRK):
    """Implicit Euler: first order, L-stable, with an error estimate from the
    trapezoidal rule; linear dense output.

    **Arguments:**

    - `root_finder`: solves the implicit stage. By default a `VeryChord` with the
        step-size controller's tolerances; any optimistix root finder is accepted.
    - `root_find_max_steps`: iterations before the step is rejected (and retried
        with a smaller step by an adaptive controller).
    """

    tableau: ClassVar[ImplicitTableau] = IMPLICIT_EULER

    def error_order(self, terms) -> float | None:
        return 2

    def interpolate(self, dense_info, t0, t1, t):
        h = t1 - t0
        theta = (t - t0) / where(h == 0, 1, h)
        return jtu.tree_map(
            lambda a, b: a + jnp.asarray(theta, a.dtype) * (b - a),
            dense_info["y0"],
            dense_info["y1"],
        )


_KVAERNO_DOC = """

    ??? cite "Reference"

        Kværnø, A. (2004). Singly diagonally implicit Runge-Kutta methods with an
        explicit first stage. BIT Numerical Mathematics, 44(3), 489-502.

    **Arguments:**

    - `root_finder`: solves the implicit stages. By default a `VeryChord` with the
        step-size controller's tolerances; any optimistix root finder is accepted.
    - `root_find_max_steps`: iterations before the step is rejected (and retried
        with a smaller step by an adaptive controller).
    """


class Kvaerno3(AbstractImplicitRK):
    __doc__ = (
        "Kværnø's 3(2) method: L-stable, stiffly accurate ESDIRK with 4 stages; "
        "cubic Hermite dense output." + _KVAERNO_DOC
    )
    tableau: ClassVar[ImplicitTableau] = KVAERNO3


class Kvaerno4(AbstractImplicitRK):
    __doc__ = (
        "Kværnø's 4(3) method: L-stable, stiffly accurate ESDIRK with 5 stages; "
        "cubic Hermite dense output." + _KVAERNO_DOC
    )
    tableau: ClassVar[ImplicitTableau] = KVAERNO4


class Kvaerno5(AbstractImplicitRK):
    __doc__ = (
        "Kværnø's 5(4) method: L-stable, stiffly accurate ESDIRK with 7 stages; "
        "cubic Hermite dense output. A good default for stiff problems at tight "
        "tolerances." + _KVAERNO_DOC
    )
    tableau: ClassVar[ImplicitTableau] = KVAERNO5
