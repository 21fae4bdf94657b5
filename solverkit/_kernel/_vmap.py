"""`jax.vmap(diffeqsolve)` on the whole-solve kernel.

On a TPU a vmapped solve is a lockstep loop whose every step is several small
kernels, bound by their launches; the whole-solve kernel runs the same batch in one
(`ensemble_solve`'s kernel path). `vmap_aware` wraps a solve (as `mode` says) in a
batching rule (`jax.custom_batching.custom_vmap`) that takes the kernel where the
batch is one it can solve: the vmap batches only the initial state, the array
arguments and the values the vector field closes over (the rule moves the batched
ones into the kernel's per-trajectory arguments). Anything else batched (times,
tolerances, ...) falls back to the plain vmap of the same traced solve.

Reverse mode: JAX can't transpose a `custom_vmap`, so the solve is a `custom_vjp`
whose rules are `custom_vmap`s too, where a vmap is seen among the solve's inputs
(`mode` "gradient"): its forward rule runs the kernel (the residuals are the
inputs), its backward rule pulls back through the kernel path's own reverse mode
(forward sensitivities in the kernel, or the vmapped solve's adjoint where those
don't apply), as `ensemble_solve(kernel=True)` does. Where no vmap is seen (inside a
`jit` that a `vmap` may batch later: `mode` "forward") the forward rule is the plain
solve's (`jax.vjp` of it). A solve seen differentiated but not batched, or
differentiated twice (forward over reverse: the kernel's rules can't be
differentiated in forward mode), is not wrapped at all. It applies only to the
adjoints that support reverse mode alone.
"""

import dataclasses
import os
from collections.abc import Callable

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_batching import custom_vmap

from .._adjoint._backsolve import BacksolveAdjoint
from .._adjoint._base import AbstractAdjoint, zeros_cotangent
from .._adjoint._checkpoint import RecursiveCheckpointAdjoint
from .._closure._convert import Closure, closure_convert
from .._problem import Problem
from .._solution import Solution
from .._term import ClosureTerm
from . import _field
from ._scalarize import KernelUnsupported
from ._solve import kernel_solve, supported


# Put vmapped solves on the kernel: True / False, or None (default): as the
# environment variable SOLVERKIT_VMAP_KERNEL says ("1" / "0"), else on a TPU only,
# where it was measured faster (the kernel lowers to TPUs only; elsewhere it runs in
# Pallas' interpreter, which tests use by setting this True).
ENABLED: bool | None = None
# The adjoints whose reverse mode is a `custom_vjp` anyway (no forward mode to lose).
_REVERSE_ONLY = (RecursiveCheckpointAdjoint, BacksolveAdjoint)
# What the rule may see batched: the problem's paths to them.
_ALLOWED = (("y0",), ("args",), ("terms", "closure", "consts"))


def vmap_aware(
    solve: Callable, problem: Problem, adjoint: AbstractAdjoint, throw, final
):
    """`solve(problem, adjoint, throw, final)` (a traced solve), wrapped as `mode`
    says so that a `vmap` of it runs on the kernel."""
    wrap = mode(problem, adjoint, final)
    if wrap is None:
        return solve(problem, adjoint, throw, final)
    body = lambda p, raising: solve(p, adjoint, raising, final)  # noqa: E731
    return wrapped(body, problem, throw, wrap == "gradient", adjoint.discrete)


def mode(problem: Problem, adjoint: AbstractAdjoint, final) -> str | None:
    """How `wrapped` should wrap this solve: `None` (not at all), "forward" (a rule for
    the forward pass) or "gradient" (rules for reverse mode too, where a vmap of
    what the rule takes is seen among its inputs). Only when on (`ENABLED`), for an
    adjoint in `_REVERSE_ONLY`, and a solve the kernel supports (as
    `ensemble_solve` takes it)."""
    if not _enabled() or type(adjoint) not in _REVERSE_ONLY:
        return None
    if not _field.by_default(problem) or problem.event.conds is not None:
        return None
    batch_of_one = jtu.tree_map(lambda x: x[None], problem.y0)
    if supported(problem, batch_of_one, None, final) is not None:
        return None
    differentiated, batched = _seen(problem)
    if differentiated > 1:  # the rules would be differentiated: not the kernel's
        return None
    if differentiated and not adjoint.discrete:  # its own reverse mode: the loop's
        return None
    if batched and all(_allowed(path) for path in batched):
        return "gradient"
    if differentiated or batched:  # the wrapper would go unused
        return None
    return "forward"


def _path(keys) -> tuple:
    return tuple(getattr(k, "name", None) for k in keys)


def _allowed(path: tuple) -> bool:
    return any(path[: len(a)] == a for a in _ALLOWED)


