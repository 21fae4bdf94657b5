"""Interpolations of data over time, for vector fields driven by data (a forcing term,
a dosing schedule, a control): diffrax's `LinearInterpolation`, `CubicInterpolation`,
`backward_hermite_coefficients` and `rectilinear_interpolation`.

They are equinox Modules whose leaves are the data, so a vector field may close over
one and be vmapped or differentiated with respect to the data like any other value.

Missing data is `NaN`. Rather than scanning over time, the fill-in rules below find,
for every time and channel, the index of the last observation at or before it and of
the first at or after it (a cumulative max / min of indices), and gather.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, ArrayLike, PyTree, Real

from .._errors import concrete


def _as_arrays(tree: PyTree) -> PyTree:
    return jtu.tree_map(jnp.asarray, tree)


def _check_ts(ts, name: str = "ts") -> Array:
    """`ts` as a 1-d array of at least two strictly increasing times.

    Checked in Python when `ts` is concrete, else at run time with `eqx.error_if`.
    """
    ts = jnp.asarray(ts)
    if ts.ndim != 1 or ts.shape[0] < 2:
        raise ValueError(
            f"`{name}` must be a 1-dimensional array of at least two times, got shape "
            f"{ts.shape}."
        )
    if not jnp.issubdtype(ts.dtype, jnp.floating):
        ts = ts.astype(jnp.result_type(float))
    increasing = ts[1:] > ts[:-1]  # NaN times fail too
    known = concrete(increasing)
    if known is not None:
        if not known.all():
            raise ValueError(f"`{name}` must be strictly increasing (and not NaN).")
        return ts
    return eqx.error_if(ts, ~jnp.all(increasing), f"`{name}` must be increasing.")


def _check_leading(tree: PyTree, length: int, what: str) -> None:
    for i, leaf in enumerate(jtu.tree_leaves(tree)):
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != length:
            raise ValueError(
                f"Each leaf of `{what}` must have {length} entries along its first "
                f"axis; leaf {i} has shape {jnp.shape(leaf)}."
            )


class AbstractGlobalInterpolation(eqx.Module):
    """A path through data over `[ts[0], ts[-1]]`, a polynomial on each interval
    between consecutive times; beyond the ends, the end pieces are extended."""

    ts: eqx.AbstractVar[Real[Array, " times"]]

    def _locate(self, t, left: bool) -> tuple[Array, Array]:
        """The interval holding `t` and `t` minus the interval's start."""
        side = "left" if left else "right"
        index = jnp.searchsorted(self.ts, t, side=side) - 1
        index = jnp.clip(index, 0, self.ts.shape[0] - 2)
        with jax.numpy_dtype_promotion("standard"):
            return index, t - self.ts[index]

    @property
    def t0(self) -> Array:
        """The first time of the data."""
        return self.ts[0]

    @property
    def t1(self) -> Array:
        """The last time of the data."""
        return self.ts[-1]


def _difference(a: PyTree, b: PyTree) -> PyTree:
    return jtu.tree_map(lambda x, y: x - y, a, b)


