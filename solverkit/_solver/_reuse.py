"""CVODE's rules for reusing a Jacobian and a factorisation across steps (Hindmarsh
et al., SUNDIALS: Suite of nonlinear and differential/algebraic equation solvers, ACM
TOMS 31(3):363-396, 2005, §2.1), shared by `BDF` and the implicit Runge--Kutta
solvers with `reuse_jacobian=True`:

- a new Jacobian after `JACOBIAN_STEPS` steps;
- a new factorisation with a new Jacobian, when the step's scale (`γh`, or BDF's
  `h/α`) changed by more than `REFACTOR_CHANGE` since the last one, after
  `REFACTOR_STEPS` steps, or when there is none yet;
- after a failed iteration with a Jacobian or factorisation not made for this step,
  both anew and one more try, before the step counts as failed.

The Jacobian and factorisation live in a `Cache` that a rejected step keeps (as SciPy's
BDF keeps its Jacobian): they are as good for the retry of a step as for the next
step. Every decision is made per batch element, and a new Jacobian or factorisation
is computed only when some element needs it (`maybe`): under `vmap` a `lax.cond`
would compute both branches for every element.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._closure._unvmap import batched_like, unvmap_any
from .._select import where


REFACTOR_CHANGE = 0.3
REFACTOR_STEPS = 20
JACOBIAN_STEPS = 50


class Cache(NamedTuple):
    """The Jacobian and the factorisation a step leaves for the next ones."""

    jac: Any  # in the linear solver's representation
    jac_age: Array  # int32, steps since `jac` was made
    factor: Any  # the factorisation(s) made from `jac`
    scale: Array  # the step scale `factor` was made for (0: none yet)
    factor_age: Array  # int32, steps since `factor` was made


def maybe(pred: Array, make: Callable[[], PyTree], old: PyTree) -> PyTree:
    """`make()` where `pred`, else `old`; computed only if some batch element needs
    it.

    **Arguments:**

    - `pred`: a boolean scalar (per batch element under `vmap`).
    - `make`: makes the new value, a pytree like `old`.
    - `old`: the value where `pred` is false.

    **Returns:** the new value where `pred`, else `old`.
    """
    return lax.cond(
        unvmap_any(pred),
        lambda: jax.tree_util.tree_map(lambda a, b: where(pred, a, b), make(), old),
        lambda: old,
    )


def start(jac: Any, factor: Any, scale: Array) -> Cache:
    """A cache holding a new `jac` and `factor` (made for `scale`; 0 with a
    placeholder `factor` of the right shapes, made at the first step)."""
    zero = jnp.asarray(0, jnp.int32)
    return Cache(jac, zero, factor, scale, zero)


def attempts(
    cache: Cache,
    scale: Array,
    new_jac: Callable[[], Any],
    new_factor: Callable[[Any, Array], Any],
    attempt: Callable[[Any, PyTree], PyTree],
    failed: Callable[[PyTree], Array],
    init: PyTree,
) -> tuple[Cache, PyTree]:
    """A step's iteration with the cache by the rules above: a first try with the
    cache brought up to date for this step, and, where it failed with a Jacobian or
    factorisation not made for this step, a second try with both anew.

    Both tries are passes of one loop of two (the second computes only where some
    batch element needs it; the loop is differentiable, as the implicit stages
    are), so the try, the Jacobian and the factorisation are each traced once: as a
    first try and a retry they were the largest part of a step's program (BDF's
    gradient on ROBER, the step traced three times: 1,300 of its 9,700 equations).

    **Arguments:**

    - `cache`: the last step's cache (its values are not differentiated).
    - `scale`: this step's (without derivatives).
    - `new_jac`: makes a Jacobian for this step.
    - `new_factor`: makes the factorisation of a Jacobian for a scale.
    - `attempt`: `(factor, out) -> out`: a try with a factorisation, `out` the
        previous try's output (`init` on the first).
    - `failed`: whether a try's output is a failure (a boolean scalar).
    - `init`: an output of `attempt`'s structure, before the first try.

    **Returns:** `(cache, out)`: the cache (ages not yet advanced) and the last
    try's output.
    """
    cache = jax.tree_util.tree_map(lax.stop_gradient, cache)
    stale = cache.jac_age >= JACOBIAN_STEPS
    old = cache.scale
    change = jnp.abs(scale - old) > REFACTOR_CHANGE * jnp.abs(old)
    refactor = stale | (old == 0) | change | (cache.factor_age >= REFACTOR_STEPS)

    def body(_, carry):
        cache, out, need_jac, need_factor, active = carry
        jac = maybe(need_jac, new_jac, cache.jac)
        factor = maybe(need_factor, lambda: new_factor(jac, scale), cache.factor)
        zero = jnp.zeros_like(cache.jac_age)
        cache = Cache(
            jac,
            where(need_jac, zero, cache.jac_age),
            factor,
            where(need_factor, scale, cache.scale),
            where(need_factor, zero, cache.factor_age),
        )
        out = maybe(active, lambda: attempt(factor, out), out)
        # Not after a retry: it made both for this step (age 0, `need_factor`).
        again = active & failed(out) & ((cache.jac_age > 0) | ~need_factor)
        return cache, out, again, again, again

    active = batched_like(jnp.asarray(True), (cache, scale, init))
    carry = (cache, init, stale, refactor, active)
    cache, out, *_ = lax.fori_loop(0, 2, body, carry)
    return cache, out


def advance(cache: Cache) -> Cache:
    """The cache one step older."""
    return cache._replace(jac_age=cache.jac_age + 1, factor_age=cache.factor_age + 1)
