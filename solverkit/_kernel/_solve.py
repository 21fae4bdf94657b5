"""`ensemble_solve(..., kernel=...)`'s kernel path: checks, the lane layout, the
`Solution`, and reverse mode.

Reverse mode is a `custom_vjp` whose forward pass is the kernel and whose backward
pass is the kernel again with forward sensitivities (`_backward`, where it applies),
else the `vmap` path's (the ensemble's lane loop with its adjoint, which solves
every trajectory again). The gradient is the `vmap` path's to round-off either way.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _backend
from .._adjoint._base import custom_vjp, fill_zeros
from .._closure._convert import Closure
from .._closure._raising import error_if
from .._closure._unvmap import unvmap_max
from .._problem import Problem
from .._save import flag_save_times
from .._select import where
from .._solution import (
    EVENT as _EVENT,
    MESSAGES as _MESSAGES,
    Result,
    Solution,
    SUCCESS as _SUCCESS,
)
from . import _backward, _budget, _field, _pallas, _routes, _shard, _tangent
from ._layout import from_lanes, per_trajectory, saved_rows, state_of, to_lanes
from ._pallas import LANES
from ._scalarize import KernelUnsupported


# Rows of 128 trajectories per block, when not told (None: `default_rows(N)`).
DEFAULT_ROWS: int | None = None
# A block has 8 rows per this many trajectories, in powers of two (8 to 64 rows).
# One TensorCore runs the grid's blocks in sequence, and a block's step is a chain
# of dependent operations whose latency more tiles hide, so larger blocks amortise
# each iteration's fixed cost: on a TPU v5e (Lorenz, Tsit5, float32) each doubling
# of the rows ran 1000 fixed steps 8-25% faster up to 64 rows, and a short solve
# (34 steps: the call's fixed cost) alike within its noise. Measure on a chip with
# `python -m benchmarks.kernel --cases lorenz --sizes 4096,16384
# --methods kernel@8,kernel@16,kernel@32,kernel@64`.
_TRAJECTORIES_PER_8_ROWS = 1024
_MAX_ROWS = 64
# Run the kernel in Pallas' interpreter, when not told (None: except on a TPU;
# False on a CPU lowers the kernel for a TPU: `.lower(lowering_platforms=("tpu",))`).
DEFAULT_INTERPRET: bool | None = None
# The backward pass: "tangent" (forward sensitivities in the kernel, `_backward`,
# where it applies: <= 32 directions, no event; else the loop's) or "loop" (the
# lane loop's adjoint, `_ensemble._backward`). On a TPU the tangents run about 5-10x
# faster than the loop's adjoint (measure: `python -m tools.kernel_profile --grad`).
BACKWARD = "tangent"


def default_rows(batch: int) -> int:
    """Rows per block for `batch` trajectories: 8 times the largest power of two
    at most `batch / 1024`, between 8 and 64 (one block up to 8192 trajectories)."""
    factor = max(1, batch // _TRAJECTORIES_PER_8_ROWS)
    power = 1 << (factor.bit_length() - 1)
    return min(8 * power, _MAX_ROWS)


class TangentsDeclined(Exception):
    """Forward sensitivities don't serve this backward pass (`kernel_solve` with a
    `probe`): the caller's own reverse mode must."""


class Settings(NamedTuple):
    """The static choices of a kernel solve."""

    rows: int
    interpret: bool
    save_t0: bool
    save_t1: bool


def supported(problem: Problem, y0, per_trajectory, final) -> str | None:
    """`None` where the kernel path can solve this, else what it can't do (the
    solve's options, or the chip's resources: `_budget`)."""
    try:
        _field.check(problem, y0, per_trajectory, final)
    except KernelUnsupported as e:
        return str(e)
    fits = fitted_rows(problem, y0, 0, None)
    return fits if isinstance(fits, str) else None


def fitted_rows(
    problem: Problem, y0, directions: int, rows: int | None, interpret=None
) -> int | str:
    """Rows per block for this batch (`rows`, else `DEFAULT_ROWS`, else
    `default_rows(N)`), fewer where the block would not fit the chip's VMEM; or why
    the kernel, with `directions` forward sensitivities, does not fit (`_budget`)."""
    if rows is None:
        batch = jtu.tree_leaves(y0)[0].shape[0]
        rows = DEFAULT_ROWS if DEFAULT_ROWS is not None else default_rows(batch)
    if interpret is None:
        interpret = _default_interpret()
    need = _budget.of_problem(problem, directions)
    itemsize = jnp.dtype(jtu.tree_leaves(y0)[0].dtype).itemsize
    return _budget.rows_for(need, rows, itemsize, interpret)