def _seen(problem: Problem) -> tuple[int, list[tuple]]:
    """How many differentiations see the problem here (JVP or linearize traces whose
    tracers are among its leaves, themselves or under `vmap`'s), and the paths of the
    leaves a `vmap` batches (a batch tracer's, itself or under a JVP's). Best effort
    (JAX's tracer classes): what it can't see is taken as absent, and the "forward"
    wrapper, correct either way, serves."""
    try:
        from jax._src.interpreters import ad, batching
    except ImportError:  # pragma: no cover - a JAX without these modules
        return 0, []
    jvp = tuple(
        getattr(ad, n) for n in ("JVPTracer", "LinearizeTracer") if hasattr(ad, n)
    )
    traces, batched = set(), []
    for keys, x in jtu.tree_flatten_with_path(eqx.filter(problem, eqx.is_array))[0]:
        while isinstance(x, jax.core.Tracer):
            if isinstance(x, jvp):
                traces.add(id(getattr(x, "_trace", x)))
                x = getattr(x, "primal", None)
            elif isinstance(x, batching.BatchTracer):
                if x.batch_dim is not None:
                    batched.append(_path(keys))
                x = x.val
            else:
                break
    return len(traces), batched


def _enabled() -> bool:
    if ENABLED is not None:
        return ENABLED
    setting = os.environ.get("SOLVERKIT_VMAP_KERNEL", "")
    if setting in ("0", "1"):
        return setting == "1"
    return jax.default_backend() == "tpu"


class _Fallback(Exception):
    """The kernel can't take this batch: the plain vmap does."""


def wrapped(
    body: Callable[[Problem, bool], Solution],
    problem: Problem,
    throw: bool,
    gradient: bool,
    tangents: bool,
) -> Solution:
    """`body(problem, throw)`, which a `vmap` of it runs on the kernel where it can.

    **Arguments:**

    - `body`: the solve, `(problem, throw) -> Solution` (`mode` was not `None`).
    - `problem`: its problem.
    - `throw`: whether to raise on a failed trajectory.
    - `gradient`: `mode` was "gradient": the reverse-mode rules are batching rules
        too.
    - `tangents`: whether the kernel's forward sensitivities may serve reverse mode
        (`AbstractAdjoint.discrete`).

    **Returns:**

    What `body(problem, throw)` returns; under `vmap`, the kernel's solution where
    the rule takes it (equal to the vmapped `body`'s to the tolerance's order).
    """
    dynamic, static = eqx.partition(problem, eqx.is_array)
    flat, in_tree = jtu.tree_flatten(dynamic)
    out = {}  # what tracing the plain solve found: its output's static part, avals

    def arrays_of(flat, raising=throw):  # the solve's array outputs, flattened
        sol = body(eqx.combine(jtu.tree_unflatten(in_tree, flat), static), raising)
        arrays, rest = eqx.partition(sol, eqx.is_array)
        leaves, tree = jtu.tree_flatten(arrays)
        out.update(rest=rest, tree=tree, avals=[_aval(x) for x in leaves])
        return leaves

    def on_kernel(flat, flags, raising):
        got = _on_kernel(in_tree, static, flat, flags, raising, tangents)
        if got is None:
            raise _Fallback
        return _like_body(got, problem.max_steps, out["avals"])

    run = jax.custom_vjp(_primal(arrays_of, on_kernel, throw))
    if gradient:
        run.defvjp(*_batched_rules(arrays_of, on_kernel, throw, tangents))
    else:
        run.defvjp(lambda flat: jax.vjp(arrays_of, flat), lambda pull, ct: pull(ct))
    leaves = run(flat)
    return eqx.combine(jtu.tree_unflatten(out["tree"], leaves), out["rest"])


