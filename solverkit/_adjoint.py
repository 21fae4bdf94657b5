"""Adjoints: how reverse- (and forward-) mode differentiation goes through a solve.

Each adjoint is a small strategy object with one method, `loop(problem)`, which runs
the step loop of `_loop.py` and returns its `Outputs`. The `Problem`, which holds the
closure-converted vector field, is an explicit operand of every `custom_vjp` and loop.
"""

import abc
import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _loop
from ._loop import Outputs, Problem
from ._unvmap import unvmap_any, while_loop


def _zeros_cotangent(x):
    """A zero cotangent for a primal leaf (float0 for integer and boolean leaves)."""
    if x is None:
        return None
    if eqx.is_inexact_array(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


class AbstractAdjoint(eqx.Module):
    """Base class of the adjoints."""

    @abc.abstractmethod
    def loop(self, problem: Problem) -> Outputs:
        """Run the solve described by `problem`."""

    def check(self, problem: Problem) -> None:
        """Raise a `ValueError` before tracing for an unsupported combination."""


class RecursiveCheckpointAdjoint(AbstractAdjoint):
    """Discretise-then-optimise: differentiate the solver's own operations.

    The forward pass stores the loop state every `K` steps; the backward pass
    recomputes one segment of `K` steps at a time from its checkpoint and
    backpropagates through it. With `checkpoints=None`, `K = ceil(sqrt(max_steps))`,
    so memory grows like `sqrt(max_steps)` states, and the cost (about three forward
    passes and one backward pass) grows with the steps actually taken, not with
    `max_steps`.

    **Arguments:**

    - `checkpoints`: number of checkpoint slots; `None` for `ceil(sqrt(max_steps))`.
    """

    checkpoints: int | None = None

    def loop(self, problem: Problem) -> Outputs:
        carry, bufs = _loop.init(problem)
        if self.checkpoints is None:
            segment = max(1, math.isqrt(problem.max_steps - 1) + 1)
        else:
            if self.checkpoints < 1:
                raise ValueError(
                    "RecursiveCheckpointAdjoint(checkpoints=...) must be >= 1."
                )
            segment = max(1, -(-problem.max_steps // self.checkpoints))
        slots = -(-problem.max_steps // segment)
        carry, bufs = checkpointed_while(problem, carry, bufs, segment, slots)
        return _loop.finish(problem, carry, bufs)


def checkpointed_while(problem: Problem, carry, bufs, segment: int, slots: int):
    """`_loop.run_while`, made reverse-differentiable by segment checkpointing.

    Save buffers are written once per row and never read by the loop, so they are not
    checkpointed: the cotangent of each written row is read directly in the backward
    pass.
    """
    dynamic, static = eqx.partition(problem, eqx.is_array)

    @jax.custom_vjp
    def run(dynamic, carry, bufs):
        return _loop.run_while(eqx.combine(dynamic, static), (carry, bufs))

    def fwd(dynamic, carry, bufs):
        problem = eqx.combine(dynamic, static)
        meter = _loop.progress(problem)
        store = jtu.tree_map(
            lambda x: jnp.zeros((slots,) + jnp.shape(x), x.dtype), carry
        )

        def body(state, active):
            carry, bufs, store, i = state
            save = active & (i % segment == 0)
            store = jtu.tree_map(
                lambda s, x: _loop._set_row(s, i // segment, save, x), store, carry
            )
            carry, bufs = _loop.body(problem, (carry, bufs), active)
            if meter is not None:
                meter.tick(carry)
            return carry, bufs, store, i + active.astype(jnp.int32)

        init = (carry, bufs, store, jnp.asarray(0, jnp.int32))
        carry, bufs, store, n = while_loop(
            lambda s: _loop.cond(problem, s[0]), body, init
        )
        if meter is not None:
            meter.done()
        return (carry, bufs), (dynamic, store, n, bufs, carry)

    def bwd(residuals, cotangents):
        dynamic, store, n, bufs, final = residuals
        ct_carry, ct_bufs = cotangents
        diff_mask = jtu.tree_map(eqx.is_inexact_array, final)
        p_diff, p_rest = eqx.partition(dynamic, eqx.is_inexact_array)
        ct_bufs = eqx.filter(ct_bufs, eqx.is_inexact_array)

        def vjp_step(p_diff, carry, ct_next):
            c_diff, c_rest = eqx.partition(carry, diff_mask)

            def f(p_diff, c_diff):
                problem = eqx.combine(p_diff, p_rest, static)
                new, new_bufs = _loop.body(problem, (eqx.combine(c_diff, c_rest), bufs))
                return eqx.filter(new, diff_mask), eqx.filter(
                    new_bufs, eqx.is_inexact_array
                )

            _, pullback = jax.vjp(f, p_diff, c_diff)
            return pullback((ct_next, ct_bufs))

        def recompute(p_diff, start, length):
            problem = eqx.combine(p_diff, p_rest, static)
            first = jtu.tree_map(lambda s: s[start // segment], store)
            seg = jtu.tree_map(
                lambda x: jnp.zeros((segment,) + jnp.shape(x), x.dtype), first
            )

            def body(state, active):
                carry, seg, j = state
                seg = jtu.tree_map(
                    lambda s, x: _loop._set_row(s, j, active, x), seg, carry
                )
                new, _ = _loop.step(problem, carry)
                carry = _loop._where(active, new, carry)
                return carry, seg, j + active.astype(jnp.int32)

            _, seg, _ = while_loop(
                lambda s: s[2] < length, body, (first, seg, jnp.asarray(0, jnp.int32))
            )
            return seg

        def segment_body(state, active):
            s, ct_p, ct_c = state
            start = jnp.maximum(s, 0) * segment
            length = jnp.where(active, jnp.minimum(segment, n - start), 0)
            seg = recompute(p_diff, start, length)

            def back(state, active):
                j, ct_p, ct_c = state
                carry = jtu.tree_map(
                    lambda b: lax.dynamic_index_in_dim(
                        b, jnp.maximum(j, 0), keepdims=False
                    ),
                    seg,
                )
                dp, dc = vjp_step(p_diff, carry, ct_c)
                ct_p = jtu.tree_map(lambda a, b: a + jnp.where(active, b, 0), ct_p, dp)
                ct_c = _loop._where(active, dc, ct_c)
                return j - active.astype(jnp.int32), ct_p, ct_c

            _, ct_p, ct_c = while_loop(
                lambda st: st[0] >= 0, back, (length - 1, ct_p, ct_c)
            )
            return s - active.astype(jnp.int32), ct_p, ct_c

        ct_p0 = jtu.tree_map(jnp.zeros_like, p_diff)
        ct_c0 = eqx.filter(ct_carry, diff_mask)
        last = (n + segment - 1) // segment - 1
        _, ct_p, ct_c = while_loop(
            lambda st: st[0] >= 0, segment_body, (last, ct_p0, ct_c0)
        )
        ct_dynamic = jtu.tree_map(
            lambda c, x: _zeros_cotangent(x) if c is None else c,
            eqx.combine(ct_p, jtu.tree_map(lambda _: None, p_rest)),
            dynamic,
            is_leaf=lambda x: x is None,
        )
        ct_carry_in = jtu.tree_map(
            lambda c, x: _zeros_cotangent(x) if c is None else c,
            ct_c,
            final,
            is_leaf=lambda x: x is None,
        )
        ct_bufs_in = jtu.tree_map(_zeros_cotangent, bufs)
        return ct_dynamic, ct_carry_in, ct_bufs_in

    run.defvjp(fwd, bwd)
    return run(dynamic, carry, bufs)


class DirectAdjoint(AbstractAdjoint):
    """Differentiate straight through a loop bounded by `max_steps` (a `lax.scan`).

    Supports forward mode (`jax.jvp`, `jax.jacfwd`) as well as reverse mode. Its cost
    and memory grow with `max_steps`, not with the steps taken: prefer
    `RecursiveCheckpointAdjoint` for reverse mode.
    """

    def loop(self, problem: Problem) -> Outputs:
        carry, bufs = _loop.init(problem)

        def body(state, _):
            active = _loop.cond(problem, state[0])
            state = lax.cond(
                unvmap_any(active),
                lambda s: _loop.body(problem, s, active),
                lambda s: s,
                state,
            )
            return state, None

        (carry, bufs), _ = lax.scan(body, (carry, bufs), None, length=problem.max_steps)
        return _loop.finish(problem, carry, bufs)
