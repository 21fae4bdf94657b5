"""The closure matrix: solver family x adjoint x route x kind x transform, against
references.

Each cell solves a small ODE with one *solver family* (explicit: `Tsit5`; ESDIRK:
`Kvaerno5`; Rosenbrock: `Rodas5P`) and an adaptive `PIDController` on
[0, 1], through one adjoint, with a vector field that holds its values by one
*route* (a lexical closure, a default argument, a module global, a
`functools.partial`, a bound method, an `equinox.Module` field, diffeqsolve's `args`,
or a mix of these), where the values are of one *kind* (floats, an int index into a
float table, a bool mask, a PRNG key, an `equinox.nn.MLP`) and are tracers of the
*transform* under test (`jit`, `vmap`, `grad`, `vmap(grad)`, `grad(vmap)`,
`jit(vmap(grad))`). Values and gradients are checked against analytic solutions, and
for the MLP against SciPy (DOP853 at 1e-12 on the state and its forward
sensitivities), independently of solverkit. Int, bool and key values must get `float0`
cotangents.

The full product is 3 x 3 x 8 x 5 x 6 = 2160 cells: set `SOLVERKIT_FULL_MATRIX=1` to
run it. By default a pairwise covering design of 64 cells runs: for the explicit
family, 48 cells (`_DESIGN`) in which every pair of values of any two other factors
(route and transform, route and kind, adjoint and kind, ...) is in some cell; for each
stiff family, 8 cells (`_STIFF_DESIGN`) in which every route, adjoint, kind and
transform appears, so that every pair of a family and a value of another factor is in
some cell (four of these 16 run with `SOLVERKIT_FULL_MATRIX=1` only: each family's
other six still hold every adjoint, kind and transform). The 48 are chosen to share
compilations: the solve is jitted inside `diffeqsolve` and keyed by the converted
jaxpr, which is the same for every route that holds the values as constants, so under
an eager transform cells that differ only in such a route reuse one compiled program
(only `jit` and `jit(vmap(grad))` compile afresh per cell). The quick loop
(`-m "not slow"`) runs 10 of them, with every value of every factor (`_quick_cells`);
the others are marked slow.
"""

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
import scipy.integrate
from helpers import count_compiles, full_matrix_only

import solverkit as sk


pytestmark = pytest.mark.usefixtures("x64")


# --- The solve ------------------------------------------------------------------------

_T1 = 1.0
_W = np.array([1.0, 0.5])  # the loss is W . y(t1)
_Y0 = np.array([[1.0, 2.0], [0.5, -0.4], [1.5, 0.25]])  # a batch of initial states
_BATCH = len(_Y0)
_ADJOINTS = {
    "checkpoint": sk.RecursiveCheckpointAdjoint(),
    "backsolve": sk.BacksolveAdjoint(),
    "direct": sk.DirectAdjoint(),
}
# One solver per family, of high order, so that rtol = atol = 1e-8 takes well under
# `max_steps` steps (Kvaerno3 or Rosenbrock23 would take hundreds). The implicit solver
# takes its root finder's tolerances from the controller.
_SOLVERS = {
    "explicit": sk.Tsit5(),
    "esdirk": sk.Kvaerno5(),
    "rosenbrock": sk.Rodas5P(),
}

# Tolerances. The solve runs at rtol = atol = 1e-8, so the final state is within a
# small multiple of 1e-8 of the exact one: 1e-6 (relative) for values. Gradients:
# checkpoint and direct differentiate the discrete solve exactly, so they differ
# from the analytic gradient by the discretisation error, again ~1e-8; backsolve
# solves the adjoint ODE backwards with the same controller, so its gradient is off
# by about the solve tolerance too (~1e-8 times the O(1) scale of these gradients).
# 1e-5 leaves a margin of 50 or more (measured: at most 2e-7, backsolve on the MLP;
# ~1e-8 elsewhere), while a gradient that misses a route's constant or mixes up
# batch elements is off by O(1).
_VALUE_RTOL = 1e-6
# Components near zero: the solve's atol. Kvaerno5's global error is a few times its
# tolerance (measured: 1e-8 on a component of size 6e-3, where Tsit5's is 1e-9).
_VALUE_ATOL = {"explicit": 1e-8, "esdirk": 3e-8, "rosenbrock": 1e-8}
_GRAD_RTOL = 1e-5
_GRAD_ATOL = 1e-7  # entries near zero, or exactly zero (unused table rows)


