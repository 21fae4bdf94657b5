"""`Event`: stop a solve when a condition fires."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import PyTree


class Event(eqx.Module):
    """Terminate the solve when a condition fires.

    **Arguments:**

    - `cond_fn`: `cond_fn(t, y, args, **kwargs)`, or a pytree of such functions. A
        boolean-valued one fires when it returns `True` after a step; a real-valued one
        fires when it crosses zero, and the solve then ends exactly at the crossing,
        located on the dense interpolant.
    - `root_finder`: an optimistix root finder (e.g. `optx.Newton(rtol, atol)`) to
        locate real-valued crossings; `None` uses a built-in bisection to machine
        precision. Either way the event time is differentiable (implicit function
        theorem).
    - `direction`: `None` for any crossing, `True` for upward (negative to positive),
        `False` for downward crossings only.

    `Solution.event_mask` has the structure of `cond_fn` and says which fired.
    """

    cond_fn: PyTree[Callable[..., Any]]
    root_finder: Any = None
    direction: bool | None = None
