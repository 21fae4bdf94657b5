"""The Lorenz ensemble across two JAX processes, as it would run across hosts.

`python examples/multi_process.py` is the launcher: it starts two worker processes of
this same script on this machine, which join one JAX runtime through
`jax.distributed.initialize` (a coordinator on 127.0.0.1 at a free port; CPU
collectives over gloo). The batch of rho values is one global array sharded over the
devices of both processes: each process builds only its own half
(`jax.make_array_from_process_local_data`) and solves only its own shard, with the
same `jax.jit(jax.vmap(solve))` as `examples/ensemble.py`. The results are gathered
to every process with `multihost_utils.process_allgather`; process 0 saves them. The
launcher then solves the whole batch in a single process, checks that both agree,
and plots.

Across real hosts, run the worker on each host with the same coordinator address and
its own `--process-id` (see docs/multi_process.md).

Run: `python examples/multi_process.py [--out DIR] [--size N] [--quick]`.
Writes `multi_process.png` and `multi_process.npz`.
"""

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import time


NUM_PROCESSES = 2
TIMEOUT = 600  # seconds for the workers


def lorenz_solve(rho):
    """One Lorenz trajectory (rho closed over) at 51 times in [0, 1]."""
    import jax.numpy as jnp

    import solverkit as sk

    sigma, beta = 10.0, 8.0 / 3.0

    def lorenz(t, y, args):
        x, y_, z = y
        return jnp.stack([sigma * (y_ - x), x * (rho - z) - y_, x * y_ - beta * z])

    sol = sk.diffeqsolve(
        sk.ODETerm(lorenz),
        sk.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=1e-3,
        y0=jnp.array([1.0, 0.0, 0.0]),
        saveat=sk.SaveAt(ts=jnp.linspace(0.0, 1.0, 51)),
    )
    return sol.ys


def rhos(size: int):
    import numpy as np

    return np.linspace(0.0, 21.0, size, dtype=np.float32)


# --- Worker: one process of the distributed runtime ---------------------------------


def worker(args) -> None:
    import jax

    # CPU collectives between processes (gloo is the default in recent JAX).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    me = jax.process_index()
    devices = jax.devices()  # every process's devices, in the same order everywhere
    print(
        f"process {me}/{jax.process_count()}: local {jax.local_devices()}, "
        f"global {len(devices)} devices",
        flush=True,
    )
    mesh = Mesh(np.array(devices), ("batch",))
    sharding = NamedSharding(mesh, PartitionSpec("batch"))

    # This process's contiguous half of the batch, then the global array.
    everything = rhos(args.size)
    local = np.split(everything, jax.process_count())[me]
    batch = jax.make_array_from_process_local_data(sharding, local, everything.shape)

    start = time.perf_counter()
    ys = jax.block_until_ready(jax.jit(jax.vmap(lorenz_solve))(batch))
    seconds = time.perf_counter() - start
    shards = sorted(s.index[0].start or 0 for s in ys.addressable_shards)
    print(
        f"process {me}: solved rows from {shards} of {args.size} "
        f"(compile + run {seconds:.1f} s)",
        flush=True,
    )

    gathered = multihost_utils.process_allgather(ys, tiled=True)  # on every process
    if me == 0:
        np.savez(args.result, rhos=everything, ys=np.asarray(gathered))
    jax.distributed.shutdown()


# --- Launcher -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> pathlib.Path:
    """Run the workers; return the file process 0 wrote."""
    result = args.out / "multi_process_workers.npz"
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--process-id",
                str(i),
                "--num-processes",
                str(NUM_PROCESSES),
                "--coordinator",
                coordinator,
                "--size",
                str(args.size),
                "--result",
                str(result),
            ],
            env=env,
        )
        for i in range(NUM_PROCESSES)
    ]
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")
    return result


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
    worker_options = parser.add_argument_group(
        "worker (what the launcher starts; run it yourself on each host)"
    )
    worker_options.add_argument("--worker", action="store_true")
    worker_options.add_argument("--process-id", type=int, help="0 ... N - 1")
    worker_options.add_argument("--num-processes", type=int, help="N")
    worker_options.add_argument("--coordinator", help="host:port of process 0")
    worker_options.add_argument(
        "--result",
        type=pathlib.Path,
        default=pathlib.Path("result.npz"),
        help="where process 0 saves the gathered ensemble",
    )
    args = parser.parse_args()
    if args.worker:
        args.size = args.size or 4096
        return worker(args)
    size = args.size or (16 if args.quick else 4096)
    args.size = -(-size // NUM_PROCESSES) * NUM_PROCESSES  # splits evenly
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"{args.size} Lorenz trajectories over {NUM_PROCESSES} processes")
    with __import__("numpy").load(launch(args)) as f:
        all_rhos, multi = f["rhos"], f["ys"]

    # The same batch in this one process, for comparison.
    import jax
    import matplotlib
    import numpy as np

    single = np.asarray(jax.jit(jax.vmap(lorenz_solve))(rhos(args.size)))
    np.testing.assert_allclose(multi, single, rtol=1e-5, atol=1e-5)
    print("two-process and single-process results agree.")
    np.savez(args.out / "multi_process.npz", rhos=all_rhos, multi=multi, single=single)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    half = args.size // NUM_PROCESSES
    for i in range(NUM_PROCESSES):
        part = slice(i * half, (i + 1) * half)
        ax.scatter(
            all_rhos[part],
            multi[part, -1, 2],
            s=4,
            color=f"C{i}",
            label=f"solved by process {i}",
        )
    ax.set(xlabel="rho", ylabel="z(t=1)", title="Lorenz ensemble across two processes")
    ax.legend()
    fig.tight_layout()
    path = args.out / "multi_process.png"
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
