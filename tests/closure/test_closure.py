"""Tests of closure conversion: `sk.closure_convert`, `sk.Closure`,
`sk.is_closure_converted`.

Every test runs under both settings of `jax_use_simplified_jaxpr_constants` (where the
running JAX has that flag). The core matrix, `test_every_route_and_dtype_under[trace]`,
covers every capture route x every dtype under each trace: each route closes over its
own value of each of the ten dtypes, and failures name the route and dtype.
"""

import contextlib
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback
from jax.sharding import Mesh, PartitionSpec as P

import solverkit as sk


# --- Settings and helpers -----------------------------------------------------------

_FLAG = "jax_use_simplified_jaxpr_constants"
_HAS_FLAG = hasattr(jax.config, _FLAG)
_FLAG_VALUES = [False, True] if _HAS_FLAG else [None]
# The flag's other setting (not this JAX's default) runs in the full suite only.
_FLAG_DEFAULT = getattr(jax.config, _FLAG) if _HAS_FLAG else None
_FLAG_PARAMS = [
    pytest.param(v, marks=[] if v == _FLAG_DEFAULT else [pytest.mark.slow])
    for v in _FLAG_VALUES
]


@pytest.fixture(
    autouse=True,
    params=_FLAG_PARAMS,
    ids=lambda v: "flag-absent" if v is None else f"simplified-{'on' if v else 'off'}",
)
def simplified_constants(request):
    """Run each test with `jax_use_simplified_jaxpr_constants` set, then restore it."""
    if request.param is None:
        yield None
        return
    old = getattr(jax.config, _FLAG)
    jax.config.update(_FLAG, request.param)
    try:
        yield request.param
    finally:
        jax.config.update(_FLAG, old)