class LinearInterpolation(AbstractGlobalInterpolation):
    """Piecewise linear interpolation of data `ys` observed at times `ts`.

    **Arguments:**

    - `ts`: strictly increasing times, shape `(times,)`.
    - `ys`: pytree of arrays, each of shape `(times, ...)`: the data at those times.
        Fill in missing data first (see [`solverkit.rectilinear_interpolation`][]).
    """

    ts: Real[Array, " times"]
    ys: PyTree[Array]

    def __init__(self, ts: ArrayLike, ys: PyTree[ArrayLike]):
        self.ts = _check_ts(ts)
        self.ys = _as_arrays(ys)
        _check_leading(self.ys, self.ts.shape[0], "ys")

    def evaluate(self, t0, t1=None, left: bool = True) -> PyTree[Array]:
        """The interpolation at `t0`, or its increment `y(t1) - y(t0)` if `t1` is
        given. `left` picks the left- or right-continuous value at a knot (the same
        unless the data has NaNs)."""
        if t1 is not None:
            return _difference(
                self.evaluate(t1, left=left), self.evaluate(t0, left=left)
            )
        index, offset = self._locate(t0, left)
        with jax.numpy_dtype_promotion("standard"):
            fraction = offset / (self.ts[index + 1] - self.ts[index])
            return jtu.tree_map(
                lambda y: y[index] + fraction * (y[index + 1] - y[index]), self.ys
            )

    def derivative(self, t, left: bool = True) -> PyTree[Array]:
        """The slope of the interval holding `t` (at a knot: of the interval to its
        left if `left`, else to its right)."""
        index, _ = self._locate(t, left)
        with jax.numpy_dtype_promotion("standard"):
            dt = self.ts[index + 1] - self.ts[index]
            return jtu.tree_map(lambda y: (y[index + 1] - y[index]) / dt, self.ys)


class CubicInterpolation(AbstractGlobalInterpolation):
    """Piecewise cubic interpolation: on `[ts[i], ts[i + 1]]` the path is
    `d[i] s³ + c[i] s² + b[i] s + a[i]` with `s = t - ts[i]` and
    `d, c, b, a = coeffs`.

    **Arguments:**

    - `ts`: strictly increasing times, shape `(times,)`.
    - `coeffs`: a tuple `(d, c, b, a)` of pytrees (each of the structure of the data)
        of arrays of shape `(times - 1, ...)`; any spline's coefficients will do, for
        example those of [`solverkit.backward_hermite_coefficients`][].
    """

    ts: Real[Array, " times"]
    coeffs: tuple[PyTree[Array], PyTree[Array], PyTree[Array], PyTree[Array]]

    def __init__(self, ts: ArrayLike, coeffs: tuple[PyTree, PyTree, PyTree, PyTree]):
        self.ts = _check_ts(ts)
        if not isinstance(coeffs, (tuple, list)) or len(coeffs) != 4:
            raise ValueError("`coeffs` must be a tuple (d, c, b, a) of four pytrees.")
        self.coeffs = tuple(_as_arrays(c) for c in coeffs)
        structure = jtu.tree_structure(self.coeffs[0])
        if any(jtu.tree_structure(c) != structure for c in self.coeffs):
            raise ValueError("`coeffs` = (d, c, b, a) must share one pytree structure.")
        _check_leading(self.coeffs, self.ts.shape[0] - 1, "coeffs")

    def evaluate(self, t0, t1=None, left: bool = True) -> PyTree[Array]:
        """The interpolation at `t0`, or its increment `y(t1) - y(t0)` if `t1` is
        given. `left` picks the left- or right-continuous value at a knot."""
        if t1 is not None:
            return _difference(
                self.evaluate(t1, left=left), self.evaluate(t0, left=left)
            )
        index, s = self._locate(t0, left)

        def cubic(d, c, b, a):
            return a[index] + s * (b[index] + s * (c[index] + s * d[index]))

        with jax.numpy_dtype_promotion("standard"):
            return jtu.tree_map(cubic, *self.coeffs)

    def derivative(self, t, left: bool = True) -> PyTree[Array]:
        """The derivative of the interpolation at `t` (the left or right derivative
        at a knot)."""
        index, s = self._locate(t, left)

        def slope(d, c, b, a):
            return b[index] + s * (2 * c[index] + s * (3 * d[index]))

        with jax.numpy_dtype_promotion("standard"):
            return jtu.tree_map(slope, *self.coeffs)


# --- Filling in missing data -------------------------------------------------------


def _per_channel(ts: Array, shape: tuple[int, ...]) -> Array:
    """`ts` broadcast against data of `shape`, lined up on the time axis."""
    return jnp.broadcast_to(ts.reshape(ts.shape + (1,) * (len(shape) - 1)), shape)


