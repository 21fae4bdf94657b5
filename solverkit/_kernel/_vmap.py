"""`jax.vmap(diffeqsolve)` on the whole-solve kernel.

On a TPU a vmapped solve is a lockstep loop whose every step is several small
kernels, bound by their launches; the whole-solve kernel runs the same batch in one
(`ensemble_solve`'s kernel path). `vmap_aware` wraps a solve (as `mode` says) in a
batching rule (`jax.custom_batching.custom_vmap`) that takes the kernel where the
batch is one it can solve: the vmap batches only the initial state, the array
arguments and the values the vector field closes over (the rule moves the batched
ones into the kernel's per-trajectory arguments). Anything else batched (times,
tolerances, ...) falls back to the plain vmap of the same traced solve.

Reverse mode: JAX can't transpose a `custom_vmap`, so the solve is a `custom_vjp`
whose rules are `custom_vmap`s too, where a vmap is seen among the solve's inputs
(`mode` "gradient"): its forward rule runs the kernel (the residuals are the
inputs), its backward rule pulls back through the kernel's forward sensitivities
where only `y0`, `args` and closed-over values are differentiated (symbolic zeros
say which inputs are, however the solve was traced) and they apply, else through
the plain solve's reverse mode, per batch element. Every cotangent is per batch
element, a shared input's too (`vmap(grad)` wants each element's own; under
`grad(vmap)` JAX sums them). The promise: the loop's values and derivatives, to the
tolerance's order, in every order of the transformations.

Where no vmap is seen (inside a `jit` that a `vmap` may batch later: `mode`
"forward") the forward rule is the plain solve's (`jax.vjp` of it). A solve seen
differentiated but not batched, or differentiated twice (forward over reverse: the
kernel's rules can't be differentiated in forward mode), is not wrapped at all. It
applies only to the adjoints that support reverse mode alone. Each decision is
recorded for `kernel_routes()` (`_routes`).
"""

import os
from collections.abc import Callable

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_batching import custom_vmap

from .. import _backend
from .._adjoint._backsolve import BacksolveAdjoint
from .._adjoint._base import AbstractAdjoint, materialize, zeros_cotangent
from .._adjoint._checkpoint import RecursiveCheckpointAdjoint
from .._problem import Problem
from .._solution import Solution
from . import _batch, _field, _routes, _solve
from ._solve import supported


# Put vmapped solves on the kernel: True / False, or None (default): as the
# environment variable SOLVERKIT_VMAP_KERNEL says ("1" / "0"), else on a TPU only,
# where it was measured faster (the kernel lowers to TPUs only; elsewhere it runs in
# Pallas' interpreter, which tests use by setting this True).
ENABLED: bool | None = None
# The adjoints whose reverse mode is a `custom_vjp` anyway (no forward mode to lose).
_REVERSE_ONLY = (RecursiveCheckpointAdjoint, BacksolveAdjoint)


def vmap_aware(
    solve: Callable, problem: Problem, adjoint: AbstractAdjoint, throw, final
):
    """`solve(problem, adjoint, throw, final)` (a traced solve), wrapped as `mode`
    says so that a `vmap` of it runs on the kernel."""
    wrap = mode(problem, adjoint, final)
    if wrap is None:
        return solve(problem, adjoint, throw, final)
    body = lambda p, raising: solve(p, adjoint, raising, final)  # noqa: E731
    return wrapped(body, problem, throw, wrap == "gradient", adjoint.discrete)


def mode(problem: Problem, adjoint: AbstractAdjoint, final) -> str | None:
    """How `wrapped` should wrap this solve: `None` (not at all), "forward" (a rule for
    the forward pass) or "gradient" (rules for reverse mode too, where a vmap of
    what the rule takes is seen among its inputs). Only when on (`ENABLED`), for an
    adjoint in `_REVERSE_ONLY`, and a solve the kernel supports (as
    `ensemble_solve` takes it). A solve left alone records why (`kernel_routes`)."""
    if not _enabled():
        if _routes.listening() and _seen(problem)[1]:
            why = "the route is off (SOLVERKIT_VMAP_KERNEL=0, or not on a TPU)"
            _routes.record("forward", False, why)
        return None
    wrap, why = _decide(problem, adjoint, final)
    if wrap is None:
        _routes.record("forward", False, why)
    return wrap


