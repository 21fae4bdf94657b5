"""Errors raised for bad input, before anything is traced.

Each is a `ValueError`, as solverkit promises, and also the exception class diffrax
raises for the same input (often only at run time), so code written against either
library catches it.
"""


class BadInputError(ValueError, RuntimeError):
    """An input that can't be solved as given (e.g. `SaveAt(ts=...)` outside
    `[t0, t1]`)."""


class UnsupportedError(ValueError, NotImplementedError):
    """A combination of options that solverkit does not support (e.g.
    `BacksolveAdjoint` with `SaveAt(steps=True)`)."""
