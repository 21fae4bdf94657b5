"""Closure conversion: turn any callable into a jaxpr plus an explicit pytree of every
JAX value it closes over.

This module imports nothing of solverkit, so it can be lifted into another project.
"""

import collections
import contextlib
import enum
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


try:  # Present in recent JAX; when True, concrete constants are inlined as literals.
    from jax._src.config import (
        use_simplified_jaxpr_constants as _simplified_constants,  # pyright: ignore
    )
except ImportError:  # pragma: no cover - older JAX always hoists constants.
    _simplified_constants = None


def _eval_jaxpr(jaxpr, consts, *args):
    if hasattr(jax.core, "eval_jaxpr"):
        return jax.core.eval_jaxpr(jaxpr, consts, *args)
    return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, consts))(*args)  # pragma: no cover


def _hoisting_constants():
    """Trace so that every concrete array becomes a constvar, never an inline literal.

    Which values JAX inlines depends on `jax_use_simplified_jaxpr_constants`; pinning it
    off for the duration of our own trace makes the result the same either way.
    """
    if _simplified_constants is None:  # pragma: no cover
        return contextlib.nullcontext()
    return _simplified_constants(False)


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_OUTPUT_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def _is_array(x) -> bool:
    return isinstance(x, _ARRAY_TYPES)


def _is_output_array(x) -> bool:
    """Whether an output leaf is traced (as `equinox.is_array`); others are static."""
    return isinstance(x, _OUTPUT_ARRAY_TYPES)


def _struct(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False))
    )


def _as_array(value, aval):
    """A const as a JAX array of the constvar's dtype; tracers are left as they are."""
    if isinstance(value, jax.core.Tracer):
        # A fresh tracer whose primal is an array: an autodiff tracer may carry a
        # Python scalar as its primal, which custom rules would not see as an array.
        return jnp.array(value, copy=True)
    if isinstance(value, jax.Array):
        return value
    return jnp.asarray(value, dtype=aval.dtype)


def _scalar_fits(value, dtype) -> bool:
    """Whether a Python scalar converts to `dtype` without losing its kind."""
    if isinstance(value, bool):
        return jnp.issubdtype(dtype, jnp.bool_)
    if isinstance(value, int):
        return jnp.issubdtype(dtype, jnp.number)
    if isinstance(value, float):
        return jnp.issubdtype(dtype, jnp.inexact)
    return jnp.issubdtype(dtype, jnp.complexfloating)