def _event_spec(problem: Problem, y_one, args_one) -> dict:
    """The `Spec` fields of the event's condition (none without an event)."""
    conds = _field.conditions(problem)
    if not conds:
        return {}
    (cond,) = conds
    direction = problem.event.directions
    return dict(
        cond=_field.lane_field(cond, problem.t0, y_one, args_one, scalar=True),
        cond_real=not jnp.issubdtype(cond.out_struct.dtype, jnp.bool_),
        cond_direction=None if direction is None else direction[0],
        field_consts=len(problem.terms.closure.consts),  # pyright: ignore
    )


def lane_inputs(
    problem: Problem,
    y0: PyTree,
    args_dynamic: PyTree,
    rows: int,
    directions: tuple = (),
):
    """The kernel's static `Spec` and its inputs in the lane layout.

    **Arguments:**

    - `problem`, `y0`, `args_dynamic`: as `kernel_solve` takes them (the arrays of
        `args` only).
    - `rows`: rows of 128 trajectories per block.
    - `directions`: forward sensitivities along these (`_tangent`): the state then
        holds `n (1 + K)` components, the tangents after the state.

    **Returns:**

    `(spec, times, ts, y_lanes, arg_lanes, consts)`: `_pallas.solve_blocks`'s
    arguments but the last.
    """
    leaves = jtu.tree_leaves(y0)
    batch = leaves[0].shape[0]
    one = lambda tree: jtu.tree_map(lambda x: x[0], tree)  # noqa: E731
    closure = problem.terms.closure  # pyright: ignore[reportAttributeAccessIssue]
    jvp = _field.is_rosenbrock(problem.solver)  # its Jacobian: the field's JVP
    field = _field.lane_field(closure, problem.t0, one(y0), one(args_dynamic), jvp)
    consts, shapes, _ = _field.shared_consts(problem)
    save = problem.saves[0]
    tdtype = problem.t0.dtype
    ts = save.ts if save.ts is not None else jnp.zeros((1,), tdtype)
    dt0 = problem.dt0 if problem.dt0 is not None else jnp.zeros((), tdtype)
    t1 = problem.t1
    spacing = jnp.finfo(tdtype).eps * jnp.maximum(1, jnp.abs(t1))
    land = t1 - _pallas.LANDING_ULPS * spacing
    pid = _field.pid_of(problem)
    times = jnp.stack(
        [problem.t0, t1, jnp.asarray(dt0, tdtype), land, *_grid(problem, pid)]
    )
    y_lanes = jnp.concatenate([to_lanes(x, batch, rows) for x in leaves])
    n = y_lanes.shape[0]
    starts = [_tangent.initial(d, j, y_lanes[0]) for d in directions for j in range(n)]
    y_lanes = jnp.concatenate([y_lanes, *(s[None] for s in starts)])
    arg_lanes = [to_lanes(a, batch, rows) for a in jtu.tree_leaves(args_dynamic)]
    spec = _pallas.Spec(
        tableau=problem.solver.tableau,  # pyright: ignore[reportAttributeAccessIssue]
        pid=pid,
        n=y_lanes.shape[0],
        field=field,
        num_args=tuple(a.shape[0] for a in arg_lanes),
        const_shapes=shapes,
        num_ts=0 if save.ts is None else int(save.ts.shape[0]),
        has_dt0=problem.dt0 is not None,
        max_steps=int(problem.max_steps),  # pyright: ignore[reportArgumentType]
        rows=rows,
        **_event_spec(problem, one(y0), one(args_dynamic)),
        directions=tuple(directions),
        primal=n,
    )
    return spec, times, ts, y_lanes, arg_lanes, consts


def _grid(problem: Problem, pid) -> list:
    """`ConstantStepSize`'s steps `n` in `[t0, t1]`, `max(n, 1)` and `t1 - t0`
    (`_step.FixedTimes`), computed by the controller itself (`init`: the same `n`
    as the `vmap` path); zeros for a `PIDController` (`pid`)."""
    t0, t1 = problem.t0, problem.t1
    if pid is not None:
        return [jnp.zeros((), t0.dtype)] * 3
    terms, args = problem.terms, problem.args
    func = problem.solver.func  # called as func(terms, t, y, args)
    _, state = problem.controller.init(
        terms, t0, t1, problem.y0, problem.dt0, args, func, problem.error_order
    )
    n = state.n.astype(t0.dtype)
    return [n, jnp.maximum(state.n, 1).astype(t0.dtype), t1 - t0]


