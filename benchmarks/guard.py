"""`python -m benchmarks.guard`: the ratios that matter against diffrax, compared with
a committed baseline, so that a slowdown cannot pass unseen.

Each row is one of the suite's cases (`cases.py`, the same tasks as `python -m
benchmarks`), run by solverkit and diffrax in this one process: first calls (trace,
lower, compile and one run, after `jax.clear_caches()`, the persistent cache off)
and run times, the two libraries taking turns, `--first-repeats` and `--repeats`
times; each ratio is solverkit's median over diffrax's. A ratio fails where it is
more than `TOLERANCE` above its baseline (`guard_baseline.json`), or above its
standing bound (`BOUNDS`) where it has one. The exit status is the number of
failures (0: none); the last line sums it up.

```bash
python -m benchmarks.guard                    # about a minute on two CPU cores
python -m benchmarks.guard --write-baseline   # measure, and rewrite the baseline
python -m benchmarks.guard --only lotka_volterra/grad-checkpoint --repeats 9
```
"""

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from .cases import CASES, load_peers
from .harness import Job, precision, warm_up


BASELINE = pathlib.Path(__file__).with_name("guard_baseline.json")
LIBRARIES = ("solverkit", "diffrax")
TOLERANCE = 0.25  # a ratio fails above (1 + TOLERANCE) times its baseline


@dataclasses.dataclass(frozen=True)
class Row:
    """One case of the suite at one size, and which of its ratios are judged.

    **Arguments:**

    - `case`, `variant`, `size`: the suite's task (`cases.CASES`).
    - `judged`: the ratios that can fail, of `("run", "first")`; the others are
        measured and printed only.
    """

    case: str
    variant: str
    size: int
    judged: tuple[str, ...] = ("run", "first")

    @property
    def name(self) -> str:
        return f"{self.case}/{self.variant}"


ROWS = (
    Row("lorenz", "adaptive-forward", 1024),
    Row("lorenz", "adaptive-grad", 1024),
    # A generous `max_steps` (10**5 for ~110 steps): the checkpointed gradient's
    # step record is sized by it and filled on every call.
    Row("lorenz", "adaptive-grad-max-1e5", 1024, ("run",)),
    Row("lotka_volterra", "forward", 1024),
    Row("lotka_volterra", "grad-checkpoint", 1024),
    # Backsolve's standing decision: its first call wins over its run time.
    Row("lotka_volterra", "grad-backsolve", 1024, ("first",)),
    # ROBER's run ratio is ~0.01-0.03, diffrax's run (0.1-0.4 s) the noise in it.
    Row("stiff", "rober", 64, ("first",)),
    Row("stiff", "hires", 64),
)

# Standing bounds, judged instead of the baseline's tolerance: on a CPU, the first
# calls of the checkpointed gradients are to stay within 0.6 of diffrax's.
BOUNDS = {
    "lorenz/adaptive-grad first": 0.6,
    "lotka_volterra/grad-checkpoint first": 0.6,
}


def _jobs(row: Row, libs: dict[str, Any]) -> dict[str, tuple[str, Job]]:
    """Each library's `(dtype, job)` for `row`, built from the suite's tasks."""
    tasks = CASES[row.case].tasks(row.size, libs, None, True)
    jobs = {}
    for task in tasks:
        if task.variant == row.variant and task.library in LIBRARIES:
            with precision(task.dtype):
                jobs[task.library] = (task.dtype, task.make())
    missing = set(LIBRARIES) - set(jobs)
    if missing:
        raise ValueError(f"{row.name}: no task for {sorted(missing)}")
    return jobs


def _first_call(job: Job) -> tuple[float, Callable[[], Any]]:
    """Seconds of a cold first call (trace, lower, compile, one run), and the
    compiled program's call."""
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(job.fn).lower(*job.args).compile()
    jax.block_until_ready(compiled(*job.args))
    return time.perf_counter() - start, lambda: compiled(*job.args)


def measure(row: Row, libs: dict[str, Any], first: int, repeats: int) -> dict:
    """Each library's first calls and timed runs on `row`, the libraries taking
    turns at every first call and every timed run: `{"first": {library: [s, ...]},
    "run": {...}}`."""
    jobs = _jobs(row, libs)
    times: dict[str, dict[str, list[float]]] = {
        kind: {name: [] for name in jobs} for kind in ("first", "run")
    }
    calls = {}
    for _ in range(first):
        for name, (dtype, job) in jobs.items():
            with precision(dtype):
                seconds, calls[name] = _first_call(job)
            times["first"][name].append(seconds)
    for _ in range(repeats):
        for name, (dtype, _) in jobs.items():
            with precision(dtype):
                start = time.perf_counter()
                jax.block_until_ready(calls[name]())
                times["run"][name].append(time.perf_counter() - start)
    return times


def summary(times: dict) -> dict:
    """`measure`'s times as medians per library and the two ratios (solverkit's
    median over diffrax's)."""
    out: dict[str, Any] = {}
    for kind, by_library in times.items():
        medians = {name: statistics.median(t) for name, t in by_library.items()}
        out[f"{kind}_s"] = {name: round(m, 5) for name, m in medians.items()}
        out[kind] = round(medians["solverkit"] / medians["diffrax"], 3)
    return out