def _last_observed(observed: Array) -> Array:
    """Index of the last observation at or before each time (-1: none yet)."""
    index = jnp.arange(observed.shape[0]).reshape((-1,) + (1,) * (observed.ndim - 1))
    return jax.lax.cummax(jnp.where(observed, index, -1), axis=0)


def _next_observed(observed: Array) -> Array:
    """Index of the first observation at or after each time (`times`: none left)."""
    size = observed.shape[0]
    index = jnp.arange(size).reshape((-1,) + (1,) * (observed.ndim - 1))
    return jax.lax.cummin(jnp.where(observed, index, size), axis=0, reverse=True)


def _take(values: Array, index: Array) -> Array:
    """`values[index]` per channel, with `index` clipped into range."""
    index = jnp.clip(index, 0, values.shape[0] - 1)
    return jnp.take_along_axis(values, index, axis=0)


def _first_values(ys: Array, replace_nans_at_start) -> Array:
    """`ys`, with a NaN first row replaced by `replace_nans_at_start` if given."""
    if replace_nans_at_start is None:
        return ys
    start = jnp.broadcast_to(jnp.asarray(replace_nans_at_start, ys.dtype), ys.shape[1:])
    return ys.at[0].set(jnp.where(jnp.isnan(ys[0]), start, ys[0]))


def _fill_forward(ys: Array, replace_nans_at_start=None) -> Array:
    """Each NaN replaced by the last observation before it; NaNs before the first
    observation by `replace_nans_at_start` if given."""
    ys = _first_values(ys, replace_nans_at_start)
    return _take(ys, _last_observed(~jnp.isnan(ys)))


def _hermite(t0, y0, m0, t1, y1) -> tuple[Array, Array, Array, Array]:
    """`(d, c, b, a)` of the cubic through `(t0, y0)` with slope `m0` there, and
    through `(t1, y1)` with the slope of the chord there."""
    h = t1 - t0
    excess = (y1 - y0) / h - m0
    return -excess / h**2, 2 * excess / h, m0, y0


def _hermite_leaf(ts, ys, deriv0, replace_nans_at_start, fill_forward_nans_at_end):
    """Backward Hermite coefficients `(d, c, b, a)` of one leaf `ys`, shape
    `(times, ...)`; each coefficient has shape `(times - 1, ...)`."""
    size = ys.shape[0]
    dtype = jnp.result_type(ts.dtype, ys.dtype, float)
    ts = _per_channel(ts, ys.shape).astype(dtype)
    ys = _first_values(ys.astype(dtype), replace_nans_at_start)
    observed = ~jnp.isnan(ys)
    last, following = _last_observed(observed), _next_observed(observed)

    def observation(index):  # past the end (index == size): NaN at ts[-1], or ...
        t, y = _take(ts, index), _take(ys, index)
        if fill_forward_nans_at_end:  # ... the last observation from ts[1] on
            final = last[-1:]
            filler = jnp.where(final >= 1, _take(ys, final), jnp.nan)
            y = jnp.where(index >= size, filler, y)
        return t, y

    # Segment i runs from the last observation p at or before ts[i], with slope m,
    # to the first observation n at or after ts[i + 1].
    p = last[:-1]
    tp, yp = _take(ts, p), _take(ys, p)
    tn, yn = observation(following[1:])
    # m: the backward difference from the observation q before p; at the first
    # observation, the forward difference to the one after it (or `deriv0` at ts[0]).
    q = _take(last, p - 1)
    tq, yq = _take(ts, q), _take(ys, q)
    tf, yf = observation(_take(following, p + 1))
    backward = (p >= 1) & (q >= 0)
    m = jnp.where(
        backward,
        (yp - yq) / jnp.where(backward, tp - tq, 1),  # no 0/0 even where unused
        (yf - yp) / (tf - tp),
    )
    if deriv0 is not None:
        start = jnp.broadcast_to(jnp.asarray(deriv0, dtype), ys.shape[1:])
        m = jnp.where(p == 0, start, m)
    # Where ts[i] is missing, restart the cubic from its value and slope at ts[i],
    # so that the coefficients are relative to ts[i] (a no-op where p == i).
    d, c, b, a = _hermite(tp, yp, m, tn, yn)
    s = ts[:-1] - tp
    value = a + s * (b + s * (c + s * d))
    slope = b + s * (2 * c + s * (3 * d))
    return _hermite(ts[:-1], value, slope, tn, yn)


