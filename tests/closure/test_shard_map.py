"""`diffeqsolve` inside `shard_map(check_vma=True)` (JAX's varying-axes checks on),
with values closed over sharded or replicated: solves, gradients through every
adjoint (a replicated value's gradient summed over the devices, as JAX's autodiff
sums it) and `throw=True` (one device failing fails all).

Run in a subprocess with two host devices: with several devices, a collective
inside a loop whose trip count differs between devices would never meet, which a
single device can't show."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import FULL_MATRIX


_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import solverkit as sk

    jax.config.update("jax_enable_x64", True)
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None or len(jax.devices()) < 2:
        print("SKIP"); raise SystemExit
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    # The adjoints named on the command line.
    ADJOINTS = [getattr(sk, name)() for name in sys.argv[1:]]

    def final(scale, rate, adjoint, max_steps=4096, throw=True):
        # `scale` multiplies the state, `rate` the decay: y(1) = scale exp(-rate)
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: -rate * y), sk.Tsit5(), 0.0, 1.0, 0.1,
            scale * jnp.ones(2), adjoint=adjoint, max_steps=max_steps, throw=throw,
            stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-12))
        return sol.ys[-1, 0]

    rates = jnp.array([1.0, 2.0, 3.0, 4.0])
    for adjoint in ADJOINTS:
        name = type(adjoint).__name__
        # Sharded rates (vmapped on each device), replicated scale.
        def loss(scale, rates):
            return jnp.sum(jax.vmap(lambda r: final(scale, r, adjoint))(rates))
        sharded = jax.jit(shard_map(
            lambda s, r: jax.grad(loss, argnums=(0, 1))(s, r), mesh=mesh,
            in_specs=(P(), P("x")), out_specs=(P(), P("x")), check_vma=True))
        d_scale, d_rates = sharded(2.0, rates)
        np.testing.assert_allclose(d_rates, -2.0 * jnp.exp(-rates), rtol=1e-6,
                                   err_msg=name)
        # The replicated scale's gradient is summed over the devices.
        np.testing.assert_allclose(d_scale, jnp.sum(jnp.exp(-rates)), rtol=1e-6,
                                   err_msg=name)
        print(name, "ok")

    failing = jax.jit(shard_map(
        jax.vmap(lambda r: final(1.0, r, ADJOINTS[0], max_steps=2)), mesh=mesh,
        in_specs=P("x"), out_specs=P("x"), check_vma=True))
    try:
        failing(rates).block_until_ready()
    except Exception as e:
        assert "max_steps" in str(e), e
        print("throw ok")
    else:
        raise AssertionError("a failed solve inside shard_map did not raise")
    print("OK")
    """
)


# DirectAdjoint and BacksolveAdjoint inside shard_map with `SOLVERKIT_FULL_MATRIX=1`
# only (two more gradient programs in the subprocess): the adjoints are compared with
# each other on other problems (adjoint/test_adjoint.py, the closure matrix), the
# closed-over values inside shard_map closure/test_closure.py::test_shard_map.
_ADJOINTS = ["RecursiveCheckpointAdjoint"] + (
    ["DirectAdjoint", "BacksolveAdjoint"] if FULL_MATRIX else []
)


@pytest.mark.slow
def test_diffeqsolve_in_checked_shard_map_on_two_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    )
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *_ADJOINTS],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if run.stdout.strip() == "SKIP":
        pytest.skip("this JAX has no jax.shard_map with varying-axes checks")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip().endswith("OK"), run.stdout
