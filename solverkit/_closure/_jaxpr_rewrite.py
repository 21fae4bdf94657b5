"""Rewrites of a converted jaxpr, made once by `closure_convert`: repeated equations
merged, and the slices of one array along one axis taken by one `split`. Neither
changes what the jaxpr computes; both make its reverse mode cheaper. `dce` drops the
equations whose results nothing uses (for `Traced` programs). Here too are the
two jaxpr helpers `_convert.py` and `_vma_eval.py` share: tracing with every constant
hoisted, and telling an unused output.

Common subexpressions. Users index their state again and again (`y[0] * y[1] - y[0]`).
XLA merges the repeated slices of the forward computation, but each one's transpose
under reverse mode is a pad of its own cotangent, and those pads are not merged: the
gradient of the Lotka-Volterra benchmark ran 2x slower written so than with each slice
taken once. So the jaxpr is cleared of repeated equations once, on conversion.

Slices of one array as one split. The transpose of `slice` is a `pad` of the
cotangent. A field that indexes its state (`y[0]`, `y[1:]`) sums several such pads per
stage, and XLA:CPU fuses the chains of pads through a many-stage Runge-Kutta step into
loops whose cost grows far faster than the number of stages: the Lorenz ensemble's
reverse step cost 10x its forward step (`python -m benchmarks --cases lorenz`). So the
slices of one array along one axis become one `split` at every boundary they use (and
`concatenate`s of its pieces where a slice spans several). The transpose of `split` is
a single `concatenate` of the pieces' cotangents, with no pad; forward, XLA lowers a
`split` to the same slices as before.

This module imports nothing of solverkit (see `_convert.py`).
"""

import contextlib

import jax
import jax.core
import jax.extend.core as jex
import numpy as np


try:  # Present in recent JAX; when True, concrete constants are inlined as literals.
    from jax._src.config import (
        use_simplified_jaxpr_constants as _simplified_constants,  # pyright: ignore
    )
except ImportError:  # pragma: no cover - older JAX always hoists constants.
    _simplified_constants = None


def hoisting_constants():
    """Trace so that every concrete array becomes a constvar, never an inline literal.

    Which values JAX inlines depends on `jax_use_simplified_jaxpr_constants`; pinning it
    off for the duration of our own trace makes the result the same either way.
    """
    if _simplified_constants is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _simplified_constants(False)


def is_dropped(var) -> bool:
    # An unused output (`_`); `jax.extend.core` names the type only in newer JAX.
    return type(var).__name__ == "DropVar"


# --- Common subexpressions ---------------------------------------------------------


def _literal_key(lit):
    value = np.asarray(lit.val)
    if value.ndim:
        return None
    return ("literal", str(lit.aval), value.dtype.str, value.tobytes())


_CALLS = frozenset({"pjit", "jit", "closed_call"})  # nested calls merged inside too


# --- Slices of one array as one split ---------------------------------------------


def _slice_axis(eqn, shape):
    """The one axis a unit-stride `slice` equation cuts, else None."""
    params = eqn.params
    strides = params.get("strides")
    if strides is not None and any(s != 1 for s in strides):
        return None
    bounds = zip(params["start_indices"], params["limit_indices"], shape)
    cut = [d for d, (a, b, n) in enumerate(bounds) if (a, b) != (0, n)]
    return cut[0] if len(cut) == 1 else None


def _split_equations(x, axis, slices):
    """Equations computing every one of `slices` (of `x`, along `axis`) from one
    `split`, writing the slices' own output variables; None where that fails."""
    aval = x.aval
    starts = [int(e.params["start_indices"][axis]) for e in slices]
    limits = [int(e.params["limit_indices"][axis]) for e in slices]
    if any(a >= b for a, b in zip(starts, limits)):
        return None  # an empty slice: no piece to take
    bounds = sorted({0, aval.shape[axis], *starts, *limits})
    at = {b: k for k, b in enumerate(bounds)}
    sizes = tuple(b - a for a, b in zip(bounds, bounds[1:]))

    def pieces(v):
        parts = jax.lax.split(v, sizes, axis=axis)
        return [
            parts[at[a]]
            if at[b] - at[a] == 1
            else jax.lax.concatenate(parts[at[a] : at[b]], axis)
            for a, b in zip(starts, limits)
        ]

    struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
    with hoisting_constants():
        template = jax.make_jaxpr(pieces)(struct)
    outs = template.jaxpr.outvars
    if (
        template.consts
        or not all(isinstance(v, jex.Var) for v in outs)
        or len(set(outs)) != len(outs)
        or set(outs) & set(template.jaxpr.invars)
        or any(v.aval != e.outvars[0].aval for v, e in zip(outs, slices))
    ):
        return None  # pragma: no cover - no JAX we support traces it otherwise
    rename = {template.jaxpr.invars[0]: x}
    rename.update(zip(outs, (e.outvars[0] for e in slices)))
    return [
        e.replace(
            invars=[
                rename.get(v, v) if isinstance(v, jex.Var) else v for v in e.invars
            ],
            outvars=[rename.get(v, v) for v in e.outvars],
        )
        for e in template.jaxpr.eqns
    ]


