"""`ensemble_solve`'s input checks, before tracing: the batch, the lanes, the
per-trajectory times and what is not supported."""

import contextlib
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._errors import BadInputError, concrete, UnsupportedError
from .._event import Event, split_events, with_context
from .._saveat import is_sub, SaveAt


def batch_size(y0: PyTree, args: PyTree) -> int:
    """The length of the leading axis that every array leaf of `y0` and `args`
    shares."""
    sizes = {}
    for name, tree in (("y0", y0), ("args", args)):
        for path, leaf in jtu.tree_leaves_with_path(tree):
            if name == "y0" or eqx.is_array(leaf):
                shape = np.shape(leaf)
                where_ = f"`{name}{jtu.keystr(path)}`"
                if len(shape) == 0:
                    raise ValueError(
                        "ensemble_solve takes a batch of problems: every array leaf "
                        f"of `y0` and `args` needs a leading batch axis, but {where_} "
                        "is a scalar. (Values shared by every trajectory can be "
                        "closed over by the vector field, or passed in `args` as "
                        "Python numbers.)"
                    )
                sizes[where_] = shape[0]
    if not sizes:
        raise ValueError("ensemble_solve needs `y0` with at least one array leaf.")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            "Every array leaf of `y0` and `args` must have the same leading (batch) "
            f"axis, got {listed}."
        )
    (size,) = set(sizes.values())
    if size < 1:
        raise ValueError("ensemble_solve needs at least one trajectory, got 0.")
    return int(size)


def positive_int(name: str, value) -> int | None:
    """`value` (an argument called `name`) checked to be a positive int or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be a positive int or None, got {value!r}.")
    if value < 1:
        raise ValueError(f"`{name}` must be a positive int or None, got {value}.")
    return int(value)


class PerTrajectory(NamedTuple):
    """The times given one per trajectory (leading axis: trajectory), `None` where
    shared: `t0`, `t1`, and each `SubSaveAt`'s `ts` (in the order of
    `Problem.saves`). In user time on entry, in internal time in the loop."""

    t0: Any  # Array or None
    t1: Any
    ts: tuple


def _per_trajectory(name: str, t, batch: int):
    """`t` as a scalar (shared) or an array of shape `(batch,)`: `(shared, None)` or
    `(first, t)`."""
    shape = jnp.shape(t)
    if shape == ():
        return t, None
    if shape != (batch,):
        raise ValueError(
            f"`{name}` must be a scalar (the same for every trajectory) or have shape "
            f"(N,) = ({batch},) (one per trajectory), got shape {shape}."
        )
    t = t if isinstance(t, jax.Array) else np.asarray(t)
    return t[0], t


def split_times(t0, t1, saveat: SaveAt, batch: int):
    """Check the shapes of `t0`, `t1` and `SaveAt(ts=...)`, and split them into the
    times of one trajectory (to build the `Problem` with; their values are replaced
    lane by lane) and the `PerTrajectory` times (user time, `None` where shared).
    Every trajectory must run in one direction: checked here where the times are
    known, else at run time (`_check_direction`)."""
    t0_one, t0s = _per_trajectory("t0", t0, batch)
    t1_one, t1s = _per_trajectory("t1", t1, batch)
    subs, tree = jtu.tree_flatten(saveat.subs, is_leaf=is_sub)
    rows, per = [], []
    for k, sub in enumerate(subs):
        ts = sub.ts
        if ts is None or ts.ndim == 1:
            rows.append(sub)
            per.append(None)
            continue
        name = "saveat.ts" if is_sub(saveat.subs) else f"saveat.subs[{k}].ts"
        if ts.shape[0] != batch:
            raise ValueError(
                f"`{name}` must have shape (T,) (the same times for every trajectory) "
                f"or (N, T) = ({batch}, T) (one row per trajectory), got shape "
                f"{tuple(ts.shape)}."
            )
        rows.append(eqx.tree_at(lambda s: s.ts, sub, ts[0]))
        per.append(ts)
    times = PerTrajectory(t0s, t1s, tuple(per))
    if all(x is None for x in jtu.tree_leaves(times)):
        return t0, t1, saveat, None
    c0, c1 = concrete(t0), concrete(t1)
    if c0 is not None and c1 is not None:
        c0, c1 = np.broadcast_to(c0, (batch,)), np.broadcast_to(c1, (batch,))
        sign = np.sign(c1 - c0)
        if np.any(sign > 0) and np.any(sign < 0):
            i, j = int(np.argmax(sign > 0)), int(np.argmax(sign < 0))
            raise ValueError(
                "ensemble_solve needs every trajectory to run in one direction "
                f"(`t1 - t0` of one sign, or zero), but trajectory {i} runs forwards "
                f"(t0={c0[i]}, t1={c1[i]}) and trajectory {j} backwards (t0={c0[j]}, "
                f"t1={c1[j]}). Solve the two groups with separate calls."
            )
        # Build the `Problem` from a trajectory that sets the direction.
        first = int(np.argmax(sign != 0))
        t0_one, t1_one = c0[first], c1[first]
        for k, sub in enumerate(subs):
            _check_save_times(sub.ts, c0, c1, k, is_sub(saveat.subs))
    subs = jtu.tree_unflatten(tree, rows)
    return t0_one, t1_one, eqx.tree_at(lambda s: s.subs, saveat, subs), times


def _check_save_times(ts, c0, c1, k: int, single: bool) -> None:
    """Known save times lie in each trajectory's `[t0, t1]`, in its direction."""
    cts = concrete(ts)
    if cts is None or cts.size == 0:
        return
    cts = np.broadcast_to(cts, (len(c0),) + cts.shape[-1:])
    lo, hi = np.minimum(c0, c1)[:, None], np.maximum(c0, c1)[:, None]
    outside = np.any((cts < lo) | (cts > hi), axis=1)
    backwards = np.any(np.diff(cts, axis=1) * (c1 - c0)[:, None] < 0, axis=1)
    name = "saveat.ts" if single else f"saveat.subs[{k}].ts"
    if np.any(outside):
        i = int(np.argmax(outside))
        raise BadInputError(
            f"`{name}` must lie between t0 and t1 of each trajectory: trajectory {i} "
            f"has [t0, t1] = [{c0[i]}, {c1[i]}] and save times from {cts[i].min()} to "
            f"{cts[i].max()}."
        )
    if np.any(backwards):
        i = int(np.argmax(backwards))
        raise BadInputError(
            f"`{name}` must be increasing or decreasing, in the direction from t0 to "
            f"t1: not so for trajectory {i}."
        )


