"""Gradients with respect to Python scalars inside `jit` (found by diffrax's
test_adjoint::test_against). There JAX hands a `custom_vjp`'s rules a typed literal
(a `float` subclass with a dtype, JAX >= 0.10) rather than an array for the
differentiated scalar: taken for a static value, its cotangent came out zero through
`BacksolveAdjoint` (silently) and of the wrong type through the checkpointed adjoint
(a crash in JAX)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import skip_unless_full_matrix

import solverkit as sk


def _field(t, y, args):
    a, b = args
    return jnp.stack([a * y[0] + b * y[1], y[0] - 0.1 * y[1]])


_Y0 = np.array([0.9, 5.4])


def _loss(args, y0, adjoint, ensemble=False):
    kwargs = dict(
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=adjoint,
        max_steps=4096,
    )
    if ensemble:  # the scalars closed over (an ensemble's `args` are batched)
        field = lambda t, y, _: _field(t, y, args)  # noqa: E731
        ys = sk.ensemble_solve(
            sk.ODETerm(field), sk.Tsit5(), 0.3, 3.0, None, y0[None], None,
            kernel=False, **kwargs,
        ).ys  # fmt: skip
    else:
        ys = sk.diffeqsolve(
            sk.ODETerm(_field), sk.Tsit5(), 0.3, 3.0, None, y0, args, **kwargs
        ).ys
    return jnp.sum(ys)


_ADJOINTS = {
    "direct": sk.DirectAdjoint(),
    "checkpoint": sk.RecursiveCheckpointAdjoint(),
    "backsolve": sk.BacksolveAdjoint(),
}


@pytest.mark.quick_cases("checkpoint-int")
@pytest.mark.parametrize("kind", ["float", "int"])
@pytest.mark.parametrize("name", ["direct", "checkpoint", "backsolve", "ensemble"])
def test_gradient_of_a_python_scalar_inside_jit(x64, name, kind):
    """`jit(grad)` of a loss with respect to Python scalars in `args` (closed over
    by the field of an ensemble; a float, and a float and an int with
    `allow_int=True`) equals the gradient outside `jit` and
    central differences (step 1e-6 on a solve at tolerance 1e-10: the quotient's
    error ~ tol / h = 1e-4 relative at worst, so 1e-3)."""
    if kind == "int" and name in ("direct", "backsolve"):
        skip_unless_full_matrix(
            "[checkpoint-int] and [ensemble-int] (an int beside the float: float0, "
            "in `args` and closed over) and [direct-float], [backsolve-float] (the "
            "adjoints)"
        )
    if kind == "float" and name in ("checkpoint", "ensemble"):
        skip_unless_full_matrix(
            f"[{name}-int] (the same float beside an int, through the same adjoint)"
        )
    ensemble = name == "ensemble"
    adjoint = _ADJOINTS.get(name, sk.RecursiveCheckpointAdjoint())
    args = (0.1, -1.0) if kind == "float" else (0.1, -1)
    allow_int = kind == "int"
    grad = jax.grad(_loss, allow_int=allow_int)
    inside = eqx.filter_jit(lambda a, y: grad(a, y, adjoint, ensemble))(args, _Y0)
    outside = grad(args, _Y0, adjoint, ensemble)
    h = 1e-6
    fd = (
        _loss((0.1 + h, -1.0), _Y0, adjoint, ensemble)
        - _loss((0.1 - h, -1.0), _Y0, adjoint, ensemble)
    ) / (2 * h)
    assert inside[0].dtype == jnp.float64
    np.testing.assert_allclose(inside[0], outside[0], rtol=1e-12)
    np.testing.assert_allclose(inside[0], fd, rtol=1e-3)
    assert abs(float(inside[0])) > 1  # (a zero would be the defect)
    if allow_int:
        assert inside[1].dtype == jax.dtypes.float0
    else:
        np.testing.assert_allclose(inside[1], outside[1], rtol=1e-12)