def _solve(rhs: Callable, parts: tuple, route: str, adjoint, solver, y0) -> jax.Array:
    """y(t1) of `y' = rhs(t, y, *parts)` by `solver`, the vector field holding `parts`
    by `route`."""
    with _held(route, rhs, parts) as (vf, args):
        sol = sk.diffeqsolve(
            sk.ODETerm(vf),
            solver,
            0.0,
            _T1,
            0.1,
            y0,
            args,
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
            adjoint=adjoint,
            max_steps=64,
        )
    return sol.ys[-1]


# --- Routes: how the vector field holds `parts` ------------------------------------

ROUTES = ("closure", "default", "global", "partial", "method", "module", "args", "mix")

_GLOBAL: Any = None  # set by the "global" and "mix" routes while a solve is traced


def _global_vf(t, y, args):
    rhs, parts = _GLOBAL
    return rhs(t, y, *parts)


def _partial_vf(rhs, parts, t, y, args):
    return rhs(t, y, *parts)


class _Holder:
    """A plain object; its bound method is the vector field."""

    def __init__(self, rhs, parts):
        self.rhs = rhs
        self.parts = parts

    def vf(self, t, y, args):
        return self.rhs(t, y, *self.parts)


class _HeldModule(eqx.Module):
    """An equinox Module holding the values as a field."""

    parts: tuple
    rhs: Callable = eqx.field(static=True)

    def __call__(self, t, y, args):
        return self.rhs(t, y, *self.parts)


class _Field(eqx.Module):
    value: Any


@contextlib.contextmanager
def _held(route: str, rhs: Callable, parts: tuple):
    """Yield `(vector_field, args)` holding `parts` by `route`; a global that the route
    sets is restored afterwards."""
    global _GLOBAL
    saved = _GLOBAL
    try:
        if route == "closure":
            yield (lambda t, y, args: rhs(t, y, *parts)), None
        elif route == "default":

            def vf(t, y, args, parts=parts):
                return rhs(t, y, *parts)

            yield vf, None
        elif route == "global":
            _GLOBAL = (rhs, parts)
            yield _global_vf, None
        elif route == "partial":
            yield functools.partial(_partial_vf, rhs, parts), None
        elif route == "method":
            yield _Holder(rhs, parts).vf, None
        elif route == "module":
            yield _HeldModule(parts, rhs), None
        elif route == "args":
            yield (lambda t, y, args: rhs(t, y, *args)), parts
        elif route == "mix":
            # The first part in a Module field reached through a default argument,
            # the others in a module global.
            _GLOBAL = (rhs, parts[1:])

            def mixed(t, y, args, first=_Field(parts[0])):
                fn, rest = _GLOBAL
                return fn(t, y, first.value, *rest)

            yield mixed, None
        else:
            raise ValueError(route)
    finally:
        _GLOBAL = saved


# --- Kinds of value -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Kind:
    """A problem whose vector field holds values of one kind.

    - `rhs(t, y, *parts)`: the vector field, given the held values.
    - `parts(params, data)`: the held values, from the differentiated `params` and
        one element of the (batched) `data` (which also holds `y0`).
    - `params_batched`: whether `params` get a batch axis under vmap (else they are
        shared by the batch).
    - `make()`: `(params, data)`; `params` with a batch axis when `params_batched`,
        `data` always with one (size 3).
    - `reference(params, data)`: per batch element, `(y(t1), dloss/dparams,
        dloss/dy0)`, each with a leading batch axis.
    """

    rhs: Callable
    parts: Callable
    params_batched: bool
    make: Callable
    reference: Callable


def _float_rhs(t, y, theta, mu):
    return -theta * (y - mu)


def _float_make():
    params = (jnp.array([0.5, 1.0, 1.5]), jnp.array([0.2, -0.3, 0.4]))
    return params, {"y0": jnp.asarray(_Y0)}