def _option_leaves(ys: PyTree, option, name: str) -> list:
    """`option` (None, or a pytree of the structure of `ys`) as one entry per leaf."""
    if option is None:
        return [None] * len(jtu.tree_leaves(ys))
    try:
        return jtu.tree_leaves(jtu.tree_map(lambda _, o: o, ys, option))
    except ValueError as e:
        raise ValueError(f"`{name}` must have the pytree structure of `ys`.") from e


def backward_hermite_coefficients(
    ts: Real[ArrayLike, " times"],
    ys: PyTree[ArrayLike],
    *,
    deriv0: PyTree[ArrayLike] | None = None,
    replace_nans_at_start: PyTree[ArrayLike] | None = None,
    fill_forward_nans_at_end: bool = False,
) -> tuple[PyTree[Array], PyTree[Array], PyTree[Array], PyTree[Array]]:
    """Coefficients of cubic Hermite splines with backward differences (Morrill et
    al., 2021, arXiv:2106.11028), for [`solverkit.CubicInterpolation`][].

    On `[ts[i], ts[i + 1]]` the spline starts at `ys[i]` with the slope of the chord
    from the observation before (the backward difference) and ends at `ys[i + 1]`
    with the slope of its own chord, so it is continuously differentiable. Missing
    data (`NaN`) is interpolated over: a gap is bridged by the cubic from the last
    observation before it to the first after it.

    **Arguments:**

    - `ts`: strictly increasing times, shape `(times,)`.
    - `ys`: pytree of arrays of shape `(times, ...)`; `NaN` marks missing data.
    - `deriv0`: the slope at `ts[0]`; by default the forward difference to the first
        observation after `ts[0]`.
    - `replace_nans_at_start`: a value for `ys[0]` where it is `NaN` (else the
        spline is `NaN` up to the first observation).
    - `fill_forward_nans_at_end`: if true, missing data after the last observation
        takes its value (else the spline is `NaN` after it).

    **Returns:**

    `(d, c, b, a)`, each a pytree of the structure of `ys` of arrays of shape
    `(times - 1, ...)`.
    """
    ts = _check_ts(ts)
    ys = _as_arrays(ys)
    leaves, tree = jtu.tree_flatten(ys)
    _check_leading(ys, ts.shape[0], "ys")
    derivs = _option_leaves(ys, deriv0, "deriv0")
    starts = _option_leaves(ys, replace_nans_at_start, "replace_nans_at_start")
    coeffs = _hermite_leaves(ts, leaves, derivs, starts, fill_forward_nans_at_end)
    return tuple(jtu.tree_unflatten(tree, [c[k] for c in coeffs]) for k in range(4))


@eqx.filter_jit  # one compilation, not one per operation, when called eagerly
def _hermite_leaves(ts, leaves, derivs, starts, fill_forward_nans_at_end):
    # Real times against complex data: standard promotion whatever the user's mode.
    with jax.numpy_dtype_promotion("standard"):
        return [
            _hermite_leaf(ts, y, d, r, fill_forward_nans_at_end)
            for y, d, r in zip(leaves, derivs, starts)
        ]