def _x64():
    """Context enabling float64, whichever spelling this JAX has."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pyright: ignore

    return enable_x64()


def _eval_jaxpr(jaxpr, consts, *args):
    if hasattr(jax.core, "eval_jaxpr"):
        return jax.core.eval_jaxpr(jaxpr, consts, *args)
    import jax.extend.core as jex  # pragma: no cover

    return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, consts))(*args)  # pragma: no cover


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map  # pyright: ignore

    return shard_map


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _comparable(x):
    return jax.random.key_data(x) if hasattr(x, "dtype") and _is_key(x) else x


def _assert_tree_equal(got, want):
    """Same structure, same dtypes, equal values (keys compared by their data)."""
    got_leaves, got_tree = jtu.tree_flatten(got)
    want_leaves, want_tree = jtu.tree_flatten_with_path(want)
    assert got_tree == jtu.tree_structure(want), (got_tree, want_tree)
    for g, (path, w) in zip(got_leaves, want_leaves):
        where = jtu.keystr(path)
        assert _dtype(g) == _dtype(w), (where, _dtype(g), _dtype(w))
        assert np.shape(g) == np.shape(w), where
        g, w = np.asarray(_comparable(g)), np.asarray(_comparable(w))
        if np.issubdtype(g.dtype, np.inexact):
            rtol = 2e-3 if g.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol, err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _struct_key(s):
    return (tuple(s.shape), str(s.dtype), bool(getattr(s, "weak_type", False)))


def _out_key(s):
    """`_struct_key` of an output struct leaf; a static leaf is its own key."""
    if isinstance(s, jax.ShapeDtypeStruct):
        return _struct_key(s)
    return ("static", type(s), s)


def _flat_call(closed: sk.Closure, *args):
    """`fn(*args)` through the seed invariant: eval_jaxpr on the flat arguments."""
    flat = _eval_jaxpr(closed.jaxpr, closed.consts, *jtu.tree_leaves(args))
    return jtu.tree_unflatten(jtu.tree_structure(closed.out_struct), flat)


def _avals(xs):
    return sorted((tuple(np.shape(x)), str(x.dtype)) for x in xs)


def _check_consts(closed: sk.Closure, values, concrete: bool, where: str = ""):
    """Every closed-over value is a const, and every const is a JAX array."""
    consts = closed.consts
    assert isinstance(consts, tuple), where
    for c in consts:
        assert isinstance(c, jax.Array), (where, type(c))
        scalar_types = (bool, int, float, complex, np.ndarray, np.generic)
        assert not isinstance(c, scalar_types), (where, type(c))
    leaves = jtu.tree_leaves(values)
    assert _avals(consts) == _avals(leaves), where
    if concrete:
        for leaf in leaves:
            assert any(c is leaf for c in consts), (where, leaf)


# --- Values of every dtype, and a computation that uses each -----------------------

_DTYPES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int32",
    "uint32",
    "bool",
    "complex64",
    "key",
    "raw_key",
)
_FLOATS = ("float16", "float32", "float64")
_Y = np.array([0.5, -1.25, 2.0], np.float32)


def _value(name: str, seed: int, batch: int | None = None):
    """A closed-over value of dtype `name`: shape (3,), a key, or a raw (2,) key."""
    shape = (3,) if batch is None else (batch, 3)
    rng = np.random.default_rng(seed)
    if name == "key":
        key = jax.random.key(seed)
        return key if batch is None else jax.random.split(key, batch)
    if name == "raw_key":
        key = jax.random.PRNGKey(seed)
        return key if batch is None else jax.random.split(key, batch)
    if name == "bool":
        return jnp.asarray(rng.random(shape) > 0.5)
    if name in ("int8", "int32", "uint32"):
        return jnp.asarray(rng.integers(0, 40, shape), dtype=name)
    if name == "complex64":
        return jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape), name)
    return jnp.asarray(rng.normal(size=shape), dtype=name)


def _values(names, batch=None) -> dict[str, Any]:
    return {n: _value(n, seed, batch) for seed, n in enumerate(names)}


def _use(name: str, v, y):
    """A dtype-preserving computation with closed-over `v` and the argument `y`."""
    # Few, cheap operations: every distinct one costs a compilation per trace.
    if name == "key":  # random draws from closed-over keys: test_random_draws
        return {"k": v, "data": jax.random.key_data(v)}
    if name == "bool":
        return jnp.logical_not(v)
    if name in ("int8", "int32", "uint32", "raw_key"):
        return v * 3
    return v * y.astype(v.dtype)


def _body(y, vals: dict):
    return {name: _use(name, v, y) for name, v in vals.items()}


def _loss(out) -> jax.Array:
    """Sum of every real floating output leaf, as a float32 scalar."""
    return sum(
        jnp.sum(leaf.astype(jnp.float32))
        for leaf in jtu.tree_leaves(out)
        if not _is_key(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating)
    )


# --- Capture routes -----------------------------------------------------------------

_GLOBAL_VALS: Any = None


def _global_fn(y):
    return _body(y, _GLOBAL_VALS)


class _Holder:
    def __init__(self, vals):
        self.vals = vals

    def method(self, y):
        return _body(y, self.vals)


class _CallableObject:
    def __init__(self, vals):
        self.vals = vals

    def __call__(self, y):
        return _body(y, self.vals)


class _Field(eqx.Module):
    vals: dict

    def __call__(self, y):
        return _body(y, self.vals)


def _swapped_body(vals, y):
    return _body(y, vals)


_ROUTES = (
    "closure",
    "default",
    "global",
    "partial",
    "method",
    "callable",
    "module",
    "mix",
)


@contextlib.contextmanager
def _route(route: str, vals: dict):
    """Yield a function of `y` that holds `vals` by `route`."""
    global _GLOBAL_VALS
    try:
        if route == "closure":
            yield lambda y: _body(y, vals)
        elif route == "default":

            def fn(y, v=vals):
                return _body(y, v)

            yield fn
        elif route == "global":
            _GLOBAL_VALS = vals
            yield _global_fn
        elif route == "partial":
            yield functools.partial(_swapped_body, vals)
        elif route == "method":
            yield _Holder(vals).method
        elif route == "callable":
            yield _CallableObject(vals)
        elif route == "module":
            yield _Field(vals)
        else:
            yield _mixed(vals)
    finally:
        _GLOBAL_VALS = None


def _mixed(vals: dict) -> Callable:
    """Every route at once: each part of `vals` is held a different way."""
    global _GLOBAL_VALS
    names = sorted(vals)
    parts = [{n: vals[n] for n in names[i::7]} for i in range(7)]
    module = _Field(parts[0])
    method = _Holder(parts[1]).method
    _GLOBAL_VALS = parts[2]
    lexical = parts[5]
    obj = _CallableObject(parts[6])

    def inner(y, part, default=parts[4]):
        out = {**module(y), **method(y), **_global_fn(y), **obj(y)}
        return {**out, **_body(y, part), **_body(y, default), **_body(y, lexical)}

    return functools.partial(inner, part=parts[3])


# --- The core matrix: route x trace, every dtype -----------------------------------

_MODES = ("direct", "closed", "eval")


def _probe(route: str, vals: dict, y, modes=_MODES, concrete=False) -> dict:
    """Run `fn(y)` directly, through its Closure, and through eval_jaxpr."""
    out = {}
    with _route(route, vals) as fn:
        if "direct" in modes:
            out["direct"] = fn(y)
        if modes == ("direct",):
            return out
        closed = sk.closure_convert(fn, y)
        _check_consts(closed, vals, concrete, where=route)
        assert jtu.tree_structure(closed.out_struct) == jtu.tree_structure(
            jax.eval_shape(lambda z: fn(z), y)  # a new function: no stale cache
        )
        if "closed" in modes:
            out["closed"] = closed(y)
        if "eval" in modes:
            out["eval"] = _flat_call(closed, y)
    return out


def _split(vals: dict):
    """{route: {dtype: value}} -> its real-floating part and the rest."""
    floats = {r: {n: v for n, v in d.items() if n in _FLOATS} for r, d in vals.items()}
    rest = {
        r: {n: v for n, v in d.items() if n not in _FLOATS} for r, d in vals.items()
    }
    return floats, rest


def _merge(floats: dict, rest: dict) -> dict:
    return {r: {**floats[r], **rest[r]} for r in floats}


def _ones(tree):
    return jtu.tree_map(jnp.ones_like, tree)


_BATCH = 2
_TRACES = (
    "none",
    "vmap",
    "grad",
    "jvp",
    "jit",
    "linearize",
    "vmap_grad",
    "jit_vmap",
    "grad_vmap",
)


def _run_trace(trace: str, names) -> dict:
    """Apply `trace` to the probe of every route, each holding its own values.

    Returns nested dicts with a {"direct", "closed", "eval"} level somewhere inside;
    the three agree when conversion is right. All routes go through one transform
    (one compilation under jit).
    """
    batched = trace in ("vmap", "vmap_grad", "jit_vmap", "grad_vmap")
    batch = _BATCH if batched else None
    vals = {
        route: {n: _value(n, 10 * i + j, batch) for j, n in enumerate(names)}
        for i, route in enumerate(_ROUTES)
    }
    y = jnp.asarray(_Y)
    floats, rest = _split(vals)

    def all_modes(v):
        return {r: _probe(r, v[r], y, concrete=trace == "none") for r in _ROUTES}

    def one_mode(mode):
        return lambda v: {r: _probe(r, v[r], y, (mode,))[mode] for r in _ROUTES}

    if trace == "none":
        return all_modes(vals)
    if trace == "vmap":
        return jax.vmap(all_modes)(vals)
    if trace == "jit":
        return jax.jit(all_modes)(vals)
    if trace == "jit_vmap":
        return jax.jit(jax.vmap(all_modes))(vals)
    if trace == "jvp":
        return jax.jvp(
            lambda f: all_modes(_merge(f, rest)), (floats,), (_ones(floats),)
        )
    if trace == "linearize":
        out, lin = jax.linearize(lambda f: all_modes(_merge(f, rest)), floats)
        return {"primal": out, "tangent": lin(_ones(floats))}
    result = {}
    # Under the nestings, "eval" would repeat "closed" (a Closure call is eval_jaxpr
    # on the flat arguments) at the price of a third gradient: "grad" keeps it.
    modes = _MODES if trace == "grad" else ("direct", "closed")
    for mode in modes:
        run = one_mode(mode)
        if trace == "grad":
            result[mode] = jax.grad(lambda f: _loss(run(_merge(f, rest))))(floats)
        elif trace == "vmap_grad":

            def grad_one(v):
                f, r = _split(v)
                return jax.grad(lambda f: _loss(run(_merge(f, r))))(f)

            result[mode] = jax.vmap(grad_one)(vals)
        else:
            assert trace == "grad_vmap"
            result[mode] = jax.grad(lambda f: _loss(jax.vmap(run)(_merge(f, rest))))(
                floats
            )
    return result


def _assert_modes_agree(result):
    if isinstance(result, dict) and "direct" in result:
        assert set(result) in ({"direct", "closed"}, set(_MODES)), set(result)
        _assert_tree_equal(result["closed"], result["direct"])
        if "eval" in result:
            _assert_tree_equal(result["eval"], result["direct"])
    elif isinstance(result, dict):
        for part in result.values():
            _assert_modes_agree(part)
    else:
        for part in result:
            _assert_modes_agree(part)


# Traces that the quick loop (`-m "not slow"`) leaves to the full suite.
_SLOW_TRACES = ("linearize", "jit_vmap", "grad_vmap")


@pytest.mark.parametrize(
    "trace",
    [
        pytest.param(t, marks=[pytest.mark.slow] if t in _SLOW_TRACES else [])
        for t in _TRACES
    ],
)
def test_every_route_and_dtype_under(trace):
    """Each capture route, closing over one value of each of the ten dtypes, under
    `trace`: hoisted as arrays, and fn, Closure and eval_jaxpr agree.

    A failure names the route and dtype in its path, e.g. `['mix']['int8']`.
    """
    with _x64():
        result = _run_trace(trace, _DTYPES)
    _assert_modes_agree(result)


def test_random_draws():
    """Random bits drawn from a closed-over key, under vmap and jit."""
    keys = jax.random.split(jax.random.key(0), 2)
    y = jnp.asarray(_Y)

    def draw(k):
        fn = lambda z: jax.random.bits(k, (3,)) * (z > 0)
        closed = sk.closure_convert(fn, y)
        assert _avals(closed.consts) == _avals([k])
        return fn(y), closed(y), _flat_call(closed, y)

    direct, closed, flat = jax.jit(jax.vmap(draw))(keys)
    _assert_tree_equal(closed, direct)
    _assert_tree_equal(flat, direct)
    assert not np.array_equal(direct[0], direct[1])


def test_value_dtypes():
    """The values used above really have the dtypes they claim."""
    with _x64():
        vals = _values(_DTYPES)
    for name, v in vals.items():
        if name == "key":
            assert _is_key(v)
        elif name == "raw_key":
            assert v.dtype == jnp.uint32 and v.shape == (2,)
        else:
            assert v.dtype == jnp.dtype(name), (name, v.dtype)


# --- Hoisting, consts as arrays, the seed invariant ---------------------------------


def test_concrete_arrays_hoisted():
    """Concrete JAX and NumPy arrays, scalars included, become operands."""
    big = jnp.asarray(np.linspace(0.0, 1.0, 1000), jnp.float32)
    scalar = jnp.float32(2.5)
    n = jnp.int32(3)
    np_weights = np.arange(5.0, dtype=np.float32)

    def fn(y):
        return big * y + scalar * n + jnp.sum(np_weights)

    y = jnp.float32(1.5)
    closed = sk.closure_convert(fn, y)
    assert len(closed.consts) == 4
    for c in closed.consts:
        assert isinstance(c, jax.Array)
    for v in (big, scalar, n):
        assert any(c is v for c in closed.consts)
    # No value baked into the jaxpr: substituting consts changes the result.
    swap = {id(big): big + 1, id(scalar): jnp.float32(-1.0), id(n): jnp.int32(5)}
    new_consts = [
        swap.get(id(c), c if c.shape != (5,) else c * 2) for c in closed.consts
    ]
    got = _eval_jaxpr(closed.jaxpr, new_consts, y)[0]
    want = (big + 1) * y + (-1.0) * 5 + jnp.sum(np_weights * 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # ... and the compiled program takes the weights as arguments, not constants:
    # written out, the 1000 floats alone would make the text longer than 5,000
    # characters (as `jax.jit(fn)`'s is on JAX versions that embed closed-over
    # arrays; JAX 0.12 with simplified constants passes them as arguments itself, so
    # that is no control any more).
    text = jax.jit(lambda c, y: c(y)).lower(closed, y).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main(" in line)
    assert "tensor<1000xf32>" in main.split("->")[0], main
    assert len(text) < 5_000, len(text)


def test_consts_are_arrays_under_traces():
    """Tracers from grad (of a Python float), jvp, vmap and jit: consts are arrays."""
    y = jnp.float32(2.0)

    def make(th):
        closed = sk.closure_convert(lambda z: z * th, y)
        for c in closed.consts:
            assert isinstance(c, jax.Array), type(c)
        return closed(y)

    jax.grad(make)(1.0)
    jax.jvp(make, (1.0,), (1.0,))
    jax.vmap(make)(jnp.arange(2.0))
    jax.jit(make)(1.0)
    # As a custom_vjp rule receives them: for a grad of a Python float, the tracer's
    # primal is a Python scalar unless conversion makes it an array.
    grad = jax.grad(lambda th: _apply(sk.closure_convert(lambda z: z * th, y), y))
    assert float(grad(1.0)) == 2.0


def test_seed_invariant():
    """eval_jaxpr(closed.jaxpr, closed.consts, *flat_args) == flat fn(*args)."""
    w = jnp.arange(6.0).reshape(2, 3)
    k = jax.random.key(1)

    def fn(a, b, *, scale):
        return {"x": a @ w * scale, "y": (b["n"] * 2, jax.random.key_data(k), k)}

    args = (jnp.ones(2), {"n": jnp.int32(4)})
    closed = sk.closure_convert(fn, *args, scale=3.0)
    flat = _eval_jaxpr(closed.jaxpr, closed.consts, *jtu.tree_leaves(args))
    want = jtu.tree_leaves(fn(*args, scale=3.0))
    assert len(flat) == len(want)
    for g, w_ in zip(flat, want):
        _assert_tree_equal(g, w_)
    _assert_tree_equal(closed(*args, scale=3.0), fn(*args, scale=3.0))


def test_jax_issue_21116():
    """vmap over jnp.arange(2) of a function closing over the (integer) tracer."""

    def f(x):
        def g(y):
            return x + y

        closed = sk.closure_convert(g, jnp.int32(1))
        via_eval = _eval_jaxpr(closed.jaxpr, closed.consts, jnp.int32(1))[0]
        return via_eval, closed(jnp.int32(1))

    for transform in (jax.vmap, lambda h: jax.jit(jax.vmap(h))):
        via_eval, via_call = transform(f)(jnp.arange(2))
        np.testing.assert_array_equal(via_eval, [1, 2])
        np.testing.assert_array_equal(via_call, [1, 2])
        assert via_eval.dtype == jnp.int32


# --- out_struct, effects, callbacks -------------------------------------------------


@pytest.mark.parametrize(
    "example",
    [
        jnp.asarray(1.0),  # weak float32
        jnp.float32(1.0),  # strong
        jax.ShapeDtypeStruct((), jnp.float32, weak_type=True),
        jax.ShapeDtypeStruct((3,), jnp.int32),
    ],
    ids=["weak", "strong", "struct-weak", "struct-int"],
)
def test_out_struct(example):
    w = jnp.arange(3.0)
    n = jnp.int8(2)

    def fn(y):
        return {
            "same": y,
            "times2": y * 2,
            "f32": y * jnp.float32(2),
            "int8": (n * 2, n.astype(jnp.bool_)),
            "vec": w + y,
            "numpy": np.float32(2.5),  # a NumPy scalar is an array: traced
            "python": 1.5,  # Python scalars are static, as in equinox.filter_jit
        }

    closed = sk.closure_convert(fn, example)
    want = eqx.filter_eval_shape(fn, example)
    assert jtu.tree_structure(closed.out_struct) == jtu.tree_structure(want)
    got_keys = [_out_key(s) for s in jtu.tree_leaves(closed.out_struct)]
    assert got_keys == [_out_key(s) for s in jtu.tree_leaves(want)]
    assert closed.out_struct["python"] == 1.5
    if not isinstance(example, jax.ShapeDtypeStruct):
        actual = jtu.tree_leaves(closed(example))
        assert [_out_key(eqx.filter_eval_shape(lambda: a)) for a in actual] == got_keys


def _assert_same_output(got, want):
    """Same structure; array leaves equal with equal dtypes, static leaves equal."""
    assert jtu.tree_structure(got) == jtu.tree_structure(want)
    for g, w in zip(jtu.tree_leaves(got), jtu.tree_leaves(want)):
        if eqx.is_array(w):
            assert eqx.is_array(g) and g.dtype == w.dtype
            np.testing.assert_allclose(g, w)
        else:
            assert type(g) is type(w) and g == w


def _tagged(y):
    return {"tag": "T", "y": y * 2, "n": 3, "none": None, "flag": True}


def test_static_outputs():
    """Non-array output leaves are static, as in `equinox.filter_jit`: they come back
    unchanged, `out_struct` keeps them, and the jaxpr returns only the array leaves."""
    y = jnp.arange(3.0)
    closed = sk.closure_convert(_tagged, y)
    want = eqx.filter_jit(_tagged)(y)
    _assert_same_output(closed(y), want)
    got = closed(y)
    assert got["tag"] == "T" and got["n"] == 3 and got["flag"] is True
    assert type(got["n"]) is int and got["none"] is None
    assert closed.out_struct["tag"] == "T" and closed.out_struct["n"] == 3
    assert closed.out_struct["y"] == jax.ShapeDtypeStruct((3,), jnp.float32)
    # The invariant: eval_jaxpr returns the array leaves, static leaves left out.
    flat = _eval_jaxpr(closed.jaxpr, closed.consts, y)
    arrays = [x for x in jtu.tree_leaves(want) if eqx.is_array(x)]
    assert len(flat) == len(arrays) == 1
    np.testing.assert_allclose(flat[0], arrays[0])
    # Under jit (the Closure as an argument) and vmap (over y, and over a const).
    _assert_same_output(eqx.filter_jit(lambda c, y: c(y))(closed, y), want)
    ys = jnp.stack([y, y + 1])
    batched = eqx.filter_vmap(lambda c, y: c(y), in_axes=(None, 0))(closed, ys)
    _assert_same_output(batched, eqx.filter_vmap(_tagged)(ys))
    w = jnp.arange(6.0).reshape(2, 3)

    def converted(w):
        closed = sk.closure_convert(lambda y: {"tag": "T", "y": y * w}, y)
        assert closed.out_struct["tag"] == "T"
        return closed(y)["y"]

    np.testing.assert_allclose(jax.jit(jax.vmap(converted))(w), w * y[None])


def test_static_outputs_are_part_of_identity():
    """Two programs with equal jaxprs but other static outputs are not equal, so
    neither takes the other's place in a jit cache."""
    y = jnp.arange(3.0)
    first = sk.closure_convert(lambda y: ("T", y * 2), y)
    second = sk.closure_convert(lambda y: ("U", y * 2), y)
    assert first.program != second.program
    call = eqx.filter_jit(lambda c, y: c(y))
    assert call(first, y)[0] == "T" and call(second, y)[0] == "U"


