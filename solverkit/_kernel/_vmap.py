"""`jax.vmap(diffeqsolve)` on the whole-solve kernel.

On a TPU a vmapped solve is a lockstep loop whose every step is several small
kernels, bound by their launches; the whole-solve kernel runs the same batch in one
(`ensemble_solve`'s kernel path). `vmappable` wraps a solve's forward pass in a
batching rule (`jax.custom_batching.custom_vmap`) that takes the kernel where the
batch is one it can solve: the vmap batches only the initial state, the array
arguments and the values the vector field closes over (the rule moves the batched
ones into the kernel's per-trajectory arguments). Anything else batched (times,
tolerances, ...) falls back to the plain vmap of the same traced solve.

The rule serves the forward pass only: the solve is a `custom_vjp` whose forward
rule is the plain solve's (`jax.vjp` of it), so a differentiated solve, vmapped or
not, runs exactly as it would without this module (JAX can't transpose a
`custom_vmap`). So it applies only to the adjoints that support reverse mode alone.
"""

import dataclasses
import os
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_batching import custom_vmap

from .._adjoint._backsolve import BacksolveAdjoint
from .._adjoint._base import AbstractAdjoint
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


def vmappable(problem: Problem, adjoint: AbstractAdjoint, keep) -> bool:
    """Whether `solve` should wrap this solve: on (`ENABLED`), an adjoint in
    `_REVERSE_ONLY`, and a solve the kernel supports (as `ensemble_solve` takes it)."""
    if not _enabled() or type(adjoint) not in _REVERSE_ONLY:
        return False
    if not _field.by_default(problem) or problem.event.conds is not None:
        return False
    if _differentiated(problem):  # the wrapper would go unused
        return False
    batch_of_one = jtu.tree_map(lambda x: x[None], problem.y0)
    return supported(problem, batch_of_one, None, keep) is None


def _differentiated(tree) -> bool:
    """Whether a leaf is being differentiated here: a JVP (or linearize) tracer,
    itself or under `vmap`'s. Then the solve's `custom_vjp` takes its forward rule and
    the wrapper would only cost tracing. Best effort (JAX's tracer classes): where it
    can't tell, False, and the wrapper (correct either way) stays."""
    try:
        from jax._src.interpreters import ad, batching
    except ImportError:  # pragma: no cover - a JAX without these modules
        return False
    jvp = tuple(
        getattr(ad, n) for n in ("JVPTracer", "LinearizeTracer") if hasattr(ad, n)
    )
    for x in jtu.tree_leaves(tree):
        while isinstance(x, jax.core.Tracer):
            if isinstance(x, jvp):
                return True
            x = getattr(x, "val", None) if isinstance(x, batching.BatchTracer) else None
    return False


def _enabled() -> bool:
    if ENABLED is not None:
        return ENABLED
    setting = os.environ.get("SOLVERKIT_VMAP_KERNEL", "")
    if setting in ("0", "1"):
        return setting == "1"
    return jax.default_backend() == "tpu"


def solve(body: Callable[[Problem], Solution], problem: Problem, throw: bool):
    """`body(problem)`, which a `vmap` of it runs on the kernel where it can.

    **Arguments:**

    - `body`: the solve, `Problem -> Solution` (`vmappable(problem, ...)` was True).
    - `problem`: its problem.
    - `throw`: whether the kernel path raises on a failed trajectory (as `body`).

    **Returns:**

    What `body(problem)` returns; under `vmap`, the kernel's solution where the
    rule takes it (equal to the vmapped `body`'s to the tolerance's order).
    """
    dynamic, static = eqx.partition(problem, eqx.is_array)
    flat, in_tree = jtu.tree_flatten(dynamic)
    out_static = []

    def arrays_of(flat):  # the solve's array outputs, flattened
        sol = body(eqx.combine(jtu.tree_unflatten(in_tree, flat), static))
        arrays, rest = eqx.partition(sol, eqx.is_array)
        leaves, tree = jtu.tree_flatten(arrays)
        out_static[:] = [rest, tree]
        return leaves

    @jax.custom_vjp
    def run(flat):
        closed = jax.make_jaxpr(arrays_of)(flat)
        evaluate = lambda flat: jax.core.eval_jaxpr(  # noqa: E731
            closed.jaxpr, closed.consts, *flat
        )
        batched = custom_vmap(evaluate)

        @batched.def_vmap
        def rule(axis_size, in_batched, flat):
            (flags,) = in_batched
            out = _on_kernel(problem, in_tree, static, flat, flags, throw, closed)
            if out is None:  # the plain vmap of the traced solve
                in_axes = ([0 if b else None for b in flags],)
                out = jax.vmap(evaluate, in_axes=in_axes, axis_size=axis_size)(flat)
            return out, [True] * len(out)

        return batched(flat)

    def run_fwd(flat):
        return jax.vjp(arrays_of, flat)

    def run_bwd(pull_back, cotangents):
        return pull_back(cotangents)

    run.defvjp(run_fwd, run_bwd)
    leaves = run(flat)
    rest, tree = out_static
    return eqx.combine(jtu.tree_unflatten(tree, leaves), rest)