@eqx.filter_jit
def _forward(problem: Problem, y0: PyTree, args_dynamic: PyTree, settings: Settings):
    """The kernel's `ts`, `ys`, `t1` rows and its five counts, each `(N,)`, per
    device (`_shard`). (Not stacked to `(N, 5)`: that would relayout them on a TPU.)"""

    def on_shard(problem, batched):
        (y, a), local = batched, _on_shard(settings, batched, y0)
        batch = jtu.tree_leaves(y)[0].shape[0]
        y_end, ys_ts, t_end, counts = _pallas.solve_blocks(
            *lane_inputs(problem, y, a, local.rows), local.interpret
        )
        t_end = per_trajectory(t_end, batch)
        y_end = state_of(from_lanes(y_end, batch), y, batch)
        ts_rows, ys_rows = saved_rows(problem, local, y, ys_ts, t_end, y_end)
        counts = tuple(per_trajectory(c, batch) for c in counts)
        return dict(ts=ts_rows, ys=ys_rows, t1=t_end, counts=counts)

    return _shard.over_batch(on_shard, problem, (y0, args_dynamic))


def _on_shard(settings: Settings, batched, whole) -> Settings:
    """`settings` for a shard of the batch `whole`: no more rows than it needs."""
    size, full = (jtu.tree_leaves(x)[0].shape[0] for x in (batched, whole))
    rows = settings.rows if size >= full else min(settings.rows, default_rows(size))
    return settings._replace(rows=rows)


def _tangent_rows(settings: Settings, problem: Problem, y0, args_dynamic, directions):
    """The saved rows `ys`, per direction their tangent (same layout), and which
    rows were written (`(N, T)`: the others are padding), from one kernel run with
    forward sensitivities (per device, as `_forward`)."""

    def on_shard(problem, batched):
        (y, a), local = batched, _on_shard(settings, batched, y0)
        batch = jtu.tree_leaves(y)[0].shape[0]
        inputs = lane_inputs(problem, y, a, local.rows, directions)
        y_end, ys_ts, t_end, _ = _pallas.solve_blocks(*inputs, local.interpret)
        t_end, n = per_trajectory(t_end, batch), inputs[0].own

        def rows_of(k: int, start):
            part = slice(n * k, n * (k + 1))
            end = state_of(from_lanes(y_end[part], batch), y, batch)
            return saved_rows(problem, local, start, ys_ts[:, part], t_end, end)

        def start_of(direction):
            flat = jnp.zeros((batch, n), ys_ts.dtype)
            if direction[0] == "state":
                flat = flat.at[:, direction[1]].set(1)
            return state_of(flat, y, batch)

        tangents = [rows_of(k + 1, start_of(d))[1] for k, d in enumerate(directions)]
        ts, ys = rows_of(0, y)
        return ys, tangents, jnp.isfinite(ts)

    return _shard.over_batch(on_shard, problem, (y0, args_dynamic))


def _event_mask(problem: Problem, result):
    """Which condition fired, per trajectory, shaped as the conditions."""
    if problem.event.conds is None:
        return None
    tree = jtu.tree_structure(
        problem.event.conds, is_leaf=lambda x: isinstance(x, Closure)
    )
    return jtu.tree_unflatten(tree, [result == _EVENT])


def _lane_cotangents(problem: Problem, ct: dict) -> dict:
    """The cotangents of the `Solution`'s rows as the lane loop's backward pass
    takes them (`_ensemble._lanes.row`, forwards in time: internal time is time;
    no continuing events in the kernel, so `events` is None)."""
    none = dict.fromkeys(
        ("result", "num_steps", "num_accepted", "num_rejected", "solver_state",
         "controller_state", "events"),
    )  # fmt: skip
    mask = None
    if problem.event.conds is not None:
        is_closure = lambda x: isinstance(x, Closure)  # noqa: E731
        mask = jtu.tree_map(lambda _: None, problem.event.conds, is_leaf=is_closure)
    return dict(ts=ct["ts"], ys=ct["ys"], t_end=ct["t1"], event_mask=mask, **none)