def _float_reference(params, data):
    # y(t) = mu + (y0 - mu) exp(-theta t).
    theta, mu = (np.asarray(p)[:, None] for p in params)
    y0 = np.asarray(data["y0"])
    e = np.exp(-theta * _T1)
    y1 = mu + (y0 - mu) * e
    d_theta = (-_T1 * (y0 - mu) * e) @ _W
    d_mu = np.broadcast_to(1 - e, y0.shape) @ _W
    return y1, (d_theta, d_mu), _W * e


def _index_rhs(t, y, table, index):
    return -table[index] * y


def _index_make():
    data = {"index": jnp.array([3, 0, 3], jnp.int32), "y0": jnp.asarray(_Y0)}
    return jnp.array([0.3, 0.8, 1.1, 1.6]), data


def _index_reference(table, data):
    # y(t) = y0 exp(-table[i] t): only row i of the table gets a gradient.
    index = np.asarray(data["index"])
    rate = np.asarray(table)[index][:, None]
    y0 = np.asarray(data["y0"])
    e = np.exp(-rate * _T1)
    d_table = np.zeros((len(index), np.size(table)))
    d_table[np.arange(len(index)), index] = (-_T1 * y0 * e) @ _W
    return y0 * e, d_table, _W * e


def _mask_rhs(t, y, theta, mask):
    return -jnp.where(mask, theta, 0.0) * y


def _mask_make():
    mask = jnp.array([[True, False], [False, True], [True, True]])
    return jnp.asarray(0.9), {"mask": mask, "y0": jnp.asarray(_Y0)}


def _mask_reference(theta, data):
    # Componentwise y(t) = y0 exp(-where(mask, theta, 0) t).
    rate = np.where(np.asarray(data["mask"]), float(theta), 0.0)
    y0 = np.asarray(data["y0"])
    e = np.exp(-rate * _T1)
    d_theta = (-_T1 * np.asarray(data["mask"]) * y0 * e) @ _W
    return y0 * e, d_theta, _W * e


def _draw(key, shape, dtype):
    # uniform rather than normal: cheaper to compile (no erf_inv), as random as needed.
    return jax.random.uniform(key, shape, dtype, minval=-1.0, maxval=1.0)


def _key_rhs(t, y, theta, key):
    # A constant c drawn from the key inside the vector field (on every call).
    return -theta * y + _draw(key, y.shape, y.dtype)


def _key_make():
    keys = jax.random.split(jax.random.key(7), 3)
    return jnp.array([0.6, 1.2, 0.9]), {"key": keys, "y0": jnp.asarray(_Y0)}


def _key_reference(theta, data):
    # y(t) = c/theta + (y0 - c/theta) exp(-theta t).
    c = np.asarray(jax.vmap(lambda k: _draw(k, (2,), jnp.float64))(data["key"]))
    theta = np.asarray(theta)[:, None]
    y0 = np.asarray(data["y0"])
    e = np.exp(-theta * _T1)
    y1 = c / theta + (y0 - c / theta) * e
    dy_dtheta = -c / theta**2 + c / theta**2 * e - _T1 * (y0 - c / theta) * e
    return y1, dy_dtheta @ _W, _W * e


@functools.cache
def _mlp() -> eqx.nn.MLP:
    # tanh rather than relu: a jaxpr with a custom_jvp (relu) is reused by solverkit
    # only for the same Python function, so every cell would compile afresh.
    mlp = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
    arrays = jtu.tree_leaves(eqx.filter(mlp, eqx.is_array))
    assert all(x.dtype == jnp.float64 for x in arrays)
    return mlp


def _mlp_rhs(t, y, mlp, decay):
    return mlp(y) - decay * y


def _mlp_parts(params, data):
    arrays, decay = params
    return eqx.combine(arrays, eqx.filter(_mlp(), eqx.is_array, inverse=True)), decay


def _mlp_make():
    return (eqx.filter(_mlp(), eqx.is_array), jnp.asarray(0.5)), {
        "y0": jnp.asarray(_Y0)
    }