def _decide(problem: Problem, adjoint: AbstractAdjoint, final):
    """`mode`'s answer and, for `None`, why."""
    if type(adjoint) not in _REVERSE_ONLY:
        return None, f"adjoint {type(adjoint).__name__}: not reverse-mode only"
    if not _field.by_default(problem):
        return None, "the kernel does not take this solve by default"
    if problem.event.conds is not None:
        return None, "an event"
    batch_of_one = jtu.tree_map(lambda x: x[None], problem.y0)
    why = supported(problem, batch_of_one, None, final)
    if why is not None:
        return None, why
    differentiated, batched = _seen(problem)
    if differentiated > 1:  # the rules would be differentiated: not the kernel's
        return None, "differentiated twice (forward over reverse)"
    if differentiated and not adjoint.discrete:  # its own reverse mode: the loop's
        return None, f"{type(adjoint).__name__} differentiated inside the vmap"
    if batched and all(_batch.allowed(path) for path in batched):
        return "gradient", None
    if batched:  # the wrapper would go unused
        return (
            None,
            f"batched {_batch.names([p for p in batched if not _batch.allowed(p)])}",
        )
    if differentiated:
        return None, "differentiated, not batched"
    return "forward", None


def _seen(problem: Problem) -> tuple[int, list[tuple]]:
    """How many differentiations see the problem here (JVP or linearize traces whose
    tracers are among its leaves, themselves or under `vmap`'s), and the paths of the
    leaves a `vmap` batches (a batch tracer's, itself or under a JVP's). Best effort
    (JAX's tracer classes): what it can't see is taken as absent, and the "forward"
    wrapper, correct either way, serves."""
    try:
        from jax._src.interpreters import ad, batching
    except ImportError:  # pragma: no cover - a JAX without these modules
        return 0, []
    jvp = tuple(
        getattr(ad, n) for n in ("JVPTracer", "LinearizeTracer") if hasattr(ad, n)
    )
    traces, batched = set(), []
    for keys, x in jtu.tree_flatten_with_path(eqx.filter(problem, eqx.is_array))[0]:
        while isinstance(x, jax.core.Tracer):
            if isinstance(x, jvp):
                traces.add(id(getattr(x, "_trace", x)))
                x = getattr(x, "primal", None)
            elif isinstance(x, batching.BatchTracer):
                if x.batch_dim is not None:
                    batched.append(_batch.path_of(keys))
                x = x.val
            else:
                break
    return len(traces), batched


def _enabled() -> bool:
    if ENABLED is not None:
        return ENABLED
    setting = os.environ.get("SOLVERKIT_VMAP_KERNEL", "")
    if setting in ("0", "1"):
        return setting == "1"
    return _backend.platform() == "tpu"


def wrapped(
    body: Callable[[Problem, bool], Solution],
    problem: Problem,
    throw: bool,
    gradient: bool,
    tangents: bool,
) -> Solution:
    """`body(problem, throw)`, which a `vmap` of it runs on the kernel where it can.

    **Arguments:**

    - `body`: the solve, `(problem, throw) -> Solution` (`mode` was not `None`).
    - `problem`: its problem.
    - `throw`: whether to raise on a failed trajectory.
    - `gradient`: `mode` was "gradient": the reverse-mode rules are batching rules
        too.
    - `tangents`: whether the kernel's forward sensitivities may serve reverse mode
        (`AbstractAdjoint.discrete`).

    **Returns:**

    What `body(problem, throw)` returns; under `vmap`, the kernel's solution where
    the rule takes it (equal to the vmapped `body`'s to the tolerance's order).
    """
    dynamic, static = eqx.partition(problem, eqx.is_array)
    flat, in_tree = jtu.tree_flatten(dynamic)
    out = {}  # what tracing the plain solve found: its output's static part, avals

    def arrays_of(flat, raising=throw):  # the solve's array outputs, flattened
        sol = body(eqx.combine(jtu.tree_unflatten(in_tree, flat), static), raising)
        arrays, rest = eqx.partition(sol, eqx.is_array)
        leaves, tree = jtu.tree_flatten(arrays)
        out.update(rest=rest, tree=tree, avals=[_aval(x) for x in leaves])
        return leaves

    def on_kernel(flat, flags, raising, probe=None):
        got = _batch.on_kernel(in_tree, static, flat, flags, raising, tangents, probe)
        if isinstance(got, str):
            _routes.record("backward" if probe else "forward", False, got)
            raise _batch.Fallback
        return _batch.like_body(got, problem.max_steps, out["avals"])

    def setup(flat, flags):  # the kernel's problem, or why it can't
        return _batch.kernel_problem(in_tree, static, flat, flags)

    run = jax.custom_vjp(_primal(arrays_of, on_kernel, throw))
    if gradient:
        paths = [_batch.path_of(k) for k, _ in jtu.tree_flatten_with_path(dynamic)[0]]
        rules = _Rules(arrays_of, on_kernel, setup, throw, tangents, paths)
        run.defvjp(rules.fwd, rules.bwd, symbolic_zeros=True)
    else:
        run.defvjp(lambda flat: jax.vjp(arrays_of, flat), lambda pull, ct: pull(ct))
    leaves = run(flat)
    return eqx.combine(jtu.tree_unflatten(out["tree"], leaves), out["rest"])


