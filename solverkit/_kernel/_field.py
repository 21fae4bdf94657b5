"""What the kernel path supports, and the vector field as the kernel evaluates it:
the `Closure`'s jaxpr, evaluated lane-wise on tiles (`_scalarize`), its closed-over
values read from SMEM and each trajectory's arguments from its lanes."""

from typing import Any

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._closure._convert import Closure
from .._controller._adaptive import PIDController
from .._controller._base import ConstantStepSize
from .._controller._norm import rms_norm
from .._problem import Problem
from .._progress import NoProgressMeter
from .._solver._rosenbrock import AbstractRosenbrock
from .._solver._runge_kutta import AbstractRungeKutta
from .._term import ClosureTerm
from . import _rosenbrock, _scalarize
from ._scalarize import KernelUnsupported
from ._step import Pid


# Whether `kernel=None` (on a TPU) takes the kernel for a Rosenbrock solver: yes,
# measured on a TPU v5e (float32, Van der Pol mu in [1, 100], t <= 200, PID 1e-6,
# `python -m benchmarks.stiff_ensemble --plan rodas5p-vmap:N:1e-6,
# rodas5p-kernel:N:1e-6`): 0.083 / 0.082 / 0.068 of the vmapped Rodas5P at N = 4096 /
# 16,384 / 65,536 (8.9 ms vs 108 ms at 16,384), the same steps and errors.
ROSENBROCK_BY_DEFAULT = True


def by_default(problem: Problem) -> bool:
    """Whether `kernel=None` may take the kernel for this solve (where supported)."""
    return ROSENBROCK_BY_DEFAULT or not is_rosenbrock(problem.solver)


def is_rosenbrock(solver) -> bool:
    """Whether the kernel steps `solver` as a Rosenbrock method: by class, not
    `isinstance` (a wrapper, `HalfSolver`, passes `isinstance` for what it wraps)."""
    return AbstractRosenbrock in type(solver).__mro__


