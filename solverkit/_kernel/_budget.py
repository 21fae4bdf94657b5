"""Whether a whole-solve kernel fits the chip: a resource model, computed from the
converted field's jaxpr before anything is lowered.

The kernel evaluates the field lane-wise (`_scalarize`): every per-trajectory value
of the field's program is one `(rows, 128)` tile per element, and every element-wise
operation on such a value is one operation per tile, unrolled into the kernel's
code. So a field's cost is counted in lane values and lane operations:

- `field_cost`: the operations of one evaluation (a contraction of `K` terms is `2K`
  of them) and the peak of its live lane values (a value is live from the operation
  that makes it to its last use; slices, reshapes and broadcasts move values and
  make none).
- `need`: for one solve, the kernel body's operations (the field times its
  evaluations in a step's code, the tangent system's for forward sensitivities),
  the tiles live in a block (the state and its stages, the field's live values, the
  per-trajectory arguments, the save buffer and the blocks' double buffers) and
  the bytes of the shared values (read from SMEM as scalars).
- `rows_for`: the most rows per block whose tiles fit the VMEM budget, or the
  reason none does.

The chip's memories are queried (`chip`); off a TPU the model uses a TPU v5e's.
A kernel is also declined above `MAX_OPS` operations: its code is unrolled, and
Mosaic's compile time (and Pallas' interpreter's memory on a CPU) grows with it.
"""

import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _backend
from .._solver._rosenbrock_tableau import RosenbrockTableau
from . import _field
from ._scalarize import _CALLS, _ELEMENTWISE, _inner, choices


# The most lane operations a kernel body may hold (its step's code: every field
# evaluation of a step, the initial one and the dense output's), above which the
# loop solves it. Between two points seen on a TPU v5e: the 128-point heat field
# (about 4.5 * 10^3) ran on the kernel, a 2-64-64-2 MLP field (about 7 * 10^4)
# took about 100 s to fail to compile; the cells between are
# `python -m benchmarks.neural_matrix --parts matrix`'s to measure.
MAX_OPS = 12_000
# The same bound in Pallas' interpreter (a CPU): it traces the unrolled body into
# one XLA program, about 20 s and 0.6 GB for 10^3 operations (a 2-4-4-2 MLP field,
# Tsit5: `/usr/bin/time -v` of a `jax.vmap(diffeqsolve)` with the route on).
MAX_INTERPRET_OPS = 4096
# The share of the scoped VMEM limit that the modelled tiles may fill: the rest is
# Mosaic's own (spills of the unrolled code, relayouts, semaphores).
VMEM_SHARE = 0.75
# The scoped VMEM limit the kernel asks Mosaic for, as a share of the chip's VMEM
# (the default scoped limit is 16 MiB of a TPU v5e's 128 MiB).
VMEM_LIMIT_SHARE = 0.5
# The share of SMEM that the shared values may fill (scalars, times, save times
# and Mosaic's own share the rest).
SMEM_SHARE = 0.75
LANES = 128
# Tiles of a block besides the state's: `t`, the next step's end, the PID history,
# the counters and the result, and the select masks and temporaries of a step.
_FIXED_TILES = 24


class Chip(NamedTuple):
    """The memories the model budgets against (bytes per TensorCore)."""

    vmem: int  # the VMEM the kernel's scoped limit is set from
    smem: int
    name: str


# A TPU v5e's (`pltpu.get_tpu_info_for_chip`), where no TPU is attached.
_DEFAULT = Chip(vmem=128 << 20, smem=1 << 20, name="TPU v5e (not attached: default)")


@functools.cache
def _queried() -> Chip | None:
    try:
        from jax.experimental.pallas import tpu as pltpu

        info = pltpu.get_tpu_info()
    except Exception:  # no TPU attached, or a JAX without `get_tpu_info`
        return None
    kind = jax.devices()[0].device_kind
    return Chip(int(info.vmem_capacity_bytes), int(info.smem_capacity_bytes), kind)


def chip() -> Chip:
    """The attached TPU's memories, else a TPU v5e's."""
    if _backend.platform() != "tpu":
        return _DEFAULT
    return _queried() or _DEFAULT


def vmem_limit(c: Chip | None = None) -> int:
    """The scoped VMEM limit (bytes) the kernel is compiled with."""
    c = chip() if c is None else c
    return int(c.vmem * VMEM_LIMIT_SHARE)


class FieldCost(NamedTuple):
    """One lane-wise evaluation of a program: `ops` element-wise operations on tiles,
    `live` lane values live at its peak."""

    ops: int
    live: int


def _size(v) -> int:
    return int(math.prod(v.aval.shape))


def _contraction(eqn) -> int:
    (lc, _), _ = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    return int(math.prod(shape[d] for d in lc))


