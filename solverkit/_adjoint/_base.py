"""Adjoints: how reverse- (and forward-) mode differentiation goes through a solve.

Each adjoint is a small strategy object with one method, `loop(problem)`, which runs
the step loop of `_loop.py` and returns its `Outputs`. The `Problem`, which holds the
closure-converted vector field, is an explicit operand of every `custom_vjp` and loop.

This module holds the base class and what every adjoint shares (the `custom_vjp`
wrapper, zero cotangents, which leaves are differentiated), and the adjoints that
need no machinery of their own: `DirectAdjoint`/`ForwardMode` and `ImplicitAdjoint`.
The checkpointed adjoint is in `_checkpoint.py`, the backsolve adjoint in
`_backsolve.py`.
"""

import abc
import contextlib
import functools
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _loop
from .._closure._unvmap import batched_like, unvmap_any
from .._closure._vma_eval import match_varying, union_of_axes, vary, varying_axes
from .._errors import UnsupportedError
from .._linear._linalg import lu_factorisation, value_and_jacobian
from .._loop import Outputs
from .._problem import Buffers, Carry, Problem
from .._remat import POLICY
from .._term import ClosureTerm, total_vf
from .._tree import nograd
from ._schedule import ceil_sqrt


def _standard_promotion(fn):
    """Trace `fn` (a backward pass, traced after `diffeqsolve` has returned) with
    standard dtype promotion, as `diffeqsolve` traces the forward pass."""

    @functools.wraps(fn)
    def wrapper(*args):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args)

    return wrapper