def test_out_struct_under_traces():
    """Inside vmap the struct is per example; under jit a weak tracer stays weak."""

    def check(y):
        closed = sk.closure_convert(lambda z: z * 2, y)
        want = jax.eval_shape(lambda z: z * 2, y)
        assert _struct_key(closed.out_struct) == _struct_key(want)
        return closed(y)

    jax.vmap(check)(jnp.arange(3.0))
    jax.jit(check)(1.0)
    jax.grad(check)(1.0)


def test_effects_pure():
    closed = sk.closure_convert(lambda y: y * jnp.arange(3.0), jnp.float32(1))
    assert not closed.effects
    assert closed.effects == jax.make_jaxpr(lambda y: y * jnp.arange(3.0))(1.0).effects


def test_debug_callback_fires():
    seen = []
    w = jnp.arange(3.0)

    def fn(y):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y * w)
        return y * w

    y = jnp.float32(2.0)
    closed = sk.closure_convert(fn, y)
    assert closed.effects
    assert set(closed.effects) == set(jax.make_jaxpr(fn)(y).effects)
    closed(y)
    jax.jit(lambda c, y: c(y))(closed, jnp.float32(3.0))
    _flat_call(closed, jnp.float32(4.0))
    jax.vmap(closed)(jnp.ones(2, jnp.float32))
    jax.effects_barrier()
    assert len(seen) >= 4
    for got, scale in zip(seen[:3], (2.0, 3.0, 4.0)):
        np.testing.assert_allclose(got, scale * np.arange(3.0))


