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

from .._closure._unvmap import unvmap_any


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
        lambda: jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), make(), old),
        lambda: old,
    )


def start(jac: Any, factor: Any, scale: Array) -> Cache:
    """A cache holding a new `jac` and `factor` (made for `scale`; 0 with a
    placeholder `factor` of the right shapes, made at the first step)."""
    zero = jnp.asarray(0, jnp.int32)
    return Cache(jac, zero, factor, scale, zero)


def refresh(
    cache: Cache,
    scale: Array,
    new_jac: Callable[[], Any],
    new_factor: Callable[[Any, Array], Any],
) -> tuple[Cache, Array]:
    """The cache for a step of scale `scale`, by the rules above.

    **Arguments:**

    - `cache`: the last step's cache.
    - `scale`: this step's (without derivatives).
    - `new_jac`: makes a Jacobian for this step.
    - `new_factor`: makes the factorisation of a Jacobian for a scale.

    **Returns:** `(cache, refactored)`, `refactored` whether the factorisation is
    new for this step.
    """
    stale = cache.jac_age >= JACOBIAN_STEPS
    jac = maybe(stale, new_jac, cache.jac)
    old = cache.scale
    change = jnp.abs(scale - old) > REFACTOR_CHANGE * jnp.abs(old)
    refactor = stale | (old == 0) | change | (cache.factor_age >= REFACTOR_STEPS)
    factor = maybe(refactor, lambda: new_factor(jac, scale), cache.factor)
    zero = jnp.zeros_like(cache.jac_age)
    return (
        Cache(
            jac,
            jnp.where(stale, zero, cache.jac_age),
            factor,
            jnp.where(refactor, scale, old),
            jnp.where(refactor, zero, cache.factor_age),
        ),
        refactor,
    )


def retry(
    cache: Cache,
    refactored: Array,
    failed: Array,
    scale: Array,
    new_jac: Callable[[], Any],
    new_factor: Callable[[Any, Array], Any],
    attempt: Callable[[Any], PyTree],
    out: PyTree,
) -> tuple[Cache, PyTree, Array]:
    """One more try of a failed iteration, with a new Jacobian and factorisation,
    where the failure may be theirs (not both made for this step).

    **Arguments:**

    - `cache`, `refactored`: as `refresh` returned them.
    - `failed`: whether the try failed.
    - `scale`, `new_jac`, `new_factor`: as for `refresh`.
    - `attempt`: the try again, from a factorisation; returns a pytree like `out`.
    - `out`: the failed try's output.

    **Returns:** `(cache, out, retried)`.
    """
    again = failed & ((cache.jac_age > 0) | ~refactored)

    def fresh():
        jac = new_jac()
        factor = new_factor(jac, scale)
        return start(jac, factor, scale), attempt(factor)

    cache, out = maybe(again, fresh, (cache, out))
    return cache, out, again


def advance(cache: Cache) -> Cache:
    """The cache one step older."""
    return cache._replace(jac_age=cache.jac_age + 1, factor_age=cache.factor_age + 1)
