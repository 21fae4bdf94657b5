"""A small 1-D state carried through the loop as its components.

`jax.vmap(diffeqsolve)` over a state of shape `(n,)` runs its loop on `(N, n)`
arrays. On a TPU the solver's work on them is cut into many kernels per step (the
field's `y[i]` reads and `jnp.stack`, the error norm's reduction over `n`), where on
`n` arrays of shape `(N,)` XLA fuses a whole step into two or three: TPU v5e,
float32, Lorenz (`n = 3`), Tsit5, N = 4096 / 65,536 (`python -m
benchmarks.vmap_layout`, `benchmarks/results/tpu-v5-lite/stop50_b`): 1000 fixed
steps 2.48 / 25.6 ms as one array, 0.82 / 3.17 ms as components (13 kernels a step
-> 2); adaptive to t = 1, 1.03 / 4.24 ms -> 0.81 / 1.48 ms (18 -> 3). On a CPU
(N = 64) 0.21 -> 0.15 ms and 1.38 -> 0.95 ms.

So where nothing else reads the state's layout (an explicit Runge-Kutta solver,
no event, no dense output, no solver or controller state handed in or out, the
default norm and scalar tolerances), the loop carries a tuple of `n` scalars: the
solver's arithmetic is element-wise per leaf, the same operations as on the array.
The user's functions still see the array: the vector field gets the components
stacked, and its output is split again (XLA folds the pair away), and a save's `fn`
gets them stacked. The RMS norm sums the components' squares leaf by leaf, which
may round differently from one reduction (the last bit of an error estimate).
"""

import dataclasses

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from ._controller._norm import rms_norm
from ._problem import Problem
from ._solver import AbstractERK, Euler
from ._term import ClosureTerm


# The largest state carried as components (a tuple of more leaves makes a longer
# program to trace and compile for less gain).
MAX_COMPONENTS = 8


class Split(eqx.Module):
    """The state's `size` components, as the loop carries them."""

    size: int = eqx.field(static=True)

    def parts(self, y) -> tuple:
        """The components of a state `y` of shape `(size,)`."""
        return tuple(lax.index_in_dim(y, i, keepdims=False) for i in range(self.size))

    def whole(self, parts):
        """The state of shape `(size,)` from its components."""
        return jnp.stack(parts)


def with_split(problem: Problem, saveat, controller) -> Problem:
    """`problem` with its state as components where the loop may carry it so (a
    small 1-D floating state, an explicit Runge-Kutta solver, nothing else that
    reads the state's layout: events, dense output, states handed in or out, a norm
    of the user's, per-component tolerances); else `problem` itself."""
    y0, terms = problem.y0, problem.terms
    if not (eqx.is_array(y0) and y0.ndim == 1 and 2 <= y0.shape[0] <= MAX_COMPONENTS):
        return problem
    if not jnp.issubdtype(y0.dtype, jnp.inexact) or not isinstance(terms, ClosureTerm):
        return problem
    if not isinstance(problem.solver, (AbstractERK, Euler)):
        return problem
    if problem.event.conds is not None or problem.event.timed is not None:
        return problem
    if problem.resume is not None:
        return problem
    if saveat.dense or saveat.solver_state or saveat.controller_state:
        return problem
    if getattr(controller, "norm", rms_norm) is not rms_norm:
        return problem
    if any(np.ndim(getattr(controller, name, 0)) for name in ("rtol", "atol")):
        return problem
    split = Split(int(y0.shape[0]))
    terms = dataclasses.replace(terms, split=split)
    return dataclasses.replace(problem, y0=split.parts(y0), terms=terms, split=split)