def rectilinear_interpolation(
    ts: Real[ArrayLike, " times"],
    ys: PyTree[ArrayLike],
    replace_nans_at_start: PyTree[ArrayLike] | None = None,
) -> tuple[Array, PyTree[Array]]:
    """Rectilinear interpolation (Morrill et al., 2021, arXiv:2106.11028): time
    advances with the data held, then the data jumps with time held.

    `ts = [t0, t1, t2]`, `ys = [y0, y1, y2]` become
    `[t0, t1, t1, t2, t2]` and `[y0, y0, y1, y1, y2]`. Missing data (`NaN`) is first
    filled forward with the last observation before it.

    **Arguments:**

    - `ts`: strictly increasing times, shape `(times,)`.
    - `ys`: pytree of arrays of shape `(times, ...)`; `NaN` marks missing data.
    - `replace_nans_at_start`: a value for missing data before the first
        observation (else it stays `NaN`).

    **Returns:**

    `(new_ts, new_ys)` with `2 * times - 1` entries along the first axis; new_ts is
    not increasing, so use it as data (say, a channel of a `LinearInterpolation`),
    not as the times of an interpolation.
    """
    ts = _check_ts(ts)
    ys = _as_arrays(ys)
    leaves, tree = jtu.tree_flatten(ys)
    _check_leading(ys, ts.shape[0], "ys")
    starts = _option_leaves(ys, replace_nans_at_start, "replace_nans_at_start")
    return _rectilinear(ts, leaves, starts, tree)


@eqx.filter_jit
def _rectilinear(ts, leaves, starts, tree):
    new_ys = [
        jnp.repeat(_fill_forward(y, r), 2, axis=0)[:-1] for y, r in zip(leaves, starts)
    ]
    return jnp.repeat(ts, 2)[1:], jtu.tree_unflatten(tree, new_ys)


def linear_interpolation(
    ts: Real[ArrayLike, " times"],
    ys: PyTree[ArrayLike],
    *,
    fill_forward_nans_at_end: bool = False,
    replace_nans_at_start: PyTree[ArrayLike] | None = None,
) -> PyTree[Array]:
    """Missing data (`NaN`) filled in by the straight line between the observations
    either side of it, e.g. before a [`solverkit.LinearInterpolation`][].

    **Arguments:**

    - `ts`: strictly increasing times, shape `(times,)`.
    - `ys`: pytree of arrays of shape `(times, ...)`; `NaN` marks missing data.
    - `fill_forward_nans_at_end`: if true, missing data after the last observation
        takes its value (else it stays `NaN`).
    - `replace_nans_at_start`: a value for `ys[0]` where it is `NaN`, from which the
        data up to the first observation is then filled in (else it stays `NaN`).

    **Returns:**

    `ys` with its missing data filled in (same structure, shapes and dtypes).
    """
    ts = _check_ts(ts)
    ys = _as_arrays(ys)
    leaves, tree = jtu.tree_flatten(ys)
    _check_leading(ys, ts.shape[0], "ys")
    starts = _option_leaves(ys, replace_nans_at_start, "replace_nans_at_start")
    filled = _linear_leaves(ts, leaves, starts, fill_forward_nans_at_end)
    return jtu.tree_unflatten(tree, filled)


@eqx.filter_jit
def _linear_leaves(ts, leaves, starts, fill_forward_nans_at_end):
    with jax.numpy_dtype_promotion("standard"):  # real times against complex data
        return [
            _linear_leaf(ts, y, r, fill_forward_nans_at_end)
            for y, r in zip(leaves, starts)
        ]


def _linear_leaf(ts, ys, start, fill_forward_nans_at_end):
    """One leaf of `linear_interpolation`."""
    times = _per_channel(ts, ys.shape).astype(jnp.result_type(ts.dtype, float))
    ys = _first_values(ys, start)
    observed = ~jnp.isnan(ys)
    last, following = _last_observed(observed), _next_observed(observed)
    t0, y0 = _take(times, last), _take(ys, last)
    t1, y1 = _take(times, following), _take(ys, following)
    # Before the first observation y0 is NaN (ys[0] is), after the last y1 is.
    gap = jnp.where(observed, 1, t1 - t0)
    line = y0 + ((times - t0) / gap).astype(ys.dtype) * (y1 - y0)
    if fill_forward_nans_at_end:
        line = jnp.where(following == ys.shape[0], y0, line)
    return jnp.where(observed, ys, line)
