"""The matrix-product precision of a user's vector field (`_setup.field_precision`):
"highest" where the user set none (a TPU's default multiplies float32 in bfloat16
passes, below what the error control assumes), the user's own setting otherwise."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

import solverkit as sk


W = jnp.arange(9.0).reshape(3, 3) / 10


def _precisions(jaxpr) -> set:
    """The `precision` of every `dot_general` on a 3x3 operand, in every inner jaxpr."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            if any(getattr(v.aval, "shape", ()) == (3, 3) for v in eqn.invars):
                found.add(eqn.params["precision"])
        for p in eqn.params.values():
            for inner in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(inner, jex.ClosedJaxpr):
                    found |= _precisions(inner.jaxpr)
                elif isinstance(inner, jex.Jaxpr):
                    found |= _precisions(inner)
    return found


def _program(field):
    def solve(y0):
        return sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 0.1, y0,
            stepsize_controller=sk.PIDController(1e-6, 1e-6),
        ).ys  # fmt: skip

    return jax.make_jaxpr(jax.grad(lambda y: jnp.sum(solve(y))))(jnp.ones(3)).jaxpr


def test_highest_unless_the_user_says():
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    default = (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
    got = _precisions(_program(lambda t, y, args: -W @ y))
    assert got == {highest}  # the forward products and their transposes
    explicit = lambda t, y, args: -jnp.dot(W, y, precision="default")  # noqa: E731
    assert _precisions(_program(explicit)) == {default}
    with jax.default_matmul_precision("bfloat16"):
        got = _precisions(_program(lambda t, y, args: -W @ y))
    assert highest not in got and got