class _Static:
    """A static (non-array) leaf of the example arguments, compared by value."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def matches(self, other) -> bool:
        if other is self.value:
            return True
        try:
            return bool(type(other) is type(self.value) and other == self.value)
        except Exception:
            return False

    def __repr__(self):
        return f"static {self.value!r}"


# --- Identity of a converted program ----------------------------------------------
#
# A `Closure` keeps its jaxpr as static (treedef) data, so the jit cache sees it. To
# make a second conversion of the same function hit that cache, each fresh jaxpr is
# replaced by an earlier, structurally identical one when that is provably safe:
# - for the same Python callable, when the printed jaxprs agree (addresses ignored);
# - for any callable, when the printed jaxprs agree and the jaxpr holds no Python
#   callables (custom rules, host callbacks) whose behaviour printing cannot show.

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_CANON_SIZE = 512
_canon_lock = threading.Lock()
_canon_by_text: collections.OrderedDict = collections.OrderedDict()
_canon_by_fn: dict = {}  # id(fn) -> (weakref to fn, loose key, jaxpr)


_VALUE_LIKE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    np.dtype,
    np.generic,
    enum.Enum,
)
# Parameter types that are plain values and print in full (mesh and sharding specs).
_VALUE_LIKE_NAMES = frozenset(
    {"UnspecifiedValue", "AbstractMesh", "Mesh", "AutoSharding", "PartitionSpec"}
)


def _only_printable(value) -> bool:
    """Whether a jaxpr (or an equation parameter) is fully described by its print.

    A whitelist: anything else (a custom_jvp/custom_vjp rule, a host callback, any
    unknown object) makes the jaxpr comparable by identity only.
    """
    if isinstance(value, jex.ClosedJaxpr):
        return not value.consts and _only_printable(value.jaxpr)
    if isinstance(value, jex.Jaxpr):
        for eqn in value.eqns:
            for var in eqn.invars:
                if isinstance(var, jex.Literal) and np.ndim(var.val) > 0:
                    return False
            if not all(_only_printable(p) for p in eqn.params.values()):
                return False
        return True
    if isinstance(value, (tuple, list)):
        return all(_only_printable(v) for v in value)
    if isinstance(value, dict):
        return all(_only_printable(v) for v in value.values())
    if isinstance(value, _VALUE_LIKE) or isinstance(value, jax.sharding.Sharding):
        return True
    return type(value).__name__ in _VALUE_LIKE_NAMES


class _Program:
    """Static part of a `Closure`: the jaxpr and the argument/output structure."""

    __slots__ = (
        "jaxpr",
        "in_tree",
        "in_specs",
        "out_tree",
        "out_specs",
        "out_struct",
        "_key",
    )

    def __init__(self, jaxpr, in_tree, in_specs, out_tree, out_specs, key):
        self.jaxpr = jaxpr
        self.in_tree = in_tree
        self.in_specs = in_specs
        self.out_tree = out_tree
        self.out_specs = out_specs  # per output leaf: ShapeDtypeStruct or _Static
        self.out_struct = jtu.tree_unflatten(
            out_tree, [s.value if isinstance(s, _Static) else s for s in out_specs]
        )
        self._key = key

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, _Program):
            return NotImplemented
        return self.jaxpr is other.jaxpr and self._key == other._key

    def __hash__(self):
        return hash((id(self.jaxpr), self._key))


def _spec_key(spec):
    if isinstance(spec, _Static):
        try:
            hash(spec.value)
            return ("static", type(spec.value), spec.value)
        except TypeError:
            return ("static-id", id(spec.value))
    return (spec.shape, str(spec.dtype), spec.weak_type)


def _canonical_jaxpr(fn, jaxpr, signature):
    """Return an earlier jaxpr equal to `jaxpr` (see above), else `jaxpr` itself."""
    text = str(jaxpr)
    printable = _only_printable(jaxpr)
    with _canon_lock:
        if printable:
            key = (signature, text)
            found = _canon_by_text.get(key)
            if found is not None:
                _canon_by_text.move_to_end(key)
                return found
            _canon_by_text[key] = jaxpr
            if len(_canon_by_text) > _CANON_SIZE:
                _canon_by_text.popitem(last=False)
            return jaxpr
        loose = (signature, _ADDRESS.sub("", text))
        # A bound method is made afresh on each attribute access: key it by its
        # object and function instead.
        target = getattr(fn, "__self__", None)
        func = getattr(fn, "__func__", None)
        if target is None or func is None:
            target, func = fn, None
        key = (id(target), id(func))
        previous = _canon_by_fn.get(key)
        if previous is not None and previous[0]() is target and previous[1] == loose:
            return previous[2]
        try:
            ref = weakref.ref(target, lambda _: _canon_by_fn.pop(key, None))
        except TypeError:  # not weak-referenceable: no reuse
            return jaxpr
        _canon_by_fn[key] = (ref, loose, jaxpr)
        return jaxpr


# --- Common subexpressions ---------------------------------------------------------
#
# Users index their state again and again (`y[0] * y[1] - y[0]`). XLA merges the
# repeated slices of the forward computation, but each one's transpose under reverse
# mode is a pad of its own cotangent, and those pads are not merged: the gradient of
# the Lotka-Volterra benchmark ran 2x slower written so than with each slice taken
# once. So the jaxpr is cleared of repeated equations once, on conversion.


def _literal_key(lit):
    value = np.asarray(lit.val)
    if value.ndim:
        return None
    return ("literal", str(lit.aval), value.dtype.str, value.tobytes())


def _is_dropped(var) -> bool:
    # An unused output (`_`); `jax.extend.core` names the type only in newer JAX.
    return type(var).__name__ == "DropVar"


_CALLS = frozenset({"pjit", "jit", "closed_call"})  # nested calls merged inside too


# --- Slices of one array as one split ---------------------------------------------
#
# The transpose of `slice` is a `pad` of the cotangent. A field that indexes its state
# (`y[0]`, `y[1:]`) sums several such pads per stage, and XLA:CPU fuses the chains of
# pads through a many-stage Runge-Kutta step into loops whose cost grows far faster
# than the number of stages: the Lorenz ensemble's reverse step cost 10x its forward
# step (`python -m benchmarks.vjp_stages`). So the slices of one array along one axis
# become one `split` at every boundary they use (and `concatenate`s of its pieces
# where a slice spans several). The transpose of `split` is a single `concatenate` of
# the pieces' cotangents, with no pad; forward, XLA lowers a `split` to the same
# slices as before.


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
    with _hoisting_constants():
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
    one `split` (see above), placed where the first of them was."""
    if not hasattr(jax.lax, "split"):  # pragma: no cover - JAX < 0.4.36
        return jaxpr
    groups: dict = {}  # array -> [axis or None when not splittable, equation indices]
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "slice" or _is_dropped(eqn.outvars[0]):
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


