"""`ODETerm`: the vector field of an ODE."""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree


class ODETerm(eqx.Module):
    """The right-hand side `dy/dt = vector_field(t, y, args)` of an ODE.

    **Arguments:**

    - `vector_field`: any callable `(t, y, args) -> dy/dt` returning a pytree with the
        structure, shapes and dtypes of `y`. It may close over anything: JAX arrays of
        any dtype, tracers of enclosing `vmap`/`grad`/`jit`, equinox Modules.

    As in diffrax, `ODETerm[T]` may be written in type annotations, and a term is
    stepped as `vf_prod(t, y, args, contr(t0, t1))`: the vector field times the
    control `t1 - t0`.
    """

    vector_field: Callable[..., PyTree]

    def __class_getitem__(cls, item):
        return cls  # `ODETerm[Array]` in annotations, as diffrax allows

    def vf(self, t, y, args) -> PyTree:
        """Evaluate the vector field."""
        return self.vector_field(t, y, args)

    @staticmethod
    def contr(t0, t1, **kwargs):
        """The control over `[t0, t1]`: the time step `t1 - t0`."""
        return jnp.asarray(t1) - jnp.asarray(t0)

    @staticmethod
    def prod(vf: PyTree, control) -> PyTree:
        """The vector field times the control, leafwise."""
        return jtu.tree_map(lambda v: v * control, vf)

    def vf_prod(self, t, y, args, control) -> PyTree:
        """`prod(vf(t, y, args), control)`."""
        return self.prod(self.vf(t, y, args), control)
