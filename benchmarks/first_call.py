"""First calls, measured so that two libraries can be compared within a few percent.

`python -m benchmarks --quick` times one first call per row, minutes apart; on a
shared CPU that drifts by tens of percent. Here every library's program is traced,
lowered and compiled `--repeats` times, the libraries taking turns, in one process,
and the minimum and median of each phase are reported, with the number of XLA
kernels (fusions) of the compiled program: on the CPU each kernel is an LLVM module
of its own, and compile time follows their number and size.

```bash
python -m benchmarks.first_call                       # the --quick cases
python -m benchmarks.first_call --only lotka_volterra/grad-checkpoint --repeats 7
```

To see the compile time of every kernel, run with
`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=ir_compiler=2` ("Compiled LLVM module ...").
`--save DIR` writes each program's StableHLO, for `python -m benchmarks.compile_ab`
(two versions' compile times, measured in one process).
"""

import argparse
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp

from .cases import CASES, load_peers
from .harness import precision


# (case, variant, size): the variants of `python -m benchmarks --quick`, one size each.
QUICK = [
    ("lotka_volterra", "forward", 1024),
    ("lotka_volterra", "grad-checkpoint", 1024),
    ("lotka_volterra", "grad-backsolve", 1024),
    ("lorenz", "fixed-forward", 256),
    ("lorenz", "adaptive-forward", 256),
    ("lorenz", "adaptive-grad", 256),
    ("neural_ode", "grad-backsolve", 256),
    ("stiff", "rober", 64),
    ("stiff", "hires", 64),
]


def _kernels(compiled) -> int:
    return len(re.findall(r" fusion\(", compiled.as_text()))


def _phases(job, save: pathlib.Path | None) -> tuple[float, float, int]:
    """Seconds to trace and lower, seconds to compile, and the kernel count; the
    program's StableHLO is written to `save` if given."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(job.fn).trace(*job.args).lower()
    middle = time.perf_counter()
    compiled = lowered.compile()
    end = time.perf_counter()
    if save is not None:
        save.write_text(lowered.as_text(debug_info=False))
    return middle - start, end - middle, _kernels(compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", default="solverkit,diffrax")
    parser.add_argument(
        "--only", default=None, help="comma list of case/variant (default: all)"
    )
    parser.add_argument("--save", type=pathlib.Path, default=None, help="folder")
    parser.add_argument(
        "--dtype",
        choices=("float32",),
        default=None,
        help="float32: float64 variants in float32, float64-only ones left out",
    )
    args = parser.parse_args()
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    libs, _ = load_peers(args.peers.split(","))
    names = [n for n in args.peers.split(",") if n in libs]
    only = None if args.only is None else set(args.only.split(","))
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX's own start-up
    print(
        "| case/variant | N | library | trace+lower min / median | compile min / "
        "median | kernels | first / first of " + names[-1] + " (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for case, variant, size in QUICK:
        if only is not None and f"{case}/{variant}" not in only:
            continue
        tasks = {
            t.library: t
            for t in CASES[case].tasks(size, libs, args.dtype)
            if t.variant == variant
            and t.library in names
            and not (args.dtype == "float32" and t.dtype == "float64")
        }
        if not tasks:
            continue
        rows: dict[str, list[tuple[float, float, int]]] = {n: [] for n in tasks}
        jobs = {}
        for name, task in tasks.items():
            with precision(task.dtype):
                jobs[name] = task.make()
        for _ in range(args.repeats):
            for name, task in tasks.items():
                save = None
                if args.save is not None:
                    save = args.save / f"{case}-{variant}-{name}.mlir"
                with precision(task.dtype):
                    rows[name].append(_phases(jobs[name], save))
        medians = {
            n: statistics.median(a + b for a, b, _ in r) for n, r in rows.items()
        }
        for name, r in rows.items():
            trace = [a for a, _, _ in r]
            compile_ = [b for _, b, _ in r]
            ratio = medians[name] / medians[names[-1]] if names[-1] in medians else 0
            print(
                f"| {case}/{variant} | {size} | {name} | "
                f"{min(trace):.2f} / {statistics.median(trace):.2f} s | "
                f"{min(compile_):.2f} / {statistics.median(compile_):.2f} s | "
                f"{r[0][2]} | {ratio:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
