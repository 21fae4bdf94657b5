"""Events at given times (`TimedEvent`): a dosing schedule, a reset or a switch that
changes the state at known times, and how the loop applies them.

Steps land exactly on each time (as on `jump_ts`); the step that lands there ends
with the state just before the event, which is what every save at that time shows
(the left limit); the event then changes the state and the solver restarts from the
new one, as after a jump. An event at `t0` is applied before the first step; one at
`t1` is not applied (it belongs to a solve that continues from `t1`).
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree

from .._closure._convert import Closure
from .._closure._raising import error_if
from .._errors import BadInputError, concrete
from .._select import where
from .._term import like_state
from .._time import flip


class TimedEvent(eqx.Module):
    """Change the state at given times and continue: a dosing schedule, a periodic
    reset, a switch. Pass it as `diffeqsolve(..., event=...)`, alone or with an
    [`solverkit.Event`][] as `event=(Event(...), TimedEvent(...))`.

    **Arguments:**

    - `ts`: the times, a 1-D array, increasing in the direction from `t0` to `t1`
        (strictly: give two doses at one time as one). Times outside `[t0, t1)` are
        skipped, so one schedule serves a solve split into pieces. Or, instead of
        `ts`:
    - `start`, `interval`, `count`: `count` times from `start`, `interval` apart
        (a repeated dose), as `start + interval * arange(count)`.
    - `amount`: what each event adds to the state: a pytree with the structure,
        shapes and dtypes of `y0` (a Python number may stand for a scalar leaf),
        the same amount each time; or with one more, leading, axis of length
        `len(ts)`: one amount per time. Or, instead of `amount`:
    - `effect`: `effect(t, y, args) -> y_new`, which may close over anything, as the
        vector field may; `y_new` has the structure, shapes and dtypes of `y`.

    Steps land exactly on each time. A value saved at an event's time is the state
    just before it (the left limit), and an event at `t0` is applied before the
    first step (so `SaveAt(t0=True)` shows `y0`). Gradients flow to the times, the
    amounts and whatever the effect closes over, with `RecursiveCheckpointAdjoint`
    or `DirectAdjoint`.
    """

    ts: Array
    amount: PyTree[ArrayLike] | None
    effect: Callable[..., Any] | None
    spaced: bool = eqx.field(static=True)  # given as `start`, `interval`, `count`

    def __init__(
        self,
        ts: ArrayLike | None = None,
        *,
        amount: PyTree[ArrayLike] | None = None,
        effect: Callable[..., Any] | None = None,
        start: ArrayLike | None = None,
        interval: ArrayLike | None = None,
        count: int | None = None,
    ):
        if (amount is None) == (effect is None):
            raise ValueError(
                "TimedEvent needs exactly one of `amount=` (added to the state) and "
                "`effect=` (a function (t, y, args) -> y)."
            )
        if effect is not None and not callable(effect):
            raise TypeError(
                "TimedEvent(effect=...) must be a callable (t, y, args) -> y, got "
                f"{effect!r}."
            )
        self.ts = _event_times(ts, start, interval, count)
        self.spaced = ts is None
        self.amount = amount
        self.effect = effect


def _event_times(ts, start, interval, count) -> Array:
    """`TimedEvent`'s times: `ts`, or `count` of them from `start`, `interval`
    apart; checked."""
    repeated = (start, interval, count)
    if ts is None:
        if interval is None or count is None:
            raise ValueError(
                "TimedEvent needs its times: `ts=`, or `interval=` and `count=` "
                "(with `start=`, default 0)."
            )
        if not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(
                f"TimedEvent(count=...) must be a positive int, got {count!r}."
            )
        start = 0.0 if start is None else start
        if jnp.ndim(start) != 0 or jnp.ndim(interval) != 0:
            raise ValueError(
                "TimedEvent(start=..., interval=...) must be scalars, got shapes "
                f"{jnp.shape(start)} and {jnp.shape(interval)}."
            )
        ts = start + interval * jnp.arange(count)
        ts = checked(
            ts,
            [
                (jnp.isnan(jnp.reshape(start, (1,))), lambda i: "(start=...) is NaN"),
                (
                    jnp.isnan(jnp.reshape(interval, (1,))),
                    lambda i: "(interval=...) is NaN",
                ),
                (
                    jnp.reshape((interval == 0) & (count > 1), (1,)),
                    lambda i: "(interval=...) is 0: give doses at one time as one",
                ),
            ],
        )
    elif any(r is not None for r in repeated):
        raise ValueError(
            "TimedEvent takes either `ts=` or `start=`/`interval=`/`count=`, not both."
        )
    ts = jnp.asarray(ts)
    if ts.ndim != 1 or ts.size == 0:
        raise ValueError(
            f"TimedEvent(ts=...) must be a non-empty 1-D array, got shape {ts.shape}."
        )
    if not (
        jnp.issubdtype(ts.dtype, jnp.floating) or jnp.issubdtype(ts.dtype, jnp.integer)
    ):
        raise TypeError(
            f"TimedEvent(ts=...) must hold real times, got dtype {ts.dtype}."
        )
    known = concrete(ts)
    if known is not None and known.size > 1 and not np.isnan(known).any():
        steps = np.diff(known)
        if not (np.all(steps > 0) or np.all(steps < 0)):
            raise BadInputError(
                "TimedEvent(ts=...) must be strictly increasing (or, for a "
                "backwards solve, strictly decreasing): give events at one time "
                f"as one; got {known}."
            )
    return ts


# Entries of a schedule named one by one in a run-time error message (beyond, the
# message names the kind of fault only): each is a string in the compiled program.
_NAMED_ENTRIES = 256


def checked(x: PyTree, checks: list) -> PyTree:
    """`x`, checked: each check is `(mask, describe)`, a 1-D boolean `mask` of bad
    entries and `describe(i)`, what is wrong with entry `i` (`None`: some entry).
    Known values raise `BadInputError` now; traced ones at run time (the library's
    `error_if`, once for a whole `vmap` batch), naming the first bad entry.

    **Arguments:**

    - `x`: the value the run-time check is attached to (returned).
    - `checks`: the checks, the first failing one reported.

    **Returns:**

    `x`, unchanged in value.
    """
    known = [concrete(mask) for mask, _ in checks]
    if all(k is not None for k in known):
        for k, (_, describe) in zip(known, checks):
            assert k is not None
            if k.any():
                raise BadInputError(f"TimedEvent{describe(int(np.argmax(k)))}.")
        return x
    messages, index, failed = [], jnp.zeros((), jnp.int32), jnp.asarray(False)
    for mask, describe in checks:
        if mask.shape[0] == 0:  # nothing to check (e.g. the order of one time)
            continue
        named = mask.shape[0] <= _NAMED_ENTRIES
        entries = range(mask.shape[0]) if named else [None]
        first = jnp.argmax(mask).astype(jnp.int32) if named else 0
        bad = jnp.any(mask)
        index = where(~failed & bad, len(messages) + first, index)
        failed = failed | bad
        messages += [f"TimedEvent{describe(i)}" for i in entries]
    return error_if(x, failed, index, messages)


def check_like_state(out: PyTree, y0: PyTree, what: str) -> None:
    """A new state (an effect's output, an amount added to the state) must have the
    structure, shapes and dtypes of `y0` exactly (a Python number may stand for a
    leaf of its kind): nothing is broadcast or cast silently.

    **Arguments:**

    - `out`: the value, or its `jax.ShapeDtypeStruct`s.
    - `y0`: the initial state.
    - `what`: the argument, as the error message names it.

    **Raises:**

    `ValueError` naming `what` and the expected structure, shape or dtype.
    """
    y_leaves, y_tree = jtu.tree_flatten(y0)
    out_leaves, out_tree = jtu.tree_flatten(out)
    if out_tree != y_tree:
        raise ValueError(
            f"{what} must have the structure of `y0`: expected {y_tree}, got "
            f"{out_tree}."
        )
    for i, (o, y) in enumerate(zip(out_leaves, y_leaves)):
        o_shape, y_shape = tuple(jnp.shape(o)), tuple(jnp.shape(y))
        o_dtype, y_dtype = jnp.result_type(o), jnp.result_type(y)
        weak = getattr(o, "weak_type", False) or isinstance(o, (int, float, complex))
        kind = jnp.issubdtype(o_dtype, jnp.complexfloating) <= jnp.issubdtype(
            y_dtype, jnp.complexfloating
        )
        if o_shape != y_shape or not (o_dtype == y_dtype or weak and kind):
            raise ValueError(
                f"{what}: leaf {i} must have the state's shape {y_shape} and dtype "
                f"{y_dtype}, got shape {o_shape} and dtype {o_dtype} (nothing is "
                "broadcast or cast)."
            )


class Timed(eqx.Module):
    """A `TimedEvent` inside the engine: times in internal time (increasing), the
    amount with a leading axis or not per leaf (`per_event`), or the converted
    effect."""

    ts: Array
    amount: PyTree[Array] | None
    effect: Closure | None
    per_event: tuple[bool, ...] = eqx.field(static=True)


def prepare(
    timed: TimedEvent, direction, dtype, known_t0, known_t1, y0: PyTree, effect
) -> Timed:
    """`timed` for the engine: its times checked against the direction of the solve
    and flipped to internal time; its amount checked against `y0` (`effect`: the
    converted effect, or `None`)."""
    ts = jnp.asarray(timed.ts, dtype)
    known = concrete(ts)
    if (
        known is not None
        and known.size > 1
        and known_t0 is not None
        and known_t1 is not None
        and known_t0 != known_t1
        and (known[1] - known[0]) * (known_t1 - known_t0) < 0
    ):
        what = (
            "(interval=...) must be positive for a solve forwards in time, negative "
            "backwards"
            if timed.spaced
            else "(ts=...) must run in the direction from t0 to t1"
        )
        raise BadInputError(
            f"TimedEvent{what} ({known_t0} to {known_t1}); got {known}."
        )
    internal = flip(direction, ts)
    if timed.amount is None:
        return Timed(_checked_times(internal, timed.spaced), None, effect, ())
    a_leaves, a_tree = jtu.tree_flatten(timed.amount)
    amounts = [jnp.asarray(a) for a in a_leaves]
    y_shapes = [tuple(jnp.shape(y)) for y in jtu.tree_leaves(y0)]
    if len(y_shapes) != len(amounts):
        y_shapes = [()] * len(amounts)  # the structure's error follows
    per_event = [
        a.ndim == len(s) + 1 and a.shape[0] == ts.size
        for a, s in zip(amounts, y_shapes)
    ]
    each = [
        jax.ShapeDtypeStruct(
            a.shape[1:] if e else a.shape, a.dtype, weak_type=a.weak_type
        )
        for a, e in zip(amounts, per_event)
    ]
    check_like_state(
        jtu.tree_unflatten(a_tree, each),
        y0,
        f"TimedEvent(amount=...) (or each of its {ts.size} rows, one per time)",
    )
    internal, amounts = _checked_times(
        (internal, amounts), timed.spaced, _nan_amounts(amounts, per_event)
    )
    return Timed(internal, jtu.tree_unflatten(a_tree, amounts), None, tuple(per_event))


def _checked_times(x, spaced: bool, more: Sequence = ()):
    """`x` (the internal times, or a tuple that starts with them) checked: no time
    NaN, each after the one before (in the direction of the solve); and `more`
    checks (see `checked`)."""
    ts = x[0] if isinstance(x, tuple) else x
    order = ~(ts[1:] > ts[:-1]) & ~jnp.isnan(ts[1:]) & ~jnp.isnan(ts[:-1])
    if spaced:
        wrong = "(interval=...) must be positive for a solve forwards in time, "
        checks = [
            (jnp.isnan(ts), lambda i: "(start=..., interval=...) gives a NaN time"),
            (jnp.any(order, keepdims=True), lambda i: wrong + "negative backwards"),
        ]
    else:
        checks = [
            (jnp.isnan(ts), lambda i: f"(ts=...): time {i} is NaN"),
            (
                order,
                lambda i: (
                    f"(ts=...): time {i + 1} does not come after time {i} in "
                    "the direction from t0 to t1 (strictly: give doses at one time as "
                    "one)"
                ),
            ),
        ]
    return checked(x, checks + list(more))


def _nan_amounts(amounts: list, per_event: list) -> list:
    """Checks (see `checked`) that no amount is NaN, naming the leaf (and the
    time, for one amount per time)."""
    checks = []
    for j, (a, each) in enumerate(zip(amounts, per_event)):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            continue
        nan = jnp.isnan(a)
        if each:
            mask = jnp.any(jnp.reshape(nan, (a.shape[0], -1)), axis=1)
            describe = lambda i, j=j: f"(amount=...): leaf {j}, at time {i}, is NaN"
        else:
            mask = jnp.any(nan, keepdims=True).reshape((1,))
            describe = lambda i, j=j: f"(amount=...): leaf {j} is NaN"
        checks.append((mask, describe))
    return checks


def next_time(timed: Timed, index: Array) -> Array:
    """The internal time of event `index` (`inf` past the last)."""
    n = timed.ts.shape[0]
    return where(index < n, timed.ts[jnp.minimum(index, n - 1)], jnp.inf)


def first(timed: Timed, t0: Array) -> Array:
    """The index of the first event at or after `t0`."""
    return jnp.searchsorted(timed.ts, t0, side="left").astype(jnp.int32)


def apply(timed: Timed, direction, t: Array, y: PyTree, args: PyTree, index: Array):
    """The state after event `index` at internal time `t`."""
    if timed.effect is not None:
        return like_state(timed.effect(flip(direction, t), y, args), y)
    i = jnp.minimum(index, timed.ts.shape[0] - 1)
    leaves, tree = jtu.tree_flatten(timed.amount)
    y_leaves = jtu.tree_leaves(y)
    out = []
    for a, each, yl in zip(leaves, timed.per_event, y_leaves):
        a = a[i] if each else a
        out.append(yl + a.astype(yl.dtype))
    return jtu.tree_unflatten(tree, out)
