"""Errors raised for bad input, before anything is traced.

Each is a `ValueError`, as solverkit promises, and also the exception class diffrax
raises for the same input (often only at run time), so code written against either
library catches it.
"""

import numpy as np


class BadInputError(ValueError, RuntimeError):
    """An input that can't be solved as given (e.g. `SaveAt(ts=...)` outside
    `[t0, t1]`)."""


class StructureError(TypeError, ValueError):
    """An output with the wrong pytree structure (e.g. a vector field's, for `y0`):
    a `TypeError`, and the `ValueError` diffrax raises."""


class UnsupportedError(ValueError, NotImplementedError):
    """A combination of options that solverkit does not support (e.g.
    `BacksolveAdjoint` with `SaveAt(steps=True)`)."""


def concrete(x):
    """`x` as a NumPy value if it is known now (not traced), else `None`: what can be
    checked before tracing."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except Exception:  # a tracer
        return None