def judge(name: str, baseline: dict[str, float]) -> tuple[float, str]:
    """The limit of the ratio `name` and what it is (its standing bound, or its
    baseline's tolerance); an infinite limit where there is neither."""
    if name in BOUNDS:
        return BOUNDS[name], "bound"
    if name in baseline:
        return baseline[name] * (1 + TOLERANCE), f"baseline {baseline[name]:.3f}"
    return float("inf"), "no baseline"


def _worse(row: Row, result: dict, baseline: dict[str, float]) -> list[str]:
    """The judged ratios of `row` past their limits."""
    names = [f"{row.name} {kind}" for kind in row.judged]
    return [n for n in names if result[n.split()[-1]] > judge(n, baseline)[0]]


def guard_row(row: Row, libs: dict[str, Any], args, baseline: dict) -> dict:
    """`row` measured, and where a judged ratio is past its limit, measured again
    (`--confirm` rounds at most) and judged on the medians of all rounds: one slow
    moment of a shared machine does not fail the guard."""
    times = measure(row, libs, args.first_repeats, args.repeats)
    result = summary(times)
    for _ in range(args.confirm):
        if not _worse(row, result, baseline):
            break
        more = measure(row, libs, args.first_repeats, args.repeats)
        for kind, by_library in more.items():
            for name, seconds in by_library.items():
                times[kind][name] += seconds
        result = summary(times)
    result["size"] = row.size
    result["rounds"] = len(times["first"]["diffrax"]) // args.first_repeats
    return result


def _print(row: Row, result: dict, baseline: dict) -> None:
    for kind in ("first", "run"):
        name, value = f"{row.name} {kind}", result[kind]
        seconds = result[f"{kind}_s"]
        times = f"{seconds['solverkit']:.4g} / {seconds['diffrax']:.4g}"
        if kind not in row.judged:
            limit, mark = "", "not judged"
        else:
            limit, why = judge(name, baseline)
            limit = f"{limit:.3f} ({why})"
            mark = "WORSE" if name in _worse(row, result, baseline) else "ok"
        print(
            f"| {name} | {row.size} | {value:.3f} | {limit} | {mark} | "
            f"{times} | {result['rounds']} |",
            flush=True,
        )


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=BASELINE.parent, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.guard",
        description="solverkit against diffrax, judged against a committed baseline",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs each")
    parser.add_argument(
        "--first-repeats", type=int, default=1, help="cold first calls each"
    )
    parser.add_argument(
        "--confirm",
        type=int,
        default=2,
        help="rounds more, at most, for a row with a ratio past its limit",
    )
    parser.add_argument("--only", default=None, help="comma list of case/variant")
    parser.add_argument("--baseline", type=pathlib.Path, default=BASELINE)
    parser.add_argument(
        "--write-baseline", action="store_true", help="rewrite --baseline from this run"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure, print and judge every row; returns the number of failures."""
    args = parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # first calls are cold
    libs, missing = load_peers(list(LIBRARIES))
    if missing:
        raise SystemExit(f"guard: needs {', '.join(missing)}")
    only = None if args.only is None else set(args.only.split(","))
    rows = [r for r in ROWS if only is None or r.name in only]
    old = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
    baseline = old.get("ratios", {})
    start = time.perf_counter()
    warm_up()
    ratios, measured, failed = {}, {}, []
    print("| ratio | N | now | limit | | solverkit / diffrax s | rounds |")
    print("|---" * 7 + "|")
    for row in rows:
        result = guard_row(row, libs, args, baseline)
        measured[row.name] = result
        ratios.update({f"{row.name} {kind}": result[kind] for kind in row.judged})
        failed += _worse(row, result, baseline)
        _print(row, result, baseline)
    seconds, judged = time.perf_counter() - start, len(ratios)
    if args.write_baseline:
        if only is not None:  # the other rows keep their baseline
            kept = {k: v for k, v in baseline.items() if k.split()[0] not in measured}
            ratios = {**kept, **ratios}
            measured = {**old.get("measured", {}), **measured}
        _write(args, ratios, measured, seconds)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nguard: {seconds:.0f} s at load average {load} (load skews ratios)")
    print(f"guard: worse: {', '.join(failed) or 'none'}")
    print(
        f"guard: {judged} ratios, {len(failed)} worse than baseline by > "
        f"{TOLERANCE:.0%} (or above their bound)"
    )
    return 1 if failed else 0


def _write(args, ratios: dict, measured: dict, seconds: float) -> None:
    data = {
        "how": (
            "python -m benchmarks.guard --write-baseline "
            f"--repeats {args.repeats} --first-repeats {args.first_repeats}"
            + ("" if args.only is None else f" (rows {args.only} rewritten)")
            + ": "
            "solverkit's median over diffrax's, the libraries taking turns in one "
            "process; first calls cold (trace, lower, compile, one run)"
        ),
        "commit": _commit(),
        "date": datetime.date.today().isoformat(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "seconds": round(seconds, 1),
        "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
        "ratios": ratios,
        "measured": measured,
    }
    args.baseline.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.baseline}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