def _differentiable(
    problem: Problem,
    y0,
    args_dynamic,
    settings: Settings,
    reference: Callable,
    backward: Callable | None,
    tangents: bool,
    probe: tuple | None = None,
):
    """`_forward` with reverse mode: forward sensitivities in the kernel (where
    `tangents` and they apply); else `backward`, the lane loop's backward pass, from
    the kernel's step counts; or without it, through `reference` (the `vmap` path,
    forward and backward). With a `probe` (`kernel_solve`), the closed-over values'
    cotangents are the probe's, per trajectory; theirs are zero."""

    def primal(problem, y0, args_dynamic, probe=None):
        return _forward(problem, y0, args_dynamic, settings)

    def fwd(problem, y0, args_dynamic, probe=None):
        out = primal(problem, y0, args_dynamic)
        steps = out["counts"][0]
        return out, (y0, args_dynamic, steps)

    def bwd(static, dynamic, residuals, cotangents, perturbed):
        y0, args_dynamic, num_steps = residuals
        ct = {k: cotangents[k] for k in ("ts", "ys", "t1")}
        problem = eqx.combine(dynamic, static)
        why = _backward.why_not(problem, y0, args_dynamic)
        other = _backward.perturbed_elsewhere(dynamic, perturbed[0])
        if why is None and other:
            why = f"differentiated with respect to {', '.join(other)}"
        if why is None and not (tangents and BACKWARD == "tangent"):
            why = "forward sensitivities off for this adjoint or setting"
        rows = settings.rows
        if why is None:  # its own block size: the state carries the tangents
            count = len(_backward.directions_of(problem, y0, args_dynamic) or ())
            fits = fitted_rows(problem, y0, count, settings.rows, settings.interpret)
            why, rows = (fits, rows) if isinstance(fits, str) else (None, fits)
        _routes.record("backward", why is None, why)
        if why is None:
            tangent_settings = settings._replace(rows=rows)
            return _tangent_bwd(
                tangent_settings, problem, dynamic, y0, args_dynamic, ct, probe
            )
        if probe is not None:  # the caller's reverse mode serves instead
            raise TangentsDeclined(why)
        if backward is not None:
            ct_out = _lane_cotangents(eqx.combine(dynamic, static), ct)
            ct_dynamic, ct_y, ct_args, _ = backward(
                static, dynamic, y0, args_dynamic, num_steps, ct_out
            )
            return ct_dynamic, ct_y, ct_args
        return _backward.through(reference, static, dynamic, y0, args_dynamic, ct)

    ops = (y0, args_dynamic) if probe is None else (y0, args_dynamic, probe)
    return custom_vjp(
        problem, primal, fwd, bwd, *ops,
        adjoint="ensemble_solve(kernel=True)",
        second_order="Use kernel=False for higher-order derivatives.",
        perturbed=True,
    )  # fmt: skip


def _tangent_bwd(settings, problem, dynamic, y0, args_dynamic, ct, probe):
    """The cotangents of `(dynamic, y0, args_dynamic[, probe])` by forward
    sensitivities in the kernel."""
    directions = _backward.directions_of(problem, y0, args_dynamic)
    forward = functools.partial(_tangent_rows, settings)
    ct_consts, ct_y, ct_args = _backward.pull_back(
        forward, problem, y0, args_dynamic, directions, ct["ys"], probe is not None
    )
    ct_y, ct_args = fill_zeros(ct_y, y0), fill_zeros(ct_args, args_dynamic)
    if probe is None:
        ct_dynamic = fill_zeros(_backward.with_consts(dynamic, ct_consts), dynamic)
        return ct_dynamic, ct_y, ct_args
    ct_dynamic = fill_zeros(jtu.tree_map(lambda _: None, dynamic), dynamic)
    return ct_dynamic, ct_y, ct_args, fill_zeros(tuple(ct_consts), probe)