def test_io_callback_effects():
    calls = []

    def host(v):
        calls.append(np.asarray(v))
        return np.asarray(v) + 1

    def fn(y):
        return io_callback(host, jax.ShapeDtypeStruct((), jnp.float32), y, ordered=True)

    y = jnp.float32(1.0)
    closed = sk.closure_convert(fn, y)
    assert set(closed.effects) == set(jax.make_jaxpr(fn)(y).effects)
    assert closed.effects
    assert float(closed(y)) == 2.0
    assert float(jax.jit(lambda c, y: c(y))(closed, jnp.float32(5.0))) == 6.0
    jax.effects_barrier()
    assert len(calls) == 2


def _equation_keys(jaxpr):
    return [(e.primitive, tuple(map(id, e.invars)), str(e.params)) for e in jaxpr.eqns]


@pytest.mark.slow
def test_repeated_equations_merged():
    """`y[0]` written three times is sliced once: the merged jaxpr gives the same
    values and gradients, and its reverse mode builds the cotangent without pads (see
    `_jaxpr_rewrite.cse` and `_jaxpr_rewrite._split_slices`)."""
    p = jnp.array([1.5, 1.0, 3.0, 1.0])

    def field(y):
        return jnp.stack(
            [p[0] * y[0] - p[1] * y[0] * y[1], p[3] * y[0] * y[1] - p[2] * y[1]]
        )

    y = jnp.array([0.7, 1.3])
    closed = sk.closure_convert(field, y)
    keys = _equation_keys(closed.jaxpr)
    assert len(keys) == len(set(keys))
    assert len(closed.jaxpr.eqns) < len(jax.make_jaxpr(field)(y).jaxpr.eqns)
    # Each side one jitted program (eagerly, every op was a compile).
    both = lambda f: jax.jit(lambda y: (f(y), jax.jacrev(f)(y)))(y)  # noqa: E731
    for a, b in zip(both(closed), both(field), strict=True):
        np.testing.assert_allclose(a, b)
    loss = lambda c, y: jnp.sum(c(y) ** 2)
    grad_c = eqx.filter_jit(jax.grad(loss))(closed, y).consts
    np.testing.assert_allclose(
        grad_c[0],
        jax.jit(
            jax.grad(
                lambda q: jnp.sum(
                    jnp.stack(
                        [
                            q[0] * y[0] - q[1] * y[0] * y[1],
                            q[3] * y[0] * y[1] - q[2] * y[1],
                        ]
                    )
                    ** 2
                )
            )
        )(p),
        rtol=1e-6,
    )
    pads = str(jax.make_jaxpr(jax.grad(lambda y: jnp.sum(closed(y))))(y)).count(
        "= pad["
    )
    assert pads == 0


def _slicing_fields():
    table = jnp.arange(6, dtype=jnp.int32)  # an int const, sliced too
    return {
        "components": lambda y: jnp.stack([y[1] - y[0], y[0] * y[2], y[2]]),
        "overlapping": lambda y: jnp.concatenate([y[1:] - y[:-1], y[:1] * y[2:]]),
        "skipping": lambda y: y[3:] * y[:1],
        "columns": lambda y: y.reshape(2, 2)[:, 1:] * y.reshape(2, 2)[:, :1],
        "two axes": lambda y: y.reshape(2, 2)[1:, 1:] + y.reshape(2, 2)[:1, :],
        "strided": lambda y: jax.lax.slice(y, (0,), (4,), (2,)) * y[1:3],
        "empty": lambda y: y[2:2].sum() + y[1:3],
        "int table": lambda y: y * table[1:5] + table[0],
    }


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[] if n == "components" else [pytest.mark.slow])
        for n in _slicing_fields()
    ],
)
def test_slices_become_one_split(name):
    """Unit-stride slices of one array along one axis become one `split`: the same
    values, Jacobians (forward and reverse, under `vmap`), and no `pad` in reverse
    mode; slices along several axes or with strides are left as they are."""
    field = _slicing_fields()[name]
    y = jnp.array([0.7, 1.3, -0.4, 2.1])
    closed = sk.closure_convert(field, y)
    text = str(closed.jaxpr)
    untouched = name in ("two axes", "strided", "empty")
    assert ("split[" in text) != untouched
    # Each side one jitted program (eagerly, every op was a compile).
    ys = jnp.stack([y, 2 * y, -y])
    got, want = (jax.jit(_values_and_jacobians(f))(y, ys) for f in (closed, field))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b)
    grad = jax.make_jaxpr(jax.grad(lambda y: jnp.sum(closed(y))))(y)
    assert ("= pad[" in str(grad)) == untouched


