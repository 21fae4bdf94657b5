"""The kernel's resource model (`_kernel/_budget.py`): its numbers on known fields,
the block size it picks, the solves it declines with their reason, and the backward
pass taking the loop's pull-back where the tangent kernel would not fit. Nothing
here runs a large field in Pallas' interpreter: a declined field is only traced."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solverkit as sk
from solverkit import _kernel
from solverkit._closure._convert import closure_convert
from solverkit._errors import UnsupportedError
from solverkit._kernel import _budget, _field, _solve, _vmap
from solverkit._solver._tableau import TSIT5


def _cost(f, y, args=None) -> _budget.FieldCost:
    closure = closure_convert(f, jnp.zeros(()), y, args)
    lane = _field.lane_field(closure, jnp.zeros(()), y, args)
    return _budget.field_cost(
        lane.jaxpr, _budget.lane_inputs_of(lane.jaxpr, lane.inputs)
    )


def _lorenz(t, y, args):
    x, yy, z = y
    return jnp.stack([10 * (yy - x), x * (28 - z) - yy, x * yy - 8 / 3 * z])


def _mlp(width: int, depth: int = 2, size: int = 2):
    return eqx.nn.MLP(
        size, size, width, depth, activation=jax.nn.softplus, key=jax.random.key(0)
    )


def test_field_cost_counts_lane_operations():
    # Lorenz: 2 + 3 + 3 element-wise operations; at most 5 values live at once.
    assert _cost(_lorenz, jnp.ones(3)) == _budget.FieldCost(8, 5)
    # A shared 3x3 matrix times the state plus a shared bias: each output element
    # is 3 products and 2 sums, then one sum for the bias.
    w, b = jnp.arange(9.0).reshape(3, 3), jnp.ones(3)
    assert _cost(lambda t, y, a: w @ y + b, jnp.ones(3)).ops == 3 * 5 + 3
    # Shared values alone make no lane work: only `y * c` is per trajectory.
    c = jnp.ones(3)
    assert _cost(lambda t, y, a: y * (c * 2 + 1), jnp.ones(3)).ops == 3
    # A per-trajectory argument is a lane value.
    assert _cost(lambda t, y, a: y * a, jnp.ones(3), jnp.ones(3)).ops == 3
    # An MLP's cost grows with its width squared.
    small, large = (
        _cost(lambda t, y, a: _mlp(8)(y), jnp.ones(2)),
        _cost(lambda t, y, a: _mlp(64)(y), jnp.ones(2)),
    )
    assert large.ops > 25 * small.ops and large.live > small.live


def test_need_and_rows():
    cost = _budget.FieldCost(ops=100, live=10)
    need = _budget.need(
        cost, TSIT5, n=4, directions=0, num_args=1, num_ts=2, smem_bytes=8
    )
    assert need.ops == 100 * 7  # six stages after the FSAL one, and the initial one
    # The state and 7 stages (+6), the field's values, an argument (in and its
    # double buffer), the save buffer, the fixed tiles.
    assert need.tiles == 4 * 13 + 10 + 2 + 2 * 2 * 4 + _budget._FIXED_TILES
    tangent = _budget.need(cost, TSIT5, 4, 2, 1, 2, 8)
    assert tangent.ops == 100 * 7 * 7 and tangent.tiles > 3 * 4 * 13
    chip = _budget.Chip(vmem=1 << 20, smem=1 << 10, name="test chip")
    budget = _budget.vmem_limit(chip) * _budget.VMEM_SHARE
    # The most rows (halving) whose block fits; 8 rows of 4-byte values minimum.
    for rows in (64, 32, 16, 8):
        fits = _budget.block_bytes(need.tiles, rows, 4) <= budget
        got = _budget.rows_for(need, 64, 4, False, chip)
        if fits:
            assert got == rows
            break
    big = need._replace(tiles=10**6)
    assert "VMEM" in _budget.rows_for(big, 64, 4, False, chip)
    assert "SMEM" in _budget.rows_for(need._replace(smem=1 << 10), 64, 4, False, chip)
    many = need._replace(ops=_budget.MAX_OPS + 1)
    assert "lane operations" in _budget.rows_for(many, 64, 4, False, chip)
    assert "interpreter" in _budget.rows_for(
        need._replace(ops=_budget.MAX_INTERPRET_OPS + 1), 64, 4, True, chip
    )


def test_chip_off_a_tpu():
    chip = _budget.chip()
    if jax.default_backend() != "tpu":
        assert chip == _budget._DEFAULT
    assert _budget.vmem_limit(chip) == int(chip.vmem * _budget.VMEM_LIMIT_SHARE)


def test_a_solve_placed_on_the_host_is_not_a_tpu_kernel(monkeypatch):
    # On a TPU machine, `jax.default_device(cpu)` puts a solve on the host CPU,
    # where a TPU kernel can't be lowered: the route, the interpreter choice and the
    # chip model follow the device, not JAX's default backend.
    from solverkit import _backend
    from solverkit._kernel import _solve, _vmap

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(_vmap, "ENABLED", None)
    monkeypatch.setattr(_solve, "DEFAULT_INTERPRET", None)
    monkeypatch.delenv("SOLVERKIT_VMAP_KERNEL", raising=False)
    assert _backend.platform() == "tpu" and _vmap._enabled()
    for device in (jax.devices("cpu")[0], "cpu"):
        with jax.default_device(device):
            assert _backend.platform() == "cpu"
            assert not _vmap._enabled()
            assert _solve._default_interpret()
            assert _budget.chip() == _budget._DEFAULT


def _neural_solve(y0, mlp, ts):
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: mlp(y)), sk.Tsit5(), 0.0, 1.0, None, y0,
        saveat=sk.SaveAt(ts=ts), stepsize_controller=sk.PIDController(1e-3, 1e-6),
    )  # fmt: skip


# The full suite (traces a 2-16-16-2 MLP field); the quick loop's resource model:
# this file's other tests, a declined route's reason
# test_vmap_route.py::test_kernel_routes_records_and_logs.
@pytest.mark.slow
def test_neural_field_declined_with_its_reason(monkeypatch):
    """A 2-16-16-2 MLP field: too large for the kernel's unrolled code; the kernel
    path says so, and the vmap route leaves it to the loop (only traced here)."""
    mlp, ts = _mlp(16), jnp.linspace(0, 1, 16)
    y0 = jnp.ones((256, 2))
    with pytest.raises(UnsupportedError, match="lane operations"):
        sk.ensemble_solve(
            sk.ODETerm(lambda t, y, args: mlp(y)), sk.Tsit5(), 0.0, 1.0, None, y0,
            saveat=sk.SaveAt(ts=ts), stepsize_controller=sk.PIDController(1e-3, 1e-6),
            kernel=True,
        )  # fmt: skip
    monkeypatch.setattr(_vmap, "ENABLED", True)
    program = jax.make_jaxpr(jax.vmap(lambda y: _neural_solve(y, mlp, ts).ys))(y0)
    assert "pallas_call" not in str(program)
    small = jax.make_jaxpr(jax.vmap(lambda y: _neural_solve(y, _mlp(4), ts).ys))(y0)
    assert "pallas_call" in str(small)  # a small one takes the kernel


def test_rows_fit_the_block(monkeypatch):
    """A large state gets fewer rows per block than the batch's default."""
    monkeypatch.setattr(_budget, "chip", lambda: _budget.Chip(32 << 20, 1 << 20, "t"))

    def heat(t, u, args):
        return (
            jnp.concatenate([u[1:], u[-1:]]) - 2 * u + jnp.concatenate([u[:1], u[:-1]])
        )

    y0 = jnp.ones((8192, 64))
    problem = _problem(heat, y0)
    rows = _solve.fitted_rows(problem, y0, 0, None, interpret=False)
    assert _solve.default_rows(8192) == 64 and isinstance(rows, int) and rows < 64
    need = _budget.of_problem(problem)
    budget = _budget.vmem_limit() * _budget.VMEM_SHARE
    assert _budget.block_bytes(need.tiles, rows, 4) <= budget
    assert rows == 8 or _budget.block_bytes(need.tiles, 2 * rows, 4) > budget