def _split_slices(jaxpr):
    """`jaxpr` with the unit-stride slices of each array along one axis computed by
    one `split` (see the module docstring), placed where the first of them was."""
    if not hasattr(jax.lax, "split"):  # pragma: no cover - JAX < 0.4.36
        return jaxpr
    groups: dict = {}  # array -> [axis or None when not splittable, equation indices]
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "slice" or is_dropped(eqn.outvars[0]):
            continue
        x = eqn.invars[0]
        aval = getattr(x, "aval", None)
        if not isinstance(x, jex.Var) or not isinstance(aval, jax.core.ShapedArray):
            continue
        if not isinstance(aval.dtype, np.dtype):
            continue  # say, a key array: left as it is
        axis = _slice_axis(eqn, aval.shape)
        group = groups.setdefault(x, [axis, []])
        if axis is None or group[0] != axis:
            group[0] = None
        group[1].append(i)
    replace: dict = {}  # equation index -> the equations that take its place
    for x, (axis, indices) in groups.items():
        new = None
        if axis is not None:
            new = _split_equations(x, axis, [jaxpr.eqns[i] for i in indices])
        if new is not None:
            replace.update({i: [] for i in indices})
            replace[indices[0]] = new
    if not replace:
        return jaxpr
    eqns = [new for i, eqn in enumerate(jaxpr.eqns) for new in replace.get(i, [eqn])]
    return jaxpr.replace(eqns=eqns)


def cse(jaxpr, memo=None):
    """`jaxpr` with each repeated equation (same primitive, parameters and inputs, no
    effects) removed and its outputs replaced by the first one's, and the slices of an
    array made one split; the same inside nested `jit` calls."""
    memo = {} if memo is None else memo  # id(inner ClosedJaxpr) -> (it, merged)
    rename: dict = {}
    seen: dict = {}
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        invars = [rename.get(v, v) if isinstance(v, jex.Var) else v for v in eqn.invars]
        params = eqn.params
        inner = params.get("jaxpr")
        if eqn.primitive.name in _CALLS and isinstance(inner, jex.ClosedJaxpr):
            if id(inner) not in memo:
                merged = cse(inner.jaxpr, memo)
                if merged is not inner.jaxpr:
                    merged = jex.ClosedJaxpr(merged, inner.consts)
                    memo[id(inner)] = (inner, merged)
                else:
                    memo[id(inner)] = (inner, inner)
            if memo[id(inner)][1] is not inner:
                params = {**params, "jaxpr": memo[id(inner)][1]}
        key = None
        if not eqn.effects:
            inputs = tuple(
                _literal_key(v) if isinstance(v, jex.Literal) else v for v in invars
            )
            try:
                key = (eqn.primitive, inputs, tuple(sorted(params.items())))
                hash(key)
            except TypeError:
                key = None
            if key is not None and None in inputs:
                key = None
        first = None if key is None else seen.get(key)
        if first is not None:
            for old, new in zip(eqn.outvars, first.outvars):
                if not is_dropped(old):
                    rename[old] = new
            changed = True
            continue
        if params is not eqn.params or any(
            a is not b for a, b in zip(invars, eqn.invars)
        ):
            eqn = eqn.replace(invars=invars, params=params)
            changed = True
        if key is not None and not any(is_dropped(v) for v in eqn.outvars):
            seen[key] = eqn
        eqns.append(eqn)
    if changed:
        outvars = [
            rename.get(v, v) if isinstance(v, jex.Var) else v for v in jaxpr.outvars
        ]
        jaxpr = jaxpr.replace(eqns=eqns, outvars=outvars)
    return _split_slices(jaxpr)


# --- Dead equations ------------------------------------------------------------------


def dce(jaxpr):
    """`jaxpr` without the equations (at its top level) whose outputs neither an
    output nor a kept equation uses, and that have no effects: what a traced function
    computes and then drops (the stage times of a field that ignores `t`; a step's
    counters and decisions where only its differentiable outputs are wanted). The
    kept equations stay as they are, in their order: the same values, bit for bit."""
    used = {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars if not is_dropped(v)):
            kept.append(eqn)
            used.update(v for v in eqn.invars if isinstance(v, jex.Var))
    if len(kept) == len(jaxpr.eqns):
        return jaxpr
    return jaxpr.replace(eqns=kept[::-1])
