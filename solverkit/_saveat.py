"""`SaveAt` and `SubSaveAt`: what a solve saves."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._errors import BadInputError, concrete


def save_y(t, y, args):
    """The default `SaveAt.fn`: save the state itself."""
    return y


def _ts(ts):
    return None if ts is None else jnp.asarray(ts)


class SubSaveAt(eqx.Module):
    """One set of outputs of a solve; several of them (as any pytree) make
    `SaveAt(subs=...)`, and then `Solution.ts` and `Solution.ys` have that pytree
    structure.

    **Arguments:**

    - `t0`, `t1`: save the initial / final point.
    - `ts`: save at these (monotonic) times, by dense interpolation.
    - `steps`: `True` to save after every accepted step; an int `n` to save after
        every `n`-th accepted step.
    - `fn`: `fn(t, y, args)` chooses what is saved (default: `y`).

    The saved rows are in time order (with `ts` and `steps` both, interleaved; a save
    time that coincides with a step end comes first); unused rows are padded with
    `inf` at the end, as in diffrax.
    """

    t0: bool = False
    t1: bool = False
    ts: Any = eqx.field(default=None, converter=_ts)
    steps: bool | int = False
    fn: Callable = save_y

    def __check_init__(self):
        if self.ts is not None:
            # 2-D: one row of times per trajectory, for `ensemble_solve` only
            # (`diffeqsolve` says so).
            if jnp.ndim(self.ts) not in (1, 2):
                raise ValueError(
                    f"SaveAt(ts=...) must be a 1-D array of times, got shape "
                    f"{jnp.shape(self.ts)}."
                )
            ts = concrete(self.ts)  # None when traced: checked at run time
            if ts is not None and ts.shape[-1] > 1:
                d = np.diff(ts, axis=-1)
                if not (np.all(d >= 0) or np.all(d <= 0)):
                    raise BadInputError(
                        "saveat.ts must be increasing or decreasing: "
                        "SaveAt(ts=...) must be monotonic."
                    )
        steps = self.steps
        if isinstance(steps, bool) or steps is None:
            pass
        elif not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(
                f"SaveAt(steps=...) must be a bool or an int >= 1, got {steps!r}."
            )
        if not callable(self.fn):
            raise TypeError(f"SaveAt(fn=...) must be callable, got {self.fn!r}.")

    @property
    def every(self) -> int:
        """0 if not saving steps, else save every `every`-th accepted step."""
        if self.steps is True:
            return 1
        if self.steps is False or self.steps is None:
            return 0
        return int(self.steps)


def is_sub(x) -> bool:
    return isinstance(x, SubSaveAt)


class SaveAt(eqx.Module):
    """What [`solverkit.diffeqsolve`][] saves.

    **Arguments:**

    - `t0`, `t1`, `ts`, `steps`, `fn`: as for [`solverkit.SubSaveAt`][]; unused rows
        are padded with `inf`.
    - `subs`: instead of those, a pytree of `SubSaveAt`s; `Solution.ts` and
        `Solution.ys` then have its structure.
    - `dense`: keep a dense solution for `Solution.evaluate` / `derivative`.
    - `solver_state`, `controller_state`, `made_jump`: also return these final states.
    """

    subs: PyTree[SubSaveAt]
    dense: bool = False
    solver_state: bool = False
    controller_state: bool = False
    made_jump: bool = False

    def __init__(
        self,
        *,
        t0: bool = False,
        t1: bool = False,
        ts: Any = None,
        steps: bool | int = False,
        fn: Callable = save_y,
        subs: PyTree[SubSaveAt] = None,
        dense: bool = False,
        solver_state: bool = False,
        controller_state: bool = False,
        made_jump: bool = False,
    ):
        flat = (t0, t1, ts is not None, steps is not False, fn is not save_y)
        if subs is None:
            subs = SubSaveAt(t0=t0, t1=t1, ts=ts, steps=steps, fn=fn)
        else:
            if any(flat):
                raise ValueError(
                    "Cannot pass both `subs` and any of `t0`, `t1`, `ts`, `steps` to "
                    "`SaveAt` (nor `fn`): pass either `subs=...` or those, not both."
                )
            leaves = jtu.tree_leaves(subs, is_leaf=is_sub)
            if not leaves or not all(is_sub(s) for s in leaves):
                raise ValueError(
                    "SaveAt(subs=...) must be a SubSaveAt or a pytree of SubSaveAts."
                )
        self.subs = subs
        self.dense = dense
        self.solver_state = solver_state
        self.controller_state = controller_state
        self.made_jump = made_jump

    def _single(self, name):
        if not is_sub(self.subs):
            raise AttributeError(
                f"SaveAt(subs=...) with several SubSaveAts has no single `{name}`: "
                f"read it from `saveat.subs`."
            )
        return getattr(self.subs, name)

    # Read-only views of a single `SubSaveAt` (the usual case).
    t0 = property(lambda self: self._single("t0"))
    t1 = property(lambda self: self._single("t1"))
    ts = property(lambda self: self._single("ts"))
    steps = property(lambda self: self._single("steps"))
    fn = property(lambda self: self._single("fn"))
    every = property(lambda self: self._single("every"))