def _cse(jaxpr, memo=None):
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
                merged = _cse(inner.jaxpr, memo)
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
                if not _is_dropped(old):
                    rename[old] = new
            changed = True
            continue
        if params is not eqn.params or any(
            a is not b for a, b in zip(invars, eqn.invars)
        ):
            eqn = eqn.replace(invars=invars, params=params)
            changed = True
        if key is not None and not any(_is_dropped(v) for v in eqn.outvars):
            seen[key] = eqn
        eqns.append(eqn)
    if changed:
        outvars = [
            rename.get(v, v) if isinstance(v, jex.Var) else v for v in jaxpr.outvars
        ]
        jaxpr = jaxpr.replace(eqns=eqns, outvars=outvars)
    return _split_slices(jaxpr)


# --- Evaluation inside shard_map with varying-manual-axes checks --------------------
#
# A jaxpr traced outside `shard_map` types every value as invariant across the mesh's
# manual axes. Evaluated inside `shard_map(check_vma=True)` with a varying input,
# each primitive would see mismatched types where JAX's own tracing would have cast
# the invariant operand with `pvary`. So, when some input varies, the jaxpr is
# interpreted: each primitive's operands are cast to the union of their varying axes
# (what tracing inside the shard_map would have done), nested calls are inlined, and
# loops, conds, checkpoints and custom_jvp rules are rebuilt through JAX's own API so
# that their bodies are typed afresh. On JAX without these types, nothing changes.


_typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # pyright: ignore


def _vma(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside shard_map, or on old JAX)."""
    try:
        aval = _typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def _pvary(x, axes: frozenset):
    """`x` cast from invariant to varying over `axes` (a no-op on the data)."""
    missing = tuple(sorted(axes - _vma(x), key=str))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # pyright: ignore  # pragma: no cover


def _interpret(jaxpr, consts, *args):
    """`eval_jaxpr` that casts operands to matching varying axes (see above)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        if rule is not None:
            outs = rule(ins, **eqn.params)
        else:
            union = frozenset().union(*(_vma(x) for x in ins))
            outs = _bind(eqn.primitive, eqn.params, [_pvary(x, union) for x in ins])
        for v, o in zip(eqn.outvars, outs):
            if not _is_dropped(v):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _bind(primitive, params, ins, subfuns=None):
    """Bind as `eval_jaxpr` does (whichever form of `get_bind_params` this JAX has),
    optionally with other sub-functions; always a list of outputs."""
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        old_subfuns, bind_params = bind_params
        outs = primitive.bind(*(subfuns or old_subfuns), *ins, **bind_params)
    else:
        if subfuns is not None:
            bind_params = {**bind_params, "subfuns": tuple(subfuns)}
        outs = primitive.bind(*ins, **bind_params)
    return outs if primitive.multiple_results else [outs]


