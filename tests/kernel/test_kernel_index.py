"""A per-trajectory index into a small shared array (`table[k]`, `k` vmapped) on the
kernel: `_scalarize` evaluates the `dynamic_slice` as a chain of selects over the
places it can take (XLA's clamped start), and declines a larger choice with a
reason. On the `jax.vmap` route, against the loop (float64, interpreter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_matrix_only

import solverkit as sk
from solverkit._kernel import _budget, _scalarize, _vmap


def _elements(x, shape):
    """`x`'s elements as an object array of `shape` (each a 0-d value or a tile)."""
    out = np.empty(shape, dtype=object)
    for index in np.ndindex(shape):
        out[index] = x[index] if shape else x
    return out


def test_traced_index_is_a_select_chain_with_clamped_starts():
    table = jnp.arange(12.0).reshape(4, 3) ** 2
    k = jnp.array([[-2, 0, 1, 2, 3, 7]])  # one tile of lanes, out of range too
    closed = jax.make_jaxpr(lambda t, i: jax.lax.dynamic_slice(t, (i, 1), (2, 2)))(
        table, 0
    )
    assert "dynamic_slice" in str(closed.jaxpr)

    @jax.jit  # the starts traced, as in the kernel
    def on_lanes(table, k):
        args = [_elements(table, table.shape), _elements(k, ())]
        (out,) = _scalarize.evaluate(closed.jaxpr, closed.consts, args)
        return jnp.stack([jnp.stack(list(row)) for row in out])  # (2, 2, 1, 6)

    got = on_lanes(table, k)
    for lane, i in enumerate(np.asarray(k)[0]):
        want = jax.lax.dynamic_slice(table, (int(i), 1), (2, 2))
        np.testing.assert_array_equal(got[:, :, 0, lane], want)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dynamic_slice"]
    assert _scalarize.choices(eqn) == 3  # rows 0, 1, 2; the column start is known
    assert _budget._eqn_ops(eqn) == 4 * 2 * 2  # per element: 2 compares, 2 selects


def test_large_traced_index_is_declined_with_its_reason():
    big = jnp.ones(_scalarize.MAX_CHOICES + 1)
    jaxpr = jax.make_jaxpr(lambda i: big[i])(0).jaxpr
    with pytest.raises(_scalarize.KernelUnsupported, match="traced position"):
        _scalarize.check(jaxpr)
    small = jnp.ones(_scalarize.MAX_CHOICES)
    _scalarize.check(jax.make_jaxpr(lambda i: small[i])(0).jaxpr)


N = 6


def _loss(theta, table, k):
    """The seed's pattern: a shared float and a table closed over, `table[k]`."""

    def field(t, y, args):
        return -theta * table[k] * y + jnp.stack([y[1], -y[0]])

    sol = sk.diffeqsolve(
        sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 0.1, jnp.array([1.0, 0.5]),
        saveat=sk.SaveAt(ts=jnp.linspace(0.5, 1.0, 3)),
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
    )  # fmt: skip
    return jnp.sum(sol.ys**2)


def _on_route_and_loop(monkeypatch, fn, *args):
    monkeypatch.setattr(_vmap, "ENABLED", True)
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
    got = jax.jit(lambda *a: fn(*a))(*args)
    monkeypatch.setattr(_vmap, "ENABLED", False)
    want = jax.jit(lambda *a: fn(*a))(*args)
    return jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)


def _args():  # made under the x64 fixture: float64
    return 1.3, jnp.linspace(0.5, 2.0, 5), jnp.arange(N) % 5


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
def test_table_index_on_the_route_equals_the_loop(monkeypatch):
    values = jax.vmap(_loss, in_axes=(None, None, 0))

    def both(theta, table, k):
        """Each lane's value and the gradient of their sum, from one solve (the
        pullback's forward pass)."""
        out, pullback = jax.vjp(lambda th, tb: values(th, tb, k), theta, table)
        return out, pullback(jnp.ones_like(out))

    got, want = _on_route_and_loop(monkeypatch, both, *_args())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


# `SOLVERKIT_FULL_MATRIX=1` only (7 CPU s): the table index under `grad` on the route
# is test_table_index_on_the_route_equals_the_loop (the gradient of the vmapped loss);
# `vmap` of `grad` against `grad` of `vmap` on the route, the route-vs-loop matrix
# (tests/kernel/test_vmap_route.py, its vmap_grad and grad_vmap cells).
@pytest.mark.slow
@full_matrix_only("test_table_index_on_the_route_equals_the_loop")
@pytest.mark.usefixtures("x64")
def test_table_index_per_lane_gradients_equal_the_loops(monkeypatch):
    per_lane = jax.vmap(jax.grad(_loss, argnums=(0, 1)), in_axes=(None, None, 0))
    got, want = _on_route_and_loop(monkeypatch, per_lane, *_args())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
