"""Thousands of ODE solves at once, on one device and split across several.

The Lorenz system for N values of rho in [0, 21] (the ensemble of the DiffEqGPU.jl
paper, Utkarsh et al. 2024), each solved with Tsit5 on t in [0, 1]. `jax.vmap` turns
one solve into a batched one; a `NamedSharding` on the batch axis then spreads the
same batch over every local device, with `jax.jit(jax.vmap(solve))` unchanged.

On a CPU there is one device unless XLA is told to fake more, so this script asks
for 8 (`XLA_FLAGS=--xla_force_host_platform_device_count=8`) before JAX starts.
Fake devices share the same cores, so expect no speed-up there; on a machine with
several GPUs the same code runs one shard per GPU.

Run: `python examples/ensemble.py [--out DIR] [--size N] [--quick]`.
Writes `ensemble.png`.
"""

import os


_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


SIGMA, BETA = 10.0, 8.0 / 3.0
Y0 = jnp.array([1.0, 0.0, 0.0])
TS = jnp.linspace(0.0, 1.0, 51)


def solve(rho: jax.Array) -> jax.Array:
    """One Lorenz trajectory at times `TS`; the vector field closes over `rho`."""

    def lorenz(t, y, args):
        x, y_, z = y
        return jnp.stack([SIGMA * (y_ - x), x * (rho - z) - y_, x * y_ - BETA * z])

    sol = sk.diffeqsolve(
        sk.ODETerm(lorenz),
        sk.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=1e-3,
        y0=Y0,
        saveat=sk.SaveAt(ts=TS),
    )
    return sol.ys


batched_solve = jax.jit(jax.vmap(solve))


def timed(fn, *args) -> tuple[jax.Array, float]:
    """Result of `fn(*args)` and the seconds of a second, already compiled, call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--size", type=int, default=None, help="ensemble size")
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="a few seconds' smoke run (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    devices = jax.devices()
    # The batch must split evenly over the devices.
    size = args.size or (64 if args.quick else 2048)
    size = -(-size // len(devices)) * len(devices)
    rhos = jnp.linspace(0.0, 21.0, size)
    steps = 1000 * size
    print(f"{size} Lorenz trajectories, 1000 Tsit5 steps each, {len(devices)} devices")

    # 1. One device: plain vmap.
    ys, seconds = timed(batched_solve, rhos)
    print(f"vmap on one device:      {seconds:8.3f} s ({steps / seconds:.3g} steps/s)")

    # 2. Every device: shard the batch axis; the compiled program follows the data.
    mesh = Mesh(np.array(devices), axis_names=("batch",))
    sharded_rhos = jax.device_put(rhos, NamedSharding(mesh, PartitionSpec("batch")))
    sharded_ys, seconds = timed(batched_solve, sharded_rhos)
    print(f"sharded over {len(devices)} devices: {seconds:8.3f} s")
    print("output sharding:", sharded_ys.sharding)
    assert jnp.allclose(ys, sharded_ys, rtol=1e-5, atol=1e-5)
    print("sharded and unsharded results agree.")

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    cmap = plt.get_cmap("viridis")
    for i in np.linspace(0, size - 1, 12).astype(int):
        colour = cmap(float(rhos[i]) / 21.0)
        left.plot(ys[i, :, 0], ys[i, :, 2], color=colour, lw=1)
    left.set(xlabel="x", ylabel="z", title="Trajectories, coloured by rho")
    right.scatter(rhos, ys[:, -1, 2], s=2, c=rhos, cmap=cmap)
    right.set(xlabel="rho", ylabel="z(t=1)", title=f"Final z for all {size} rho")
    fig.tight_layout()
    path = args.out / "ensemble.png"
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