def _problem(field, y0):
    """The one-trajectory `Problem` `ensemble_solve` builds (captured on its way to
    the kernel's check)."""
    seen = []

    def record(problem, y0, per_trajectory, keep):
        seen.append(problem)
        return "recorded"

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_kernel, "supported", record)
        with pytest.raises(UnsupportedError):
            sk.ensemble_solve(
                sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 1e-3, y0, kernel=True
            )
    return seen[0]


@pytest.mark.slow
def test_backward_takes_the_loop_where_tangents_do_not_fit(monkeypatch):
    """Forward sensitivities that don't fit: the lane loop's backward pass serves,
    and the gradient is the loop's."""
    rho = jnp.linspace(10.0, 28.0, 8)
    y0 = jnp.ones((8, 3))

    def loss(rho, kernel):
        sol = sk.ensemble_solve(
            sk.ODETerm(lambda t, y, r: _lorenz(t, y, None) * r / 28), sk.Tsit5(),
            0.0, 0.5, 1e-3, y0, rho, stepsize_controller=sk.PIDController(1e-6, 1e-6),
            kernel=kernel,
        )  # fmt: skip
        return jnp.sum(sol.ys)

    # The forward kernel fits; with its 4 directions the tangent kernel would not.
    monkeypatch.setattr(_budget, "MAX_INTERPRET_OPS", 400)
    called = []
    monkeypatch.setattr(_solve, "_tangent_rows", lambda *a: called.append(a))
    # Jitted: two programs (eagerly, about a hundred of op-by-op compiles).
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    got, want = grad(rho, True), grad(rho, False)
    assert not called
    np.testing.assert_allclose(got, want, rtol=1e-4)
