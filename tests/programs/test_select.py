"""`_select.where`: `jnp.where`'s values, dtypes and weak types, as one `select`
without a nested `jit` (also for a Python number against an array: the stiff solvers'
`where(keep, row, 0)`)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solverkit._select import where


_VALUES = [
    jnp.arange(3.0),
    jnp.arange(3, dtype=jnp.float32),
    jnp.arange(3, dtype=jnp.int32),
    jnp.asarray([1 + 2j, 3j, 4], jnp.complex64),
    jnp.asarray([True, False, True]),
    jnp.asarray(2.5),
    0,
    2,
    0.5,
    True,
]


@pytest.mark.parametrize("x,y", list(itertools.product(_VALUES, _VALUES)))
def test_like_jnp_where(x, y):
    pred = jnp.asarray([True, False, False])
    try:
        want = jnp.where(pred, x, y)
    except (TypeError, ValueError):  # a promotion JAX refuses: so must `where`
        with pytest.raises((TypeError, ValueError)):
            where(pred, x, y)
        return
    got = where(pred, x, y)
    assert got.dtype == want.dtype
    assert got.weak_type == want.weak_type
    np.testing.assert_array_equal(got, want)


def test_number_against_array_is_one_select():
    """`where(p, row, 0)` traces to a `select_n` (and broadcasts), no `jit`."""
    jaxpr = jax.make_jaxpr(lambda p, x: where(p, x, 0) + where(p, 1, x))(
        True, jnp.ones(3)
    )
    names = {eqn.primitive.name for eqn in jaxpr.eqns}
    assert "select_n" in names
    assert not names & {"jit", "pjit"}, jaxpr