def _as_fn(closed):
    """A ClosedJaxpr as a function of its flat inputs, interpreted."""
    return lambda *xs: _interpret(closed.jaxpr, closed.consts, *xs)


def _call_rule(ins, *, jaxpr, **_):
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return _interpret(jaxpr.jaxpr, jaxpr.consts, *ins)
    return _interpret(jaxpr, (), *ins)


def _call_jaxpr_rule(ins, *, call_jaxpr, **_):
    return _call_rule(ins, jaxpr=call_jaxpr)


def _scan_rule(ins, *, jaxpr, num_consts, num_carry, length, reverse, unroll, **_):
    consts, init, xs = (
        ins[:num_consts],
        ins[num_consts : num_consts + num_carry],
        ins[num_consts + num_carry :],
    )
    body = _as_fn(jaxpr)
    # The carry must keep its type: make it vary wherever any input does (a sound
    # over-approximation of what the body may make it).
    union = frozenset().union(*(_vma(x) for x in ins))
    init = [_pvary(x, union) for x in init]

    def step(carry, x):
        out = body(*consts, *carry, *x)
        return out[:num_carry], out[num_carry:]

    carry, ys = jax.lax.scan(
        step, init, xs, length=length, reverse=reverse, unroll=unroll
    )
    return [*carry, *ys]


def _while_rule(ins, *, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts, **_):
    cond_consts, body_consts = ins[:cond_nconsts], ins[cond_nconsts:][:body_nconsts]
    init = ins[cond_nconsts + body_nconsts :]
    cond, body = _as_fn(cond_jaxpr), _as_fn(body_jaxpr)
    union = frozenset().union(*(_vma(x) for x in ins))  # as for scan
    init = [_pvary(x, union) for x in init]
    return jax.lax.while_loop(
        lambda c: cond(*cond_consts, *c)[0], lambda c: body(*body_consts, *c), init
    )


def _cond_rule(ins, *, branches, **_):
    index, *ops = ins
    return jax.lax.switch(index, [_as_fn(b) for b in branches], *ops)


def _remat_rule(ins, *, jaxpr, prevent_cse, policy, **_):
    fn = lambda *xs: _call_rule(xs, jaxpr=jaxpr)
    return jax.checkpoint(fn, prevent_cse=prevent_cse, policy=policy)(*ins)


def _custom_jvp_rule(ins, **params):
    """The custom_jvp call again, with its primal and JVP jaxprs interpreted."""
    from jax._src import custom_derivatives as cd, linear_util as lu  # noqa: PLC0415

    call_jaxpr, num_consts = params["call_jaxpr"], params["num_consts"]
    jvp_jaxpr_fun = params["jvp_jaxpr_fun"]

    def jvp(*xs):
        half = len(xs) // 2
        primals, tangents = xs[num_consts:half], xs[half + num_consts :]
        zeros = [type(t) is cd.SymbolicZero for t in tangents]
        jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
        nonzero = [t for t in tangents if type(t) is not cd.SymbolicZero]
        out = _interpret(jvp_jaxpr, jvp_consts, *primals, *nonzero)
        out_primals, it = out[: len(out_zeros)], iter(out[len(out_zeros) :])
        out_tangents = [
            cd.SymbolicZero(_typeof(p).to_tangent_aval()) if z else next(it)
            for p, z in zip(out_primals, out_zeros)
        ]
        return [*out_primals, *out_tangents]

    union = frozenset().union(*(_vma(x) for x in ins))
    subfuns = (
        lu.wrap_init(_as_fn(call_jaxpr), debug_info=call_jaxpr.jaxpr.debug_info),
        lu.wrap_init(jvp, debug_info=jvp_jaxpr_fun.debug_info),
    )
    ins = [_pvary(x, union) for x in ins]
    return _bind(cd.custom_jvp_call_p, params, ins, subfuns)


def _pvary_rule(ins, *, axes, **_):
    # A jaxpr traced inside shard_map casts where a value was invariant then; it may
    # vary by now (say, a loop's time): cast only the axes it does not vary over yet.
    return [_pvary(x, frozenset(axes)) for x in ins]