def _mlp_leaves(mlp) -> list:
    """[W1, b1, W2, b2] of the MLP `f(y) = W2 tanh(W1 y + b1) + b2`."""
    return [x for layer in mlp.layers for x in (layer.weight, layer.bias)]


def _mlp_weights(arrays) -> list[np.ndarray]:
    return [np.asarray(x) for x in _mlp_leaves(arrays)]


def _mlp_sensitivity_rhs(weights, decay):
    """`(y, S)' = (f(y), J S + df/dp)`: the MLP problem and its forward sensitivities
    `S = dy/dp`, with `p` = (W1, b1, W2, b2, decay, y0) flattened."""
    w1, b1, w2, b2 = weights
    sizes = [w1.size, b1.size, w2.size, b2.size, 1, 2]
    ends = np.cumsum(sizes)
    n = int(ends[-1])

    def rhs(t, z):
        y, s = z[:2], z[2:].reshape(2, n)
        h = np.tanh(w1 @ y + b1)
        w2g = w2 * (1 - h**2)  # W2 diag(tanh')
        f_p = np.zeros((2, n))
        f_p[:, : ends[0]] = (w2g[:, :, None] * y).reshape(2, -1)  # d/dW1[j, k]
        f_p[:, ends[0] : ends[1]] = w2g  # d/db1
        f_p[:, ends[1] : ends[2]] = np.kron(np.eye(2), h)  # d/dW2[i, j]
        f_p[:, ends[2] : ends[3]] = np.eye(2)  # d/db2
        f_p[:, ends[3]] = -y  # d/ddecay
        jac = w2g @ w1 - decay * np.eye(2)
        return np.concatenate([w2 @ h + b2 - decay * y, (jac @ s + f_p).ravel()])

    return rhs, ends


def _mlp_reference(params, data):
    # SciPy's DOP853 at 1e-12 on the state and its sensitivities: independent of
    # solverkit.
    arrays, decay = params
    weights = _mlp_weights(arrays)
    rhs, ends = _mlp_sensitivity_rhs(weights, float(decay))
    y1s, d_params, d_y0s = [], [], []
    for y0 in np.asarray(data["y0"]):
        s0 = np.zeros((2, ends[-1]))
        s0[:, ends[-2] :] = np.eye(2)
        sol = scipy.integrate.solve_ivp(
            rhs,
            (0.0, _T1),
            np.concatenate([y0, s0.ravel()]),
            method="DOP853",
            rtol=1e-12,
            atol=1e-12,
        )
        z = sol.y[:, -1]
        grad = _W @ z[2:].reshape(2, -1)
        blocks = np.split(grad, ends[:-1])
        new = [b.reshape(w.shape) for b, w in zip(blocks, weights)]
        d_arrays = eqx.tree_at(_mlp_leaves, arrays, new)
        d_params.append((d_arrays, blocks[4][0]))
        y1s.append(z[:2])
        d_y0s.append(blocks[5])
    stacked = jtu.tree_map(lambda *xs: np.stack(xs), *d_params)
    return np.stack(y1s), stacked, np.stack(d_y0s)


KINDS = {
    "float": _Kind(_float_rhs, lambda p, d: p, True, _float_make, _float_reference),
    "int_index": _Kind(
        _index_rhs,
        lambda p, d: (p, d["index"]),
        False,
        _index_make,
        _index_reference,
    ),
    "bool_mask": _Kind(
        _mask_rhs, lambda p, d: (p, d["mask"]), False, _mask_make, _mask_reference
    ),
    "key": _Kind(_key_rhs, lambda p, d: (p, d["key"]), True, _key_make, _key_reference),
    "mlp": _Kind(_mlp_rhs, _mlp_parts, False, _mlp_make, _mlp_reference),
}


# --- Transforms ---------------------------------------------------------------------

TRANSFORMS = ("jit", "vmap", "grad", "vmap_grad", "grad_vmap", "jit_vmap_grad")


