"""Implicit (ESDIRK) and IMEX Runge--Kutta solvers: one generic step reading an
`ImplicitTableau`.

Per step: the Jacobian of the implicit term is the one carried in the solver state
(taken at the start of the step, so a rejected step's retry reuses it), one inverse of
`I - γh J` serves every stage and every chord iteration, and each stage's root gets
exact derivatives from the implicit function theorem (`_root_finder.implicit_root`).
With `reuse_jacobian`, the Jacobian and the factorisations live across steps by
CVODE's rules (`_reuse.py`), and a rejected step keeps them.
"""

import functools
from typing import Any, ClassVar, NamedTuple, TYPE_CHECKING

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from .._linear._linalg import invert
from .._linear._linear_solver import AbstractLinearSolver, DenseLinearSolver
from .._select import where
from .._solution import RESULTS
from .._tolerances import Tolerances
from .._tree import nograd, tree_add, tree_where
from . import _reuse as reuse
from ._base import AbstractImplicitSolver, axpy
from ._implicit_dense import public_dense_info
from ._implicit_tableau import ImplicitTableau
from ._local_interpolation import (
    LocalLinearInterpolation,
    ThirdOrderHermitePolynomialInterpolation,
)
from ._reuse import Cache
from ._root_finder import (
    bind_tols,
    chord,
    implicit_root,
    is_very_chord,
    optx_solve,
    Stage,
    VeryChord,
    with_stepsize_controller_tols,
)


if TYPE_CHECKING:  # pyright reads `eqx.AbstractClassVar` as an instance field
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class ImplicitState(NamedTuple):
    """What a step starts from: the fields at `(t0, y0)`, and the implicit term's
    Jacobian there (`None` with an optimistix root finder, which takes its own, or
    with `reuse_jacobian`, which keeps it in `cache`)."""

    f_explicit: PyTree | None
    f_implicit: PyTree
    jac: Any  # in the linear solver's representation
    eta: Array  # the chord iteration's convergence factor, carried between stages
    # With `reuse_jacobian` only: the Jacobian and the factorisations (made for
    # `h`), kept by a rejected step (`revert`).
    cache: Cache | None = None