_RULES = {
    "pvary": _pvary_rule,
    "pjit": _call_rule,
    "jit": _call_rule,
    "closed_call": _call_jaxpr_rule,
    "core_call": _call_jaxpr_rule,
    "scan": _scan_rule,
    "while": _while_rule,
    "cond": _cond_rule,
    "checkpoint": _remat_rule,
    "remat2": _remat_rule,
    "custom_jvp_call": _custom_jvp_rule,
}


def _evaluate(jaxpr, consts, args):
    """The jaxpr's outputs; interpreted when a value varies over shard_map axes."""
    if any(_vma(x) for x in (*consts, *args)):
        return _interpret(jaxpr, consts, *args)
    return _eval_jaxpr(jaxpr, consts, *args)


# --- Public API ---------------------------------------------------------------------


class Closure(eqx.Module):
    """A function with every JAX value it closes over made explicit.

    Made by [`solverkit.closure_convert`][]. Its pytree leaves are `consts`, the
    closed-over values (of every dtype), so a `Closure` can be passed as an ordinary
    argument through `jax.custom_vjp`, `lax.while_loop`, `vmap`, `grad`, `jit`, ...

    **Attributes:**

    - `consts`: tuple of every JAX value the function closes over, as arrays.
    - `jaxpr`: the closed-over-value-free jaxpr, with `consts` as its constvars.
    - `out_struct`: the output pytree, with a `jax.ShapeDtypeStruct` for each array
        leaf and each static (non-array) leaf as it is.
    - `effects`: the jaxpr's effects.

    The jaxpr takes the array leaves of the arguments and returns the array leaves of
    the output, in `jax.tree_util` order with static leaves left out:
    `jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat_args)` equals
    `[x for x in jax.tree_util.tree_leaves(fn(*args)) if equinox.is_array(x)]`.
    """

    consts: tuple[Any, ...]
    program: _Program = eqx.field(static=True)

    @property
    def jaxpr(self) -> jex.Jaxpr:
        return self.program.jaxpr

    @property
    def out_struct(self):
        return self.program.out_struct

    @property
    def effects(self):
        return self.program.jaxpr.effects

    def __call__(self, *args, **kwargs):
        program = self.program
        leaves, treedef = jtu.tree_flatten((args, kwargs))
        if treedef != program.in_tree:
            raise ValueError(
                "Closure called with arguments of another structure: expected "
                f"{program.in_tree}, got {treedef}."
            )
        flat = []
        for i, (leaf, spec) in enumerate(zip(leaves, program.in_specs)):
            if isinstance(spec, _Static):
                if not spec.matches(leaf):
                    raise ValueError(
                        f"Closure argument leaf {i}: expected the static value "
                        f"{spec.value!r} it was converted with, got {leaf!r}."
                    )
                continue
            if isinstance(leaf, (bool, int, float, complex)) and spec.shape == ():
                if not _scalar_fits(leaf, spec.dtype):
                    raise ValueError(
                        f"Closure argument leaf {i}: expected an array of dtype "
                        f"{spec.dtype}, got the Python {type(leaf).__name__} {leaf!r}."
                    )
                leaf = jnp.asarray(leaf, dtype=spec.dtype)
            shape = np.shape(leaf)
            dtype = getattr(leaf, "dtype", None)
            if shape != spec.shape or dtype != spec.dtype:
                raise ValueError(
                    f"Closure argument leaf {i}: expected shape {spec.shape} and dtype "
                    f"{spec.dtype}, got shape {shape} and dtype {dtype}."
                )
            flat.append(leaf)
        out = iter(_evaluate(program.jaxpr, self.consts, flat))
        leaves = []
        for spec in program.out_specs:
            if isinstance(spec, _Static):
                leaves.append(spec.value)
                continue
            # A constant output comes back as a Python scalar: make it an array.
            o = next(out)
            leaves.append(o if isinstance(o, jax.Array) else jnp.asarray(o, spec.dtype))
        return jtu.tree_unflatten(program.out_tree, leaves)