def _values_and_jacobians(f):
    """`f(y)`, its Jacobians by `jacrev` and `jacfwd` at `y`, and by `jacrev` under
    `vmap` over `ys`."""
    return lambda y, ys: (
        f(y),
        jax.jacrev(f)(y),
        jax.jacfwd(f)(y),
        jax.vmap(jax.jacrev(f))(ys),
    )


def test_repeated_equations_merged_inside_jit():
    field = jax.jit(lambda y: jnp.stack([y[0] * y[1] - y[0], y[0] * y[1]]))
    y = jnp.array([0.7, 1.3])
    closed = sk.closure_convert(lambda y: field(y) * field(y), y)
    (call,) = [e for e in closed.jaxpr.eqns if "jaxpr" in e.params]
    inner = call.params["jaxpr"].jaxpr
    keys = _equation_keys(inner)
    assert len(keys) == len(set(keys))
    (unmerged,) = jax.make_jaxpr(field)(y).eqns
    assert len(inner.eqns) < len(unmerged.params["jaxpr"].jaxpr.eqns)
    np.testing.assert_allclose(closed(y), field(y) ** 2)
    np.testing.assert_allclose(
        jax.jacrev(closed)(y), jax.jacrev(lambda y: field(y) ** 2)(y)
    )


def test_repeated_effects_and_random_draws_kept():
    """Equations with effects are never merged; equal random draws from one key are
    equal anyway, and draws from split keys stay distinct."""
    seen = []
    key = jax.random.key(0)

    def fn(y):
        jax.debug.callback(lambda v: seen.append(1), y)
        jax.debug.callback(lambda v: seen.append(1), y)
        a = jax.random.normal(key, ())
        b = jax.random.normal(jax.random.split(key)[1], ())
        return y + a, y + b, y + jax.random.normal(key, ())

    y = jnp.float32(1.0)
    closed = sk.closure_convert(fn, y)
    out = closed(y)
    jax.effects_barrier()
    assert len(seen) == 2
    np.testing.assert_allclose(out, fn(y))
    assert out[0] != out[1] and out[0] == out[2]


# --- Calling with wrong arguments ---------------------------------------------------


def _example_closure():
    w = jnp.arange(3.0)

    def fn(a, b, *, scale):
        return a * w * scale + b["n"]

    args = (jnp.ones(3, jnp.float32), {"n": jnp.int32(1)})
    return sk.closure_convert(fn, *args, scale=2.0), args


def test_call_right_arguments():
    closed, args = _example_closure()
    np.testing.assert_allclose(closed(*args, scale=2.0), 2 * np.arange(3.0) + 1)


# NumPy arguments: validated like JAX ones, and cheap to make at import.
_F3 = np.ones(3, np.float32)
_N = {"n": np.int32(1)}
_WRONG_CALLS = {
    # id: (args, kwargs, what the message says was expected, what it says came)
    "missing-arg": ((_F3,), {"scale": 2.0}, r"\{'n': \*\}", r"\(\(\*,\)"),
    "dict-key": ((_F3, {"m": np.int32(1)}), {"scale": 2.0}, "'n'", "'m'"),
    "list-for-dict": ((_F3, [np.int32(1)]), {"scale": 2.0}, "{'n'", r"\[\*\]"),
    "missing-kwarg": ((_F3, _N), {}, "'scale'", r"\{\}"),
    "extra-kwarg": ((_F3, _N), {"scale": 2.0, "x": 1.0}, "'scale'", "'x'"),
    "shape": ((np.ones(4, np.float32), _N), {"scale": 2.0}, r"\(3,\)", r"\(4,\)"),
    "shape-nested": (
        (_F3, {"n": np.ones(2, np.int32)}),
        {"scale": 2.0},
        r"\(\)",
        r"\(2,\)",
    ),
    "dtype": ((np.ones(3, np.int32), _N), {"scale": 2.0}, "float32", "int32"),
    "dtype-nested": (
        (_F3, {"n": np.float32(1)}),
        {"scale": 2.0},
        "int32",
        "float32",
    ),
    "static-value": ((_F3, _N), {"scale": 3.0}, "2.0", "3.0"),
    "static-type": ((_F3, _N), {"scale": 2}, "2.0", "2"),
}


@pytest.mark.parametrize("case", list(_WRONG_CALLS))
def test_call_wrong_arguments(case):
    """Another structure, shape, dtype or static value: ValueError naming both."""
    args, kwargs, expected, got = _WRONG_CALLS[case]
    closed, _ = _example_closure()
    with pytest.raises(ValueError) as info:
        closed(*args, **kwargs)
    message = str(info.value)
    assert re.search(f"expected.*{expected}.*got.*{got}", message, re.S), message


def test_call_wrong_key_kind():
    closed = sk.closure_convert(lambda k: jax.random.normal(k, (2,)), jax.random.key(0))
    closed(jax.random.key(3))
    with pytest.raises(ValueError, match="expected.*got"):
        closed(jax.random.PRNGKey(3))


def test_call_python_scalar_of_wrong_kind():
    """A Python float where an int32 was converted must not be silently truncated."""
    closed = sk.closure_convert(lambda n: n * 2, jnp.int32(1))
    np.testing.assert_array_equal(closed(3), 6)  # an int for an int is fine
    with pytest.raises(ValueError, match="expected.*got"):
        closed(1.5)


# --- A Closure as an ordinary argument ----------------------------------------------


@jax.custom_vjp
def _apply(closure, y):
    return closure(y)


_BWD_SEEN: list = []
_BWD_NONE: list = [False]


def _apply_fwd(closure, y):
    for c in closure.consts:
        assert isinstance(c, jax.Array), f"const reached custom_vjp fwd as {type(c)}"
    return closure(y), (closure, y)


def _apply_bwd(res, ct):
    closure, y = res
    for c in closure.consts:
        assert isinstance(c, jax.Array), f"const reached custom_vjp bwd as {type(c)}"
    _, pullback = jax.vjp(lambda c, z: c(z), closure, y)
    closure_ct, y_ct = pullback(ct)
    _BWD_SEEN.append(
        [(c.dtype, t.dtype) for c, t in zip(closure.consts, closure_ct.consts)]
    )
    if _BWD_NONE[0]:
        closure_ct = jtu.tree_map(
            lambda c, t: t if jnp.issubdtype(c.dtype, jnp.inexact) else None,
            closure,
            closure_ct,
        )
    return closure_ct, y_ct