def _depends_on_inputs(closed: jex.ClosedJaxpr) -> bool:
    """Whether any output of `closed` depends on any of its inputs (an equation
    whose inputs do makes all its outputs do)."""
    jaxpr = closed.jaxpr
    seen = set(jaxpr.invars)
    used = lambda v: not isinstance(v, jex.Literal) and v in seen  # noqa: E731
    for eqn in jaxpr.eqns:
        if any(used(v) for v in eqn.invars):
            seen.update(eqn.outvars)
    return any(used(v) for v in jaxpr.outvars)


def check_event_context(event, context: dict, saveat: SaveAt, y0, args) -> None:
    """With per-trajectory times, an `Event`'s conditions must not read the `t0`,
    `t1` or `saveat` that diffrax passes them as keywords: they are bound once, for
    every trajectory, when the conditions are converted."""
    event, _ = split_events(event)
    if not isinstance(event, Event):
        return
    subs, tree = jtu.tree_flatten(saveat.subs, is_leaf=is_sub)
    t, y, a = jnp.asarray(context["t0"]), y0, args

    def conditions(t0, t1, ts):
        new = [
            sub if x is None else eqx.tree_at(lambda s: s.ts, sub, x)
            for sub, x in zip(subs, ts)
        ]
        sv = eqx.tree_at(lambda s: s.subs, saveat, jtu.tree_unflatten(tree, new))
        kw = dict(context, t0=t0, t1=t1, saveat=sv)
        return [
            with_context(f, **kw)(t, y, a)
            for f in jtu.tree_leaves(event.cond_fn, is_leaf=callable)
        ]

    ts = [s.ts for s in subs]
    closed = jax.make_jaxpr(conditions)(context["t0"], context["t1"], ts)
    if _depends_on_inputs(closed):
        raise UnsupportedError(
            "With per-trajectory `t0`, `t1` or `SaveAt(ts=...)`, an Event's cond_fn "
            "can't use its `t0`, `t1` or `saveat` keyword arguments (ensemble_solve "
            "binds them once, for every trajectory): pass what it needs in `args`."
        )


def check_unsupported(saveat: SaveAt) -> None:
    if saveat.dense:
        raise UnsupportedError(
            "ensemble_solve does not support SaveAt(dense=True) (dense output); for "
            "that, use `jax.vmap(diffeqsolve)` (a lockstep batch) instead of "
            "ensemble_solve."
        )


@contextlib.contextmanager
def reverse_only():
    """Turn JAX's error for forward-mode autodiff of the `custom_vjp` around the
    lanes into one that says what to use instead."""
    try:
        yield
    except TypeError as e:
        text = str(e)
        if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
            raise UnsupportedError(
                "ensemble_solve supports reverse-mode differentiation (jax.grad, "
                "jax.vjp) only, not forward mode (jax.jvp, jax.jacfwd): for forward "
                "mode differentiate a lockstep batch, `jax.vmap(diffeqsolve)` with "
                f"`adjoint=DirectAdjoint()`. (JAX said: {e})"
            ) from None
        raise
