"""Forward sensitivities inside the kernel: the state carries, besides its `n`
components, `n` more per direction `k`, the derivative `S_k` of the state along that
direction, and the vector field becomes `(f(y), J_y f S_k + ∂f/∂p_k, ...)`.

The `vmap` path stops gradients at every step-size choice (`_controller`, `_loop`),
so its step times have no derivative and its tangent is the same Runge–Kutta steps
applied to the tangent: this system, stepped on the primal's steps (the controller
and the finiteness check read the first `n` components only).

A direction is static: `("state", j)` (`S_k` starts at the unit vector `e_j`, no
parameter moves), `("arg", i, c)` (component `c` of per-trajectory argument `i`) or
`("const", i, c)` (element `c` of the field's closed-over value `i`); those two
start at `S_k = 0`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._scalarize import reverse_mode_nans


Direction = tuple


def _zero(x):
    """A zero tangent for `x`: `float0` for integers and booleans."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _unit(x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise ValueError("a direction along an integer or boolean value")
    return jnp.ones_like(x)


def initial(direction: Direction, j: int, like):
    """`S_k`'s component `j` at `t0`: 1 for `("state", j)`, else 0 (as `like`)."""
    one = direction[0] == "state" and direction[1] == j
    return jnp.full_like(like, 1 if one else 0)


def augment(
    field: Callable, n: int, directions: tuple, args: list, consts: list
) -> Callable:
    """The augmented field `(t, tiles) -> tiles` of the `n + n K` components.

    **Arguments:**

    - `field`: `(t, y tiles, arg tiles, const elements) -> dy/dt tiles` (a
        `LaneField`).
    - `n`: the state's components; `directions`: the `K` directions (see above).
    - `args`: each per-trajectory argument's tiles; `consts`: the field's shared
        values, object arrays of scalars.

    **Returns:**

    The field of the state and its `K` tangents, concatenated.
    """
    shapes = [c.shape for c in consts]
    flat = [list(c.flat) for c in consts]

    def call(t, y, a, c):
        elements = []
        for values, shape in zip(c, shapes):
            out = np.empty(shape, dtype=object)
            for index, v in zip(np.ndindex(shape), values):
                out[index] = v
            elements.append(out)
        return field(t, y, a, elements)

    def tangents(direction: Direction):
        da = [[_zero(x) for x in arg] for arg in args]
        dc = [[_zero(x) for x in c] for c in flat]
        kind = direction[0]
        if kind == "arg":
            da[direction[1]][direction[2]] = _unit(args[direction[1]][direction[2]])
        elif kind == "const":
            dc[direction[1]][direction[2]] = _unit(flat[direction[1]][direction[2]])
        elif kind != "state":
            raise ValueError(f"unknown direction {direction!r}")
        return da, dc

    seeds = [tangents(d) for d in directions]

    def augmented(t, ys: list) -> list:
        y = ys[:n]
        out = list(call(t, y, args, flat))
        for k, (da, dc) in enumerate(seeds):
            s = ys[n * (k + 1) : n * (k + 2)]
            with reverse_mode_nans():
                _, ds = jax.jvp(
                    lambda y, a, c: call(t, y, a, c), (y, args, flat), (s, da, dc)
                )
            out += list(ds)
        return out

    return augmented