def _functions(kind: _Kind, route: str, adjoint, solver, ints_traced: bool = True):
    """`value(params, data) = y(t1)` and `loss(params, data) = (W . y(t1), y(t1))`,
    for one batch element; the vector field is built inside, holding tracers (but
    for the int, bool and key values when not `ints_traced`)."""

    def value(params, data):
        parts = kind.parts(params, data)
        for leaf in jtu.tree_leaves(parts):
            if callable(leaf):
                continue
            if not (ints_traced or jnp.issubdtype(leaf.dtype, jnp.floating)):
                continue
            assert isinstance(leaf, jax.core.Tracer), type(leaf)
        return _solve(kind.rhs, parts, route, adjoint, solver, data["y0"])

    def loss(params, data):
        y1 = value(params, data)
        return jnp.dot(jnp.asarray(_W), y1), y1

    return value, loss


def _grad(loss):
    # Every argument is differentiated: ints, bools and keys must get float0.
    return jax.grad(loss, argnums=(0, 1), has_aux=True, allow_int=True)


def _first(tree):
    return jtu.tree_map(lambda x: x[0], tree)


def _run(transform: str, kind: _Kind, route: str, adjoint, solver, params, data):
    """Apply `transform`; returns `(values, grads)`, with `grads = None` for the
    forward transforms and `(dloss/dparams, dloss/ddata)` otherwise."""
    # jax.grad alone passes int, bool and key arguments through untraced.
    value, loss = _functions(
        kind, route, adjoint, solver, ints_traced=transform != "grad"
    )
    axis = 0 if kind.params_batched else None
    one_params = _first(params) if kind.params_batched else params
    if transform == "jit":
        return jax.jit(value)(one_params, _first(data)), None
    if transform == "vmap":
        # Shared parameters too get a batch axis (of copies): under a plain vmap they
        # would otherwise be held as concrete arrays, not as tracers of the vmap.
        if not kind.params_batched:
            params = jtu.tree_map(lambda x: jnp.stack([x] * _BATCH), params)
        return jax.vmap(value)(params, data), None
    if transform == "grad":
        grads, y1 = _grad(loss)(one_params, _first(data))
        return y1, grads
    if transform == "vmap_grad":
        grads, y1 = jax.vmap(_grad(loss), in_axes=(axis, 0))(params, data)
        return y1, grads
    if transform == "jit_vmap_grad":
        grads, y1 = jax.jit(jax.vmap(_grad(loss), in_axes=(axis, 0)))(params, data)
        return y1, grads
    assert transform == "grad_vmap"

    def total(params, data):
        losses, y1 = jax.vmap(loss, in_axes=(axis, 0))(params, data)
        return jnp.sum(losses), y1

    grads, y1 = _grad(total)(params, data)
    return y1, grads


def _expected(transform: str, kind: _Kind, params, data):
    """What `_run` should return, from the per-element reference."""
    y1, d_params, d_y0 = kind.reference(params, data)
    if transform == "jit":
        return y1[0], None
    if transform == "vmap":
        return y1, None
    if transform == "grad":
        return y1[0], (_first(d_params), d_y0[0])
    if transform == "grad_vmap" and not kind.params_batched:
        d_params = jtu.tree_map(lambda g: np.sum(g, axis=0), d_params)
    return y1, (d_params, d_y0)


# --- The design ---------------------------------------------------------------------

# The default cells: for each transform (row) and route (column), the adjoint
# (C checkpoint, B backsolve, D direct) and the kind. Every pair of values of two
# factors is in some cell (test_design_covers_every_pair). Under the eager transforms
# (vmap, grad, vmap_grad, grad_vmap) each row has 5 groups of cells with one adjoint
# and kind that hold their values as constants (or, for "args", as arguments), and
# each group compiles once; jit and jit_vmap_grad compile per cell. The table came
# from a search that minimised the estimated compile time (checkpoint > direct >
# backsolve; mlp, key > the rest), the adjoints kept near 16 cells each.
_DESIGN = """
#                closure default global  partial method  module  args    mix
jit              D.bool  D.float B.bool  D.mlp   D.int   D.float C.key   D.bool
vmap             C.mlp   C.mlp   C.mlp   D.int   C.mlp   B.key   D.float D.bool
grad             C.int   C.int   C.int   D.key   B.float B.mlp   B.bool  D.key
vmap_grad        D.key   D.key   D.key   C.float B.mlp   B.bool  B.int   C.float
grad_vmap        B.float C.bool  C.bool  C.bool  B.key   C.bool  B.mlp   D.int
jit_vmap_grad    D.key   B.bool  C.float B.bool  B.bool  B.int   B.float B.mlp
"""
_SHORT = {
    "C": "checkpoint",
    "B": "backsolve",
    "D": "direct",
    "float": "float",
    "int": "int_index",
    "bool": "bool_mask",
    "key": "key",
    "mlp": "mlp",
}