def _eqn_ops(eqn) -> int:
    """Lane operations of one equation (its outputs being lane values)."""
    name = eqn.primitive.name
    out = sum(_size(v) for v in eqn.outvars)
    if name in _ELEMENTWISE:
        return out
    if name == "dot_general":
        return out * max(2 * _contraction(eqn) - 1, 1)
    if name.startswith("reduce_"):
        return max(_size(eqn.invars[0]) - out, 0)
    if name == "dynamic_slice":  # a compare and a select per place
        return out * 2 * (choices(eqn) - 1)
    return 0  # structural: moves elements


def _flatten(jaxpr: jex.Jaxpr, lane: list[bool]) -> tuple[list, list, list, list]:
    """The program's equations with calls inlined, as `(ops, made, uses)` per
    equation: its lane operations, the lane values it makes (ids, sizes) and the
    ids it reads; `lane` says which inputs (constvars then invars) are lane values.
    Returns those lists and the outputs' ids."""
    ops, made, uses = [], [], []
    counter = [0]

    def new() -> int:
        counter[0] += 1
        return counter[0]

    def walk(jaxpr: jex.Jaxpr, inputs: list) -> list:
        local: dict = {}
        for var, value in zip([*jaxpr.constvars, *jaxpr.invars], inputs):
            local[var] = value

        def read(v):
            return None if isinstance(v, jex.Literal) else local.get(v)

        for eqn in jaxpr.eqns:
            xs = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in _CALLS:
                inner, consts = _inner(eqn.params, _CALLS[name])
                outs = walk(inner, [None] * len(consts) + xs)
            else:
                is_lane = any(x is not None for x in xs)
                structural = name not in _ELEMENTWISE and name != "dot_general"
                structural = structural and not name.startswith("reduce_")
                structural = structural and _eqn_ops(eqn) == 0
                if not is_lane:
                    outs = [None] * len(eqn.outvars)
                elif structural:  # views of its inputs' values
                    alias = tuple(i for x in xs if x is not None for i in x)
                    outs = [alias] * len(eqn.outvars)
                else:
                    ids = [new() for _ in eqn.outvars]
                    ops.append(_eqn_ops(eqn))
                    made.append([(i, _size(v)) for i, v in zip(ids, eqn.outvars)])
                    uses.append({i for x in xs if x is not None for i in x})
                    outs = [(i,) for i in ids]
            for var, value in zip(eqn.outvars, outs):
                local[var] = value
        return [read(v) for v in jaxpr.outvars]

    start = [(new(),) if is_lane else None for is_lane in lane]
    outs = walk(jaxpr, start)
    return ops, made, uses, [i for o in outs if o is not None for i in o]


def field_cost(jaxpr: jex.Jaxpr, lane: list[bool]) -> FieldCost:
    """The lane operations and peak live lane values of one evaluation of `jaxpr`.

    **Arguments:**

    - `jaxpr`: a lane-wise program (a converted field's, or its tangent program).
    - `lane`: per input (`constvars` then `invars`), whether it differs per
        trajectory (the state, `t`, the per-trajectory arguments) or is shared.

    **Returns:**

    A `FieldCost`; the inputs count as live (they are the kernel's own tiles).
    """
    ops, made, uses, outs = _flatten(jaxpr, lane)
    last: dict = {i: len(ops) for i in outs}
    for k, used in enumerate(uses):
        for i in used:
            last[i] = max(last.get(i, -1), k)
    live = peak = 0
    ends: dict = {}
    for k, values in enumerate(made):
        for i, size in values:
            if i in last:  # a value never read is dropped as it is made
                live += size
                ends.setdefault(last[i], []).append(size)
        peak = max(peak, live)
        live -= sum(ends.pop(k, []))
    return FieldCost(int(sum(ops)), int(peak))


class Need(NamedTuple):
    """What one kernel asks of the chip: lane operations in its body, tiles live in
    a block (VMEM: each `rows x 128` elements), shared bytes (SMEM)."""

    ops: int
    tiles: int
    smem: int


def evaluations(tableau) -> int:
    """Field evaluations in a step's code: the stages (a Rosenbrock step's first one
    with the Jacobian's `n` JVPs, counted by the caller), plus the initial one."""
    stages = (
        len(tableau.c) if isinstance(tableau, RosenbrockTableau) else len(tableau.c) - 1
    )  # FSAL: the last stage is the next step's first
    return stages + 1


