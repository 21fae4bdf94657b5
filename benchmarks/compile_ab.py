"""XLA compile times of saved programs, measured in one process, the programs taking
turns: the way to compare two versions' compile times on a CPU whose speed drifts
by tens of percent between processes.

```bash
only="--only lotka_volterra/grad-checkpoint --repeats 1"
python -m benchmarks.first_call $only --save /tmp/new
git worktree add /tmp/old <commit>  # older than this script: copy it there
(cd /tmp/old && python -m benchmarks.first_call $only --save /tmp/was)
python -m benchmarks.compile_ab /tmp/was/*-solverkit.mlir /tmp/new/*-solverkit.mlir
```

It compiles StableHLO text through JAX's private compiler entry point
(`jax._src.compiler.backend_compile_and_load`), which may move between JAX versions.
"""

import argparse
import pathlib
import statistics
import time

import jax
from jax._src import compiler
from jax._src.interpreters import mlir
from jax._src.lib import xla_client
from jax._src.lib.mlir import ir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=pathlib.Path)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # programs may hold float64
    backend = jax.devices()[0].client
    devices = xla_client.DeviceList(tuple(jax.devices()[:1]))
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    texts = {f: f.read_text() for f in args.files}
    wall: dict[pathlib.Path, list[float]] = {f: [] for f in args.files}
    cpu: dict[pathlib.Path, list[float]] = {f: [] for f in args.files}
    for _ in range(args.repeats):
        for f, text in texts.items():
            with mlir.make_ir_context():
                module = ir.Module.parse(text)
                start, start_cpu = time.perf_counter(), time.process_time()
                compiler.backend_compile_and_load(backend, module, devices, options, [])
                wall[f].append(time.perf_counter() - start)
                cpu[f].append(time.process_time() - start_cpu)
    print("| program | compile min / median | CPU time min / median |")
    print("|---|---|---|")
    for f in args.files:
        w, c = wall[f], cpu[f]
        print(
            f"| {f} | {min(w):.3f} / {statistics.median(w):.3f} s | "
            f"{min(c):.3f} / {statistics.median(c):.3f} s |"
        )


if __name__ == "__main__":
    main()
