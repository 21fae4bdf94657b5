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
python -m benchmarks.first_call --dtype float32 --repeats 2 --budget 150 --out DIR
```

`--out DIR` writes `first_call.md` and `first_call.json` (rewritten after each case);
`--budget S` skips the cases left once S seconds have passed (listed in both).

To see the compile time of every kernel, run with
`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=ir_compiler=2` ("Compiled LLVM module ...").
`--save DIR` writes each program's StableHLO, for `python -m benchmarks.compile_ab`
(two versions' compile times, measured in one process).
"""

import argparse
import json
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


def _case(args, libs, names, case: str, variant: str, size: int) -> list[dict]:
    """One row per library: phases of `--repeats` first calls, libraries in turn."""
    tasks = {
        t.library: t
        for t in CASES[case].tasks(size, libs, args.dtype)
        if t.variant == variant
        and t.library in names
        and not (args.dtype == "float32" and t.dtype == "float64")
    }
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
    medians = {n: statistics.median(a + b for a, b, _ in r) for n, r in rows.items()}
    out = []
    for name, r in rows.items():
        trace, compile_ = [a for a, _, _ in r], [b for _, b, _ in r]
        base = medians.get(names[-1])
        out.append({
            "case": f"{case}/{variant}", "size": size, "library": name,
            "trace_min_s": min(trace), "trace_median_s": statistics.median(trace),
            "compile_min_s": min(compile_),
            "compile_median_s": statistics.median(compile_),
            "kernels": r[0][2], "first_median_s": medians[name],
            "ratio": medians[name] / base if base else None,
        })  # fmt: skip
    return out


def _line(r: dict) -> str:
    ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
    return (
        f"| {r['case']} | {r['size']} | {r['library']} | "
        f"{r['trace_min_s']:.2f} / {r['trace_median_s']:.2f} s | "
        f"{r['compile_min_s']:.2f} / {r['compile_median_s']:.2f} s | "
        f"{r['kernels']} | {ratio} |"
    )


def _worst(rows: list[dict], last: str) -> str:
    """The largest ratio of a library other than `last` to `last`'s."""
    ratios = [r for r in rows if r["library"] != last and r["ratio"] is not None]
    if not ratios:
        return ""
    worst = max(ratios, key=lambda r: r["ratio"])
    return (
        f"\nLargest first-call ratio to {last}: {worst['ratio']:.2f} "
        f"({worst['library']}, {worst['case']}, N = {worst['size']}).\n"
    )


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
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="folder for .md and .json"
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds in all")
    args = parser.parse_args()
    for folder in (args.save, args.out):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    libs, _ = load_peers(args.peers.split(","))
    names = [n for n in args.peers.split(",") if n in libs]
    only = None if args.only is None else set(args.only.split(","))
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX's own start-up
    head = (
        "| case/variant | N | library | trace+lower min / median | compile min / "
        "median | kernels | first / first of " + names[-1] + " (median) |\n"
        "|---|---|---|---|---|---|---|"
    )
    print(head, flush=True)
    rows, skipped, start = [], [], time.perf_counter()
    for case, variant, size in QUICK:
        if only is not None and f"{case}/{variant}" not in only:
            continue
        if args.budget is not None and time.perf_counter() - start > args.budget:
            skipped.append(f"{case}/{variant}")
            continue
        for row in _case(args, libs, names, case, variant, size):
            rows.append(row)
            print(_line(row), flush=True)
        _write(args.out, head, rows, skipped, names[-1])
    _write(args.out, head, rows, skipped, names[-1])
    print(_worst(rows, names[-1]))


def _write(out, head: str, rows: list[dict], skipped: list[str], last: str) -> None:
    if out is None:
        return
    meta = {"device": jax.devices()[0].device_kind, "skipped (budget)": skipped}
    (out / "first_call.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    note = f"\nSkipped (budget spent): {', '.join(skipped)}\n" if skipped else ""
    table = "\n".join([head] + [_line(r) for r in rows])
    (out / "first_call.md").write_text(table + "\n" + _worst(rows, last) + note)


if __name__ == "__main__":
    main()
