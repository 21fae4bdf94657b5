"""Closure conversion: turn any callable into a jaxpr plus an explicit pytree of every
JAX value it closes over.

Here: tracing, hoisting every closed-over value, and the conversion cache (a
program's identity). The rewrites of the traced jaxpr are in `_jaxpr_rewrite.py`, its
evaluation inside `shard_map` in `_vma_eval.py`. With those two modules this one
imports nothing of solverkit, so the three can be lifted into another project.
"""

import collections
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

from ._jaxpr_rewrite import cse, hoisting_constants
from ._vma_eval import evaluate, varying_axes


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


def _eqns_printable(jaxpr) -> bool:
    """Whether a jaxpr's equations are fully described by its print (its own
    constants aside)."""
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if isinstance(var, jex.Literal) and np.ndim(var.val) > 0:
                return False
        if not all(_only_printable(p) for p in eqn.params.values()):
            return False
    return True


def _only_printable(value) -> bool:
    """Whether a jaxpr (or an equation parameter) is fully described by its print.

    A whitelist: anything else (a custom_jvp/custom_vjp rule, a host callback, any
    unknown object) makes the jaxpr comparable by identity only.
    """
    if isinstance(value, (jex.ClosedJaxpr, jex.Jaxpr)):
        # Constants don't print. (Read through what both classes have: from JAX
        # 0.11 a jaxpr carries its constants, and `ClosedJaxpr` is `Jaxpr`.)
        if len(getattr(value, "consts", None) or ()):
            return False
        return _eqns_printable(value)
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
    # Its own constants are the `Closure`'s (operands), not part of the program.
    printable = _eqns_printable(jaxpr)
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
        out = iter(evaluate(program.jaxpr, self.consts, flat))
        leaves = []
        for spec in program.out_specs:
            if isinstance(spec, _Static):
                leaves.append(spec.value)
                continue
            # A constant output comes back as a Python scalar: make it an array.
            o = next(out)
            leaves.append(o if isinstance(o, jax.Array) else jnp.asarray(o, spec.dtype))
        return jtu.tree_unflatten(program.out_tree, leaves)


def _trace(fn: Callable, in_tree, in_specs, varying=()):
    """Trace `fn` on the array leaves of its example arguments (the others static).

    **Returns:**

    `(closed_jaxpr, out_tree, out_leaves)`: the jaxpr returns the array leaves of the
    output; `out_leaves` are all of them as traced (tracers and static values).
    """
    dynamic = [s for s in in_specs if not isinstance(s, _Static)]
    # An argument that varies over `shard_map` axes is traced as itself, so that the
    # jaxpr types it as varying (a `ShapeDtypeStruct` can't say so outside a mesh).
    for i, x in varying:
        dynamic[i] = x
    traced_out = []  # (treedef, leaves) of fn's output, recorded during the trace

    def flat_fn(*flat):
        it = iter(flat)
        full = [s.value if isinstance(s, _Static) else next(it) for s in in_specs]
        call_args, call_kwargs = jtu.tree_unflatten(in_tree, full)
        leaves, tree = jtu.tree_flatten(fn(*call_args, **call_kwargs))
        traced_out.append((tree, leaves))
        # Only array leaves are traced; the others are static, as in filter_jit.
        return [x for x in leaves if _is_output_array(x)]

    with hoisting_constants():
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
    arrays = [x for x in leaves if _is_array(x)]
    varying = [
        (i, x)
        for i, x in enumerate(arrays)
        if isinstance(x, jax.Array) and varying_axes(x)
    ]
    closed_jaxpr, out_tree, out_leaves = _trace(fn, in_tree, in_specs, varying)
    jaxpr = cse(closed_jaxpr.jaxpr)
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


_NUMBERS = (bool, int, float, complex)


def output_struct(closure: Closure) -> Any:
    """`closure.out_struct`, with Python-number outputs (static in a `Closure`, as in
    `equinox.filter_jit`) as the weakly typed scalars they become when used."""

    def leaf(o):
        if isinstance(o, _NUMBERS):
            return jax.eval_shape(jnp.asarray, o)
        return o

    return jtu.tree_map(leaf, closure.out_struct)


def array_outputs(fn):
    """`fn` with its Python-number outputs made arrays, so that they are traced."""

    def with_arrays(*args, **kwargs):
        out = fn(*args, **kwargs)
        return jtu.tree_map(
            lambda o: jnp.asarray(o) if isinstance(o, _NUMBERS) else o, out
        )

    return with_arrays
