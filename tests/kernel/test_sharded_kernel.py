"""`jax.jit(jax.vmap(diffeqsolve))` on the kernel with the batch sharded over
devices (`solverkit/_kernel/_shard.py`): each device solves its own shard in its
own kernel. The compiled program has no all-gather (the batch stays where it is),
and the values and per-trajectory gradients equal the loop's.

Run in a subprocess with eight host devices (the kernel in Pallas' interpreter):
a single device can't show a partitioned program."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest


_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import solverkit as sk
    from solverkit._kernel import _vmap

    jax.config.update("jax_enable_x64", True)
    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    N = 16

    def solve(rho, y0):  # rho: a vmapped value closed over
        def field(t, y, args):
            return jnp.stack([-rho * y[0] + y[1], -args * y[1]])

        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 0.1, y0, 2.0,
            saveat=sk.SaveAt(ts=jnp.linspace(0.25, 1.0, 4)),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8))
        return sol.ys

    def loss(rho, y0):
        return jnp.sum(solve(rho, y0) ** 2)

    forward = jax.vmap(solve)
    gradient = jax.vmap(jax.grad(loss, argnums=(0, 1)))
    rho = jnp.linspace(1.0, 2.0, N)
    y0 = jnp.ones((N, 2)) + 0.01 * jnp.arange(N)[:, None]
    sharded = (jax.device_put(rho, NamedSharding(mesh, P("batch"))),
               jax.device_put(y0, NamedSharding(mesh, P("batch", None))))
    for name, fn in [("forward", forward), ("gradient", gradient)]:
        _vmap.ENABLED = True
        uses = "pallas_call" in str(jax.make_jaxpr(lambda *a: fn(*a))(rho, y0))
        assert uses, name + ": the kernel did not take the solve"
        compiled = jax.jit(lambda *a: fn(*a)).lower(*sharded).compile()
        hlo = compiled.as_text()
        assert "all-gather" not in hlo, name + ": the batch is gathered"
        got = compiled(*sharded)
        for x in jax.tree_util.tree_leaves(got):
            assert x.sharding.spec[0] == "batch", (name, x.sharding)
        _vmap.ENABLED = False
        want = jax.jit(lambda *a: fn(*a))(rho, y0)
        for a, b in zip(jax.tree_util.tree_leaves(got),
                        jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=name)
        print(name, "ok")
    print("OK")
    """
)


@pytest.mark.slow
def test_sharded_batch_solves_each_shard_on_its_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["SOLVERKIT_VMAP_KERNEL"] = "0"  # the script turns the route on and off
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=pathlib.Path(__file__).parents[1],
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip().endswith("OK"), run.stdout
