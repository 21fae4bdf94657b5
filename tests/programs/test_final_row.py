"""`SaveAt(t1=True)` (and `t0`): the final row is built directly (`_save._final_only`),
not as a row of `inf` set to the final point (first calls: ~4% of a
checkpointed gradient's trace). The same values and gradients, bit for bit, as the
general path, with closed-over values of several dtypes, under `jit`, `vmap` and
`grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import skip_unless_full_matrix

import solverkit as sk
from solverkit import _save


def _solve(rates, y0, saveat, adjoint):
    index = jnp.asarray(2, jnp.int32)
    table = jnp.array([0.5, 1.0, 1.5], jnp.float32)

    def field(t, y, args):
        a, b, c, d = rates * table[index].astype(rates.dtype)
        return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])

    sol = sk.diffeqsolve(
        sk.ODETerm(field), sk.Tsit5(), 0.0, 2.0, 0.05, y0, saveat=saveat,
        stepsize_controller=sk.PIDController(rtol=1e-7, atol=1e-7),
        adjoint=adjoint, max_steps=256,
    )  # fmt: skip
    return sol.ts, sol.ys


# Each `SaveAt` with the checkpointed adjoint; `DirectAdjoint` (another backward
# pass through the same `_save.finish_save`) with `t1` only.
_CASES = [
    (sk.SaveAt(t1=True), sk.RecursiveCheckpointAdjoint()),
    (sk.SaveAt(t0=True, t1=True), sk.RecursiveCheckpointAdjoint()),
    (sk.SaveAt(t0=True), sk.RecursiveCheckpointAdjoint()),
    (sk.SaveAt(t1=True), sk.DirectAdjoint()),
]


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "saveat, adjoint",
    _CASES,
    ids=["t1-checkpoint", "t0-t1-checkpoint", "t0-checkpoint", "t1-direct"],
)
# The full suite (each case compiles a gradient twice); the quick loop checks the
# shorter program (test_shorter_program), and `SaveAt(t1=True)`'s values and
# gradients everywhere else.
@pytest.mark.slow
def test_same_as_general_path(monkeypatch, saveat, adjoint):
    if isinstance(adjoint, sk.DirectAdjoint):
        # `SOLVERKIT_FULL_MATRIX=1` only: the same `_save.finish_save` as
        # [t1-checkpoint]'s, DirectAdjoint against the checkpointed adjoint
        # adjoint/test_adjoint.py's.
        skip_unless_full_matrix("[t1-checkpoint] (the same final row)")
    if saveat.t0 and saveat.t1:
        # `SOLVERKIT_FULL_MATRIX=1` only: the final row built directly is
        # [t1-checkpoint]'s, the t0 row beside it [t0-checkpoint]'s.
        skip_unless_full_matrix("[t1-checkpoint] and [t0-checkpoint]")
    rates = jnp.array([[1.5, 1.0, 3.0, 1.0], [1.2, 0.8, 2.5, 1.1]])
    y0 = jnp.array([[1.0, 1.0], [1.2, 0.9]], jnp.float64)

    def loss(r, y):
        ts, ys = jax.vmap(lambda a, b: _solve(a, b, saveat, adjoint))(r, y)
        return jnp.sum(ys**2) + jnp.sum(ts), (ts, ys)

    run = lambda: jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(rates, y0)  # noqa: E731
    got = run()
    real = _save.finish_save

    calls = []

    def general(problem, save, buf, carry, t_end, y_end):
        # The general path: `_final_only` bypassed.
        calls.append(save)
        monkeypatch.setattr(_save, "_final_only", _old_final(buf, carry))
        return real(problem, save, buf, carry, t_end, y_end)

    monkeypatch.setattr(_save, "finish_save", general)
    want = run()
    assert calls
    leaves = jax.tree_util.tree_leaves
    assert len(leaves(got)) == len(leaves(want))
    for a, b in zip(leaves(got), leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def _old_final(buf, carry):
    def final(problem, save, t_end, y_end):
        if not save.t1:
            t_dtype = problem.t0.dtype
            return jnp.zeros((0,), t_dtype), _save._inf_like(save.fn.out_struct, (0,))
        return _save._rows_and_final(problem, save, buf, carry, t_end, y_end)

    return final


def _count(jaxpr) -> int:
    """Equations of `jaxpr`, those of nested jaxprs included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(sub, "eqns"):
                    n += _count(sub)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    n += _count(sub.jaxpr)
    return n


def test_shorter_program(monkeypatch):
    # The final point is not written into a row of `inf`: a shorter program (fails
    # on the old code, which has no `_final_only`).
    rates, y0 = jnp.array([1.5, 1.0, 3.0, 1.0]), jnp.array([1.0, 1.0])
    saveat = sk.SaveAt(t1=True)

    def equations():
        solve = lambda r: _solve(r, y0, saveat, sk.RecursiveCheckpointAdjoint())  # noqa: E731
        jax.clear_caches()  # (`diffeqsolve`'s own `jit` would reuse its trace)
        return _count(jax.make_jaxpr(solve)(rates).jaxpr)

    got = equations()
    monkeypatch.setattr(_save, "_final_only", _old_final(None, None))
    real = _save.finish_save

    def general(problem, save, buf, carry, t_end, y_end):
        monkeypatch.setattr(_save, "_final_only", _old_final(buf, carry))
        return real(problem, save, buf, carry, t_end, y_end)

    monkeypatch.setattr(_save, "finish_save", general)
    assert got < equations()