# The stiff families' cells: for each route (row) and family (column), the adjoint,
# kind and transform. In each column every adjoint, kind and transform appears
# (test_design_covers_every_pair). The first row is the quick loop's cell of each
# family; the others are marked slow.
_STIFF_DESIGN = """
#          esdirk               rosenbrock
closure    C.float.grad         D.int.grad
default    D.int.vmap           C.mlp.vmap_grad
global     B.bool.vmap_grad     B.key.jit
partial    C.key.jit            D.bool.jit_vmap_grad
method     B.mlp.grad_vmap      C.float.grad_vmap
module     D.float.jit_vmap_grad D.key.vmap
args       C.bool.vmap          B.float.grad
mix        D.key.vmap_grad      C.int.jit_vmap_grad
"""
FAMILIES = tuple(_SOLVERS)
_STIFF_FAMILIES = FAMILIES[1:]

Cell = tuple[str, str, str, str, str]  # (family, adjoint, route, kind, transform)


def _design_cells() -> list[Cell]:
    """The cells of `_DESIGN` (explicit) and `_STIFF_DESIGN`."""
    lines = [line.split() for line in _DESIGN.strip().splitlines()]
    assert tuple(lines[0][1:]) == ROUTES
    assert tuple(line[0] for line in lines[1:]) == TRANSFORMS
    cells = []
    for transform, *entries in lines[1:]:
        for route, entry in zip(ROUTES, entries, strict=True):
            adjoint, kind = entry.split(".")
            cells.append(("explicit", _SHORT[adjoint], route, _SHORT[kind], transform))
    lines = [line.split() for line in _STIFF_DESIGN.strip().splitlines()]
    assert tuple(lines[0][1:]) == _STIFF_FAMILIES
    assert tuple(line[0] for line in lines[1:]) == ROUTES
    for route, *entries in lines[1:]:
        for family, entry in zip(_STIFF_FAMILIES, entries, strict=True):
            adjoint, kind, transform = entry.split(".")
            cells.append((family, _SHORT[adjoint], route, _SHORT[kind], transform))
    return cells


# The explicit cells in the quick loop: every route, adjoint, kind and transform once
# or more, cheap ones (the three grad cells share one compilation).
_QUICK_EXPLICIT = [
    ("checkpoint", "closure", "int_index", "grad"),
    ("checkpoint", "default", "int_index", "grad"),
    ("checkpoint", "global", "int_index", "grad"),
    ("direct", "partial", "mlp", "jit"),
    ("direct", "args", "float", "vmap"),
    ("backsolve", "module", "bool_mask", "vmap_grad"),
    ("backsolve", "method", "key", "grad_vmap"),
    ("backsolve", "mix", "mlp", "jit_vmap_grad"),
]


def _quick_cells() -> set[Cell]:
    """The cells in the quick loop (`-m "not slow"`): `_QUICK_EXPLICIT`, and each
    stiff family's first (the closure route)."""
    cells = [cell for cell in _design_cells() if cell[0] != "explicit"]
    quick = {next(cell for cell in cells if cell[0] == f) for f in _STIFF_FAMILIES}
    return quick | {("explicit", *cell) for cell in _QUICK_EXPLICIT}


def _full_cells() -> list[Cell]:
    return [
        (family, adjoint, route, kind, transform)
        for family in FAMILIES
        for adjoint in _ADJOINTS
        for kind in KINDS
        for transform in TRANSFORMS
        for route in ROUTES
    ]


FULL = os.environ.get("SOLVERKIT_FULL_MATRIX", "") not in ("", "0")

