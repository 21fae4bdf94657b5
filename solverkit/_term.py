"""Terms, diffrax's protocol: `AbstractTerm`, `ODETerm`, `MultiTerm`; and
`ClosureTerm`, the form every term takes inside the engine.

A term is stepped as `vf_prod(t, y, args, contr(t0, t1))`: its vector field times a
control over the step. For an ODE the control is the time step `t1 - t0`.
"""

import abc
import contextlib
import typing
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from ._closure._convert import Closure, closure_convert
from ._custom_types import Args, RealScalarLike, Y
from ._time import flip


class AbstractTerm(eqx.Module):
    """Base class of the terms (diffrax's protocol).

    A subclass defines `vf(t, y, args)`, `contr(t0, t1)` and `prod(vf, control)`;
    `vf_prod` defaults to `prod(vf(t, y, args), control)`. For an ODE,
    `prod(vf(t, y, args), contr(t0, t1))` is the change of `y` over `[t0, t1]` to
    first order.
    """

    def __class_getitem__(cls, item):
        return cls  # `ODETerm[Array]` in annotations, as diffrax allows

    @abc.abstractmethod
    def vf(self, t: RealScalarLike, y: PyTree, args: PyTree) -> PyTree:
        """The vector field at `(t, y)`."""

    @abc.abstractmethod
    def contr(self, t0: RealScalarLike, t1: RealScalarLike, **kwargs) -> PyTree:
        """The control over `[t0, t1]`."""

    @abc.abstractmethod
    def prod(self, vf: PyTree, control: PyTree) -> PyTree:
        """The vector field applied to a control."""

    def vf_prod(
        self, t: RealScalarLike, y: PyTree, args: PyTree, control: PyTree
    ) -> PyTree:
        """`prod(vf(t, y, args), control)`."""
        return self.prod(self.vf(t, y, args), control)

    def is_vf_expensive(
        self, t0: RealScalarLike, t1: RealScalarLike, y: Y, args: Args
    ) -> bool:
        """As diffrax: whether `vf` costs more than `vf_prod` (never, for an ODE)."""
        return False

    @property
    def first_step_from_func(self) -> bool:
        """Whether an adaptive controller chooses the first step (`dt0=None`) from
        the solver's `func`: for an ODE. Otherwise it takes 0.01, as diffrax does
        for terms that are not an `ODETerm`, and never calls `func`."""
        return True


def _leafwise_product(vf: PyTree, control: PyTree) -> PyTree:
    return jtu.tree_map(lambda v: v * control, vf)


class ODETerm(AbstractTerm):
    """The right-hand side `dy/dt = vector_field(t, y, args)` of an ODE.

    **Arguments:**

    - `vector_field`: any callable `(t, y, args) -> dy/dt` returning a pytree with the
        structure and shapes of `y` (a scalar output is broadcast, as in diffrax). It
        may close over anything: JAX arrays of any dtype, tracers of enclosing
        `vmap`/`grad`/`jit`, equinox Modules.
    """

    vector_field: Callable[..., PyTree]

    def vf(self, t: RealScalarLike, y: PyTree, args: PyTree) -> PyTree:
        return self.vector_field(t, y, args)

    def contr(self, t0: RealScalarLike, t1: RealScalarLike, **kwargs) -> Array:
        """The time step `t1 - t0`."""
        return jnp.asarray(t1) - jnp.asarray(t0)

    def prod(self, vf: PyTree, control: PyTree) -> PyTree:
        return _leafwise_product(vf, control)


class MultiTerm(AbstractTerm):
    """Several terms, stepped together: their vector fields and controls are tuples,
    and `prod` sums the terms' products. IMEX solvers take
    `MultiTerm(explicit_term, implicit_term)`; the other solvers integrate the sum.

    **Arguments:**

    - `*terms`: the terms.

    As in diffrax, `MultiTerm[tuple[ODETerm, ODETerm]]` names the structure a solver
    expects (it is the tuple `(ODETerm, ODETerm)`).
    """

    terms: tuple[AbstractTerm, ...]

    def __init__(self, *terms: AbstractTerm):
        if not terms:
            raise ValueError("MultiTerm needs at least one term.")
        for i, term in enumerate(terms):
            if not isinstance(term, AbstractTerm):
                raise TypeError(
                    f"MultiTerm: term {i} must be an AbstractTerm (e.g. ODETerm(f)), "
                    f"got {type(term).__name__}."
                )
        self.terms = tuple(terms)

    def __class_getitem__(cls, item):
        args = typing.get_args(item)
        return MultiTermStructure(args) if args else cls

    def vf(self, t: RealScalarLike, y: PyTree, args: PyTree) -> tuple:
        return tuple(term.vf(t, y, args) for term in self.terms)

    def contr(self, t0: RealScalarLike, t1: RealScalarLike, **kwargs) -> tuple:
        return tuple(term.contr(t0, t1, **kwargs) for term in self.terms)

    def prod(self, vf: tuple, control: tuple) -> PyTree:
        parts = [term.prod(v, c) for term, v, c in zip(self.terms, vf, control)]
        return jtu.tree_map(lambda *xs: sum(xs[1:], xs[0]), *parts)


class MultiTermStructure(tuple):
    """`MultiTerm[tuple[A, B]]`: the tuple `(A, B)`, marked as the structure of a
    `MultiTerm` (a solver whose `term_structure` is a plain tuple takes a plain tuple
    of terms, as diffrax's `SemiImplicitEuler`)."""


