"""Root finding for the implicit stages: `VeryChord`, `with_stepsize_controller_tols`,
the simplified Newton iteration, and its derivative by the implicit function theorem.

Each implicit stage solves `G(z) = z - ψ - γh f(t, z) = 0`. The iteration runs under
`stop_gradient` (a `while_loop` is not reverse-differentiable); `implicit_root` then
returns the root with the derivative the implicit function theorem gives,
`dz = -(I - γh ∂f/∂z(t, z))^{-1} ∂G/∂p dp`, using the exact Jacobian at the root,
so derivatives are exact whatever the iteration did. Every value the vector field
depends on is an explicit operand of that rule.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import optimistix as optx
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, PyTree

from .._linear._linalg import factorise, Inverse, jacobian
from .._select import where
from .._solution import Result, RESULTS
from .._tolerances import Tolerances


class _UseStepSizeTol:
    def __repr__(self) -> str:
        return "<taken from `diffeqsolve(..., stepsize_controller=...)`>"


use_stepsize_tol = _UseStepSizeTol()


class VeryChord(optx.AbstractRootFinder):
    """The chord method of the implicit stages: one Jacobian per step (at the start
    of the step), reused by every stage and every iteration, with one inversion of
    `I - γh J` per step (each iteration is then a matrix-vector product).

    Convergence follows Hairer & Wanner (Solving ODEs II, IV.8): with the rate
    `θ = ‖Δ_k‖ / ‖Δ_{k-1}‖`, the iteration has converged when
    `θ / (1 - θ) ‖Δ_k‖ <= kappa` (norms scaled by `atol + rtol |z|`); it has
    diverged only when `θ >= 1`, and it gives up early when even at rate `θ` the
    remaining iterations cannot meet the tolerance. Slow convergence is not
    divergence.

    **Arguments:**

    - `rtol`, `atol`: tolerances of the iteration (by default those of the step-size
        controller: `with_stepsize_controller_tols(VeryChord)()`).
    - `norm`: the norm of the scaled increments (by default the controller's).
    - `kappa`: the fraction of the tolerance the iteration error must reach.

    It is also an optimistix root finder (`optx.root_find(fn, VeryChord(...), y0)`),
    as diffrax's: `init` linearises `fn` at `y0` (dense Jacobian, LU-factorised),
    unless `options=dict(init_state=...)` hands it an earlier state, whose
    linearisation is then reused; `step` is one chord iteration, `terminate` the
    test above.
    """

    rtol: Any
    atol: Any
    norm: Callable[[PyTree], Array] = optx.max_norm
    kappa: float = 1e-2

    def init(self, fn, y, args, options, f_struct, aux_struct, tags):
        del f_struct, aux_struct, tags
        if "init_state" in options:
            return options["init_state"]
        flat, unflatten = ravel_pytree(y)
        residual = lambda x: ravel_pytree(fn(unflatten(x), args)[0])[0]
        lu = jax.scipy.linalg.lu_factor(lax.stop_gradient(jax.jacfwd(residual)(flat)))
        real = jnp.finfo(flat.dtype).dtype  # the real type of a complex state
        inf = jnp.asarray(jnp.inf, real)
        return _ChordState(lu, inf, inf, jnp.asarray(0), optx.RESULTS.successful)

    def step(self, fn, y, args, options, state, tags):
        del options, tags
        fx, aux = fn(y, args)
        flat_y, unflatten = ravel_pytree(y)
        flat_fx = ravel_pytree(fx)[0].astype(flat_y.dtype)
        delta = jax.scipy.linalg.lu_solve(lax.stop_gradient(state.lu), flat_fx)
        new_y = unflatten(flat_y - delta)
        with jax.numpy_dtype_promotion("standard"):
            scale = jtu.tree_map(lambda x: self.atol + self.rtol * jnp.abs(x), new_y)
            scaled = jtu.tree_map(lambda d, c: d / c, unflatten(delta), scale)
            size = jnp.asarray(self.norm(scaled), state.size.dtype)
        ok = jnp.all(jnp.isfinite(delta))
        singular = optx.RESULTS.singular
        result = optx.RESULTS.where(ok, state.result, singular)  # pyright: ignore
        return (
            new_y,
            _ChordState(state.lu, size, state.size, state.steps + 1, result),
            aux,
        )

    def terminate(self, fn, y, args, options, state, tags):
        del fn, y, args, options, tags
        # The rate is known from the second iteration on; a zero increment converged.
        rate = state.size / state.prev_size
        tiny = state.size < 100 * jnp.finfo(state.size.dtype).eps
        estimate = state.size * rate / (1 - rate)
        converged = tiny | ((rate < 1) & (estimate < self.kappa))
        diverged = ~jnp.isfinite(rate) | (rate > 2)
        judged = state.steps >= 2
        failed = state.result != optx.RESULTS.successful
        done = failed | (judged & (converged | diverged))
        code = optx.RESULTS.where(
            judged & diverged & ~converged,
            optx.RESULTS.nonlinear_divergence,
            state.result,
        )
        return done, code

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        del fn, args, options, state, tags, result
        return y, aux, {}


class _ChordState(NamedTuple):
    """`VeryChord`'s state as an optimistix root finder."""

    lu: Any  # LU factors of the Jacobian at the linearisation point
    size: Array  # the last scaled increment's norm
    prev_size: Array  # the one before
    steps: Array
    result: Any


def with_stepsize_controller_tols(cls: type) -> Callable[..., Any]:
    """Wrap a root-finder class (`VeryChord`, or an optimistix root finder such as
    `optimistix.Chord` or `optimistix.Newton`) so that it takes `rtol`, `atol` and
    `norm` from the step-size controller passed to `diffeqsolve`.

    **Arguments:**

    - `cls`: the class.

    **Returns:**

    A function taking `cls`'s other arguments and returning the root finder.
    """

    def make(*args, **kwargs):
        for name in ("rtol", "atol", "norm"):
            if name in kwargs:
                raise ValueError(
                    f"`{name}` is taken from the step-size controller; construct "
                    f"`{cls.__name__}(..., {name}=...)` directly to set it."
                )
        finder = cls(*args, rtol=jnp.inf, atol=jnp.inf, norm=optx.max_norm, **kwargs)
        return eqx.tree_at(
            lambda f: (f.rtol, f.atol, f.norm),
            finder,
            (use_stepsize_tol, use_stepsize_tol, use_stepsize_tol),
        )

    return make


def bind_tols(root_finder, tolerances: Tolerances | None, solver_name: str):
    """`root_finder` with every `use_stepsize_tol` field taken from the controller's
    `tolerances`; a `ValueError` when the controller has none (`None`)."""
    names = [
        n
        for n in ("rtol", "atol", "norm")
        if _is_sentinel(getattr(root_finder, n, None))
    ]
    if not names:
        return root_finder
    if tolerances is None:
        # The first sentence is diffrax's, which its users and tests match on.
        raise ValueError(
            "A fixed step size controller is being used alongside an implicit "
            "solver, but the tolerances for the implicit solver have not been "
            f"specified. {solver_name} takes the tolerances of its root finder from "
            "the step-size controller, but this one has none. Use an adaptive "
            "controller such as `PIDController(rtol=..., atol=...)`, or pass them, "
            f"e.g. `{solver_name}(root_finder=VeryChord(rtol=1e-6, atol=1e-6))`."
        )
    values = tuple(getattr(tolerances, n) for n in names)
    return eqx.tree_at(
        lambda f: tuple(getattr(f, n) for n in names), root_finder, values
    )


def _is_sentinel(value) -> bool:
    # Ours, or diffrax's own `use_stepsize_tol` (a diffrax root finder passed in).
    return value is use_stepsize_tol or type(value).__name__ == "_UseStepSizeTol"


def is_very_chord(finder) -> bool:
    """Whether `finder` is a `VeryChord` (ours or diffrax's, which has the same
    fields and meaning): run by `chord` with the step's one Jacobian."""
    if isinstance(finder, VeryChord):
        return True
    cls = type(finder)
    return cls.__name__ == "VeryChord" and cls.__module__.startswith("diffrax")


# ---------------------------------------------------------------------------------
# The stage equation and its derivative.


class Stage(NamedTuple):
    """The data of one stage equation `z = psi + gamma_h * f(t, z)`."""

    term: Any  # has .vf(t, y, args)
    t: Array
    psi: PyTree
    gamma_h: Array
    args: PyTree


def residual(z, stage: Stage):
    """`G(z) = z - psi - γh f(t, z)`."""
    f = stage.term.vf(stage.t, z, stage.args)
    return jtu.tree_map(
        lambda zi, p, fi: zi - p - jnp.asarray(stage.gamma_h, zi.dtype) * fi,
        z,
        stage.psi,
        f,
    )


@eqx.filter_custom_jvp
def implicit_root(z, stage: Stage):
    """`z` (a root of `residual(·, stage)`, found without gradients), with the
    derivative of the exact root with respect to `stage` (implicit function theorem).
    """
    return z


@implicit_root.def_jvp
def _implicit_root_jvp(primals, tangents):
    z, stage = primals
    _, t_stage = tangents
    z = lax.stop_gradient(z)
    if t_stage is None:
        return z, jtu.tree_map(jnp.zeros_like, z)
    is_none = lambda x: x is None  # noqa: E731
    diff = jtu.tree_map(
        lambda t, s: None if t is None else s, t_stage, stage, is_leaf=is_none
    )
    rest = jtu.tree_map(
        lambda t, s: s if t is None else None, t_stage, stage, is_leaf=is_none
    )
    t_diff = jtu.tree_map(lambda t: t, t_stage, is_leaf=is_none)

    def g(d):
        return residual(z, eqx.combine(d, rest))

    _, dg = jax.jvp(g, (diff,), (t_diff,))
    jac, _ = jacobian(lambda t, y: stage.term.vf(t, y, stage.args), stage.t, z)
    lu = factorise(jac, stage.gamma_h)
    dz = lu.solve(jtu.tree_map(jnp.negative, dg))
    return z, dz


# ---------------------------------------------------------------------------------
# The simplified Newton (chord) iteration.


def _scaled_norm(delta, z, rtol, atol, norm) -> Array:
    def leaf(d, zi):
        scale = atol + rtol * jnp.abs(zi)
        return d / scale.astype(d.dtype)

    return norm(jtu.tree_map(leaf, delta, z))


def _roundoff(delta, z) -> Array:
    """Whether the increment is at the level of rounding error in every leaf."""
    small = [
        jnp.all(jnp.abs(d) <= 100 * jnp.finfo(d.dtype).eps * jnp.abs(zi))
        for d, zi in zip(jtu.tree_leaves(delta), jtu.tree_leaves(z))
    ]
    return jnp.all(jnp.stack(small)) if small else jnp.asarray(True)


class _Newton(NamedTuple):
    k: Array
    z: PyTree
    last: Array  # scaled norm of the previous increment
    eta: Array
    status: Result  # successful while iterating or on convergence
    done: Array


def _verdict(s, first, theta, eta, size, delta, max_steps: int, kappa):
    """After an iteration of the chord method with rate `theta` and scaled increment
    `size`: `(converged, failed, status)` (Hairer & Wanner IV.8; see `VeryChord`)."""
    finite = jnp.isfinite(size)
    diverged = ~finite | (~first & (theta >= 1))
    converged = finite & ((eta * size <= kappa) | (size == 0) | _roundoff(delta, s.z))
    remaining = max_steps - s.k - 1
    hopeless = ~first & (theta**remaining / (1 - theta) * size > kappa)
    out_of_steps = remaining <= 0
    failed = ~converged & (diverged | hopeless | out_of_steps)
    status = RESULTS.where(
        diverged & ~converged,
        RESULTS.implicit_divergence,
        RESULTS.where(failed, RESULTS.implicit_nonconvergence, RESULTS.successful),
    )
    return converged, failed, status


def chord(
    finder: VeryChord,
    stage: Stage,
    z0: PyTree,
    inverse: Inverse | Any,  # anything with `.solve(pytree) -> pytree`
    eta0: Array,
    max_steps: int,
    ref: PyTree,
    skip: Array | bool = False,
) -> tuple[PyTree, Result, Array]:
    """Solve the stage equation by the chord method with the inverted iteration
    matrix `inverse` (no gradients flow through it: see `implicit_root`). With
    `skip` (an earlier stage failed: the step will be rejected) it returns `z0`.

    **Returns:**

    `(z, result, eta)`: the iterate, a `RESULTS` member (`successful`,
    `implicit_divergence` or `implicit_nonconvergence`), and the
    convergence factor `θ/(1-θ)` to start the next stage's iteration from.
    """
    rtol, atol, kappa = finder.rtol, finder.atol, finder.kappa
    dtype = jnp.result_type(*jtu.tree_leaves(z0))
    real = jnp.finfo(dtype).dtype

    def body(s: _Newton) -> _Newton:
        delta = inverse.solve(jtu.tree_map(jnp.negative, residual(s.z, stage)))
        size = _scaled_norm(delta, ref, rtol, atol, finder.norm).astype(real)
        z = jtu.tree_map(jnp.add, s.z, delta)
        first = s.k == 0
        theta = where(first, 0.0, size / where(s.last > 0, s.last, 1.0))
        eta = where(first, s.eta, theta / jnp.maximum(1 - theta, 1e-10))
        converged, failed, status = _verdict(
            s, first, theta, eta, size, delta, max_steps, kappa
        )
        return _Newton(
            s.k + 1,
            z,
            size,
            jnp.where(first, s.eta, eta),
            status,
            converged | failed,
        )

    init = _Newton(
        jnp.asarray(0),
        z0,
        jnp.asarray(1.0, real),
        jnp.asarray(eta0, real),
        RESULTS.successful,
        jnp.asarray(skip),
    )
    out = lax.while_loop(lambda s: ~s.done, body, init)
    return out.z, out.status, out.eta


def _slope_residual(k, stage: Stage):
    """The stage equation for the stage's slope `k` (`z = psi + γh k`), as diffrax
    states it: `k - f(t, psi + γh k)`, in the units of the derivative."""
    z = _stage_value(k, stage)
    f = stage.term.vf(stage.t, z, stage.args)
    return jtu.tree_map(lambda ki, fi: ki - fi, k, f)


def _stage_value(k, stage: Stage):
    return jtu.tree_map(
        lambda p, ki: p + jnp.asarray(stage.gamma_h, ki.dtype) * ki, stage.psi, k
    )


def optx_solve(
    finder, stage: Stage, z0: PyTree, max_steps: int
) -> tuple[PyTree, Result]:
    """Solve the stage equation with an optimistix root finder (its own Jacobians).

    The finder solves for the stage's slope `k`, `k = f(t, psi + γh k)`, as in
    diffrax, so that its tolerances mean what they mean there: units of `dy/dt`, not
    of `y` (a relative tolerance on a state component near zero, as in stiff
    chemistry, is then reachable).

    **Returns:**

    `(z, result)`, `result` a `RESULTS` member.
    """
    safe = where(stage.gamma_h == 0, 1, stage.gamma_h)  # an inactive (empty) step
    k0 = jtu.tree_map(lambda z, p: (z - p) / jnp.asarray(safe, z.dtype), z0, stage.psi)
    sol = optx.root_find(
        _slope_residual, finder, k0, stage, max_steps=max_steps, throw=False
    )
    ok = sol.result == optx.RESULTS.successful
    out_of_steps = sol.result == optx.RESULTS.max_steps_reached
    result = RESULTS.where(
        ok,
        RESULTS.successful,
        RESULTS.where(
            out_of_steps, RESULTS.implicit_nonconvergence, RESULTS.implicit_divergence
        ),
    )
    return _stage_value(sol.value, stage), result
