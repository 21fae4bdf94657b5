"""The one map between user time `t` and the loop's internal time `tau`.

A solve runs in internal time `tau = direction * t`, which always increases: a
backwards solve (`t1 < t0`) runs forwards in `-t`, so no solver or controller ever
sees a negative step. `direction` is `None` for a forwards solve (the map is then the
identity and adds no operation) or the array `-1` for a backwards one. The map is its
own inverse, so the same function turns internal time back into user time.
"""

from typing import Any, NamedTuple, overload

import jax.numpy as jnp
from jaxtyping import Array

from ._custom_types import RealScalarLike
from ._select import where


@overload
def flip(direction: Array | None, t: Array) -> Array: ...
@overload
def flip(direction: Array | None, t: RealScalarLike) -> RealScalarLike: ...
def flip(direction: Array | None, t: RealScalarLike):
    """`direction * t`: the internal time of user time `t`, and the user time of
    internal time `t`."""
    return t if direction is None else direction * t


def flip_finite(direction: Array | None, t: RealScalarLike):
    """`flip`, leaving non-finite times (the `inf` padding of saved times) as they
    are."""
    if direction is None:
        return t
    return where(jnp.isfinite(t), direction * t, t)


class Times(NamedTuple):
    """The times of a solve, checked: arrays of one floating dtype, their values where
    known before tracing (else `None`), and the direction of integration."""

    dtype: Any
    t0: Array
    t1: Array
    dt0: Array | None  # internal time (positive)
    known_t0: Any
    known_t1: Any
    known_dt0: Any
    direction: Array | None  # -1 backwards, None forwards (see above)
