"""`ODETerm`: the vector field of an ODE."""

from collections.abc import Callable

import equinox as eqx
from jaxtyping import PyTree


class ODETerm(eqx.Module):
    """The right-hand side `dy/dt = vector_field(t, y, args)` of an ODE.

    **Arguments:**

    - `vector_field`: any callable `(t, y, args) -> dy/dt` returning a pytree with the
        structure, shapes and dtypes of `y`. It may close over anything: JAX arrays of
        any dtype, tracers of enclosing `vmap`/`grad`/`jit`, equinox Modules.
    """

    vector_field: Callable[..., PyTree]

    def vf(self, t, y, args) -> PyTree:
        """Evaluate the vector field."""
        return self.vector_field(t, y, args)
