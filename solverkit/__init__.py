"""solverkit: ODE solvers in JAX whose vector fields may close over anything."""

from ._closure import (
    Closure as Closure,
    closure_convert as closure_convert,
    is_closure_converted as is_closure_converted,
)


__version__ = "0.1.0"
