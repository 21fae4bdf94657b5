"""The kernel's backward pass by forward sensitivities (`_tangent`): one kernel run
carries the tangent of every trajectory along each of its inputs (state components,
per-trajectory argument components, elements of the values the field closes over),
and the cotangents are contracted with them.

Its cost grows with the number of directions, not with the outputs, so it is used
for few of them (`MAX_DIRECTIONS`), no event and a Runge-Kutta method (a Rosenbrock
step's tangent is not this system's); otherwise the lane loop's backward
pass (`_ensemble._backward`) runs.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._adjoint._base import fill_zeros, parameters
from .._problem import Problem
from .._select import where
from .._solver._rosenbrock import AbstractRosenbrock


# Directions (inputs per trajectory plus shared scalars) up to which the backward
# pass is this one.
MAX_DIRECTIONS = 32


def _size(x, batch: int) -> int:
    return int(np.prod(x.shape, dtype=int)) // batch


def directions_of(problem: Problem, y0, args_dynamic) -> tuple | None:
    """The directions of every differentiable input, or `None` where this backward
    pass does not apply (`why_not` says why)."""
    if _excluded(problem) is not None:
        return None
    leaves = jtu.tree_leaves(y0)
    batch = leaves[0].shape[0]
    n = sum(_size(x, batch) for x in leaves)
    out: list = [("state", j) for j in range(n)]
    for i, a in enumerate(jtu.tree_leaves(args_dynamic)):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            out += [("arg", i, c) for c in range(_size(a, batch))]
    consts = problem.terms.closure.consts  # pyright: ignore[reportAttributeAccessIssue]
    for i, c in enumerate(consts):
        if jnp.issubdtype(c.dtype, jnp.inexact):
            out += [("const", i, e) for e in range(int(np.prod(c.shape, dtype=int)))]
    return tuple(out) if len(out) <= MAX_DIRECTIONS else None


def why_not(problem: Problem, y0, args_dynamic) -> str | None:
    """Why this backward pass does not apply, or `None` where it does."""
    excluded = _excluded(problem)
    if excluded is not None:
        return excluded
    if directions_of(problem, y0, args_dynamic) is None:
        return f"more than {MAX_DIRECTIONS} differentiable inputs per trajectory"
    return None


def _excluded(problem: Problem) -> str | None:
    """An event, a Rosenbrock solver, or a field with a custom derivative rule
    (`jax.custom_jvp` / `jax.custom_vjp`: the tangents here would differentiate the
    rule's primal code, not take the rule, as reverse mode does)."""
    if problem.event.conds is not None:
        return "an event"
    if isinstance(problem.solver, AbstractRosenbrock):
        return "a Rosenbrock solver"
    closure = problem.terms.closure  # pyright: ignore[reportAttributeAccessIssue]
    if has_custom_rule(closure.jaxpr):
        return "the vector field has a custom_jvp / custom_vjp rule"
    return None


_CUSTOM = ("custom_jvp_call", "custom_vjp_call", "custom_lin")


def has_custom_rule(jaxpr) -> bool:
    """Whether `jaxpr` (or one nested in it) calls a `custom_jvp` / `custom_vjp`."""
    for eqn in jaxpr.eqns:
        if any(eqn.primitive.name.startswith(c) for c in _CUSTOM):
            return True
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if hasattr(inner, "eqns") and has_custom_rule(inner):
                    return True
    return False


def _contract(ct_ys, rows, written):
    """Per trajectory, `Σ ct · tangent` over the saved rows that were written (the
    others, padding, hold `inf`). A written row's NaN or infinite tangent stays, even
    where its cotangent is zero (a trajectory that blew up, masked out of the
    loss): `0 · NaN`, as reverse mode gives."""

    def term(c, t):
        mask = written.reshape(written.shape + (1,) * (t.ndim - 2))
        return jnp.sum((c * where(mask, t, 0)).reshape(c.shape[0], -1), axis=1)

    return sum(jtu.tree_leaves(jtu.tree_map(term, ct_ys, rows)))


def pull_back(
    forward, problem: Problem, y0, args_dynamic, directions, ct_ys, per_lane=False
):
    """The cotangents of `(problem's closed-over values, y0, args_dynamic)`.

    **Arguments:**

    - `forward`: `(problem, y0, args_dynamic, directions) -> (ys rows, [ys rows
        of each direction's tangent], which rows were written)`, the kernel with
        forward sensitivities (`_solve._tangent_rows`).
    - `problem`, `y0`, `args_dynamic`: as the forward pass took them.
    - `directions`: from `directions_of`.
    - `ct_ys`: the cotangent of the saved rows `ys`.
    - `per_lane`: give each closed-over value's cotangent per trajectory (a leading
        batch axis), not summed over the batch.

    **Returns:**

    `(ct_consts, ct_y0, ct_args)`: a list over the field's closed-over values
    (`None` for those not differentiated), and pytrees like `y0`, `args_dynamic`
    (`None` leaves where not differentiated).
    """
    _, tangents, written = forward(problem, y0, args_dynamic, directions)
    g = [_contract(ct_ys, t, written) for t in tangents]
    leaves, tree = jtu.tree_flatten(y0)
    batch = leaves[0].shape[0]
    by_kind: dict = {}
    for d, gk in zip(directions, g):
        by_kind.setdefault((d[0],) + tuple(d[1:-1]), []).append(gk)
    state = jnp.stack(by_kind[("state",)], axis=1)  # (N, n) in leaf order
    ct_y, start = [], 0
    for x in leaves:
        size = _size(x, batch)
        ct_y.append(state[:, start : start + size].reshape(x.shape).astype(x.dtype))
        start += size
    ct_args = []
    for i, a in enumerate(jtu.tree_leaves(args_dynamic)):
        parts = by_kind.get(("arg", i))
        if parts is not None:
            parts = jnp.stack(parts, 1).reshape(a.shape).astype(a.dtype)
        ct_args.append(parts)
    consts = problem.terms.closure.consts  # pyright: ignore[reportAttributeAccessIssue]
    ct_consts = []
    for i, c in enumerate(consts):
        parts = by_kind.get(("const", i))
        if parts is not None and per_lane:
            parts = jnp.stack(parts, 1).reshape((batch, *c.shape)).astype(c.dtype)
        elif parts is not None:
            parts = jnp.stack([jnp.sum(p) for p in parts])
            parts = parts.reshape(c.shape).astype(c.dtype)
        ct_consts.append(parts)
    args_tree = jtu.tree_structure(args_dynamic)
    return (
        ct_consts,
        jtu.tree_unflatten(tree, ct_y),
        jtu.tree_unflatten(args_tree, ct_args),
    )


def with_consts(dynamic: Problem, ct_consts: list) -> Problem:
    """A cotangent of the problem's arrays: `ct_consts` at the field's closed-over
    values, `None` elsewhere."""
    nothing = jtu.tree_map(lambda _: None, dynamic)
    return eqx.tree_at(
        lambda p: p.terms.closure.consts,
        nothing,
        tuple(ct_consts),
        is_leaf=lambda x: x is None,
    )


# Where forward sensitivities reach: the problem's leaves under these paths.
_TANGENT_INPUTS = (("y0",), ("args",), ("terms", "closure", "consts"))


def perturbed_elsewhere(dynamic: Problem, flags) -> list[str]:
    """The paths of the problem's differentiated leaves that forward sensitivities
    don't reach (times, `dt0`, save times, tolerances, ...)."""
    spec = jtu.tree_leaves(parameters(dynamic))
    out = []
    for (keys, flag), differentiable in zip(jtu.tree_flatten_with_path(flags)[0], spec):
        path = tuple(getattr(k, "name", None) for k in keys)
        inside = any(path[: len(a)] == a for a in _TANGENT_INPUTS)
        if flag and differentiable and not inside:
            out.append(".".join(str(k) for k in path if k is not None))
    return out


def _outputs(sol) -> dict:
    """The differentiable outputs of the `vmap` path's `Solution`."""
    return dict(ts=sol.ts, ys=sol.ys, t1=sol.t1)


def through(reference, static, dynamic, y0, args_dynamic, ct):
    """The cotangents of `(dynamic, y0, args_dynamic)` through `reference`, the
    `vmap` path (forward and backward)."""
    spec = parameters(dynamic)
    p_diff, p_rest = eqx.partition(dynamic, spec)
    a_diff, a_rest = eqx.partition(args_dynamic, eqx.is_inexact_array)

    def solve(p, y, a):
        problem = eqx.combine(p, p_rest, static)
        return _outputs(reference(problem, y, eqx.combine(a, a_rest)))

    _, vjp = jax.vjp(solve, p_diff, y0, a_diff)
    ct_p, ct_y, ct_a = vjp(ct)
    nothing = lambda tree: jtu.tree_map(lambda _: None, tree)  # noqa: E731
    ct_dynamic = fill_zeros(eqx.combine(ct_p, nothing(p_rest)), dynamic)
    ct_args = fill_zeros(eqx.combine(ct_a, nothing(a_rest)), args_dynamic)
    return ct_dynamic, fill_zeros(ct_y, y0), ct_args
