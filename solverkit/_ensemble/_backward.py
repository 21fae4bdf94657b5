"""`ensemble_solve` in reverse mode: the backward rule of the `custom_vjp` around the
lane loop.

Each trajectory is solved again as `diffeqsolve` solves it, with the user's
`adjoint`, and pulled back through that solve (the same steps as the lane loop
took for it). The trajectories go through in chunks of `lanes`, each chunk a
lockstep `vmap`, longest first (sorted by the steps each took forwards), so that
the trajectories of a chunk take about as many steps as one another and few lanes
idle: the work is close to the sum of the steps, as in the forward pass, rather
than `N` times the longest.
"""

import dataclasses

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._adjoint._base import fill_zeros, parameters
from .._progress import NoProgressMeter
from ._lanes import row, with_lane


def _pull_back(static, p_rest, final, adjoint):
    """`pull_back(p_diff, y, a_diff, tm, a_rest, ct)`: the cotangents of
    `(p_diff, y, a_diff, tm)` from `ct`, those of a lockstep `vmap` of solves (one
    per row of `y`) with the problem's differentiated arrays `p_diff`."""

    def one(p_diff, y, a_diff, tm, a_rest):
        problem = eqx.combine(p_diff, p_rest, static)
        problem = dataclasses.replace(problem, meter=NoProgressMeter())
        problem = with_lane(problem, y, eqx.combine(a_diff, a_rest), tm)
        out = row(problem, adjoint.loop(problem), final)
        return eqx.filter(out, eqx.is_inexact_array)

    def pull_back(p_diff, y, a_diff, tm, a_rest, ct):
        solve = jax.vmap(one, in_axes=(None, 0, 0, 0, 0))
        _, vjp = jax.vjp(
            lambda p, y, a, tm: solve(p, y, a, tm, a_rest), p_diff, y, a_diff, tm
        )
        return vjp(ct)

    return pull_back


def _in_chunks(pull_back, p_diff, inputs, ct_out, num_steps, lanes: int):
    """`pull_back` over chunks of `lanes` trajectories, longest first: the
    cotangents of `p_diff` summed over the chunks, and those of each trajectory's
    inputs in the order of the input."""
    batch = num_steps.shape[0]
    chunks = -(-batch // lanes)
    size = chunks * lanes
    # The last chunk is padded with copies of the shortest trajectory, which get no
    # cotangent.
    order = jnp.argsort(-num_steps, stable=True)
    order = jnp.concatenate([order, jnp.full(size - batch, order[-1])])
    valid = jnp.arange(size) < batch

    def rows(x, mask: bool = False):
        x = x[order]
        if mask:
            x = jnp.where(valid.reshape((size,) + (1,) * (x.ndim - 1)), x, 0)
        return x.reshape((chunks, lanes) + x.shape[1:])

    def body(ct_p, xs):
        dp, *rest = pull_back(p_diff, *xs)
        ct_p = jtu.tree_map(lambda c, d: c + d.astype(c.dtype), ct_p, dp)
        return ct_p, tuple(rest)

    xs = (*jtu.tree_map(rows, inputs), jtu.tree_map(lambda c: rows(c, True), ct_out))
    zeros = jtu.tree_map(lambda p: jnp.zeros(p.shape, p.dtype), p_diff)
    ct_p, ct_inputs = lax.scan(body, zeros, xs)
    # Trajectory `i` is row `position[i]` of the chunks.
    position = (
        jnp.zeros(batch, order.dtype)
        .at[order[:batch]]
        .set(jnp.arange(batch, dtype=order.dtype))
    )
    unsort = lambda x: x.reshape((size,) + x.shape[2:])[position]  # noqa: E731
    return ct_p, jtu.tree_map(unsort, ct_inputs)


def backward(static, dynamic, residuals, ct_out, lanes: int, final, adjoint):
    """The cotangents of the problem's arrays (`dynamic`), `y0`, `args` (its array
    leaves) and the per-trajectory times, from those of every trajectory's outputs
    (`ct_out`); `residuals` are `(y0, args_dynamic, times, num_steps)`."""
    y0, args_dynamic, times, num_steps = residuals
    ct_out = eqx.filter(ct_out, eqx.is_inexact_array)
    # A lane's own `y0` and `args` replace the problem's (`with_lane`).
    spec = dataclasses.replace(parameters(dynamic), y0=False, args=False)
    p_diff, p_rest = eqx.partition(dynamic, spec)
    a_diff, a_rest = eqx.partition(args_dynamic, eqx.is_inexact_array)
    pull_back = _pull_back(static, p_rest, final, adjoint)
    if num_steps.shape[0] <= lanes:
        ct_p, ct_y, ct_a, ct_t = pull_back(p_diff, y0, a_diff, times, a_rest, ct_out)
    else:
        inputs = (y0, a_diff, times, a_rest)
        ct_p, (ct_y, ct_a, ct_t) = _in_chunks(
            pull_back, p_diff, inputs, ct_out, num_steps, lanes
        )
    nothing = lambda tree: jtu.tree_map(lambda _: None, tree)  # noqa: E731
    ct_dynamic = fill_zeros(eqx.combine(ct_p, nothing(p_rest)), dynamic)
    ct_args = fill_zeros(eqx.combine(ct_a, nothing(a_rest)), args_dynamic)
    # `times` holds floating arrays only, each differentiated.
    return ct_dynamic, fill_zeros(ct_y, y0), ct_args, ct_t
