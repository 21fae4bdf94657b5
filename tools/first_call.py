"""First calls, measured so that two libraries can be compared within a few percent.

`python -m benchmarks --quick` times one first call per row, minutes apart; on a
shared CPU that drifts by tens of percent. Here every library's program is traced,
lowered and compiled `--repeats` times, the libraries taking turns, in one process,
and the minimum and median of each phase are reported, with the number of XLA
kernels (fusions) of the compiled program: on the CPU each kernel is an LLVM module
of its own, and compile time follows their number and size. Trace and lower are
also given apart, with the run of the compiled program and the seconds Python's
garbage collector took inside trace and lower (a full collection can take 0.4 s:
each call starts from a collected heap, so one library does not pay for the
other's garbage).

```bash
python -m tools.first_call                       # the --quick cases
python -m tools.first_call --only lotka_volterra/grad-checkpoint --repeats 7
python -m tools.first_call --dtype float32 --repeats 2 --budget 150 --out DIR
python -m tools.first_call --only lorenz/fixed-forward --profile DIR  # cProfile
```

`--out DIR` writes `first_call.md` and `first_call.json` (rewritten after each case);
`--budget S` skips the cases left once S seconds have passed (listed in both).
`--profile DIR` writes, for each library's last repeat, the cProfile statistics of
its trace and lower (`.prof`, and the 40 costliest functions as text); the
profiler slows those phases several times, so take timings from a run without it.

To see the compile time of every kernel, run with
`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=ir_compiler=2` ("Compiled LLVM module ...").
`--save DIR` writes each program's StableHLO (`.mlir`), to compile again elsewhere,
e.g. with `python -m tools.compile_flags`.
"""

import argparse
import cProfile
import gc
import io
import json
import pathlib
import pstats
import re
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.cases import CASES, load_peers
from benchmarks.harness import precision


# (case, variant, size): the variants of `python -m benchmarks --quick`, one size each.
QUICK = [
    ("lotka_volterra", "forward", 1024),
    ("lotka_volterra", "grad-checkpoint", 1024),
    ("lotka_volterra", "grad-backsolve", 1024),
    ("lorenz", "fixed-forward", 256),
    ("lorenz", "adaptive-forward", 256),
    ("lorenz", "adaptive-grad", 256),
    ("lorenz", "fixed-grad", 256),  # the accel table's largest single-shot ratio
    ("neural_ode", "grad-backsolve", 256),
    ("stiff", "rober", 64),
    ("stiff", "hires", 64),
]


def _kernels(compiled) -> int:
    return len(re.findall(r" fusion\(", compiled.as_text()))


class _GcClock:
    """Seconds spent in Python's garbage collector while `running`."""

    def __init__(self):
        self.seconds, self._start, self.running = 0.0, 0.0, False

    def __call__(self, phase: str, info: dict) -> None:
        if not self.running:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def _phases(job, save: pathlib.Path | None, profile: pathlib.Path | None) -> dict:
    """Seconds to trace, lower, compile and run once, the garbage collector's seconds
    within trace and lower, and the kernel count; the program's StableHLO is written
    to `save` and the trace and lower's cProfile statistics to `profile`, if given."""
    jax.clear_caches()
    gc.collect()  # every call starts from the same heap (see the module's docstring)
    clock, profiler = _GcClock(), cProfile.Profile() if profile else None
    gc.callbacks.append(clock)
    clock.running = True
    try:
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        traced = jax.jit(job.fn).trace(*job.args)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        middle = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        clock.running = False
    finally:
        gc.callbacks.remove(clock)
    compiled = lowered.compile()
    end = time.perf_counter()
    jax.block_until_ready(compiled(*job.args))
    ran = time.perf_counter()
    if save is not None:
        save.write_text(lowered.as_text(debug_info=False))
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile.with_suffix(".prof"))
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(40)
        profile.with_suffix(".txt").write_text(text.getvalue())
    return {
        "trace": traced_at - start, "lower": middle - traced_at,
        "compile": end - middle, "run": ran - end, "gc": clock.seconds,
        "kernels": _kernels(compiled),
    }  # fmt: skip


def _case(args, libs, names, case: str, variant: str, size: int) -> list[dict]:
    """One row per library: phases of `--repeats` first calls, libraries in turn."""
    tasks = {
        t.library: t
        for t in CASES[case].tasks(size, libs, args.dtype)
        if t.variant == variant
        and t.library in names
        and not (args.dtype == "float32" and t.dtype == "float64")
    }
    rows: dict[str, list[dict]] = {n: [] for n in tasks}
    jobs = {}
    for name, task in tasks.items():
        with precision(task.dtype):
            jobs[name] = task.make()
    for _ in range(args.repeats):
        for name, task in tasks.items():
            save = profile = None
            if args.save is not None:
                save = args.save / f"{case}-{variant}-{name}.mlir"
            if args.profile is not None:
                profile = args.profile / f"{case}-{variant}-{name}"
            with precision(task.dtype):
                rows[name].append(_phases(jobs[name], save, profile))
    first = {
        n: [p["trace"] + p["lower"] + p["compile"] for p in r] for n, r in rows.items()
    }
    medians = {n: statistics.median(f) for n, f in first.items()}
    out = []
    for name, r in rows.items():
        median = lambda key: statistics.median(p[key] for p in r)  # noqa: E731
        trace = [p["trace"] + p["lower"] for p in r]
        compile_ = [p["compile"] for p in r]
        base = medians.get(names[-1])
        out.append({
            "case": f"{case}/{variant}", "size": size, "library": name,
            "trace_min_s": min(trace), "trace_median_s": statistics.median(trace),
            "trace_only_median_s": median("trace"), "lower_median_s": median("lower"),
            "gc_median_s": median("gc"), "run_median_s": median("run"),
            "compile_min_s": min(compile_),
            "compile_median_s": statistics.median(compile_),
            "kernels": r[0]["kernels"], "first_median_s": medians[name],
            "ratio": medians[name] / base if base else None,
        })  # fmt: skip
    return out


def _line(r: dict) -> str:
    ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
    return (
        f"| {r['case']} | {r['size']} | {r['library']} | "
        f"{r['trace_min_s']:.2f} / {r['trace_median_s']:.2f} s | "
        f"{r['compile_min_s']:.2f} / {r['compile_median_s']:.2f} s | "
        f"{r['kernels']} | {ratio} | {r['trace_only_median_s']:.2f} / "
        f"{r['lower_median_s']:.2f} / {r['gc_median_s']:.2f} / "
        f"{r['run_median_s']:.3f} s |"
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
    parser.add_argument(
        "--profile", type=pathlib.Path, default=None, help="folder for cProfile stats"
    )
    args = parser.parse_args()
    for folder in (args.save, args.out, args.profile):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    libs, _ = load_peers(args.peers.split(","))
    names = [n for n in args.peers.split(",") if n in libs]
    only = None if args.only is None else set(args.only.split(","))
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX's own start-up
    head = (
        "| case/variant | N | library | trace+lower min / median | compile min / "
        "median | kernels | first / first of " + names[-1] + " (median) | trace / "
        "lower / gc in them / run (medians) |\n"
        "|---|---|---|---|---|---|---|---|"
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
