"""Adjoints: how reverse- (and forward-) mode differentiation goes through a solve.

Each adjoint is a small strategy object with one method, `loop(problem)`, which runs
the step loop of `_loop.py` and returns its `Outputs`. The `Problem`, which holds the
closure-converted vector field, is an explicit operand of every `custom_vjp` and loop.
"""

import abc
import functools
import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _loop
from ._closure import closure_convert
from ._controller import ClipStepSizeController, rms_norm
from ._errors import UnsupportedError
from ._loop import Outputs, Problem
from ._progress import NoProgressMeter
from ._saveat import save_y
from ._select import where
from ._unvmap import unvmap_any, while_loop


def _standard_promotion(fn):
    """Trace `fn` (a backward pass, traced after `diffeqsolve` has returned) with
    standard dtype promotion, as `diffeqsolve` traces the forward pass."""

    @functools.wraps(fn)
    def wrapper(*args):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args)

    return wrapper


def _zeros_cotangent(x):
    """A zero cotangent for a primal leaf (float0 for integer and boolean leaves)."""
    if x is None:
        return None
    if eqx.is_inexact_array(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _parameters(tree):
    """Filter spec of the leaves of `tree` to differentiate: its inexact arrays,
    except the time direction of a `VectorField` (a sign: its derivative is zero, and
    carrying its cotangent would only cost work, and backward steps)."""

    def spec(x):
        if not isinstance(x, _loop.VectorField):
            return eqx.is_inexact_array(x)
        out = jtu.tree_map(eqx.is_inexact_array, x)
        if x.direction is None:
            return out
        return eqx.tree_at(lambda v: v.direction, out, False)

    return jtu.tree_map(spec, tree, is_leaf=lambda x: isinstance(x, _loop.VectorField))


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
        if problem.max_steps is None:
            carry, bufs = _not_reverse_differentiable(problem, carry, bufs)
            return _loop.finish(problem, carry, bufs)
        if self.checkpoints is None:
            segment = max(1, math.isqrt(problem.max_steps - 1) + 1)
        else:
            if self.checkpoints < 1:
                raise ValueError(
                    "RecursiveCheckpointAdjoint(checkpoints=...) must be >= 1."
                )
            segment = max(1, -(-problem.max_steps // self.checkpoints))
        slots = -(-problem.max_steps // segment)
        try:
            carry, bufs = checkpointed_while(problem, carry, bufs, segment, slots)
        except TypeError as e:
            if is_forward_mode_error(e):
                raise forward_mode_error("RecursiveCheckpointAdjoint", e) from None
            raise
        return _loop.finish(problem, carry, bufs)


def _not_reverse_differentiable(problem: Problem, carry, bufs):
    """`_loop.run_while`, with a clear error for reverse-mode autodiff: with
    `max_steps=None` there is no bound on the memory checkpoints would need."""
    dynamic, static = eqx.partition(problem, eqx.is_array)

    @jax.custom_vjp
    def run(dynamic, carry, bufs):
        return _loop.run_while(eqx.combine(dynamic, static), (carry, bufs))

    def fwd(dynamic, carry, bufs):
        return run(dynamic, carry, bufs), None

    def bwd(residuals, cotangents):
        raise UnsupportedError(
            "RecursiveCheckpointAdjoint can't differentiate a solve with "
            "`max_steps=None` in reverse mode (its checkpoints need a bound): pass "
            "an int `max_steps`, or use BacksolveAdjoint()."
        )

    run.defvjp(fwd, bwd)
    return run(dynamic, carry, bufs)


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
            carry, bufs, store, i, shown = state
            save = active & (i % segment == 0)
            store = jtu.tree_map(
                lambda s, x: _loop._set_row(s, i // segment, save, x), store, carry
            )
            before = carry
            carry, bufs = _loop.body(problem, (carry, bufs), active)
            if meter is not None:
                shown = meter.tick(shown, before, carry)
            return carry, bufs, store, i + active.astype(jnp.int32), shown

        init = (carry, bufs, store, jnp.asarray(0, jnp.int32))
        if _loop.adaptive(problem):
            init = _loop.batch_like(carry.num_steps, init)
        shown = None if meter is None else meter.start(carry)
        carry, bufs, store, n, _ = while_loop(
            lambda s: _loop.cond(problem, s[0]), body, init + (shown,)
        )
        if meter is not None:
            meter.done(carry)
        return (carry, bufs), (dynamic, store, n, bufs, carry)

    @_standard_promotion
    def bwd(residuals, cotangents):
        dynamic, store, n, bufs, final = residuals
        ct_carry, ct_bufs = cotangents
        diff_mask = jtu.tree_map(eqx.is_inexact_array, final)
        p_diff, p_rest = eqx.partition(dynamic, _parameters(dynamic))
        ct_bufs = eqx.filter(ct_bufs, eqx.is_inexact_array)
        batch = _loop.adaptive(static)  # the controller is static

        def vjp_step(p_diff, carry, ct_next):
            c_diff, c_rest = eqx.partition(carry, diff_mask)

            def f(p_diff, c_diff):
                problem = eqx.combine(p_diff, p_rest, static)
                new, new_bufs = _loop.body(
                    problem, (eqx.combine(c_diff, c_rest), bufs), differentiable=True
                )
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

            init = (first, seg, jnp.asarray(0, jnp.int32))
            if batch:
                init = _loop.batch_like(length, init)
            _, seg, _ = while_loop(lambda s: s[2] < length, body, init)
            return seg

        def segment_body(state, active):
            s, ct_p, ct_c = state
            start = jnp.maximum(s, 0) * segment
            length = where(active, jnp.minimum(segment, n - start), 0)
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
                ct_p = jtu.tree_map(lambda a, b: a + where(active, b, 0), ct_p, dp)
                ct_c = _loop._where(active, dc, ct_c)
                return j - active.astype(jnp.int32), ct_p, ct_c

            init = (length - 1, ct_p, ct_c)
            if batch:
                init = _loop.batch_like(length, init)
            _, ct_p, ct_c = while_loop(lambda st: st[0] >= 0, back, init)
            return s - active.astype(jnp.int32), ct_p, ct_c

        ct_p0 = jtu.tree_map(jnp.zeros_like, p_diff)
        ct_c0 = eqx.filter(ct_carry, diff_mask)
        last = (n + segment - 1) // segment - 1
        init = (last, ct_p0, ct_c0)
        if batch:
            init = _loop.batch_like(n, init)
        _, ct_p, ct_c = while_loop(lambda st: st[0] >= 0, segment_body, init)
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
    """Differentiate straight through a loop bounded by `max_steps`.

    The loop is a `lax.scan` over blocks of `ceil(sqrt(max_steps))` steps; each block
    is checkpointed (recomputed in the backward pass) and skipped entirely once every
    batch element has finished. Supports forward mode (`jax.jvp`, `jax.jacfwd`) as
    well as reverse mode; memory grows like `sqrt(max_steps)` loop states (save
    buffers included). Prefer `RecursiveCheckpointAdjoint` for reverse mode.
    """

    def check(self, problem: Problem) -> None:
        if problem.max_steps is None:
            raise UnsupportedError(
                "DirectAdjoint needs an int `max_steps` (it loops over a bounded "
                "number of steps): pass an int `max_steps`, or use "
                "BacksolveAdjoint() for an unbounded solve."
            )

    def loop(self, problem: Problem) -> Outputs:
        carry, bufs = _loop.init(problem)
        block = max(1, math.isqrt(problem.max_steps - 1) + 1)
        blocks = -(-problem.max_steps // block)

        def step(state, _):
            active = _loop.cond(problem, state[0])
            return _loop.body(problem, state, active, differentiable=True), None

        @jax.checkpoint
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


def forward_mode_error(adjoint: str, error: Exception) -> Exception:
    return TypeError(
        f"{adjoint} supports reverse-mode differentiation (jax.grad, jax.vjp) only; "
        "for forward mode (jax.jvp, jax.jacfwd) use `adjoint=DirectAdjoint()`. "
        f"(JAX said: {error})"
    )


def is_forward_mode_error(error: Exception) -> bool:
    text = str(error)
    return "custom_vjp" in text and ("forward-mode" in text or "jvp" in text)


_LOOP_STAGES_MAX_SIZE = 256


def _augmented(tau, state, aux):
    """The adjoint system of `dy/dtau = g(tau, y, theta)` in the outer internal time:
    `dy = g`, `da = -a dg/dy`, `dtheta_bar = -a dg/dtheta`."""
    term, args = aux
    y, a, _ = state
    theta, rest = eqx.partition((term, args), _parameters((term, args)))

    def g(theta, y):
        term, args = eqx.combine(theta, rest)
        return term.vf(tau, y, args)

    fy, pullback = jax.vjp(g, theta, y)
    g_theta, g_y = pullback(a)
    neg = lambda x: jtu.tree_map(jnp.negative, x)
    return fy, neg(g_y), neg(g_theta)


def adjoint_rms_seminorm(x) -> jax.Array:
    """A norm for the step-size controller of [`solverkit.BacksolveAdjoint`][] that
    measures only the state and its adjoint, not the parameter cotangents being
    accumulated: the backward solve then takes fewer steps (Kidger, Chen and Lyons,
    "Hey, that's not an ODE", ICML 2021). Use as `BacksolveAdjoint(
    stepsize_controller=PIDController(..., norm=adjoint_rms_seminorm))`.

    **Arguments:**

    - `x`: the augmented state `(y, a, parameter cotangents...)`.

    **Returns:**

    The RMS norm of `(y, a)`.
    """
    if not isinstance(x, tuple) or len(x) < 3:
        raise ValueError(
            "adjoint_rms_seminorm is a norm for the adjoint system of "
            "BacksolveAdjoint (a tuple (y, a, parameter cotangents)); got "
            f"{jtu.tree_structure(x)}."
        )
    return rms_norm((x[0], x[1]))


def _dot(a, b):
    leaves = [
        jnp.sum((x * y).real).astype(jnp.result_type(float))
        for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    ]
    return sum(leaves) if leaves else jnp.asarray(0.0)


class BacksolveAdjoint(AbstractAdjoint):
    """Optimise-then-discretise: solve the continuous adjoint equations backwards in
    time, in constant memory.

    Differentiates with respect to `y0`, `args`, **every floating-point value the
    vector field closes over**, `t0`, `t1` and `SaveAt(ts=...)`. Supports
    `SaveAt(t0=..., t1=..., ts=...)` with the default `fn`; no events, `steps` or
    `dense`. Gradients are accurate to about the solve's tolerance (not to machine
    precision, as with `RecursiveCheckpointAdjoint`). Reverse mode only.

    **Arguments:**

    - `solver`: solver for the backward solve (default: the forward one).
    - `stepsize_controller`: controller for the backward solve (default: the
        forward one).
    """

    solver: object = None
    stepsize_controller: object = None

    def check(self, problem: Problem) -> None:
        unsupported = []
        if len(problem.saves) != 1:
            unsupported.append("SaveAt(subs=...) with several SubSaveAts")
        if problem.every:
            unsupported.append("SaveAt(steps=...)")
        if problem.dense:
            unsupported.append("SaveAt(dense=True)")
        if problem.conds is not None:
            unsupported.append("events")
        identity = _identity_jaxpr(problem, save_y)
        if any(save.fn.jaxpr is not identity for save in problem.saves):
            unsupported.append("SaveAt(fn=...)")
        if unsupported:
            raise UnsupportedError(
                "BacksolveAdjoint does not support "
                + ", ".join(unsupported)
                + "; use RecursiveCheckpointAdjoint() instead."
            )

    def loop(self, problem: Problem) -> Outputs:
        dynamic, static = eqx.partition(problem, eqx.is_array)
        adjoint = self

        def forward(dynamic):
            problem = eqx.combine(dynamic, static)
            carry, bufs = _loop.init(problem)
            carry, bufs = _loop.run_while(problem, (carry, bufs))
            return _loop.finish(problem, carry, bufs)

        @jax.custom_vjp
        def run(dynamic):
            return forward(dynamic)

        def fwd(dynamic):
            out = forward(dynamic)
            return out, (dynamic, out)

        @_standard_promotion
        def bwd(residuals, ct_out):
            dynamic, out = residuals
            problem = eqx.combine(dynamic, static)
            ct = adjoint._backward(problem, out, ct_out.ys)
            return (ct,)

        run.defvjp(fwd, bwd)
        try:
            return run(dynamic)
        except TypeError as e:
            if is_forward_mode_error(e):
                raise forward_mode_error("BacksolveAdjoint", e) from None
            raise

    def _solve_back(self, problem: Problem, aux, state, ta, tb):
        """Integrate the augmented state from internal time `ta` back to `tb`."""
        solver = problem.solver if self.solver is None else self.solver
        controller = (
            problem.controller
            if self.stepsize_controller is None
            else self.stepsize_controller
        )
        controller = _in_forward_time(controller, problem.term)
        neg_ta = -ta
        closure = closure_convert(_augmented, neg_ta, state, aux)
        # The adjoint system's vector field (a field and its vjp) is large. For a
        # small augmented state its Runge-Kutta stages run in a loop, which compiles
        # faster and runs as fast (measured: LV, 8 numbers per trajectory); for a
        # large one (a neural ODE's parameter cotangents) the loop's stacked stages
        # cost more than they save, so the stages stay unrolled.
        loop = sum(x.size for x in jtu.tree_leaves(state)) <= _LOOP_STAGES_MAX_SIZE
        inner = Problem(
            solver=solver,
            controller=controller,
            term=_loop.VectorField(closure, -jnp.ones_like(ta), loop_stages=loop),
            args=aux,
            y0=state,
            t0=neg_ta,
            t1=-tb,
            dt0=problem.dt0,
            saves=(),
            save_tree=jtu.tree_structure(None),
            dense=False,
            conds=None,
            event_direction=None,
            root_finder=None,
            max_steps=problem.max_steps,
            meter=NoProgressMeter(),
        )
        carry, bufs = _loop.init(inner)
        carry, _ = _loop.run_while(inner, (carry, bufs))
        failed = (carry.t < inner.t1) | (carry.result != _loop._SUCCESS)
        y = eqx.error_if(
            carry.y,
            failed,
            "BacksolveAdjoint: the backward (adjoint) solve failed, so no gradient "
            "can be given. Increase `max_steps` or pass BacksolveAdjoint("
            "stepsize_controller=...) with looser tolerances.",
        )
        return y

    def _backward(self, problem: Problem, out: Outputs, ct_ys):
        aux = (problem.term, problem.args)
        theta, _ = eqx.partition(aux, _parameters(aux))
        g = lambda tau, y: problem.term.vf(tau, y, problem.args)
        (save,) = problem.saves
        rows_t0 = 1 if save.t0 else 0
        num_ts = 0 if save.ts is None else save.ts.shape[0]
        take = lambda tree, i: jtu.tree_map(lambda x: x[i], tree)
        zeros_y = jtu.tree_map(jnp.zeros_like, problem.y0)
        ct_y1 = take(ct_ys, rows_t0 + num_ts) if save.t1 else zeros_y
        T = out.t_end
        ct_T = _dot(ct_y1, g(T, out.y_end)) if save.t1 else jnp.zeros_like(T)
        a = ct_y1
        theta_bar = jtu.tree_map(jnp.zeros_like, theta)
        y = out.y_end
        t_cur = T
        ct_ts = None
        if num_ts:
            ts = save.ts

            def segment(k, state):
                i = num_ts - 1 - k
                y, a, theta_bar, t_cur, ct_ts = state
                t_i = ts[i]
                y, a, theta_bar = self._solve_back(
                    problem, aux, (y, a, theta_bar), t_cur, t_i
                )
                y = take(out.ys, rows_t0 + i)  # restart from the saved forward value
                ct_row = take(ct_ys, rows_t0 + i)
                a = jtu.tree_map(jnp.add, a, ct_row)
                ct_ts = ct_ts.at[i].set(_dot(ct_row, g(t_i, y)).astype(ts.dtype))
                return y, a, theta_bar, t_i, ct_ts

            state = (y, a, theta_bar, t_cur, jnp.zeros_like(ts))
            y, a, theta_bar, t_cur, ct_ts = lax.fori_loop(0, num_ts, segment, state)
        y, a, theta_bar = self._solve_back(
            problem, aux, (y, a, theta_bar), t_cur, problem.t0
        )
        ct_t0 = -_dot(a, g(problem.t0, problem.y0))
        if save.t0:
            a = jtu.tree_map(jnp.add, a, take(ct_ys, 0))
        dynamic, _ = eqx.partition(problem, eqx.is_array)
        ct = jtu.tree_map(_zeros_cotangent, dynamic)
        ct_aux = jtu.tree_map(
            lambda c, x: _zeros_cotangent(x) if c is None else c,
            theta_bar,
            eqx.partition(aux, eqx.is_array)[0],
            is_leaf=lambda x: x is None,
        )
        ct = eqx.tree_at(
            lambda p: (p.y0, p.t0, p.t1),
            ct,
            (a, ct_t0.astype(problem.t0.dtype), ct_T.astype(problem.t1.dtype)),
        )
        ct = _replace_subtrees(ct, ct_aux)
        if ct_ts is not None:
            ct = eqx.tree_at(lambda p: p.saves[0].ts, ct, ct_ts)
        return ct


def _in_forward_time(controller, term):
    """A `ClipStepSizeController`'s times (in user time) put in the forward solve's
    internal time, which the backward solve's own direction then maps to its own."""
    if not isinstance(controller, ClipStepSizeController):
        return controller
    inner = _in_forward_time(controller.controller, term)
    move = lambda ts: None if ts is None else term.to_user(ts)
    return ClipStepSizeController(
        inner, move(controller.step_ts), move(controller.jump_ts)
    )


def _replace_subtrees(ct, ct_aux):
    term, args = ct_aux
    ct = eqx.tree_at(lambda p: p.term, ct, term, is_leaf=lambda x: x is None)
    return eqx.tree_at(lambda p: p.args, ct, args, is_leaf=lambda x: x is None)


def _identity_jaxpr(problem: Problem, save_y):
    return closure_convert(save_y, problem.t0, problem.y0, problem.args).jaxpr
