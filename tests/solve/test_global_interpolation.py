"""Tests of the interpolations of data: `LinearInterpolation`, `CubicInterpolation`,
`backward_hermite_coefficients`, `rectilinear_interpolation`.

Values against diffrax's (missing data included); then a solve whose vector field
closes over a `CubicInterpolation`, differentiated with respect to the data with each
adjoint, against finite differences, under `jit` and `vmap`.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import assert_tree_allclose, float64, skip_unless_full_matrix

import solverkit as sk


_RNG = np.random.default_rng(0)
_TS = np.concatenate([[0.0], np.sort(_RNG.uniform(0.2, 4.8, 7)), [5.0]])
_YS = _RNG.normal(size=(9, 3, 2))
_TIMES = [-0.5, 0.0, float(_TS[3]), 2.2, 4.9, 5.0, 6.0]  # ends, a knot, outside


def _missing():
    """`_YS` with gaps: at the start, inside, at the end, per channel."""
    ys = _YS.copy()
    ys[0, 0, 0] = ys[3, 0, 0] = np.nan
    ys[0:3, 1, 1] = np.nan
    ys[4:6, 2, 0] = np.nan
    ys[7:, 0, 1] = np.nan
    ys[8, 2, 1] = np.nan
    return ys


def _first_missing():
    ys = _missing()
    ys[0] = np.nan
    return ys


@eqx.filter_jit
def _path_values(path):
    """Values, left and right derivatives and increments to 3.1 at `_TIMES`: one
    compiled function per kind of path and shape of data."""

    def at(t):
        return (
            path.evaluate(t, left=True),
            path.evaluate(t, left=False),
            path.derivative(t, left=True),
            path.derivative(t, left=False),
            jtu.tree_map(lambda a, b: a - b, path.evaluate(3.1), path.evaluate(t)),
        )

    return jax.vmap(at)(jnp.asarray(_TIMES))


def _compare_paths(mine, theirs, rtol=1e-10):
    assert_tree_allclose(_path_values(mine), _path_values(theirs), rtol=rtol, atol=rtol)
    # The increment form of evaluate.
    assert_tree_allclose(
        mine.evaluate(1.2, 3.1),
        jtu.tree_map(lambda a, b: a - b, mine.evaluate(3.1), mine.evaluate(1.2)),
    )


@pytest.mark.parametrize(
    "ys, options",
    [
        pytest.param(_YS, {}, marks=pytest.mark.slow),
        (_missing(), {}),
        pytest.param(
            _missing(),
            {"fill_forward_nans_at_end": True, "deriv0": np.full((3, 2), 0.7)},
            marks=pytest.mark.slow,
        ),
        (
            _first_missing(),
            {
                "replace_nans_at_start": -1.0,
                "fill_forward_nans_at_end": True,
                "deriv0": 0.2,
            },
        ),
    ],
    ids=["complete", "missing", "fill-end-deriv0", "all-options"],
)
# Quick loop: [all-options].
@pytest.mark.quick_cases("all-options")
def test_cubic_against_diffrax(ys, options):
    with float64():
        theirs = diffrax.backward_hermite_coefficients(
            jnp.asarray(_TS), jnp.asarray(ys), **options
        )
        mine = sk.backward_hermite_coefficients(_TS, ys, **options)
        for m, t in zip(mine, theirs):
            np.testing.assert_allclose(m, t, rtol=1e-10, atol=1e-10)
        _compare_paths(
            sk.CubicInterpolation(_TS, mine),
            diffrax.CubicInterpolation(jnp.asarray(_TS), theirs),
        )


def test_linear_and_rectilinear_against_diffrax():
    with float64():
        ys = {"a": _YS, "b": _YS[:, 0, 0]}
        _compare_paths(
            sk.LinearInterpolation(_TS, ys),
            diffrax.LinearInterpolation(
                jnp.asarray(_TS), jtu.tree_map(jnp.asarray, ys)
            ),
        )
        for start in (None, 0.5):
            got = sk.rectilinear_interpolation(_TS, _missing(), start)
            want = diffrax.rectilinear_interpolation(
                jnp.asarray(_TS), jnp.asarray(_missing()), start
            )
            assert_tree_allclose(got, want)


@pytest.mark.parametrize(
    "ys, options",
    [
        (_missing(), {}),
        (_missing(), {"fill_forward_nans_at_end": True}),
        (_first_missing(), {"replace_nans_at_start": -1.0}),
        (
            _first_missing(),
            {"replace_nans_at_start": 0.5, "fill_forward_nans_at_end": True},
        ),
    ],
    ids=["missing", "fill-end", "start", "both"],
)  # fmt: skip
@pytest.mark.quick_cases("both")
def test_linear_interpolation_fills_as_diffrax(ys, options):
    # diffrax's `linear_interpolation` (missing data filled by the line between the
    # observations either side), as a pytree, jitted, and vmapped over data sets.
    with float64():
        ts = jnp.asarray(_TS)
        want = diffrax.linear_interpolation(ts, jnp.asarray(ys), **options)
        got = sk.linear_interpolation(_TS, ys, **options)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        tree = {  # the options as a pytree of the data's structure, a tuple
            k: (v,) if k == "replace_nans_at_start" else v for k, v in options.items()
        }
        fill = lambda y: sk.linear_interpolation(ts, (y,), **tree)[0]  # noqa: E731
        batch = jnp.stack([jnp.asarray(ys), 2 * jnp.asarray(ys)])
        want2 = diffrax.linear_interpolation(ts, batch[1], **options)
        np.testing.assert_allclose(
            jax.jit(jax.vmap(fill))(batch)[1], want2, rtol=1e-12, atol=1e-12
        )
        # A straight line's fill is the line: the gradient of the filled sum with
        # respect to the observations matches diffrax's (zero at the gaps).
        grad = lambda f: jax.grad(lambda y: jnp.nansum(f(y)))  # noqa: E731
        ref = lambda y: diffrax.linear_interpolation(ts, y, **options)  # noqa: E731
        observed = ~np.isnan(ys)
        np.testing.assert_allclose(
            jax.jit(grad(fill))(jnp.asarray(ys))[observed],
            grad(ref)(jnp.asarray(ys))[observed],
            rtol=1e-12,
        )


@pytest.mark.slow
def test_pytree_data_and_attributes():
    ys = {"u": jnp.arange(4.0), "v": jnp.ones((4, 2))}
    ts = jnp.arange(4.0)
    coeffs = sk.backward_hermite_coefficients(ts, ys)
    cubic = sk.CubicInterpolation(ts, coeffs)
    linear = sk.LinearInterpolation(ts, ys)
    assert cubic.t0 == linear.t0 == 0 and cubic.t1 == linear.t1 == 3
    assert cubic.coeffs[0]["v"].shape == (3, 2) and linear.ys is not None
    # The data is the interpolation's leaves; its knots are reproduced exactly.
    assert len(jtu.tree_leaves(cubic)) == 1 + 4 * 2
    assert_tree_allclose(cubic.evaluate(2.0), {"u": 2.0, "v": jnp.ones(2)})
    assert_tree_allclose(linear.derivative(1.5), {"u": 1.0, "v": jnp.zeros(2)})
    # derivative is the derivative of evaluate.
    _, tangent = jax.jvp(cubic.evaluate, (jnp.asarray(1.3),), (jnp.asarray(1.0),))
    assert_tree_allclose(tangent, cubic.derivative(1.3), rtol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="`ts` must be a 1-dimensional"):
        sk.LinearInterpolation(jnp.zeros((2, 2)), jnp.zeros(2))
    with pytest.raises(ValueError, match="strictly increasing"):
        sk.LinearInterpolation(jnp.array([0.0, 2.0, 1.0]), jnp.zeros(3))
    with pytest.raises(ValueError, match="`ys` must have 3 entries"):
        sk.LinearInterpolation(jnp.arange(3.0), jnp.zeros(4))
    with pytest.raises(ValueError, match="`coeffs` must have 2 entries"):
        sk.CubicInterpolation(jnp.arange(3.0), (jnp.zeros(3),) * 4)
    with pytest.raises(ValueError, match=r"\(d, c, b, a\)"):
        sk.CubicInterpolation(jnp.arange(3.0), (jnp.zeros(2),) * 3)
    with pytest.raises(ValueError, match="`deriv0` must have the pytree structure"):
        sk.backward_hermite_coefficients(
            jnp.arange(3.0), {"a": jnp.zeros(3)}, deriv0={"b": 0.0}
        )


# --- Closed over by a vector field, differentiated with respect to the data ---------

_DOSE_TS = np.linspace(0.0, 4.0, 9)  # float64 under `float64()`


def _solve(drive_values, adjoint):
    """A damped oscillator driven by a cubic interpolation of `drive_values`, which
    the vector field closes over; returns the state at t = 4 (fixed steps, which
    compile faster than adaptive ones)."""
    drive = sk.CubicInterpolation(
        _DOSE_TS, sk.backward_hermite_coefficients(_DOSE_TS, drive_values)
    )

    def vector_field(t, y, args):
        x, v = y
        return jnp.stack([v, drive.evaluate(t) - 0.5 * v - 4.0 * x])

    sol = sk.diffeqsolve(
        sk.ODETerm(vector_field),
        sk.Tsit5(),
        t0=0.0,
        t1=4.0,
        dt0=0.05,
        y0=jnp.array([1.0, 0.0]),
        adjoint=adjoint,
        max_steps=128,
    )
    return sol.ys[-1]


@eqx.filter_jit
def _loss_and_grad(drive_values, adjoint):
    loss = lambda d: jnp.sum(_solve(d, adjoint) ** 2)
    return jax.value_and_grad(loss)(drive_values)


_ADJOINTS = {
    "recursive": sk.RecursiveCheckpointAdjoint(),
    "direct": sk.DirectAdjoint(),
    "backsolve": sk.BacksolveAdjoint(),
}


def _loss(drive_values):
    return jnp.sum(_solve(drive_values, sk.RecursiveCheckpointAdjoint()) ** 2)


_batched_loss = jax.jit(jax.vmap(_loss))  # vmapped over the closed-over data


@pytest.fixture(scope="module")
def drive_data():
    """Data, and the gradient of the loss by central differences (one vmapped call)."""
    with float64():
        values = jnp.sin(1.7 * _DOSE_TS) + 0.5
        eps = 1e-2  # the solution is linear in the data, so the loss is quadratic
        steps = eps * np.eye(values.shape[0])
        losses = _batched_loss(
            jnp.concatenate([values[None] + steps, values[None] - steps])
        )
        fd = (losses[: len(steps)] - losses[len(steps) :]) / (2 * eps)
        yield values, fd, losses


@pytest.mark.parametrize(
    "adjoint",
    [
        pytest.param(a, marks=[] if a == "recursive" else [pytest.mark.slow])
        for a in sorted(_ADJOINTS)
    ],
)
def test_gradient_wrt_closed_over_data(adjoint, drive_data):
    if adjoint != "recursive":
        # `SOLVERKIT_FULL_MATRIX=1` only: the gradient wrt closed-over data is
        # [recursive]'s; the adjoints are compared on other problems (closed-over
        # values of every kind: closure/test_closure_matrix.py's cells).
        skip_unless_full_matrix("[recursive] and test_closure_matrix.py")
    values, fd, _ = drive_data
    with float64():
        _, grad = _loss_and_grad(values, _ADJOINTS[adjoint])
        # Central differences are exact for a quadratic loss (up to round-off).
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
        if adjoint != "recursive":
            _, reference = _loss_and_grad(values, _ADJOINTS["recursive"])
            # Backsolve solves the adjoint equation, to Tsit5's error at dt = 0.05.
            atol = 1e-6 if adjoint == "backsolve" else 1e-12
            np.testing.assert_allclose(grad, reference, rtol=1e-8, atol=atol)


def test_vmap_over_closed_over_data(drive_data):
    """The vmapped solves of the fixture agree with unbatched ones."""
    values, _, losses = drive_data
    with float64():
        first, _ = _loss_and_grad(
            values + 1e-2 * jnp.eye(values.shape[0])[0], _ADJOINTS["recursive"]
        )
        last, _ = _loss_and_grad(
            values - 1e-2 * jnp.eye(values.shape[0])[-1], _ADJOINTS["recursive"]
        )
        np.testing.assert_allclose([losses[0], losses[-1]], [first, last], rtol=1e-12)