def _batched_paths(in_tree, flags) -> list[tuple]:
    """The attribute paths (`("y0", ...)`) of the problem's batched leaves."""
    marked = jtu.tree_unflatten(in_tree, flags)
    with_paths = jtu.tree_flatten_with_path(marked)[0]
    return [
        tuple(getattr(k, "name", None) for k in path) for path, b in with_paths if b
    ]


def _on_kernel(problem, in_tree, static, flat, flags, throw, closed):
    """The rule's kernel path: the batched solve's output leaves, or `None` where
    something other than `y0`, `args` and the field's closed-over values is batched
    (or the kernel can't solve it after all)."""
    allowed = (("y0",), ("args",), ("terms", "closure", "consts"))
    for path in _batched_paths(in_tree, flags):
        if not any(path[: len(a)] == a for a in allowed):
            return None
    size = next(x.shape[0] for x, b in zip(flat, flags) if b)
    batched = jtu.tree_unflatten(in_tree, flags)
    full = eqx.combine(jtu.tree_unflatten(in_tree, flat), static)
    one = eqx.combine(
        jtu.tree_unflatten(in_tree, [x[0] if b else x for x, b in zip(flat, flags)]),
        static,
    )
    closure = full.terms.closure
    const_flags = batched.terms.closure.consts
    arg_leaves, arg_tree = jtu.tree_flatten(full.args)
    arg_flags = jtu.tree_leaves(batched.args)
    arg_flags += [False] * (len(arg_leaves) - len(arg_flags))  # non-array leaves
    lane_args = [a for a, b in zip(arg_leaves, arg_flags) if b]
    lane_consts = [c for c, b in zip(closure.consts, const_flags) if b]

    def field(t, y, pack):
        args_in, consts_in = iter(pack[0]), iter(pack[1])
        args = [next(args_in) if b else a for a, b in zip(arg_leaves, arg_flags)]
        consts = tuple(
            next(consts_in) if b else c for c, b in zip(closure.consts, const_flags)
        )
        return Closure(consts, closure.program)(
            t, y, jtu.tree_unflatten(arg_tree, args)
        )

    pack = (lane_args, lane_consts)
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
            sol = kernel_solve(kernel_problem, y0, pack, throw, _unreachable)
        except KernelUnsupported:
            return None
    return _like_body(sol, one, closed.out_avals, size)


def _like_body(sol: Solution, problem: Problem, avals, size: int) -> list:
    """The kernel's `Solution` as the flat array outputs of the vmapped body."""
    stats = dict(sol.stats)
    del stats["lanes"], stats["lane_steps"]
    stats["max_steps"] = problem.max_steps
    sol = dataclasses.replace(sol, stats=stats)
    leaves = jtu.tree_leaves(eqx.filter(sol, eqx.is_array))
    if len(leaves) != len(avals):
        raise AssertionError(f"{len(leaves)} kernel outputs for {len(avals)}")
    out = []
    for x, aval in zip(leaves, avals):
        if x.shape != (size, *aval.shape):
            raise AssertionError(f"kernel output {x.shape}, expected {aval.shape}")
        out.append(x.astype(aval.dtype))
    return out


def _unreachable(*_):
    raise AssertionError("the vmap rule's kernel solve is never differentiated")