def check_term_structure(terms, structure, name: str) -> None:
    """Raise a `ValueError` (diffrax's first words, its `TermAndSolverIncompatible`)
    unless `terms` has the structure of `structure`: a `MultiTerm` of as many terms
    for `MultiTerm[tuple[...]]`, a tuple, list or dict of terms of that structure,
    and a term for a term class."""

    def fail(got: str):
        raise ValueError(
            f"Terms are not compatible with solver! {name} takes terms of the "
            f"structure {structure!r} (for an IMEX solver: MultiTerm(explicit_term, "
            f"implicit_term); for SemiImplicitEuler: a tuple (term_a, term_b)), got "
            f"{got}."
        )

    def describe(x) -> str:
        if isinstance(x, MultiTerm):
            return f"MultiTerm of {len(x.terms)} terms"
        if isinstance(x, (tuple, list)):
            return f"a {type(x).__name__} of {len(x)}"
        return type(x).__name__

    def walk(x, s):
        if isinstance(s, MultiTermStructure):
            if not isinstance(x, MultiTerm) or len(x.terms) != len(s):
                fail(describe(x))
        elif isinstance(s, (tuple, list)):
            if type(x) not in (tuple, list) or len(x) != len(s):
                fail(describe(x))
            for xi, si in zip(x, s):
                walk(xi, si)
        elif isinstance(s, dict):
            if not isinstance(x, dict) or set(x) != set(s):
                fail(describe(x))
            for key in s:
                walk(x[key], s[key])
        elif not isinstance(x, AbstractTerm):
            fail(describe(x))

    walk(terms, structure)


def rate_function(term: AbstractTerm) -> Callable[..., PyTree]:
    """`term` as one function `(t, y, args) -> dy/dt`.

    An `ODETerm`'s own vector field (so that converting it twice hits the conversion
    cache); for any other term, its `vf_prod` with the control of a unit time step,
    which for an ODE term is `dy/dt`.
    """
    if type(term) is ODETerm:
        return term.vector_field
    return _TermRate(term)


class _TermRate(eqx.Module):
    term: AbstractTerm

    def __call__(self, t: RealScalarLike, y: Y, args: Args):
        return self.term.vf_prod(t, y, args, self.term.contr(t, t + 1))


def like_state(out: PyTree, y: PyTree) -> PyTree:
    """A vector field's output in the structure, shapes and dtypes of the state `y`,
    as diffrax accepts it: a scalar (`lambda t, y, args: 0`, a zero term) is broadcast,
    and integer or weakly typed values are cast. `diffeqsolve` has checked before
    tracing that nothing else differs; where nothing does, this adds no operation."""
    y_leaves, y_tree = jtu.tree_flatten(y)
    if jtu.tree_structure(out) != y_tree:  # one scalar for the whole state
        out = jtu.tree_unflatten(y_tree, [out] * len(y_leaves))

    def leaf(o, y: Y):
        o = jnp.asarray(o)
        if o.dtype != y.dtype:
            o = o.astype(y.dtype)
        if o.shape != y.shape:
            o = jnp.broadcast_to(o, y.shape)
        return o

    return jtu.tree_map(leaf, out, y)


class ClosureTerm(AbstractTerm):
    """A term inside the engine: its converted vector field, run in internal time
    `tau = direction * t`, which always increases (a backwards solve runs forwards in
    `-t`). `vf` is `dy/dtau`; the control is the internal time step.
    """

    closure: Closure
    direction: Array | None  # None: forwards in time

    def vf(self, tau: RealScalarLike, y: PyTree, args: PyTree) -> PyTree:
        direction = self.direction
        out = like_state(self.closure(flip(direction, tau), y, args), y)
        if direction is None:
            return out
        return jtu.tree_map(lambda o: o * direction.astype(o.dtype), out)

    def contr(self, t0: RealScalarLike, t1: RealScalarLike, **kwargs) -> Array:
        return jnp.asarray(t1) - jnp.asarray(t0)

    def prod(self, vf: PyTree, control: PyTree) -> PyTree:
        return _leafwise_product(vf, control)


def total_vf(terms: AbstractTerm, t: RealScalarLike, y: PyTree, args: PyTree) -> PyTree:
    """`dy/dt` of converted terms: the sum of a `MultiTerm`'s parts."""
    if not isinstance(terms, MultiTerm):
        return terms.vf(t, y, args)
    parts = terms.vf(t, y, args)
    return jtu.tree_map(lambda *xs: sum(xs[1:], xs[0]), *parts)


# The matrix-product precision a vector field is traced with where the user set none
# (`jax.default_matmul_precision` unset, and a product without `precision=`). A
# TPU's default multiplies float32 in bfloat16 passes: the error estimate then sees
# the products' rounding (about 1e-3 relative), which an rtol below it can't meet.
# Reported on a TPU v5e (a 2-64-64-2 softplus MLP field, Tsit5, PID 1e-3 / 1e-6,
# N = 4096): the default's values and gradients were 0.16 off a float64 reference,
# "highest"'s 9e-3, and "highest" solved twice as fast (fewer rejected steps);
# `python -m benchmarks.neural_matrix --parts precision` measures both. On a CPU
# it changes nothing. Opt out with `jax.default_matmul_precision("default")`.
FIELD_PRECISION = "highest"


def field_precision() -> contextlib.AbstractContextManager:
    """The context a user's vector field is traced in: `FIELD_PRECISION` for its
    matrix products, unless the user set `jax.default_matmul_precision` (globally or
    around the solve), which is kept; a product's own `precision=` always is."""
    if getattr(jax.config, "jax_default_matmul_precision", None) is not None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(FIELD_PRECISION)


def convert_rate(term: AbstractTerm, *example) -> Closure:
    """`term`'s rate function (`rate_function`) converted on `example` arguments
    (`closure_convert`), traced under `field_precision`."""
    with field_precision():
        return closure_convert(rate_function(term), *example)