def _stats(problem: Problem, counts, rows: int) -> dict:
    """The lane loop's `stats` from the kernel's five `(N,)` counts; `lanes`, the
    lanes of the blocks of `rows` rows, padding included; `lane_steps`, their
    iterations."""
    counts = [c.astype(jnp.result_type(int)) for c in counts]
    batch, block = counts[0].shape[0], rows * LANES
    lanes = -(-batch // block) * block
    return dict(
        num_steps=counts[0],
        num_accepted_steps=counts[1],
        num_rejected_steps=counts[2],
        max_steps=jnp.full((batch,), int(problem.max_steps or 0), counts[0].dtype),
        lanes=lanes,
        lane_steps=jnp.sum(counts[4]) + (lanes - batch) * counts[4][-1],
    )


def _check(outputs: tuple, result):
    """`outputs`, raising at run time if any trajectory failed: one reduction of the
    result codes to the largest failure code, and an error check on that scalar
    alone (its `cond` carries no output), which every inexact output then depends
    on (`x - 0` is `x`, bit for bit, `-0.0` included)."""
    failed = (result != _SUCCESS) & (result != _EVENT)
    index = unvmap_max(where(failed, result, 0))
    token = error_if(jnp.zeros((), jnp.int32), index > 0, index, _MESSAGES)
    return jtu.tree_map(
        lambda a: a - token.astype(a.dtype) if eqx.is_inexact_array(a) else a,
        outputs,
    )


def _default_interpret() -> bool:
    if DEFAULT_INTERPRET is not None:
        return DEFAULT_INTERPRET
    return _backend.platform() != "tpu"  # it lowers to TPUs only, so far


def kernel_solve(
    problem: Problem,
    y0: PyTree,
    args: PyTree,
    throw: bool,
    reference: Callable[[Problem, PyTree, PyTree], Solution],
    backward: Callable | None = None,
    *,
    tangents: bool = True,
    rows: int | None = None,
    interpret: bool | None = None,
    probe: tuple | None = None,
) -> Solution:
    """Solve the ensemble with the whole-solve kernel (see `supported` first).

    **Arguments:**

    - `problem`: the `Problem` of one trajectory, as `ensemble_solve` builds it.
    - `y0`, `args`: the batch (leading axis `N` on every array leaf).
    - `throw`: raise if any trajectory fails.
    - `reference`: `(problem, y0, args) -> Solution`, the `vmap` path without
        raising: the backward pass pulls cotangents back through it (forward and
        backward) unless `backward` is given.
    - `backward`: `(static, dynamic, y0, args_dynamic, num_steps, cotangents) ->
        (ct_dynamic, ct_y0, ct_args, ct_times)`, the lane loop's backward pass
        (`_ensemble._backward`), which solves each trajectory again with the
        adjoint, in chunks sorted by the steps each took (the kernel's counts);
        used where forward sensitivities in the kernel (`BACKWARD`) don't apply.
    - `tangents`: whether forward sensitivities may serve; `False` for an adjoint
        whose gradient is its own approximation (`BacksolveAdjoint`: the continuous
        adjoint, and its first call, which `backward` compiles in less time).
    - `rows`: rows of 128 trajectories per block (a multiple of 8 on a TPU);
        default `DEFAULT_ROWS`, else `default_rows(N)`.
    - `interpret`: run the kernel in Pallas' interpreter; default
        `DEFAULT_INTERPRET`, else except on a TPU.
    - `probe`: per closed-over value of the field, `None` or zeros with a leading
        batch axis (`(N, *shape)`), which the solution does not depend on: its
        cotangent is that value's per trajectory, by forward sensitivities (the
        value's own is then zero). The `vmap` rule's per-example gradients.

    **Returns:**

    The `Solution` the `vmap` path returns, to the tolerance's order.
    """
    if interpret is None:
        interpret = _default_interpret()
    fits = fitted_rows(problem, y0, 0, rows, interpret)
    if isinstance(fits, str):
        raise KernelUnsupported(fits)
    rows = fits
    save = problem.saves[0]
    settings = Settings(rows, interpret, save.t0, save.t1)
    args_dynamic, args_static = eqx.partition(args, eqx.is_array)
    del args_static  # shared by every trajectory: part of the converted field
    with jax.numpy_dtype_promotion("standard"):
        out = _differentiable(
            problem, y0, args_dynamic, settings, reference, backward, tangents, probe
        )
    counts = out["counts"]
    ts, ys, t_end = out["ts"], out["ys"], out["t1"]
    batch = t_end.shape[0]
    result = flag_save_times(problem, counts[3])
    if throw:
        ts, ys, t_end = _check((ts, ys, t_end), result)
    return Solution(
        t0=jnp.broadcast_to(problem.t0, (batch,)),
        t1=t_end,
        ts=ts,
        ys=ys,
        stats=_stats(problem, counts, rows),
        result=Result(result),
        event_mask=_event_mask(problem, result),
        made_jump=None,
        solver_state=None,
        controller_state=None,
    )
