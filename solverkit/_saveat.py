"""`SaveAt`: what a solve saves."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np


def save_y(t, y, args):
    """The default `SaveAt.fn`: save the state itself."""
    return y


def _ts(ts):
    return None if ts is None else jnp.asarray(ts)


class SaveAt(eqx.Module):
    """What [`solverkit.diffeqsolve`][] saves.

    **Arguments:**

    - `t0`, `t1`: save the initial / final point.
    - `ts`: save at these (monotonic) times, by dense interpolation.
    - `steps`: `True` to save after every accepted step; an int `n` to save after
        every `n`-th accepted step. Unused slots are padded with `inf`.
    - `fn`: `fn(t, y, args)` chooses what is saved (default: `y`).
    - `dense`: keep a dense solution for `Solution.evaluate` / `derivative`.
    - `solver_state`, `controller_state`, `made_jump`: also return these final states.
    """

    t0: bool = False
    t1: bool = False
    ts: Any = eqx.field(default=None, converter=_ts)
    steps: bool | int = False
    fn: Callable = save_y
    dense: bool = False
    solver_state: bool = False
    controller_state: bool = False
    made_jump: bool = False

    def __check_init__(self):
        if self.ts is not None:
            if jnp.ndim(self.ts) != 1:
                raise ValueError(
                    f"SaveAt(ts=...) must be a 1-D array of times, got shape "
                    f"{jnp.shape(self.ts)}."
                )
            try:
                ts = np.asarray(self.ts)
            except Exception:  # traced: checked at run time
                ts = None
            if ts is not None and ts.size > 1:
                d = np.diff(ts)
                if not (np.all(d >= 0) or np.all(d <= 0)):
                    raise ValueError("SaveAt(ts=...) must be monotonic.")
        steps = self.steps
        if isinstance(steps, bool) or steps is None:
            pass
        elif not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(
                f"SaveAt(steps=...) must be a bool or an int >= 1, got {steps!r}."
            )
        if self.ts is not None and self.every:
            raise ValueError("SaveAt can't save at both `ts` and `steps`: pick one.")

    @property
    def every(self) -> int:
        """0 if not saving steps, else save every `every`-th accepted step."""
        if self.steps is True:
            return 1
        if self.steps is False or self.steps is None:
            return 0
        return int(self.steps)
