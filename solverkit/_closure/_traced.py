"""`Traced`: a function traced to a jaxpr once per kind of input, then evaluated
from that jaxpr.

Evaluating a jaxpr binds the same primitives, in the same order, as tracing the
Python that made it, without the Python around them (and without tracing the small
`jit`s inside it again). The checkpointed adjoint calls a solver step in four places
(the forward loop, the carry leaves a step returns unchanged, the backward pass's
recomputation and its pullback); through one `Traced` the step is traced in Python
once per kind of input, and the program JAX builds from each call is the one it
built before (the same StableHLO, up to the names of its functions). Measured on
the Lotka-Volterra gradient (Tsit5, `vmap`, CPU seconds of the trace): the
recomputation loop 0.045-0.070 -> 0.027-0.032 s; a separate trace to find the
unchanged leaves, ~0.06 s, is gone.

The jaxpr keeps only the equations whose results are used (`_jaxpr_rewrite.dce`):
evaluated, it computes no value the Python would have computed and dropped (a step's
stage times where the field ignores `t`; under `jax.vjp` of a function that keeps
only a step's differentiable outputs, its counters and decisions).

An input's kind is its type as JAX sees it (shape, dtype, weak type, varying manual
axes) where it is a tracer, and the object itself where it is not: a concrete value
stays concrete for the traced Python (which may branch on it) and is kept in the jaxpr.
The pytree structure, the JAX settings that change what is traced (dtype promotion,
x64, matmul precision) and the non-array outputs are part of the kind too.

This module imports nothing of solverkit.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.tree_util as jtu
from jax.core import Tracer

from ._jaxpr_rewrite import cse, dce
from ._vma_eval import _eval_jaxpr


_typeof = getattr(jax, "typeof", None) or jax.core.get_aval  # pyright: ignore

# The settings under which the same Python traces to a different program.
_SETTINGS = (
    "jax_numpy_dtype_promotion",
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
)


def _settings() -> tuple:
    return tuple(getattr(jax.config, name, None) for name in _SETTINGS)


class _Kind(NamedTuple):
    """What a trace depends on: the structure, each leaf's type (a tracer) or the
    leaf itself (anything else), and the settings."""

    treedef: Any
    leaves: tuple  # per leaf: (True, type) for a tracer, (False, leaf) otherwise
    settings: tuple

    def matches(self, other: "_Kind") -> bool:
        if self.settings != other.settings or len(self.leaves) != len(other.leaves):
            return False
        for (tracer, a), (other_tracer, b) in zip(self.leaves, other.leaves):
            if tracer != other_tracer or (a != b if tracer else a is not b):
                return False
        return self.treedef == other.treedef


class _Entry(NamedTuple):
    kind: _Kind
    jaxpr: jex.ClosedJaxpr
    inputs: tuple[int, ...]  # the leaves that are the jaxpr's inputs, in order
    out_tree: Any
    out_static: tuple  # per output leaf: its value if not an array, else None
    outputs: tuple[int, ...]  # the output leaves the jaxpr computes, in order
    # The same with repeated equations merged (`cse`), made on first use.
    merged: list


def _kind(args: tuple) -> tuple[_Kind, list]:
    leaves, treedef = jtu.tree_flatten(args)
    kinds = tuple(
        (True, _typeof(x)) if isinstance(x, Tracer) else (False, x) for x in leaves
    )
    return _Kind(treedef, kinds, _settings()), leaves


class Traced:
    """`fn`, traced to a jaxpr once per kind of input (see the module's docstring)
    and evaluated from that jaxpr on later calls.

    Where `fn` (or a non-array leaf of its arguments, compared by identity, such as
    a controller's norm) closes over a value of an enclosing trace, the traced jaxpr
    holds that tracer as a constant and is kept like any other: evaluated, it binds
    the same tracer the Python would. A call matches a kept program only with the
    same non-array objects (`is`), so the same closures; the callers make a
    `Traced` of a module-level function for each solve, so its programs live inside
    the trace of that solve (and its backward pass), where those tracers are live.
    (Such programs used to be dropped, so that each call traced `fn` twice: a
    vmapped BDF gradient with a norm closing over a traced value traced the norm
    113 times against 15, 18.6 against 4.1 s of tracing.)

    `simplified(*args)` evaluates the program with its repeated equations merged
    (`_jaxpr_rewrite.cse`): the same values, bit for bit, but where that program is
    then differentiated in reverse mode, the cotangents of the merged equations are
    summed in another order. So it serves the programs that are not (a loop's
    step, the backward pass's recomputation, a pullback already transposed).

    **Arguments:**

    - `fn`: a function of pytrees, returning a pytree; called as `fn(*args)`.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self._entries: list[_Entry] = []

    def entry(self, *args) -> _Entry:
        """The traced jaxpr for `args` (traced now if new)."""
        kind, leaves = _kind(args)
        for entry in self._entries:
            if entry.kind.matches(kind):
                return entry
        entry = self._trace(kind, leaves)
        self._entries.append(entry)
        return entry

    def _trace(self, kind: _Kind, leaves: list) -> _Entry:
        inputs = tuple(i for i, (tracer, _) in enumerate(kind.leaves) if tracer)
        outs: list = []

        def flat(*values):
            full = list(leaves)
            for i, x in zip(inputs, values):
                full[i] = x
            out_leaves, out_tree = jtu.tree_flatten(
                self.fn(*jtu.tree_unflatten(kind.treedef, full))
            )
            outs.append(out_tree)
            arrays = [i for i, x in enumerate(out_leaves) if isinstance(x, jax.Array)]
            static = tuple(None if i in arrays else x for i, x in enumerate(out_leaves))
            outs.append((static, tuple(arrays)))
            return [out_leaves[i] for i in arrays]

        jaxpr = jax.make_jaxpr(flat)(*[leaves[i] for i in inputs])
        pruned = dce(jaxpr.jaxpr)  # nothing outside reads what nothing inside uses
        if pruned is not jaxpr.jaxpr:
            jaxpr = jex.ClosedJaxpr(pruned, jaxpr.consts)
        out_tree, (static, outputs) = outs
        return _Entry(kind, jaxpr, inputs, out_tree, static, outputs, [])

    def __call__(self, *args):
        return self._evaluate(args, merged=False)

    def simplified(self, *args):
        """`self(*args)`, from the program with its repeated equations merged (see
        the class's docstring)."""
        return self._evaluate(args, merged=True)

    def _evaluate(self, args: tuple, merged: bool):
        entry = self.entry(*args)
        jaxpr = entry.jaxpr.jaxpr
        if merged:
            if not entry.merged:
                entry.merged.append(dce(cse(jaxpr)))
            jaxpr = entry.merged[0]
        leaves = jtu.tree_leaves(args)
        values = _eval_jaxpr(
            jaxpr, entry.jaxpr.consts, *[leaves[i] for i in entry.inputs]
        )
        out = list(entry.out_static)
        for i, x in zip(entry.outputs, values):
            out[i] = x
        return jtu.tree_unflatten(entry.out_tree, out)

    def passed_through(self, *args) -> tuple[int | None, ...]:
        """Per output leaf of `fn(*args)`: the index of the input leaf (of the
        flattened `args`) that it is, the same variable of the traced program, or
        `None` (computed, or not an array). Traces `fn` if it has not been traced
        for `args` yet."""
        entry = self.entry(*args)
        invar = {id(v): i for v, i in zip(entry.jaxpr.jaxpr.invars, entry.inputs)}
        sources: list[int | None] = [None] * len(entry.out_static)
        for i, var in zip(entry.outputs, entry.jaxpr.jaxpr.outvars):
            sources[i] = invar.get(id(var))
        return tuple(sources)