def _float(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise KernelUnsupported(
            f"PIDController's `{name}` is not a concrete number"
        ) from None


def pid_of(problem: Problem) -> Pid | None:
    """The `PIDController`'s settings, `None` for `ConstantStepSize`, or
    `KernelUnsupported`."""
    c = problem.controller
    if type(c) is ConstantStepSize:
        return None
    if type(c) is not PIDController:
        raise KernelUnsupported(
            f"the step-size controller {type(c).__name__} (the kernel supports "
            "PIDController and ConstantStepSize)"
        )
    if c.norm is not rms_norm or c.step_ts is not None or c.jump_ts is not None:
        raise KernelUnsupported(
            "a PIDController with `norm`, `step_ts` or `jump_ts` (the kernel supports "
            "the RMS norm and no clipped times)"
        )
    order = c.error_order if c.error_order is not None else problem.error_order
    opt = lambda v, name: None if v is None else _float(name, v)  # noqa: E731
    return Pid(
        _float("rtol", c.rtol), _float("atol", c.atol), _float("pcoeff", c.pcoeff),
        _float("icoeff", c.icoeff), _float("dcoeff", c.dcoeff),
        opt(c.dtmin, "dtmin"), opt(c.dtmax, "dtmax"), bool(c.force_dtmin),
        _float("safety", c.safety), _float("factormin", c.factormin),
        _float("factormax", c.factormax), _float("error_order", order),
    )  # fmt: skip


def _check_solver(problem: Problem, y0) -> None:
    """Raise `KernelUnsupported` unless the solver is one the kernel steps: an
    explicit FSAL RK method with an error estimate and dense output, or a
    Rosenbrock method (`_rosenbrock.check`)."""
    solver = problem.solver
    if is_rosenbrock(solver):
        leaves = jtu.tree_leaves(y0)
        batch = leaves[0].shape[0]
        n = sum(int(np.prod(x.shape, dtype=int)) // batch for x in leaves)
        _rosenbrock.check(solver, n)  # pyright: ignore[reportArgumentType]
        return
    tab = getattr(solver, "tableau", None)
    if (  # by class, as `is_rosenbrock`: a wrapper passes `isinstance`
        AbstractRungeKutta not in type(solver).__mro__
        or getattr(solver, "scan_kind", None) is not None
        or tab is None
        or not tab.fsal
        or tab.dense is None
        or tab.b_err is None
    ):
        raise KernelUnsupported(
            f"the solver {type(solver).__name__} (the kernel supports explicit FSAL "
            "Runge-Kutta methods with an error estimate and dense output: Tsit5, "
            "Dopri5; and the Rosenbrock methods Rodas5P, Rodas4, Rosenbrock23)"
        )


def check(problem: Problem, y0, per_trajectory, final) -> None:
    """Raise `KernelUnsupported` naming what the kernel can't do for this solve."""
    _check_solver(problem, y0)
    pid_of(problem)
    if not isinstance(problem.terms, ClosureTerm) or problem.direction is not None:
        raise KernelUnsupported("a MultiTerm, or a solve backwards in time")
    unsupported = {
        "an Event that continues, has several conditions or a root_finder": (
            problem.event.continues
            or problem.event.root_finder is not None
            or (problem.event.conds is not None and len(conditions(problem)) != 1)
        ),
        "a TimedEvent": problem.event.timed is not None,
        "SaveAt(dense=True)": problem.dense,
        "SaveAt(steps=...), SaveAt(fn=...) or several SubSaveAt": len(problem.saves)
        != 1
        or problem.saves[0].every != 0
        or not problem.saves[0].saves_y,
        "per-trajectory t0, t1 or SaveAt(ts)": per_trajectory is not None,
        "SaveAt(solver_state/controller_state/made_jump)": any(final),
        "a progress meter": not isinstance(problem.meter, NoProgressMeter),
        "max_steps=None": problem.max_steps is None,
        "resuming a solve": problem.resume is not None,
    }
    for what, bad in unsupported.items():
        if bad:
            raise KernelUnsupported(what)
    leaves = jtu.tree_leaves(y0)
    dtypes = {leaf.dtype for leaf in leaves}
    if len(dtypes) != 1 or not jnp.issubdtype(leaves[0].dtype, jnp.floating):
        raise KernelUnsupported(
            f"a state of dtypes {sorted(map(str, dtypes))} (the kernel needs one real "
            "floating dtype)"
        )
    closures = [problem.terms.closure, *conditions(problem)]  # pyright: ignore
    consts = [c for closure in closures for c in closure.consts]
    for c in consts:
        if not (jnp.issubdtype(c.dtype, jnp.number) or c.dtype == jnp.bool_):
            raise KernelUnsupported(f"a closed-over value of dtype {c.dtype}")
        if jnp.issubdtype(c.dtype, jnp.complexfloating):
            raise KernelUnsupported("a complex closed-over value")
    for closure in closures:
        _scalarize.check(closure.jaxpr)
    if is_rosenbrock(problem.solver):  # its Jacobian: the field's JVP, on tiles like it
        _scalarize.check(tangent_program(closures[0].jaxpr, len(leaves))[0])


def conditions(problem: Problem) -> list[Closure]:
    """The event's converted conditions (none without an event)."""
    if problem.event.conds is None:
        return []
    return jtu.tree_leaves(
        problem.event.conds, is_leaf=lambda x: isinstance(x, Closure)
    )


def _smem(x):
    """A shared value flattened to 1-D for SMEM (booleans as int32)."""
    x = jnp.reshape(x, (-1,))
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def shared_consts(problem: Problem) -> tuple[list, tuple, tuple]:
    """The values the vector field (then the event's condition) closes over, as
    kernel inputs, their shapes and dtypes."""
    closures = [problem.terms.closure, *conditions(problem)]  # pyright: ignore
    consts = [c for closure in closures for c in closure.consts]
    return (
        [_smem(c) for c in consts],
        tuple(tuple(c.shape) for c in consts),
        tuple(c.dtype for c in consts),
    )


def _elements(tiles: list, shape: tuple, dtype) -> np.ndarray:
    out = np.empty(shape, dtype=object)
    for flat, index in enumerate(np.ndindex(shape)):
        x = tiles[flat]
        out[index] = x != 0 if dtype == jnp.bool_ else x
    return out


def _scalar(x) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = x
    return out


def tangent_program(jaxpr: jex.Jaxpr, n_y: int) -> tuple[jex.Jaxpr, list]:
    """The JVP of a lane-wise field's jaxpr along `t` and the state (its first
    `1 + n_y` inputs), as a jaxpr `(consts, inputs, tangents of t and the state) ->
    (outputs, their tangents)` and its own constants: evaluated by `_scalarize`
    like the field itself (so its selects are anchored, and `_scalarize.check`
    names what it can't evaluate before the kernel is traced)."""
    spec = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)  # noqa: E731
    consts = [spec(v) for v in jaxpr.constvars]
    ins = [spec(v) for v in jaxpr.invars]
    along = range(1 + n_y)

    def jvp(consts, ins, tangents):
        def fn(*moving):
            full = list(ins)
            for i, x in zip(along, moving):
                full[i] = x
            return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, consts))(*full)

        return jax.jvp(fn, tuple(ins[i] for i in along), tuple(tangents))

    closed = jax.make_jaxpr(jvp)(consts, ins, [ins[i] for i in along])
    return closed.jaxpr, list(closed.consts)


