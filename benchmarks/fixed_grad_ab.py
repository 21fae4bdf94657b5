"""The vmapped fixed-step Lorenz gradient of issue #38 (`lorenz/fixed-grad`: Tsit5,
dt 1e-3, 1000 steps, float32, rho closed over, `RecursiveCheckpointAdjoint`):
the row operations of each `while` loop of its optimized HLO, and the run time and
first call of two solverkit trees side by side in one process.

```bash
python -m benchmarks.fixed_grad_ab                      # this tree: counts at N = 64
git archive <commit> solverkit | tar -x -C /tmp/old     # another tree, to compare
python -m benchmarks.fixed_grad_ab --old /tmp/old --sizes 4096 --repeats 10
python -m benchmarks.fixed_grad_ab --old ab/a --old ab/b --sizes 4096,65536 --out DIR
```

`--old DIR` (repeatable) imports `DIR/solverkit` as another package (named
`DIR`'s last part in the tables), so the trees run in turn in
one process (a shared CPU drifts by tens of percent between processes). Counted
per `while` loop of the optimized HLO (`hlo_loops.loops`): gathers, scatters,
dynamic slices and dynamic update slices (a vmapped row of a stack is a gather
that XLA may turn into a dynamic slice), nested loops, kernels (fusions) and all
instructions; the first loop is the forward pass, the next the backward pass's
chunks with its refill and pullback loops inside. Run times: the minimum and
median of `--repeats` calls, the trees taking turns; first call: trace, lower and
compile, the minimum over `--first-calls` rounds; the gradient's largest
difference from the first tree's, relative to its largest entry. `--out DIR` writes
`fixed_grad_ab.json` and `.md`.
"""

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import cases
from .hlo_loops import loops, ROW_OPS


def program(lib: Any, n: int, throw: bool = False):
    """`lorenz/fixed-grad` of `benchmarks.cases` with `lib` as solverkit, `throw` as
    in `python -m benchmarks --throw` (false in the accelerator runs): `(fn,
    args)`."""
    tasks = cases.lorenz_tasks(n, {"solverkit": lib}, "float32", throw)
    (task,) = [t for t in tasks if t.variant == "fixed-grad"]
    job = task.make()
    return job.fn, job.args


def load(tree: pathlib.Path, name: str) -> Any:
    """`tree/solverkit` imported as the package `name`."""
    init = tree / "solverkit" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        raise ValueError(f"--old: no solverkit package under {tree}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _first_call(fn, args) -> tuple[float, Any]:
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(fn).trace(*args).lower().compile()
    return time.perf_counter() - start, compiled


def _measure(libs: dict[str, Any], sizes, count_size, repeats, firsts, write) -> None:
    """Counts at `count_size`, then run times and first calls at each of `sizes`,
    handing the rows so far to `write` after each."""
    rows: dict[str, Any] = {"counts": {}, "times": []}
    for name, lib in libs.items():
        fn, args = program(lib, count_size)
        _, compiled = _first_call(fn, args)
        rows["counts"][name] = loops(compiled.as_text())
    write(rows)
    for n in sizes:
        compiled, first = {}, {name: [] for name in libs}
        for _ in range(firsts):
            for name, lib in libs.items():
                fn, args = program(lib, n)
                seconds, compiled[name] = _first_call(fn, args)
                first[name].append(seconds)
        x = program(next(iter(libs.values())), n)[1]
        runs = {name: [] for name in libs}
        for name in libs:  # warm up
            jax.block_until_ready(compiled[name](*x))
        for _ in range(repeats):
            for name in libs:
                start = time.perf_counter()
                jax.block_until_ready(compiled[name](*x))
                runs[name].append(time.perf_counter() - start)
        grads = {name: np.asarray(compiled[name](*x)[0]) for name in libs}
        ref = grads[next(iter(libs))]
        for name in libs:
            diff = float(np.max(np.abs(grads[name] - ref)) / np.max(np.abs(ref)))
            rows["times"].append({
                "n": n, "tree": name, "run_min": min(runs[name]),
                "run_median": statistics.median(runs[name]),
                "first_min": min(first[name]), "grad_diff": diff,
            })  # fmt: skip
        write(rows)


def _markdown(rows, count_size: int) -> str:
    lines = [f"Row operations per while loop (optimized HLO, N = {count_size}):", ""]
    lines += ["| tree | loop | " + " | ".join(ROW_OPS) + " | while | fusion | size |"]
    lines += ["|---" * (len(ROW_OPS) + 5) + "|"]
    for name, found in rows["counts"].items():
        for i, loop in enumerate(found):
            ops = " | ".join(str(loop["ops"][k]) for k in ROW_OPS)
            label = "  " * loop["depth"] + f"{i}"
            lines.append(
                f"| {name} | {label} | {ops} | {loop['ops']['while']} | "
                f"{loop['ops']['fusion']} | {loop['size']} |"
            )
    lines += ["", "| N | tree | run min | run median | first call min | grad diff |"]
    lines += ["|---|---|---|---|---|---|"]
    for r in rows["times"]:
        lines.append(
            f"| {r['n']} | {r['tree']} | {r['run_min'] * 1e3:.2f} ms | "
            f"{r['run_median'] * 1e3:.2f} ms | {r['first_min']:.2f} s | "
            f"{r['grad_diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=pathlib.Path, action="append", default=[])
    parser.add_argument("--sizes", default="", help="run-time sizes, e.g. 4096")
    parser.add_argument("--count-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--first-calls", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    a = parser.parse_args()
    import solverkit

    libs = {}
    for tree in a.old:  # named by their folders
        libs[tree.name] = load(tree, f"solverkit_{len(libs)}")
    libs["this tree"] = solverkit
    sizes = [int(s) for s in a.sizes.split(",") if s]

    def write(rows):  # after each size, so a run cut short leaves its figures
        rows["backend"] = jax.default_backend()
        rows["paths"] = {name: lib.__file__ for name, lib in libs.items()}
        text = _markdown(rows, a.count_size)
        print(text, flush=True)
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "fixed_grad_ab.json").write_text(json.dumps(rows, indent=1))
            (a.out / "fixed_grad_ab.md").write_text(text + "\n")

    _measure(libs, sizes, a.count_size, a.repeats, a.first_calls, write)


if __name__ == "__main__":
    jnp.zeros(())  # the backend, before the trees are imported
    main()