def _aval(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _axes(flags) -> list:
    return [0 if b else None for b in flags]


def _primal(arrays_of, on_kernel, throw):
    """The forward solve: the traced plain solve, the kernel under `vmap`."""

    def primal(flat):
        closed = jax.make_jaxpr(arrays_of)(flat)
        evaluate = lambda flat: jax.core.eval_jaxpr(  # noqa: E731
            closed.jaxpr, closed.consts, *flat
        )
        batched = custom_vmap(evaluate)

        @batched.def_vmap
        def rule(axis_size, in_batched, flat):
            (flags,) = in_batched
            try:
                leaves = on_kernel(flat, flags, throw)
                _routes.record("forward", True, None)
            except _batch.Fallback:  # the plain vmap of the traced solve
                run = jax.vmap(evaluate, in_axes=(_axes(flags),), axis_size=axis_size)
                leaves = run(flat)
            return leaves, [True] * len(leaves)

        return batched(flat)

    return primal


class _Rules:
    """The `custom_vjp` rules (with symbolic zeros: which inputs are perturbed),
    each a batching rule too: forward, the kernel (its residuals the inputs);
    backward, a pull-back through the kernel's forward sensitivities where only
    `y0`, `args` and closed-over values are perturbed, else the plain solve's
    reverse mode. Unbatched, they never run: the wrapper is "gradient" only where a
    vmap batches the problem, whose rules then serve every call (the unbatched
    backward rule raises at run time rather than return a wrong gradient).

    Every cotangent is returned per batch element: under `vmap(grad)` each element's
    gradient of a shared input is its own; under `grad(vmap)` JAX sums them."""

    def __init__(self, arrays_of, on_kernel, setup, throw, tangents, paths):
        self.arrays_of, self.on_kernel, self.setup = arrays_of, on_kernel, setup
        self.throw, self.tangents, self.paths = throw, tangents, paths

    def fwd(self, primals):
        flat = [p.value for p in primals]
        marks = tuple(() if p.perturbed else None for p in primals)
        leaves, flat = self._fwd()(flat)
        return leaves, (flat, marks)

    def _fwd(self):
        fwd = custom_vmap(lambda flat: (self.arrays_of(flat), flat))

        @fwd.def_vmap
        def fwd_rule(axis_size, in_batched, flat):
            (flags,) = in_batched
            try:
                leaves = self.on_kernel(flat, flags, self.throw)
                _routes.record("forward", True, None)
            except _batch.Fallback:
                run = jax.vmap(
                    self.arrays_of, in_axes=(_axes(flags),), axis_size=axis_size
                )
                leaves = run(flat)
            return (leaves, flat), ([True] * len(leaves), list(flags))

        return fwd

    def bwd(self, residuals, ct):
        flat, marks = residuals
        perturbed = [m is not None for m in marks]
        ct = [materialize(c) for c in ct]
        bwd = custom_vmap(_bwd_plain)

        @bwd.def_vmap
        def bwd_rule(axis_size, in_batched, flat, ct):
            flags, ct_flags = in_batched
            ct = [c if b else _broadcast(c, axis_size) for c, b in zip(ct, ct_flags)]
            try:
                got = self._tangent(flat, flags, ct, perturbed, axis_size)
            except _batch.Fallback:
                got = self._loop(flat, flags, ct, axis_size)
            return got, [True] * len(flat)

        return (bwd(flat, ct),)

    def _loop(self, flat, flags, ct, size):
        """Per batch element, the plain solve's reverse mode."""

        def pull_one(f, c):
            return jax.vjp(lambda f: self.arrays_of(f, False), f)[1](c)[0]

        return jax.vmap(pull_one, in_axes=(_axes(flags), 0), axis_size=size)(flat, ct)

    def _tangent(self, flat, flags, ct, perturbed, size):
        """Per batch element, the cotangents by the kernel's forward sensitivities,
        or `_batch.Fallback`."""
        other = [
            p for p, d in zip(self.paths, perturbed) if d and not _batch.allowed(p)
        ]
        why = None if self.tangents else "the adjoint's own reverse mode"
        why = f"differentiated with respect to {_batch.names(other)}" if other else why
        if why is not None:
            _routes.record("backward", False, why)
            raise _batch.Fallback
        # The kernel holds `y0` per batch element anyway: broadcast, its cotangent
        # is per element; shared `args` and closed-over values stay shared, and a
        # probe takes their cotangents per element.
        is_y0 = [p[:1] == ("y0",) for p in self.paths]
        flat = [_broadcast(x, size) if y and not b else x for x, y, b in zip(
            flat, is_y0, flags)]  # fmt: skip
        flags = [b or y for b, y in zip(flags, is_y0)]
        got = self.setup(flat, flags)
        if isinstance(got, str):
            _routes.record("backward", False, got)
            raise _batch.Fallback
        consts = got[0].terms.closure.consts
        probe = tuple(
            jnp.zeros((size, *c.shape), c.dtype) if eqx.is_inexact_array(c) else None
            for c in consts
        )
        batched = [i for i, b in enumerate(flags) if b]

        def run(xs, probe):  # the batched inputs differentiated, the rest fixed
            f = list(flat)
            for i, x in zip(batched, xs):
                f[i] = x
            return self.on_kernel(f, flags, False, probe)

        try:
            _, pull = jax.vjp(run, [flat[i] for i in batched], probe)
            ct_batched, ct_probe = pull(ct)
        except _solve.TangentsDeclined:
            raise _batch.Fallback from None
        out = _per_element(self.setup, flat, flags, ct_probe, size)
        out.update(zip(batched, ct_batched))
        return [out[i] for i in range(len(flat))]


def _per_element(setup, flat, flags, ct_probe, size) -> dict:
    """The cotangents of the shared inputs, per batch element, from those of the
    kernel field's closed-over values (`ct_probe`): through the map from the inputs
    to those values (the copies `closure_convert` makes)."""
    index = [i for i, (x, b) in enumerate(zip(flat, flags)) if not b]
    inexact = [i for i in index if eqx.is_inexact_array(flat[i])]

    def consts_of(xs):
        f = list(flat)
        for i, x in zip(inexact, xs):
            f[i] = x
        consts = setup(f, flags)[0].terms.closure.consts
        return tuple(c for c in consts if eqx.is_inexact_array(c))

    cts = tuple(c for c in ct_probe if c is not None)
    per = []
    if inexact:
        _, pull = jax.vjp(consts_of, [flat[i] for i in inexact])
        per = jax.vmap(lambda c: pull(c)[0], axis_size=size)(cts)
    out = {i: _broadcast(zeros_cotangent(flat[i]), size) for i in index}
    out.update(zip(inexact, per))
    return out


_NEVER = "internal error: solverkit's vmap rule's backward pass ran unbatched"


def _bwd_plain(flat, ct):
    del ct
    never = eqx.error_if(jnp.zeros(()), jnp.asarray(True), _NEVER)
    return [_guarded(zeros_cotangent(x), never) for x in flat]


def _guarded(zero, never):
    """`zero`, made to depend on `never` (an error raised if it runs)."""
    if eqx.is_inexact_array(zero):
        return zero + never.astype(zero.dtype)
    return zero


def _broadcast(x, size: int):
    if jnp.result_type(x) == jax.dtypes.float0:
        return np.zeros((size, *jnp.shape(x)), jax.dtypes.float0)
    return jnp.broadcast_to(x, (size, *jnp.shape(x)))