_apply.defvjp(_apply_fwd, _apply_bwd)


def _cvjp_vector_field(y, th32, th64, n, flag, c, key, raw):
    out = y * th32 * n.astype(jnp.float32) + (flag * th64).astype(jnp.float32)
    out = out + jnp.real(c * y) + jax.random.key_data(key)[0].astype(jnp.float32)
    return out + raw[1].astype(jnp.float32)


def _cvjp_loss(converted: bool):
    def loss(th32, th64, y, n):
        flag = jnp.asarray([True, False, True])
        c = jnp.asarray([1 + 2j, -1j, 0.5], jnp.complex64)
        key, raw = jax.random.key(0), jax.random.PRNGKey(1)
        fn = lambda z: _cvjp_vector_field(z, th32, th64, n, flag, c, key, raw)
        if converted:
            out = _apply(sk.closure_convert(fn, y), y)
        else:
            out = fn(y)
        return jnp.sum(out**2)

    return loss


@pytest.mark.parametrize(
    "trace, zero",
    [("jit_grad", "float0"), ("jit_grad", "none"), ("jit_vmap_grad", "float0")],
)
def test_custom_vjp(trace, zero):
    """Float consts get the right cotangents, int/bool/key consts float0 (or None)."""
    _BWD_SEEN.clear()
    _BWD_NONE[0] = zero == "none"
    with _x64(), contextlib.ExitStack() as stack:
        stack.callback(_BWD_NONE.__setitem__, 0, False)
        th32 = jnp.asarray([0.3, -0.7, 1.1], jnp.float32)
        th64 = jnp.float64(0.25)
        y = jnp.asarray(_Y)
        n = jnp.int32(3)
        results = []
        for converted in (True, False):
            grad = jax.grad(_cvjp_loss(converted), argnums=(0, 1, 2))
            if trace == "jit_grad":
                grad = jax.jit(grad)
            if trace == "jit_vmap_grad":
                grad = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0)))
                results.append(
                    grad(
                        jnp.stack([th32, -th32]),
                        th64,
                        y,
                        n + jnp.arange(2, dtype=jnp.int32),
                    )
                )
            else:
                results.append(grad(th32, th64, y, n))
    _assert_tree_equal(results[0], results[1])
    assert _BWD_SEEN
    for const_dtype, ct_dtype in _BWD_SEEN[0]:
        if jnp.issubdtype(const_dtype, jnp.inexact):
            assert ct_dtype == const_dtype
        else:
            assert ct_dtype == jax.dtypes.float0, (const_dtype, ct_dtype)
    kinds = {str(d) for d, _ in _BWD_SEEN[0]}
    assert {"float32", "float64", "int32", "bool", "complex64", "uint32"} <= kinds
    assert any(kind.startswith("key") for kind in kinds), kinds


def test_filter_custom_vjp_python_float_primal():
    """A grad tracer whose primal is a Python float still gets its gradient."""

    @eqx.filter_custom_vjp
    def apply(closure, y):
        return closure(y)

    @apply.def_fwd
    def fwd(perturbed, closure, y):
        return closure(y), None

    @apply.def_bwd
    def bwd(residuals, ct, perturbed, closure, y):
        _, pullback = eqx.filter_vjp(lambda c: c(y), closure)
        return pullback(ct)[0]

    n = jnp.int32(3)
    y = jnp.float32(2.0)

    def loss(th):
        return apply(sk.closure_convert(lambda z: z * th * n, y), y)

    assert float(jax.grad(loss)(1.0)) == 6.0
    assert float(jax.grad(loss)(jnp.float32(1.0))) == 6.0


def _closure_and_fn(th, n, key):
    """A Closure over a float vector, an int and a key, and its function."""
    fn = lambda y: y * th + (n + jax.random.key_data(key)[0] % 5).astype(jnp.float32)
    return sk.closure_convert(fn, jnp.asarray(_Y)), fn


def _reference(ths, ns, keys, ys):
    """NumPy value of `_closure_and_fn(th, n, key)[1](y)`, batched over everything."""
    offsets = np.asarray(jax.random.key_data(keys))[..., 0] % 5
    offset = (np.asarray(ns) + offsets).astype(np.float32)
    return np.asarray(ys) * np.asarray(ths) + offset[..., None]