def need(
    cost: FieldCost,
    tableau,
    n: int,
    directions: int,
    num_args: int,
    num_ts: int,
    smem_bytes: int,
) -> Need:
    """The kernel's `Need` for a field of `cost`.

    **Arguments:**

    - `cost`: the field's (`field_cost`).
    - `tableau`: the method's (an RK `ButcherTableau` or a `RosenbrockTableau`).
    - `n`: the state's components; `directions`: forward sensitivities carried
        (the state then has `n (1 + directions)` components).
    - `num_args`: per-trajectory argument components; `num_ts`: save times.
    - `smem_bytes`: bytes of the shared values.

    **Returns:**

    The `Need`.
    """
    stages = len(tableau.c)
    width = n * (1 + directions)
    evals = evaluations(tableau)
    ops = cost.ops * evals * (1 + 3 * directions)  # a JVP: about twice, plus the primal
    live = cost.live * (1 + 2 * directions)
    state = width * (stages + 6)  # y, stages, y1, error, the last step's, blocks
    if isinstance(tableau, RosenbrockTableau):
        ops += cost.ops * 2 * n + 4 * n**3  # the Jacobian's JVPs and the inverse
        state += 2 * n * n
    tiles = state + live + 2 * num_args + 2 * num_ts * width + _FIXED_TILES
    return Need(int(ops), int(tiles), int(smem_bytes))


def block_bytes(tiles: int, rows: int, itemsize: int) -> int:
    """VMEM bytes of `tiles` tiles of `rows x 128` elements."""
    return tiles * rows * LANES * itemsize


def rows_for(
    need: Need, rows: int, itemsize: int, interpret: bool, c: Chip | None = None
) -> int | str:
    """The most rows per block, at most `rows` (halving, down to 8), whose tiles fit
    the VMEM budget; or the reason the kernel does not fit (a `str`). `interpret`:
    the kernel runs in Pallas' interpreter (its own bound on operations)."""
    c = chip() if c is None else c
    most = MAX_INTERPRET_OPS if interpret else MAX_OPS
    if need.ops > most:
        where = " in Pallas' interpreter" if interpret else ""
        return (
            f"the kernel's step would hold about {need.ops} lane operations (the "
            f"vector field's, unrolled; at most {most}{where}): a field this large, "
            "such as a neural network, is solved by the loop"
        )
    if need.smem > c.smem * SMEM_SHARE:
        return (
            f"the vector field closes over {need.smem} bytes of shared values, "
            f"more than the kernel's SMEM budget ({int(c.smem * SMEM_SHARE)} bytes "
            f"of {c.name}'s {c.smem})"
        )
    budget = vmem_limit(c) * VMEM_SHARE
    while rows > 8 and block_bytes(need.tiles, rows, itemsize) > budget:
        rows //= 2
    used = block_bytes(need.tiles, rows, itemsize)
    if used > budget:
        return (
            f"a block of {rows * LANES} trajectories needs about {used} bytes of VMEM "
            f"({need.tiles} live tiles), more than the kernel's budget "
            f"({int(budget)} bytes of {c.name}'s {c.vmem})"
        )
    return rows


def lane_inputs_of(jaxpr: jex.Jaxpr, inputs: tuple) -> list[bool]:
    """Which inputs of a converted field's program (`constvars`, then `t` and the
    flat inputs `LaneField.inputs` describes) differ per trajectory."""
    lane = [False] * len(jaxpr.constvars) + [True]
    lane += [kind[0] in ("y", "arg") for kind in inputs]
    return lane


def array_bytes(shapes, dtypes) -> int:
    """Bytes of arrays of `shapes` and `dtypes` (booleans as int32, as in SMEM)."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        size = np.dtype(dtype).itemsize if np.dtype(dtype) != np.bool_ else 4
        total += int(math.prod(shape)) * size
    return total


def of_problem(problem, directions: int = 0) -> Need:
    """The `Need` of the kernel solving `problem` (one trajectory's `Problem`, as
    `ensemble_solve` and the `vmap` rule build it), carrying `directions` forward
    sensitivities."""
    closure = problem.terms.closure
    args_one = eqx.filter(problem.args, eqx.is_array)
    field = _field.lane_field(closure, problem.t0, problem.y0, args_one)
    cost = field_cost(field.jaxpr, lane_inputs_of(field.jaxpr, field.inputs))
    conds = _field.conditions(problem)
    consts = [c for cl in [closure, *conds] for c in cl.consts]
    for cond in conds:  # evaluated after every step, like one more stage
        lane = _field.lane_field(cond, problem.t0, problem.y0, args_one, scalar=True)
        extra = field_cost(lane.jaxpr, lane_inputs_of(lane.jaxpr, lane.inputs))
        cost = FieldCost(cost.ops + extra.ops, max(cost.live, extra.live))
    size = lambda x: int(math.prod(jnp.shape(x)))  # noqa: E731
    save = problem.saves[0]
    return need(
        cost,
        problem.solver.tableau,
        n=sum(size(x) for x in jtu.tree_leaves(problem.y0)),
        directions=directions,
        num_args=sum(size(x) for x in jtu.tree_leaves(args_one)),
        num_ts=0 if save.ts is None else int(save.ts.shape[0]),
        smem_bytes=array_bytes([c.shape for c in consts], [c.dtype for c in consts]),
    )