def _trace(fn: Callable, in_tree, in_specs):
    """Trace `fn` on the array leaves of its example arguments (the others static).

    **Returns:**

    `(closed_jaxpr, out_tree, out_leaves)`: the jaxpr returns the array leaves of the
    output; `out_leaves` are all of them as traced (tracers and static values).
    """
    dynamic = [s for s in in_specs if not isinstance(s, _Static)]
    traced_out = []  # (treedef, leaves) of fn's output, recorded during the trace

    def flat_fn(*flat):
        it = iter(flat)
        full = [s.value if isinstance(s, _Static) else next(it) for s in in_specs]
        call_args, call_kwargs = jtu.tree_unflatten(in_tree, full)
        leaves, tree = jtu.tree_flatten(fn(*call_args, **call_kwargs))
        traced_out.append((tree, leaves))
        # Only array leaves are traced; the others are static, as in filter_jit.
        return [x for x in leaves if _is_output_array(x)]

    with _hoisting_constants():
        closed_jaxpr = jax.make_jaxpr(flat_fn)(*dynamic)
    ((out_tree, out_leaves),) = traced_out
    return closed_jaxpr, out_tree, out_leaves


def closure_convert(fn: Callable, *args, **kwargs) -> Closure:
    """Convert `fn` into a [`solverkit.Closure`][] that holds every JAX value `fn`
    closes over, of every dtype, as explicit pytree leaves.

    Closed-over values are found by tracing `fn` once, however `fn` holds them: a
    lexical closure, a default argument, a global, a `functools.partial`, a bound
    method, a callable object or an `equinox.Module`. Tracers of enclosing
    transformations (`vmap`, `grad`, `jvp`, `jit`, ...) and concrete arrays alike
    become `consts`. Repeated equations of the traced function (the same operation on
    the same inputs, without effects) are merged, and the unit-stride slices of an
    array along one axis are taken with one `split`, which makes its reverse mode
    cheaper.

    **Arguments:**

    - `fn`: any Python callable.
    - `*args`, `**kwargs`: example arguments. Array leaves (JAX or NumPy arrays,
        `jax.ShapeDtypeStruct`) are traced; every other leaf (Python scalars among them)
        is static and must be passed again, equal, on each call.

    **Returns:**

    A `Closure`, callable with arguments of the example's structure, shapes and
    dtypes. Output leaves that are not arrays (strings, Python scalars) are static,
    as in `equinox.filter_jit`: they are recorded on conversion and returned
    unchanged by each call. A `Closure` passed as `fn` is returned unchanged.
    """
    if isinstance(fn, Closure):
        return fn
    if not callable(fn):
        raise TypeError(f"closure_convert expects a callable, got {type(fn).__name__}.")
    leaves, in_tree = jtu.tree_flatten((args, kwargs))
    in_specs = tuple(_struct(x) if _is_array(x) else _Static(x) for x in leaves)
    closed_jaxpr, out_tree, out_leaves = _trace(fn, in_tree, in_specs)
    jaxpr = _cse(closed_jaxpr.jaxpr)
    consts = tuple(
        _as_array(c, v.aval) for c, v in zip(closed_jaxpr.consts, jaxpr.constvars)
    )
    # Array leaves' types from the jaxpr's output types: they keep weak types.
    avals = iter(closed_jaxpr.out_avals)
    out_specs = tuple(
        _struct(next(avals)) if _is_output_array(x) else _Static(x) for x in out_leaves
    )
    signature = (
        in_tree,
        tuple(_spec_key(s) for s in in_specs),
        out_tree,
        tuple(_spec_key(s) for s in out_specs),
    )
    jaxpr = _canonical_jaxpr(fn, jaxpr, signature)
    program = _Program(jaxpr, in_tree, in_specs, out_tree, out_specs, signature)
    return Closure(consts, program)


def is_closure_converted(obj) -> bool:
    """Whether `obj` is a [`solverkit.Closure`][] (made by `closure_convert`).

    **Arguments:**

    - `obj`: anything.

    **Returns:**

    `True` for a `Closure`, else `False`.
    """
    return isinstance(obj, Closure)