# Design cells of the stiff families run with `SOLVERKIT_FULL_MATRIX=1` only: the
# others of each family still hold every adjoint, kind and transform
# (test_design_covers_every_pair); a route is converted before the solver sees its
# values, and every route is in the explicit cells and in each family's others.
_STIFF_FULL_MATRIX_ONLY: set[Cell] = {
    ("rosenbrock", "backsolve", "args", "float", "grad"),
    ("rosenbrock", "checkpoint", "mix", "int_index", "jit_vmap_grad"),
    ("esdirk", "direct", "mix", "key", "vmap_grad"),
    ("esdirk", "checkpoint", "args", "bool_mask", "vmap"),
}

# Cells where solverkit is known to be wrong: (family, adjoint, route, kind,
# transform) -> reason. None at present.
_KNOWN_FAILURES: dict[Cell, str] = {}


def _params(cells):
    quick = _quick_cells()
    params = []
    for cell in cells:
        marks = []
        if cell in _KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=_KNOWN_FAILURES[cell]))
        if cell not in quick:
            marks.append(pytest.mark.slow)
        if cell in _STIFF_FULL_MATRIX_ONLY:
            marks.append(full_matrix_only(f"this family's other cells ({cell[0]}-*)"))
        params.append(pytest.param(*cell, id="-".join(cell), marks=marks))
    return params


def test_design_covers_every_pair():
    cells = _design_cells()
    assert len(set(cells)) == len(cells) == 48 + 8 * len(_STIFF_FAMILIES)
    factors = (FAMILIES, tuple(_ADJOINTS), ROUTES, tuple(KINDS), TRANSFORMS)
    explicit = [cell for cell in cells if cell[0] == "explicit"]
    for i in range(5):
        for j in range(i + 1, 5):
            # A family and a value of another factor: in some cell. Values of two
            # other factors: in some explicit cell.
            within = cells if i == 0 else explicit
            seen = {(cell[i], cell[j]) for cell in within}
            missing = {(a, b) for a in factors[i] for b in factors[j]} - seen
            assert not missing, (i, j, missing)
    # Without the cells left to `SOLVERKIT_FULL_MATRIX=1`, each stiff family still
    # has every adjoint, kind and transform.
    assert _STIFF_FULL_MATRIX_ONLY <= set(cells)
    kept = [c for c in cells if c not in _STIFF_FULL_MATRIX_ONLY]
    for family in _STIFF_FAMILIES:
        own = [c for c in kept if c[0] == family]
        for i in (1, 3, 4):
            assert {c[i] for c in own} == set(factors[i]), (family, i)
    # The quick loop's cells are design cells, with every value of every factor.
    quick = _quick_cells()
    assert quick <= set(cells)
    for i, values in enumerate(factors):
        assert {cell[i] for cell in quick} == set(values), i


# --- Checks -------------------------------------------------------------------------


def _assert_nontrivial(grads, batched: bool) -> None:
    """Some entry of the parameter gradient is far from zero (for each batch element
    when `batched`)."""
    leaves = [np.asarray(g) for g in jtu.tree_leaves(grads)]
    if batched:
        flat = np.concatenate([g.reshape(len(g), -1) for g in leaves], axis=1)
        assert np.all(np.max(np.abs(flat), axis=1) > 1e-2), flat
    else:
        flat = np.concatenate([g.ravel() for g in leaves])
        assert np.max(np.abs(flat)) > 1e-2, flat


def _check_data_grads(got: dict, data: dict, want_y0, batched: bool) -> None:
    """dloss/dy0 as expected; every int, bool and key leaf gets float0."""
    assert set(got) == set(data)
    np.testing.assert_allclose(got["y0"], want_y0, rtol=_GRAD_RTOL, atol=_GRAD_ATOL)
    for name, x in data.items():
        if name == "y0":
            continue
        g = got[name]
        assert g.dtype == jax.dtypes.float0, (name, g.dtype)
        shape = np.shape(x) if batched else np.shape(x)[1:]
        assert np.shape(g) == shape, (name, np.shape(g), shape)