def _stacked_closures(size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ths = jnp.asarray(rng.normal(size=(size, 3)), jnp.float32)
    ns = jnp.arange(size, dtype=jnp.int32)
    keys = jax.random.split(jax.random.key(seed), size)
    stacked = jax.vmap(lambda th, n, k: _closure_and_fn(th, n, k)[0])(ths, ns, keys)
    ys = jnp.asarray(rng.normal(size=(size, 3)), jnp.float32)
    return stacked, (ths, ns, keys), ys


def test_while_loop():
    """A Closure in the carry of a while_loop, converted under jit and under vmap."""
    key = jax.random.key(0)
    y0 = jnp.asarray(_Y)

    def run(th, n):
        closed, _ = _closure_and_fn(th, n, key)

        def body(carry):
            c, y, i = carry
            return c, c(y), i + 1

        return lax.while_loop(lambda c: c[2] < 3, body, (closed, y0, 0))[1]

    def three_steps(th, n):
        y = np.asarray(y0)
        for _ in range(3):
            y = _reference(th, n, key, y)
        return y

    th, n = jnp.asarray([0.5, 1.0, -0.5]), jnp.int32(2)
    np.testing.assert_allclose(jax.jit(run)(th, n), three_steps(th, n), rtol=1e-6)
    ths = jnp.stack([th, 2 * th])
    ns = n + jnp.arange(2, dtype=jnp.int32)  # a vmapped integer, closed over
    got = jax.vmap(run)(ths, ns)
    for i in range(2):
        np.testing.assert_allclose(got[i], three_steps(ths[i], ns[i]), rtol=1e-6)


def test_scan_carry_and_xs():
    """Stacked Closures as the xs of a scan, and a Closure in its carry."""
    stacked, (ths, ns, keys), _ = _stacked_closures(4)
    assert stacked.consts[0].shape[0] == 4

    def step(y, c):
        y = c(y)
        return y, y

    final, ys = jax.jit(lambda c, y: lax.scan(step, y, c))(stacked, jnp.asarray(_Y))
    y = np.asarray(_Y)
    for i in range(4):
        y = _reference(ths[i], ns[i], keys[i], y)
        np.testing.assert_allclose(ys[i], y, rtol=1e-5)
    np.testing.assert_allclose(final, y, rtol=1e-5)

    closed, _ = _closure_and_fn(ths[0], ns[0], keys[0])
    (_, out), _ = lax.scan(
        lambda c, _: ((c[0], c[0](c[1])), None), (closed, jnp.asarray(_Y)), length=3
    )
    want = np.asarray(_Y)
    for _ in range(3):
        want = _reference(ths[0], ns[0], keys[0], want)
    np.testing.assert_allclose(out, want, rtol=1e-5)


def test_checkpoint():
    n, key = jnp.int32(2), jax.random.key(0)
    y = jnp.asarray(_Y)

    def loss(th, converted):
        closed, fn = _closure_and_fn(th, n, key)
        if converted:
            return jnp.sum(jax.checkpoint(lambda c, z: c(z))(closed, y) ** 2)
        return jnp.sum(fn(y) ** 2)

    th = jnp.asarray([0.5, 1.0, -0.5])
    both = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (value, grad), (want_value, want_grad) = both(th, True), both(th, False)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


def test_vmap_over_consts():
    """vmap and eqx.filter_vmap over a batch of Closures (batched consts)."""
    stacked, (ths, ns, keys), ys = _stacked_closures(2)
    closed, fn = _closure_and_fn(ths[0], ns[0], keys[0])

    @jax.jit
    def variants(stacked, closed, ys):
        return (
            jax.vmap(lambda c, y: c(y))(stacked, ys),
            eqx.filter_vmap(lambda c, y: c(y))(stacked, ys),
            jax.vmap(lambda c, y: c(y), in_axes=(0, None))(stacked, ys[0]),
            jax.vmap(closed)(ys),  # an unbatched Closure, batched argument
        )

    both, filtered, one_y, unbatched = variants(stacked, closed, ys)
    np.testing.assert_allclose(both, _reference(ths, ns, keys, ys), rtol=1e-6)
    np.testing.assert_allclose(filtered, both, rtol=1e-6)
    np.testing.assert_allclose(one_y, _reference(ths, ns, keys, ys[0]), rtol=1e-6)
    np.testing.assert_allclose(
        unbatched, _reference(ths[0], ns[0], keys[0], ys), rtol=1e-6
    )


_VMA_CHECKS = "check_vma" in inspect.signature(_shard_map()).parameters


def _shard_map_options(checked: bool) -> dict:
    if checked:
        return {}
    params = inspect.signature(_shard_map()).parameters
    return {"check_vma": False} if "check_vma" in params else {"check_rep": False}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_shard_map(checked):
    """Batched Closures sharded along their consts, and a replicated Closure.

    `checked` keeps shard_map's default replication / varying-axes checks on.
    """
    shard_map = functools.partial(_shard_map(), **_shard_map_options(checked))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    size = 2 * len(jax.devices())
    stacked, (ths, ns, keys), ys = _stacked_closures(size)
    batched = shard_map(
        jax.vmap(lambda c, y: c(y)),
        mesh=mesh,
        in_specs=(P("x"), P("x")),
        out_specs=P("x"),
    )
    np.testing.assert_allclose(
        jax.jit(batched)(stacked, ys), _reference(ths, ns, keys, ys), rtol=1e-5
    )
    closed, _ = _closure_and_fn(ths[0], ns[0], keys[0])
    replicated = shard_map(
        jax.vmap(lambda c, y: c(y), in_axes=(None, 0)),
        mesh=mesh,
        in_specs=(P(), P("x")),
        out_specs=P("x"),
    )
    np.testing.assert_allclose(
        jax.jit(replicated)(closed, ys),
        _reference(ths[0], ns[0], keys[0], ys),
        rtol=1e-5,
    )


def _many_primitives(th):
    """A function of `y` closing over `th` through nested jit, custom_jvp, scan,
    fori_loop, while_loop, cond, checkpoint and literals."""

    def fn(y):
        y = jax.jit(lambda a: a * th + 1.0)(y)
        y = jax.nn.softplus(y) + jax.nn.relu(y - 0.5)
        y = lax.scan(lambda c, x: (c * x + th, c.sum()), y, jnp.full((2, 2, 3), 0.5))[0]
        y = lax.fori_loop(0, 2, lambda i, c: c * 0.5 + th, y)
        y = lax.cond(y[0, 0] > 0, lambda a: a * th, lambda a: a + 1.0, y)
        y = jax.checkpoint(lambda a: jnp.sin(a) * th)(y)
        count = lax.while_loop(
            lambda c: c[1] < 3, lambda c: (c[0] + 1, c[1] + 1), (y, 0)
        )
        return y + lax.stop_gradient(count[0]) + jnp.arange(3.0)[None]

    return fn


@pytest.mark.skipif(not _VMA_CHECKS, reason="this JAX has no varying-axes checks")
def test_shard_map_checked_primitives():
    """Inside shard_map(check_vma=True), a Closure whose jaxpr holds nested calls,
    loops, conds, checkpoints and custom_jvp rules, with a replicated const `th` and
    a sharded `y`: values and gradients (w.r.t. both) as without shard_map."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ys = jnp.linspace(-1.0, 1.0, 6 * len(jax.devices())).reshape(-1, 3)  # 2 rows each
    th = jnp.asarray([[0.5, -1.0, 0.25]])

    def sharded(th, ys):
        # Each device's block of rows, unbatched: JAX's own vmap of a cond with a
        # batched predicate fails inside shard_map(check_vma=True) (jax 0.10.2).
        closed = sk.closure_convert(_many_primitives(th), ys[:2])
        return _shard_map()(
            lambda c, y: c(y),
            mesh=mesh,
            in_specs=(P(), P("x")),
            out_specs=P("x"),
        )(closed, ys)

    def plain(th, ys):
        blocks = ys.reshape(-1, 2, 3)
        return jnp.concatenate([_many_primitives(th)(b) for b in blocks])

    loss = lambda f: jax.jit(
        jax.value_and_grad(lambda t, y: jnp.sum(f(t, y) ** 2), (0, 1))
    )
    (got, got_grads), (want, want_grads) = loss(sharded)(th, ys), loss(plain)(th, ys)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not _VMA_CHECKS, reason="this JAX has no varying-axes checks")
def test_shard_map_checked_converted_inside():
    """A Closure converted inside shard_map(check_vma=True), whose jaxpr holds JAX's
    own pvary casts, called with an argument that varies where the example did not
    (as a solver's time does, once it is carried with varying values)."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ys = jnp.arange(6.0 * len(jax.devices())).reshape(-1, 3)
    th = jnp.asarray([[0.5, -1.0, 0.25]])

    def block(th, y):
        # Closing over the varying `y`, the jaxpr casts the invariant `t * th`.
        closed = sk.closure_convert(lambda t: t * th + y, jnp.float32(0.0))
        assert "pvary" in str(closed.jaxpr)
        return closed(y[0, 0])  # t now varies over "x"

    got = jax.jit(
        _shard_map()(block, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))
    )(th, ys)
    blocks = np.asarray(ys).reshape(len(jax.devices()), -1, 3)
    want = np.concatenate([b[0, 0] * np.asarray(th) + b for b in blocks])
    np.testing.assert_allclose(got, want, rtol=1e-6)


# --- Cost of conversion and identity of converted programs -------------------------


def test_one_trace():
    calls = []
    th = jnp.asarray([0.5, 1.0, -0.5])

    def fn(y):
        calls.append(None)
        return y * th

    y = jnp.asarray(_Y)
    closed = sk.closure_convert(fn, y)
    assert len(calls) == 1
    closed(y)
    jax.jit(lambda c, y: c(y))(closed, y)
    jax.vmap(closed)(jnp.stack([y, y]))
    jax.grad(lambda z: jnp.sum(closed(z)))(y)
    lax.while_loop(
        lambda c: c[1] < 2, lambda c: (c[0], c[1] + 1, c[0](c[2])), (closed, 0, y)
    )
    _flat_call(closed, y)
    assert len(calls) == 1

    def inside(t):
        local = []

        def g(y):
            local.append(None)
            return y * t

        closed = sk.closure_convert(g, y)
        assert len(local) == 1
        closed(y)
        closed(y)
        assert len(local) == 1
        return closed(y)

    jax.vmap(inside)(jnp.arange(2.0))
    jax.jit(inside)(1.0)
    jax.grad(lambda t: jnp.sum(inside(t)))(1.0)


class _Methods:
    def __init__(self, w):
        self.w = w

    def plain(self, y):
        return y * self.w

    def relu(self, y):
        return jax.nn.relu(y * self.w)


_W = jnp.asarray([0.5, -1.0, 2.0])
_METHODS = _Methods(_W)


class _ReluModule(eqx.Module):
    w: jax.Array

    def __call__(self, y):
        return jax.nn.relu(y * self.w)


_MODULE = _ReluModule(_W)


def _noop(v):
    pass


def _with_callback(y):
    jax.debug.callback(_noop, y)
    return y * _W


_SAME_FUNCTION = {
    "lambda": (lambda f: lambda: f)(lambda y: y * _W),
    "relu-lambda": (lambda f: lambda: f)(lambda y: jax.nn.relu(y * _W)),
    "callback": lambda: _with_callback,
    "module": lambda: _MODULE,
    "callable": (lambda f: lambda: f)(_CallableObject({"float32": _W})),
    "bound-method": lambda: _METHODS.plain,
    "bound-method-relu": lambda: _METHODS.relu,
}


@pytest.mark.parametrize("kind", list(_SAME_FUNCTION))
def test_reconvert_same_function_no_recompile(kind):
    """The same function converted twice: equal treedefs, one jit compilation."""
    get = _SAME_FUNCTION[kind]
    y = jnp.asarray(_Y)
    first = sk.closure_convert(get(), y)
    second = sk.closure_convert(get(), y)
    other_y = sk.closure_convert(get(), 2 * y)  # new values, same shapes
    assert jtu.tree_structure(first) == jtu.tree_structure(second)
    assert jtu.tree_structure(first) == jtu.tree_structure(other_y)
    assert [id(c) for c in first.consts] == [id(c) for c in second.consts]
    traces = []

    @jax.jit
    def apply(c, z):
        traces.append(None)
        return c(z)

    apply(first, y)
    apply(second, y)
    apply(other_y, y)
    assert len(traces) == 1


def test_distinct_functions_stay_distinct():
    """Functions that print alike but behave differently are never conflated."""
    y = jnp.asarray(_Y)

    def make_custom(scale):
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x)

        @f.defjvp
        def f_jvp(primals, tangents):
            return f(primals[0]), scale * tangents[0]

        return f

    f1, f2 = make_custom(1.0), make_custom(5.0)
    c1 = sk.closure_convert(lambda z: f1(z * _W), y)
    c2 = sk.closure_convert(lambda z: f2(z * _W), y)
    g1 = jax.grad(lambda z: jnp.sum(c1(z)))(y)
    g2 = jax.grad(lambda z: jnp.sum(c2(z)))(y)
    np.testing.assert_allclose(g2, 5 * g1, rtol=1e-6)

    def callback_fn(host):
        return lambda z: jax.pure_callback(
            host, jax.ShapeDtypeStruct((3,), jnp.float32), z
        )

    c3 = sk.closure_convert(callback_fn(lambda v: np.asarray(v) + 1), y)
    c4 = sk.closure_convert(callback_fn(lambda v: np.asarray(v) + 2), y)
    np.testing.assert_allclose(c4(y) - c3(y), np.ones(3))

    c5 = sk.closure_convert(lambda z: z * 1.0000001, y)
    c6 = sk.closure_convert(lambda z: z * 1.0, y)
    assert not np.array_equal(c5(y), c6(y))