class LaneField(eqx.Module):
    """The vector field of one trajectory, evaluated on tiles: `(t, y tiles, arg
    tiles, const elements) -> dy/dt tiles` (static data of the kernel); with
    `tangent` (`tangent_program`), its JVP along `t` and `y` too (`jvp`)."""

    jaxpr: Any = eqx.field(static=True)
    # per flat input after `t`: ("y", shape) / ("arg", index, shape, dtype) /
    # ("value", constant)
    inputs: tuple = eqx.field(static=True)
    out_shapes: tuple = eqx.field(static=True)
    out_dtype: Any = eqx.field(static=True)
    const_dtypes: tuple = eqx.field(static=True)
    tangent: Any = eqx.field(static=True, default=None)

    @property
    def autonomous(self) -> bool:
        """Whether the field ignores `t` (its jaxpr's first input)."""
        t = self.jaxpr.invars[0]
        used = [v for eqn in self.jaxpr.eqns for v in eqn.invars] + list(
            self.jaxpr.outvars
        )
        return not any(v is t for v in used)

    def _flat(self, t, y: list, args: list, consts: list) -> tuple[list, list]:
        """The jaxpr's inputs after its constants, and its constants, as element
        arrays."""
        consts = [
            np.vectorize(lambda x: x != 0, otypes=[object])(c) if d == jnp.bool_ else c
            for c, d in zip(consts, self.const_dtypes)
        ]
        flat = [_scalar(t)]
        y_iter = iter(y)
        for kind in self.inputs:
            if kind[0] == "y":
                size = int(np.prod(kind[1], dtype=int))
                flat.append(
                    _elements([next(y_iter) for _ in range(size)], kind[1], None)
                )
            elif kind[0] == "arg":
                _, index, shape, dtype = kind
                flat.append(_elements(args[index], shape, dtype))
            else:
                flat.append(_scalarize.as_elements(kind[1]))
        return flat, consts

    def _tiles(self, outs: list, tile: tuple) -> list:
        """The outputs' elements as tiles of the state's dtype, in order."""
        tiles = []
        if len(outs) == 1 and len(self.out_shapes) > 1:
            outs = [outs[0]] * len(self.out_shapes)
        for out, shape in zip(outs, self.out_shapes):
            out = np.broadcast_to(out, shape)
            for index in np.ndindex(shape):
                x = jnp.asarray(out[index]).astype(self.out_dtype)
                tiles.append(jnp.broadcast_to(x, tile))
        return tiles

    def __call__(self, t, y: list, args: list, consts: list) -> list:
        flat, consts = self._flat(t, y, args, consts)
        return self._tiles(_scalarize.evaluate(self.jaxpr, consts, flat), y[0].shape)

    def jvp(self, t, y: list, args: list, consts: list, dt, dy: list):
        """`(f, df)`: the field and its derivative along `(dt, dy)` (a 0-d value or
        a tile each, `dy` one per state component), as tiles."""
        flat, consts = self._flat(t, y, args, consts)
        jaxpr, own = self.tangent
        tangents = [_scalar(dt)]
        start = 0
        for kind in self.inputs:
            if kind[0] == "y":
                size = int(np.prod(kind[1], dtype=int))
                tangents.append(_elements(dy[start : start + size], kind[1], None))
                start += size
        own = [_scalarize.as_elements(c) for c in own]
        outs = _scalarize.evaluate(jaxpr, own, consts + flat + tangents)
        half = len(outs) // 2
        tile = y[0].shape
        return self._tiles(outs[:half], tile), self._tiles(outs[half:], tile)


def lane_field(
    closure: Closure, t0, y_one, args_one, tangent: bool = False, scalar: bool = False
) -> LaneField:
    """The `LaneField` of a converted `(t, y, args)` function, for a trajectory
    shaped like `y_one` with arguments like `args_one` (array leaves: the
    per-trajectory arguments, in order): the vector field (shaped like `y`), or with
    `scalar` an event condition (one value, as `y`'s dtype); with `tangent`, its
    JVP along `t` and `y` too (`LaneField.jvp`)."""
    program = closure.program
    leaves = jtu.tree_leaves(((t0, y_one, args_one), {}))
    n_y = len(jtu.tree_leaves(y_one))
    inputs, arg_index = [], 0
    for i, (leaf, spec) in enumerate(zip(leaves, program.in_specs)):
        dynamic = isinstance(spec, jax.ShapeDtypeStruct)
        is_array = eqx.is_array(leaf)
        if i == 0:
            if not dynamic:
                raise KernelUnsupported("a vector field converted with a static `t`")
            continue
        if i <= n_y:
            inputs.append(("y", tuple(spec.shape)))
            continue
        if is_array:
            if dynamic:
                inputs.append(("arg", arg_index, tuple(spec.shape), spec.dtype))
            arg_index += 1
        elif dynamic:
            inputs.append(("value", np.asarray(leaf, spec.dtype)))
    y_leaves = jtu.tree_leaves(y_one)
    shapes = ((),) if scalar else tuple(tuple(x.shape) for x in y_leaves)
    if len(program.out_specs) not in (1, len(shapes)) or not all(
        isinstance(s, jax.ShapeDtypeStruct) for s in program.out_specs
    ):
        raise KernelUnsupported("a vector field whose output is not shaped like y")
    return LaneField(
        program.jaxpr,
        tuple(inputs),
        shapes,
        y_leaves[0].dtype,
        tuple(c.dtype for c in closure.consts),
        tangent_program(program.jaxpr, n_y) if tangent else None,
    )