class AbstractImplicitRK(AbstractImplicitSolver):
    """An ESDIRK (or IMEX additive) Runge--Kutta method read from its `tableau`."""

    tableau: AbstractClassVar[ImplicitTableau]
    interpolation_cls: ClassVar[Any] = ThirdOrderHermitePolynomialInterpolation.from_k
    root_finder: Any = with_stepsize_controller_tols(VeryChord)()
    root_find_max_steps: int = 10
    linear_solver: AbstractLinearSolver = DenseLinearSolver()
    reuse_jacobian: bool = False

    def __check_init__(self) -> None:
        if not isinstance(self.linear_solver, AbstractLinearSolver):
            raise TypeError(
                f"{type(self).__name__}(linear_solver=...) must be a solverkit "
                f"`AbstractLinearSolver`, got {self.linear_solver!r}."
            )

    def order(self, terms) -> int:
        return self.tableau.order

    def error_order(self, terms) -> float | None:
        return self.tableau.embedded_order + 1

    def bind_controller_tols(
        self, tolerances: Tolerances | None
    ) -> "AbstractImplicitRK":
        finder = bind_tols(self.root_finder, tolerances, type(self).__name__)
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
        return is_very_chord(self.root_finder)

    def _reuses(self) -> bool:
        return self.reuse_jacobian and self._uses_chord()

    def _linearise(self, im, t, y, args):
        """The implicit term's Jacobian at `(t, y)`, without gradients."""
        return self.linear_solver.linearise(*_flat_field(nograd((im, t, y, args))))[1]

    def _factorise(self, jac, h):
        """One factorisation of `I - γhJ` per distinct diagonal value `γ` (one for an
        ESDIRK method), stacked. The dense default inverts it (a matrix-vector
        product per chord iteration), without the refinement of
        `DenseLinearSolver`'s solves: the chord iteration evaluates its residual
        exactly."""
        diagonals = self.tableau.diagonals
        if type(self.linear_solver) is DenseLinearSolver:
            invs = [invert(jac, g * h) for g in diagonals]
        else:
            ls = self.linear_solver
            invs = [ls.factorise(jac, g * h, None) for g in diagonals]
        return jtu.tree_map(lambda *x: jnp.stack(x), *invs)

    def _start(
        self, terms, t, y, args, f_implicit=None, cache: Cache | None = None
    ) -> ImplicitState:
        ex, im = self._terms(terms)
        f_ex = None if ex is None else ex.vf(t, y, args)
        if f_implicit is None:
            f_implicit = im.vf(t, y, args)
        jac = None
        if self._uses_chord() and not self._reuses():
            jac = self._linearise(im, t, y, args)
        eta = jnp.real(jnp.asarray(1.0, jnp.result_type(*jtu.tree_leaves(y))))
        return ImplicitState(f_ex, f_implicit, jac, eta, cache)

    def func(self, terms, t0, y0, args) -> PyTree:
        ex, im = self._terms(terms)
        f = im.vf(t0, y0, args)
        return f if ex is None else tree_add(ex.vf(t0, y0, args), f)

    def init(self, terms, t0, t1, y0, args) -> ImplicitState:
        state = self._start(terms, t0, y0, args)
        if not self._reuses():
            return state
        jac = self._linearise(self._terms(terms)[1], t0, y0, args)
        # No factorisation yet (scale 0): the first step makes it for its `h`.
        h = jnp.zeros_like(lax.stop_gradient(jnp.asarray(t1) - jnp.asarray(t0)))
        shapes = jax.eval_shape(self._factorise, jac, h)
        factor = jtu.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return state._replace(cache=reuse.start(jac, factor, h))

    def revert(self, accepted, new_state, old_state) -> ImplicitState:
        out = tree_where(accepted, new_state, old_state)
        if self._reuses():  # a rejected step keeps its Jacobian and factorisations
            out = out._replace(cache=new_state.cache)
        return out

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump=False):
        """One step, with diffrax's `dense_info`: `dict(y0=, y1=)` for ImplicitEuler,
        else `dict(y0=, y1=, k=)`, `k` the stage increments `h k_i` stacked on a
        leading axis of each leaf (`(stages, *y.shape)`), a pair `(k_explicit,
        k_implicit)` for an IMEX method, as `interpolation_cls(t0=, t1=,
        **dense_info)` takes them."""
        del made_jump
        return self._step(terms, t0, t1, y0, args, solver_state, True)

    def loop_step(self, terms, t0, t1, y0, args, solver_state, made_jump=False):
        """`step` as the loop takes it: `dense_info` is `y0, y1, f0, f1`, the slopes
        at both ends for a cubic Hermite (`f1` consistent with `y1`, see
        `_consistent_slope`), or `y0, y1` for ImplicitEuler."""
        del made_jump
        return self._step(terms, t0, t1, y0, args, solver_state, False)

    def interpolate(self, dense_info, t0, t1, t) -> PyTree:
        """The dense output at `t`, from `step`'s or `loop_step`'s `dense_info`."""
        if "f0" in dense_info:
            cls = ThirdOrderHermitePolynomialInterpolation
            return cls(t0=t0, t1=t1, **dense_info).evaluate(t)
        return super().interpolate(dense_info, t0, t1, t)

    def _step(self, terms, t0, t1, y0, args, state: ImplicitState, public: bool):
        ex, im = self._terms(terms)
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = t1 - t0
        if self._reuses():
            return self._step_reusing(terms, t0, t1, y0, args, state, public)
        inv = None
        if self._uses_chord():
            assert state.jac is not None  # `_start` took it for the chord
            inv = self._factorise(lax.stop_gradient(state.jac), h)
        out = self._stages(ex, im, t0, t1, y0, args, state, inv)
        return self._finish(terms, t1, y0, h, args, out, public)

    def _stages(self, ex, im, t0, t1, y0, args, state: ImplicitState, inv):
        """Every stage of the step: `(k_im, k_ex, z, status, eta)`."""
        tab = self.tableau
        h = t1 - t0
        stack = lambda f: jtu.tree_map(  # noqa: E731
            lambda x: jnp.zeros((tab.num_stages,) + x.shape, x.dtype).at[0].set(x), f
        )
        carry = (
            stack(state.f_implicit),
            None if ex is None else stack(state.f_explicit),
            y0,
            RESULTS.successful,
            state.eta,
        )
        body = functools.partial(self._stage, ex, im, t0, t1, h, y0, args, inv)
        return lax.fori_loop(1, tab.num_stages, body, carry)

    def _step_reusing(self, terms, t0, t1, y0, args, state: ImplicitState, public):
        """A step with the Jacobian and factorisations kept across steps by CVODE's
        rules (`_reuse.py`; see `reuse_jacobian`): a retry after a convergence
        failure takes a new Jacobian at `(t0, y0)`. Every decision is on values
        without gradients; the stages' derivatives come from the exact Jacobian at
        each root (`implicit_root`), whatever matrix the chord iteration used (with
        the old factorisation `h` may differ from the one it was made for by up to
        30%: the chord iteration converges with such a matrix, to the same root)."""
        ex, im = self._terms(terms)
        h = t1 - t0
        hs = lax.stop_gradient(h)
        assert state.cache is not None
        new_jac = lambda: self._linearise(im, t0, y0, args)  # noqa: E731
        cache, refactored = reuse.refresh(
            nograd(state.cache), hs, new_jac, self._factorise
        )
        attempt = lambda factor: self._stages(  # noqa: E731
            ex, im, t0, t1, y0, args, state, factor
        )
        out = attempt(cache.factor)
        failed = out[3] != RESULTS.successful
        cache, out, _ = reuse.retry(
            cache, refactored, failed, hs, new_jac, self._factorise, attempt, out
        )
        return self._finish(terms, t1, y0, h, args, out, public, reuse.advance(cache))

    def _stage(self, ex, im, t0, t1, h, y0, args, inv, i, carry):
        """Stage `i` of a step: solve for its value, store its slopes."""
        tab = self.tableau
        k_im, k_ex, _, status, eta = carry
        c = jnp.asarray(tab.c, h.dtype)[i]
        ti = where(c == 1, t1, t0 + c * h)
        gamma_h = jnp.asarray(tab.a_im.diagonal(), h.dtype)[i] * h
        psi = axpy(y0, h, [(tab.a_im, k_im), (tab.a_ex, k_ex)], i)
        guess = axpy(psi, gamma_h, [(tab.predictor, k_im)], i)
        stage = Stage(im, ti, psi, gamma_h, args)
        if inv is None:
            z, stage_status = optx_solve(
                *nograd((self.root_finder, stage, guess)),
                self.root_find_max_steps,
            )
        else:
            which = jnp.asarray(_inverse_index(tab))[i]
            inv_i = jtu.tree_map(lambda x: x[which], inv)
            if type(self.linear_solver) is not DenseLinearSolver:
                fn, _ = _flat_field(nograd((stage.term, t0, y0, args)))
                inv_i = _ProtocolSolve(self.linear_solver, nograd(inv_i), fn)
            eta0 = jnp.maximum(eta, jnp.finfo(eta.dtype).eps) ** 0.8
            z, stage_status, eta = chord(
                *nograd((self.root_finder, stage, guess, inv_i, eta0)),
                self.root_find_max_steps,
                lax.stop_gradient(y0),
                skip=status != RESULTS.successful,
            )
        status = RESULTS.where(status == RESULTS.successful, stage_status, status)
        z = implicit_root(z, stage)
        # A zero step (an inactive step of a batch or scan) must not divide by zero,
        # not even in a branch that is masked out, or its gradient is NaN.
        safe = where(gamma_h == 0, 1, gamma_h)
        k = jtu.tree_map(lambda zi, p: (zi - p) / safe.astype(zi.dtype), z, psi)
        k_im = jtu.tree_map(lambda ks, x: ks.at[i].set(x), k_im, k)
        if ex is not None:
            f = ex.vf(ti, z, args)
            k_ex = jtu.tree_map(lambda ks, x: ks.at[i].set(x), k_ex, f)
        return k_im, k_ex, z, status, eta

    def _finish(self, terms, t1, y0, h, args, stages, public: bool, cache=None):
        """The step's outputs from its stages, `dense_info` in `step`'s form if
        `public`, else in `loop_step`'s."""
        tab = self.tableau
        k_im, k_ex, z, status, eta = stages
        last = tab.num_stages - 1
        pick = lambda ks, j: jtu.tree_map(lambda x: x[j], ks)  # noqa: E731
        if tab.stiffly_accurate:
            y1 = z
            f_implicit1 = pick(k_im, last)  # = f(t1, y1) at the root
        else:
            y1 = axpy(y0, h, [(tab.b_im, k_im), (tab.b_ex, k_ex)])
            f_implicit1 = None
            if tab.implicit_stiffly_accurate:
                f_implicit1 = self._consistent_slope(terms, t1, y1, args, z, k_im)
        zero = jtu.tree_map(jnp.zeros_like, y0)
        y_error = axpy(zero, h, [(tab.b_err_im, k_im), (tab.b_err_ex, k_ex)])
        ok = status == RESULTS.successful
        y_error = jtu.tree_map(lambda e: where(ok, e, jnp.inf), y_error)
        new_state = self._start(terms, t1, y1, args, f_implicit1, cache)
        new_state = new_state._replace(eta=eta)
        f0, f1 = pick(k_im, 0), new_state.f_implicit
        if k_ex is not None:
            f0 = tree_add(pick(k_ex, 0), f0)
            f1 = tree_add(new_state.f_explicit, f1)
        if self.interpolation_cls is LocalLinearInterpolation:
            dense_info = dict(y0=y0, y1=y1)
        elif public:
            dense_info = public_dense_info(y0, y1, h, k_im, k_ex)
        else:
            dense_info = dict(y0=y0, y1=y1, f0=f0, f1=f1)
        return y1, y_error, dense_info, new_state, status

    def _consistent_slope(self, terms, t1, y1, args, z, k_im) -> PyTree:
        """The implicit field at `(t1, y1)` for the next step's first stage and the
        dense output, with the last stage's Newton error taken out (IMEX methods
        whose implicit tableau is stiffly accurate, e.g. KenCarp3/4/5).

        The last stage `z` solves `z = ψ + γh f(t1, z)` only to the Newton
        tolerance: `z = z* + δ`. Evaluating `f(t1, y1)` directly returns
        `f(z*) + Jδ + ...`, and with a stiff Jacobian `Jδ` is huge (on ROBER,
        `‖hJ‖ ~ 1e9`): it entered the next step's stages, its error estimate (many
        rejected steps) and the Hermite dense output (errors ~1000 times the
        tolerance). The last stage's slope `k = (z - ψ)/(γh) = f(t1, z) + G(z)/(γh)`
        is consistent instead (`δ/(γh)`, not `Jδ`; a stiffly accurate ESDIRK carries
        it as is). Here `y1 = z + E`, `E` the explicit term's part of the update, so
        `f(t1, y1) + k - f(t1, z)` keeps the effect of `E` exactly and drops `Jδ`
        (one more evaluation of the implicit field per step)."""
        _, im = self._terms(terms)
        k_last = jtu.tree_map(lambda x: x[-1], k_im)
        f_y1 = im.vf(t1, y1, args)
        f_z = im.vf(t1, z, args)
        return jtu.tree_map(lambda a, k, b: a + (k - b), f_y1, k_last, f_z)


def _flat_field(operands):
    """`(fn, x)`: the term's vector field at time `t` on the ravelled state, and the
    ravelled `y`, for `operands = (term, t, y, args)`."""
    term, t, y, args = operands
    flat, unravel = ravel_pytree(y)

    def fn(x):
        return ravel_pytree(term.vf(t, unravel(x), args))[0].astype(flat.dtype)

    return fn, flat


class _ProtocolSolve:
    """Solves of the chord iteration through a linear solver's protocol, on pytrees
    of the state's structure (as `Inverse.solve`)."""

    def __init__(self, linear_solver: AbstractLinearSolver, factor, fn):
        self.linear_solver, self.factor, self.fn = linear_solver, factor, fn

    def solve(self, rhs: PyTree) -> PyTree:
        flat, unravel = ravel_pytree(rhs)
        out = self.linear_solver.solve(self.factor, flat, self.fn)
        return unravel(out.astype(flat.dtype))


def _inverse_index(tab: ImplicitTableau) -> np.ndarray:
    """For each stage, which of the step's inverses it uses."""
    diag = tab.a_im.diagonal()
    return np.array([tab.diagonals.index(float(g)) if g else 0 for g in diag])