@pytest.mark.parametrize(
    ("family", "adjoint", "route", "kind", "transform"),
    _params(_full_cells() if FULL else _design_cells()),
)
def test_matrix(family, adjoint, route, kind, transform):
    spec = KINDS[kind]
    params, data = spec.make()
    solver = _SOLVERS[family]
    got_y1, got_grads = _run(
        transform, spec, route, _ADJOINTS[adjoint], solver, params, data
    )
    want_y1, want_grads = _expected(transform, spec, params, data)
    atol = _VALUE_ATOL[family]
    np.testing.assert_allclose(got_y1, want_y1, rtol=_VALUE_RTOL, atol=atol)
    if want_grads is None:
        assert got_grads is None
        return
    (got_params, got_data), (want_params, want_y0) = got_grads, want_grads
    assert jtu.tree_structure(got_params) == jtu.tree_structure(want_params)
    for g, w in zip(jtu.tree_leaves(got_params), jtu.tree_leaves(want_params)):
        assert jnp.issubdtype(g.dtype, jnp.floating), g.dtype
        np.testing.assert_allclose(g, w, rtol=_GRAD_RTOL, atol=_GRAD_ATOL)
    # The reference is not zero either (a silently zero gradient must fail).
    batched = transform != "grad"
    per_element = batched and (transform != "grad_vmap" or spec.params_batched)
    _assert_nontrivial(want_params, per_element)
    _assert_nontrivial(got_params, per_element)
    _check_data_grads(got_data, data, want_y0, batched)


def test_routes_share_compilations():
    """Under an eager transform, every route that holds the values as constants
    reuses the first one's compiled solve: the default design's cost relies on it."""
    kind = KINDS["float"]
    params, data = kind.make()
    const_routes = [route for route in ROUTES if route != "args"]
    backsolve, tsit5 = _ADJOINTS["backsolve"], _SOLVERS["explicit"]
    _run("grad", kind, const_routes[0], backsolve, tsit5, params, data)
    for route in const_routes[1:]:
        with count_compiles() as counter:
            _run("grad", kind, route, backsolve, tsit5, params, data)
        assert counter.count == 0, route


# --- The MLP reference ---------------------------------------------------------------


def test_mlp_reference_sensitivities():
    """The MLP reference's gradient (forward sensitivities) against central finite
    differences of plain SciPy solves, along a random direction in (params, y0);
    and its value against the equinox MLP's vector field."""
    params, data = _mlp_make()
    y1, d_params, d_y0 = _mlp_reference(params, data)
    arrays, decay = params
    weights = _mlp_weights(arrays)
    y0 = np.asarray(data["y0"][0])
    rhs, ends = _mlp_sensitivity_rhs(weights, float(decay))
    z = np.zeros(2 + 2 * ends[-1])
    z[:2] = y0
    mlp = _mlp_parts(params, data)[0]
    want = _mlp_rhs(0.0, jnp.asarray(y0), mlp, decay)
    np.testing.assert_allclose(rhs(0.0, z)[:2], want, rtol=1e-12)
    flat = np.concatenate([w.ravel() for w in weights] + [[float(decay)], y0])

    def loss(x):
        parts = np.split(x, ends[:-1])
        w1, b1, w2, b2 = (p.reshape(w.shape) for p, w in zip(parts, weights))
        decay, y0 = parts[4][0], parts[5]

        def f(t, y):
            return w2 @ np.tanh(w1 @ y + b1) + b2 - decay * y

        sol = scipy.integrate.solve_ivp(
            f, (0.0, _T1), y0, method="DOP853", rtol=1e-13, atol=1e-13
        )
        return _W @ sol.y[:, -1]

    np.testing.assert_allclose(_W @ y1[0], loss(flat), rtol=1e-10)
    direction = np.random.default_rng(0).normal(size=flat.shape)
    eps = 1e-4
    fd = (loss(flat + eps * direction) - loss(flat - eps * direction)) / (2 * eps)
    grad = np.concatenate(
        [np.ravel(g) for g in jtu.tree_leaves(_first(d_params))] + [d_y0[0]]
    )
    assert abs(fd) > 1e-2
    np.testing.assert_allclose(grad @ direction, fd, rtol=1e-7)