def zeros_cotangent(x):
    """A zero cotangent for a primal leaf (float0 for integer and boolean leaves)."""
    if x is None:
        return None
    if eqx.is_inexact_array(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def fill_zeros(cotangent, primal):
    """`cotangent` with every `None` (a leaf not differentiated) replaced by a zero
    cotangent of the primal leaf."""
    return jtu.tree_map(
        lambda c, x: zeros_cotangent(x) if c is None else c,
        cotangent,
        primal,
        is_leaf=lambda x: x is None,
    )


def parameters(tree):
    """Filter spec of the leaves of `tree` to differentiate: its inexact arrays,
    except the time direction (of a `Problem` or a `ClosureTerm`: a sign, whose
    derivative is zero; carrying its cotangent would only cost work, and backward
    steps) and the states passed in to resume a solve (they reach the loop through
    its initial carry, which is differentiated on its own)."""

    def spec(x):
        if not _is_term(x):
            return eqx.is_inexact_array(x)
        out = jtu.tree_map(eqx.is_inexact_array, x)
        if isinstance(x, Problem):
            out = eqx.tree_at(lambda p: p.terms, out, parameters(x.terms))
            if x.resume is not None:  # differentiated through the initial carry
                out = eqx.tree_at(
                    lambda p: p.resume, out, jtu.tree_map(lambda _: False, x.resume)
                )
        if x.direction is None:
            return out
        return eqx.tree_at(lambda v: v.direction, out, False)

    return jtu.tree_map(spec, tree, is_leaf=_is_term)


def _is_term(x) -> bool:
    return isinstance(x, (ClosureTerm, Problem))


@contextlib.contextmanager
def reverse_only(adjoint: "AbstractAdjoint"):
    """Turn JAX's error for forward-mode autodiff of a `custom_vjp` (the adjoints
    that support reverse mode only) into one that says what to use instead."""
    try:
        yield
    except TypeError as e:
        text = str(e)
        if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
            raise TypeError(
                f"{type(adjoint).__name__} supports reverse-mode differentiation "
                "(jax.grad, jax.vjp) only; for forward mode (jax.jvp, jax.jacfwd) use "
                f"`adjoint=DirectAdjoint()`. (JAX said: {e})"
            ) from None
        raise


# What the error for reverse-over-reverse suggests, by the name `custom_vjp` is given
# (`_first_order_p` carries the name only: a short parameter keeps jaxprs short).
_SECOND_ORDER = (
    "Use forward-over-reverse, `jax.jacfwd(jax.grad(f))` (`jax.hessian` is that), "
    "or `adjoint=DirectAdjoint()`, whose loop has a fixed length."
)
_second_order: dict[str, str] = {}


def _twice_in_reverse(ct, **params):
    name = params["adjoint"]
    raise UnsupportedError(
        f"{name} can't be differentiated twice in reverse mode (`jax.grad` of "
        "`jax.grad`): its backward pass is a loop whose length depends on the "
        f"solve. {_second_order.get(name, _SECOND_ORDER)}"
    )


# The identity on the cotangents a backward pass returns. Its derivative is itself
# (so forward-over-reverse goes through), but its transpose raises: reverse-over-
# reverse meets it before JAX's error for the loops behind it, and says what to use.
# It lowers to nothing.
_first_order_p = Primitive("solverkit_first_order")
_first_order_p.def_impl(lambda x, *, adjoint: x)
_first_order_p.def_abstract_eval(lambda x, *, adjoint: x)
mlir.register_lowering(_first_order_p, lambda ctx, x, *, adjoint: [x])
batching.primitive_batchers[_first_order_p] = lambda args, dims, *, adjoint: (
    _first_order_p.bind(*args, adjoint=adjoint),
    dims[0],
)
ad.deflinear(_first_order_p, _twice_in_reverse)


def _first_order(cotangents, adjoint: str):
    """`cotangents`, marked as not differentiable again in reverse mode."""
    return jtu.tree_map(
        lambda c: (
            _first_order_p.bind(c, adjoint=adjoint) if eqx.is_inexact_array(c) else c
        ),
        cotangents,
    )


def _match_varying(cotangents, axes):
    """Inside `shard_map`, each cotangent summed over the manual axes it varies over
    beyond its primal's (an invariant input used on every device)."""
    return jtu.tree_map(
        lambda c, a: match_varying(c, a) if eqx.is_inexact_array(c) else c,
        cotangents,
        axes,
        is_leaf=lambda x: x is None,
    )


def _as_arrays(tree):
    """`tree` with each literal JAX hands a rule as an array. Differentiated inside
    `jit`, a Python scalar reaches a `custom_vjp`'s rules as a typed literal (a
    `float` subclass with a dtype, JAX >= 0.10), not an array: every leaf test here
    (`eqx.is_inexact_array`) would take it for a static value, and its cotangent
    would be zero (`BacksolveAdjoint`) or of the wrong type."""
    return jtu.tree_map(
        lambda x: (
            jnp.asarray(x)
            if hasattr(x, "dtype") and not isinstance(x, (jax.Array, np.ndarray))
            else x
        ),
        tree,
    )


def custom_vjp(
    problem: Problem,
    primal: Callable,
    fwd: Callable,
    bwd: Callable,
    *ops,
    adjoint: str = "This adjoint",
    second_order: str | None = None,
    perturbed: bool = False,
):
    """`primal(problem, *ops)` as a `custom_vjp` with the rules `fwd(problem, *ops)
    -> (out, residuals)` and `bwd(static, dynamic, residuals, cotangents)`, which
    returns the cotangents of `(dynamic, *ops)`. The backward pass can be
    differentiated in forward mode, not in reverse mode (`adjoint` names the adjoint
    in that error; `second_order`, if given, replaces what it suggests instead).
    With `perturbed`, `bwd` also takes `perturbed=`, a tree like `(dynamic, *ops)`
    of bools: which inputs are differentiated (JAX's symbolic zeros), known however
    the solve was traced (`jax.grad(jax.jit(f))` too).

    The problem's arrays (`dynamic`) are an explicit operand, so every user value
    crosses the boundary explicitly; its non-array part (`static`) is static.
    """
    if second_order is not None:
        _second_order[adjoint] = second_order
    dynamic, static = eqx.partition(problem, eqx.is_array)
    # Inside `shard_map`, the manual axes each input varies over: a cotangent that
    # varies over more is summed over them (see `_match_varying`).
    axes = jtu.tree_map(varying_axes, (dynamic, *ops))

    # Every output is batched under a `vmap` that batches any input (`batched_like`):
    # one shared by the batch would get one cotangent for the whole batch, which the
    # batched backward pass would count once per element.
    @jax.custom_vjp
    def solve(dynamic, *operands):
        dynamic, operands = _as_arrays((dynamic, operands))
        out = primal(eqx.combine(dynamic, static), *operands)
        return batched_like(out, (dynamic, operands))

    def solve_fwd(dynamic, *operands):
        dynamic, operands = _as_arrays((dynamic, operands))
        out, residuals = fwd(eqx.combine(dynamic, static), *operands)
        return batched_like(out, (dynamic, operands)), (dynamic, residuals)

    @_standard_promotion
    def solve_bwd(residuals, cotangents, flags=None):
        dynamic, residuals = residuals
        # Inside `shard_map`: the backward pass works on values that vary over
        # every manual axis anything does, and sums each cotangent back to its
        # primal's axes at the end.
        union = union_of_axes((dynamic, residuals, cotangents))
        if union:
            dynamic, residuals, cotangents = vary(
                (dynamic, residuals, cotangents), union
            )
        if flags is None:
            out = bwd(static, dynamic, residuals, cotangents)
        else:
            out = bwd(static, dynamic, residuals, cotangents, perturbed=flags)
        if union:
            out = _match_varying(out, axes)
        return _first_order(out, adjoint)

    if perturbed:
        _defvjp_marking_perturbed(solve, solve_fwd, solve_bwd, (dynamic, ops))
    else:
        solve.defvjp(solve_fwd, solve_bwd)
    return solve(dynamic, *ops)


def _defvjp_marking_perturbed(solve, fwd: Callable, bwd: Callable, example) -> None:
    """`solve.defvjp(fwd, bwd)` with JAX's symbolic zeros, `bwd` also taking which
    inputs are differentiated: a tree like `example` (`(dynamic, ops)`) of bools. The
    forward rule's residuals carry them as structure (`()` where perturbed, `None`
    where not), so they are static when the backward rule is traced."""
    tree = jtu.tree_structure(example)
    is_primal = lambda x: isinstance(x, CustomVJPPrimal)  # noqa: E731

    def marked_fwd(dynamic, *operands):
        primals = jtu.tree_leaves((dynamic, operands), is_leaf=is_primal)
        values = jtu.tree_map(lambda p: p.value, (dynamic, operands), is_leaf=is_primal)
        out, residuals = fwd(values[0], *values[1])
        return out, (residuals, tuple(() if p.perturbed else None for p in primals))

    def marked_bwd(residuals, cotangents):
        residuals, marks = residuals
        flags = jtu.tree_unflatten(tree, [m is not None for m in marks])
        cotangents = jtu.tree_map(materialize, cotangents)
        return bwd(residuals, cotangents, flags)

    solve.defvjp(marked_fwd, marked_bwd, symbolic_zeros=True)


def materialize(c):
    """A symbolic zero cotangent as an array."""
    if not isinstance(c, SymbolicZero):
        return c
    aval = c.aval
    if aval.dtype == jax.dtypes.float0:  # pyright: ignore[reportAttributeAccessIssue]
        return np.zeros(aval.shape, jax.dtypes.float0)  # pyright: ignore
    return jnp.zeros(aval.shape, aval.dtype)  # pyright: ignore


class AbstractAdjoint(eqx.Module):
    """Base class of the adjoints.

    `discrete`: whether its gradient is the derivative of the solve as computed (its
    steps, to round-off), which forward sensitivities of the same steps give too;
    `False` for an adjoint with its own approximation (a continuous adjoint solved
    backwards, the implicit function theorem at a steady state).
    """

    discrete: ClassVar[bool] = True

    @abc.abstractmethod
    def loop(self, problem: Problem) -> Outputs:
        """Run the solve described by `problem`."""

    def check(self, problem: Problem) -> None:
        """Raise a `ValueError` before tracing for an unsupported combination."""


def run(problem: Problem, carry: Carry, bufs: Buffers) -> tuple[Carry, Buffers]:
    """The loop as a plain `lax.while_loop` (not reverse-differentiable)."""
    return _loop.run_while(problem, carry, bufs)[:2]


class _AbstractDirect(AbstractAdjoint):
    """The loop of `DirectAdjoint` and `ForwardMode`: a `lax.scan` over blocks of
    `ceil(sqrt(max_steps))` steps, each block checkpointed (recomputed in the backward
    pass) and skipped entirely once every batch element has finished."""

    def check(self, problem: Problem) -> None:
        if problem.max_steps is None:
            raise UnsupportedError(
                f"{type(self).__name__} needs an int `max_steps` (it loops over a "
                "bounded "
                "number of steps): pass an int `max_steps`, or use "
                "BacksolveAdjoint() for an unbounded solve."
            )

    def loop(self, problem: Problem) -> Outputs:
        assert problem.max_steps is not None  # `check` raised otherwise
        carry, bufs = _loop.init(problem)
        block = ceil_sqrt(problem.max_steps)
        blocks = -(-problem.max_steps // block)

        def step(state, _):
            active = _loop.cond(problem, state[0])
            return _loop.body(problem, state, active, differentiable=True), None

        # Recomputed in the backward pass, with the forward pass's decisions and
        # step ends (`_remat.py`).
        @functools.partial(jax.checkpoint, policy=POLICY)
        def run_block(state, _):
            running = unvmap_any(_loop.cond(problem, state[0]))
            state = lax.cond(
                running,
                lambda s: lax.scan(step, s, None, length=block)[0],
                lambda s: s,
                state,
            )
            return state, None

        (carry, bufs), _ = lax.scan(run_block, (carry, bufs), None, length=blocks)
        return _loop.finish(problem, carry, bufs)


class DirectAdjoint(_AbstractDirect):
    """Differentiate straight through a loop bounded by `max_steps`.

    The loop is a `lax.scan` over blocks of `ceil(sqrt(max_steps))` steps; each block
    is checkpointed (recomputed in the backward pass) and skipped entirely once every
    batch element has finished. Supports forward mode (`jax.jvp`, `jax.jacfwd`) as
    well as reverse mode; memory grows like `sqrt(max_steps)` loop states (save
    buffers included). Prefer `RecursiveCheckpointAdjoint` for reverse mode.
    """


class ForwardMode(_AbstractDirect):
    """Differentiate in forward mode (`jax.jvp`, `jax.jacfwd`): diffrax's name for
    it. It is the same loop as [`solverkit.DirectAdjoint`][], which supports forward
    mode and reverse mode alike."""


class ImplicitAdjoint(AbstractAdjoint):
    """Differentiate a steady state by the implicit function theorem.

    For a solve that ends at a steady state `y*` (`f(t, y*, θ) = 0`, e.g. with
    `event=Event(steady_state_event())`), the derivative of `y*` is
    `-(∂f/∂y)^{-1} ∂f/∂θ`, whatever the path to it: the solve itself is not
    differentiated, so memory and cost do not depend on its steps. `θ` is everything
    the vector field depends on (`args` and every value it closes over); the initial
    state has no influence on a steady state, and gets a zero derivative. Forward and
    reverse mode alike.

    Supports `SaveAt(t1=True)` (with any `fn`), and `t0=True`; not `ts`, `steps` or
    `dense`, whose values are not steady states.

    !!! note

        The gradient is only meaningful at a steady state: check that the solve
        ended there (`sol.result`, or the event that fired). It is the derivative of
        the steady state near the one found, as in diffrax.
    """

    discrete: ClassVar[bool] = False

    def check(self, problem: Problem) -> None:
        unsupported = []
        if any(save.ts is not None or save.every for save in problem.saves):
            unsupported.append("SaveAt(ts=...) or SaveAt(steps=...)")
        if problem.dense:
            unsupported.append("SaveAt(dense=True)")
        if unsupported:
            raise UnsupportedError(
                "Can only use `adjoint=ImplicitAdjoint()` with "
                "`saveat=SaveAt(t1=True)` (or `SaveAt(t0=True, t1=True)`): "
                "ImplicitAdjoint differentiates the final (steady) state only; it "
                "does not support " + ", ".join(unsupported) + "."
            )

    def loop(self, problem: Problem) -> Outputs:
        fixed = nograd(problem)
        carry, bufs = run(fixed, *_loop.init(fixed))
        carry = carry._replace(y=_steady_state(problem, carry.t, carry.y))
        return _loop.finish(problem, carry, bufs)


def _steady_state(problem: Problem, t, y_star):
    """`y_star`, with the derivative of the root of `f(t, ·, θ)` by the implicit
    function theorem: one Newton correction `δ = -J^{-1} f(y*)` (with `J = ∂f/∂y` at
    `y*`, not differentiated) whose value is taken away again."""
    t, y_star = lax.stop_gradient((t, y_star))
    rate = lambda y: total_vf(problem.terms, t, y, problem.args)  # noqa: E731
    _, jac, _ = value_and_jacobian(lambda _, y: rate(y), t, y_star)
    lu = lu_factorisation(lax.stop_gradient(jac))
    delta = lu.solve(jtu.tree_map(jnp.negative, rate(y_star)))
    return jtu.tree_map(lambda y, d: y + d - lax.stop_gradient(d), y_star, delta)
