"""The `vmap` rule's kernel side (`_vmap`): the batched solve as `kernel_solve`
takes it (the batched `args` and closed-over values moved into its per-trajectory
arguments, the shared ones closed over by its field), and its `Solution` back as
the vmapped solve's flat outputs."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._closure._convert import Closure, closure_convert
from .._solution import Solution
from .._term import ClosureTerm
from ._scalarize import KernelUnsupported
from ._solve import kernel_solve, supported


# What the rule may see batched: the problem's paths to them.
ALLOWED = (("y0",), ("args",), ("terms", "closure", "consts"))


class Fallback(Exception):
    """The kernel can't take this batch: the plain vmap does."""


def names(paths) -> str:
    return ", ".join(".".join(str(k) for k in p if k is not None) for p in paths)


def path_of(keys) -> tuple:
    return tuple(getattr(k, "name", None) for k in keys)


def allowed(path: tuple) -> bool:
    return any(path[: len(a)] == a for a in ALLOWED)


def kernel_problem(in_tree, static, flat, flags):
    """The batched solve as the kernel takes it, `(problem, y0, pack)`: the field
    takes the batched `args` and closed-over values in `pack` (per trajectory) and
    closes over the shared ones; or why the kernel can't (something other than
    `y0`, `args` and the field's closed-over values batched)."""
    marked = jtu.tree_flatten_with_path(jtu.tree_unflatten(in_tree, flags))[0]
    other = [path_of(keys) for keys, b in marked if b and not allowed(path_of(keys))]
    if other:
        return f"batched {names(other)}"
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
        solved = dataclasses.replace(one, terms=term, args=pack_one)
        why = supported(solved, y0, None, (False,) * 3)
    return why if why is not None else (solved, y0, pack)


def on_kernel(in_tree, static, flat, flags, throw, tangents, probe=None):
    """The rule's kernel path: the batched solve's `Solution`, or why the kernel
    can't solve it (`kernel_problem`, or the kernel's own checks)."""
    got = kernel_problem(in_tree, static, flat, flags)
    if isinstance(got, str):
        return got
    solved, y0, pack = got
    with jax.numpy_dtype_promotion("standard"):
        try:
            return kernel_solve(
                solved, y0, pack, throw, _no_reference, tangents=tangents,
                probe=probe,
            )  # fmt: skip
        except KernelUnsupported as e:
            return str(e)


def _no_reference(*_):
    """Where the kernel's forward sensitivities don't serve reverse mode: the
    backward rule takes the plain solve's instead."""
    raise Fallback


def like_body(sol: Solution, max_steps, avals) -> list:
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