def test_reconvert_closure_unchanged():
    y = jnp.asarray(_Y)
    closed = sk.closure_convert(lambda z: z * _W, y)
    assert sk.closure_convert(closed, y) is closed
    assert sk.closure_convert(closed) is closed
    assert sk.is_closure_converted(closed)
    assert not sk.is_closure_converted(lambda z: z)
    assert not sk.is_closure_converted(_MODULE)
    assert isinstance(closed, eqx.Module)


def test_not_callable():
    with pytest.raises(TypeError):
        sk.closure_convert(3.0, 1.0)  # pyright: ignore


# --- Random pytrees of random dtypes and shapes -------------------------------------


class _LeafSpec:
    def __init__(self, kind, shape, seed):
        self.kind, self.shape, self.seed = kind, shape, seed


def _leaf(spec: _LeafSpec):
    size = int(np.prod(spec.shape))
    if spec.kind in ("key", "raw_key"):
        keys = jax.random.split(jax.random.key(spec.seed), max(size, 1))
        keys = keys[0] if spec.shape == () else keys.reshape(spec.shape)
        return keys if spec.kind == "key" else jax.random.key_data(keys)
    rng = np.random.default_rng(spec.seed)
    if spec.kind == "bool":
        return jnp.asarray(rng.random(spec.shape) > 0.5)
    if spec.kind in ("int8", "int32", "uint32"):
        return jnp.asarray(rng.integers(0, 40, spec.shape), spec.kind)
    data = rng.normal(size=spec.shape)
    if spec.kind == "complex64":
        data = data + 1j * rng.normal(size=spec.shape)
    return jnp.asarray(data, spec.kind)


def _use_leaf(v, y):
    if _is_key(v):
        return (v, jax.random.key_data(v))
    if v.dtype == jnp.bool_:
        return jnp.logical_not(v)
    if jnp.issubdtype(v.dtype, jnp.integer):
        return v * 2
    return v * y.astype(v.dtype)


_leaf_specs = st.builds(
    _LeafSpec,
    st.sampled_from(_DTYPES),
    st.sampled_from([(), (3,)]),
    st.integers(0, 2**16),
)
_trees = st.recursive(
    _leaf_specs,
    lambda children: (
        st.lists(children, min_size=1, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3)
    ),
    max_leaves=4,
)


@hypothesis.settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(spec_tree=_trees, trace=st.sampled_from(["none", "vmap"]))
def test_random_pytrees(spec_tree, trace):
    with _x64():
        tree = jtu.tree_map(_leaf, spec_tree)
        y = jnp.float32(1.5)

        def probe(tree, concrete):
            fn = lambda z: jtu.tree_map(lambda v: _use_leaf(v, z), tree)
            closed = sk.closure_convert(fn, y)
            _check_consts(closed, tree, concrete)
            want = jax.eval_shape(fn, y)
            assert [_struct_key(s) for s in jtu.tree_leaves(closed.out_struct)] == [
                _struct_key(s) for s in jtu.tree_leaves(want)
            ]
            return {"direct": fn(y), "closed": closed(y), "eval": _flat_call(closed, y)}

        if trace == "none":
            result = probe(tree, True)
        else:
            batched = jtu.tree_map(
                lambda s: jnp.stack(
                    [_leaf(s), _leaf(_LeafSpec(s.kind, s.shape, s.seed + 1))]
                ),
                spec_tree,
            )
            result = jax.vmap(lambda t: probe(t, False), axis_size=2)(batched)
    _assert_modes_agree(result)