def _aval(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _axes(flags) -> list:
    return [0 if b else None for b in flags]


def _primal(arrays_of, on_kernel, throw):
    """The forward solve: the traced plain solve, the kernel under `vmap`."""

    def primal(flat):
        closed = jax.make_jaxpr(arrays_of)(flat)
        evaluate = lambda flat: jax.core.eval_jaxpr(  # noqa: E731
            closed.jaxpr, closed.consts, *flat
        )
        batched = custom_vmap(evaluate)

        @batched.def_vmap
        def rule(axis_size, in_batched, flat):
            (flags,) = in_batched
            try:
                leaves = on_kernel(flat, flags, throw)
            except _Fallback:  # the plain vmap of the traced solve
                run = jax.vmap(evaluate, in_axes=(_axes(flags),), axis_size=axis_size)
                leaves = run(flat)
            return leaves, [True] * len(leaves)

        return batched(flat)

    return primal


def _batched_rules(arrays_of, on_kernel, throw, tangents):
    """The `custom_vjp` rules, each a batching rule too: forward, the kernel (its
    residuals the inputs); backward, a pull-back through the kernel path's own
    reverse mode. Unbatched, they never run: the wrapper is "gradient" only where
    a vmap batches the problem, whose rules then serve every call (the unbatched
    backward rule raises at run time rather than return a wrong gradient)."""
    fwd = custom_vmap(lambda flat: (arrays_of(flat), flat))

    @fwd.def_vmap
    def fwd_rule(axis_size, in_batched, flat):
        (flags,) = in_batched
        try:
            leaves = on_kernel(flat, flags, throw)
        except _Fallback:
            run = jax.vmap(arrays_of, in_axes=(_axes(flags),), axis_size=axis_size)
            leaves = run(flat)
        return (leaves, flat), ([True] * len(leaves), list(flags))

    def bwd_plain(flat, ct):
        del ct
        never = eqx.error_if(jnp.zeros(()), jnp.asarray(True), _NEVER)
        return [_guarded(zeros_cotangent(x), never) for x in flat]

    bwd = custom_vmap(bwd_plain)

    @bwd.def_vmap
    def bwd_rule(axis_size, in_batched, flat, ct):
        flags, ct_flags = in_batched
        ct = [c if b else _broadcast(c, axis_size) for c, b in zip(ct, ct_flags)]
        try:
            if not tangents:
                raise _Fallback
            _, pull = jax.vjp(lambda f: on_kernel(f, flags, False), flat)
            (ct_flat,) = pull(ct)
        except _Fallback:  # the plain solve again, and its adjoint

            def pull_one(f, c):
                return jax.vjp(lambda f: arrays_of(f, False), f)[1](c)[0]

            run = jax.vmap(pull_one, in_axes=(_axes(flags), 0), axis_size=axis_size)
            return run(flat, ct), [True] * len(flat)
        return ct_flat, list(flags)

    return (lambda flat: fwd(flat)), (lambda flat, ct: (bwd(flat, ct),))


_NEVER = "internal error: solverkit's vmap rule's backward pass ran unbatched"


def _guarded(zero, never):
    """`zero`, made to depend on `never` (an error raised if it runs)."""
    if eqx.is_inexact_array(zero):
        return zero + never.astype(zero.dtype)
    return zero


def _broadcast(x, size: int):
    if jnp.result_type(x) == jax.dtypes.float0:
        return np.zeros((size, *jnp.shape(x)), jax.dtypes.float0)
    return jnp.broadcast_to(x, (size, *jnp.shape(x)))


def _on_kernel(in_tree, static, flat, flags, throw, tangents):
    """The rule's kernel path: the batched solve's `Solution`, or `None` where
    something other than `y0`, `args` and the field's closed-over values is batched
    (or the kernel can't solve it after all)."""
    marked = jtu.tree_flatten_with_path(jtu.tree_unflatten(in_tree, flags))[0]
    if not all(_allowed(_path(keys)) for keys, b in marked if b):
        return None
    size = next(x.shape[0] for x, b in zip(flat, flags) if b)
    batched = jtu.tree_unflatten(in_tree, flags)
    full = eqx.combine(jtu.tree_unflatten(in_tree, flat), static)
    rows = [jax.lax.stop_gradient(x[0]) if b else x for x, b in zip(flat, flags)]
    one = eqx.combine(jtu.tree_unflatten(in_tree, rows), static)  # for shapes
    closure = full.terms.closure
    const_flags = batched.terms.closure.consts
    arg_arrays, arg_rest = eqx.partition(full.args, eqx.is_array)
    arg_leaves, arg_tree = jtu.tree_flatten(arg_arrays)
    arg_flags = jtu.tree_leaves(batched.args)

    def field(t, y, pack):
        args_in, consts_in = iter(pack[0]), iter(pack[1])
        args = [next(args_in) if b else a for a, b in zip(arg_leaves, arg_flags)]
        consts = tuple(
            next(consts_in) if b else c for c, b in zip(closure.consts, const_flags)
        )
        args = eqx.combine(jtu.tree_unflatten(arg_tree, args), arg_rest)
        return Closure(consts, closure.program)(t, y, args)

    pack = (
        [a for a, b in zip(arg_leaves, arg_flags) if b],
        [c for c, b in zip(closure.consts, const_flags) if b],
    )
    pack_one = jtu.tree_map(lambda x: x[0], pack)
    y0 = jtu.tree_map(
        lambda y, b: y if b else jnp.broadcast_to(y, (size, *y.shape)),
        full.y0,
        batched.y0,
    )

    with jax.numpy_dtype_promotion("standard"):
        term = ClosureTerm(closure_convert(field, one.t0, one.y0, pack_one), None)
        kernel_problem = dataclasses.replace(one, terms=term, args=pack_one)
        if supported(kernel_problem, y0, None, (False,) * 3) is not None:
            return None
        try:
            return kernel_solve(
                kernel_problem, y0, pack, throw, _no_reference, tangents=tangents
            )
        except KernelUnsupported:
            return None


def _no_reference(*_):
    """Where the kernel's forward sensitivities don't serve reverse mode: the
    backward rule takes the plain solve's instead."""
    raise _Fallback


def _like_body(sol: Solution, max_steps, avals) -> list:
    """The kernel's `Solution` as the flat array outputs of the vmapped solve."""
    stats = dict(sol.stats)
    del stats["lanes"], stats["lane_steps"]
    stats["max_steps"] = max_steps
    sol = dataclasses.replace(sol, stats=stats)
    leaves = jtu.tree_leaves(eqx.filter(sol, eqx.is_array))
    if len(leaves) != len(avals):
        raise AssertionError(f"{len(leaves)} kernel outputs for {len(avals)}")
    out = []
    for x, aval in zip(leaves, avals):
        if x.shape[1:] != aval.shape:
            raise AssertionError(f"kernel output {x.shape}, expected {aval.shape}")
        out.append(x.astype(aval.dtype))
    return out
