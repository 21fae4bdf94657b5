"""Summarise a profiled test run: compilations and CPU time per tier and per file.

Record, then summarise (numbers that do not depend on the machine's load: counts of
XLA compilations, and CPU seconds, which load changes far less than wall time):

    SOLVERKIT_TEST_PROFILE=/tmp/prof SOLVERKIT_TEST_JAX_CACHE=/tmp/empty-cache \\
        python -m pytest -q -m "not slow"
    python -m tools.suite_profile /tmp/prof --top 10 [--out DIR]

`--quick-ids FILE` (the node ids of `pytest --collect-only -q -m "not slow"`, one a
line) re-tiers the recorded rows: what the quick loop of another checkout would cost,
test by test, from one run's records.

`compiles` counts XLA backend compilations, a persistent-cache read included
(`cache_hits` says how many were reads); `compile_s` is their seconds, `trace_s`
and `lower_s` the tracing to a jaxpr and lowering to StableHLO: wall-clock seconds,
which a loaded machine stretches. `cpu_s` is the process's CPU time (all threads), with
that of the subprocesses a test waited for (examples, benchmark smoke tests).
"""

import argparse
import collections
import json
import pathlib


_FIELDS = ("compiles", "cache_hits", "trace_s", "lower_s", "compile_s", "cpu_s")


def load(where: pathlib.Path) -> list[dict]:
    """The rows of every `*.jsonl` file under `where` (one row per test), each with
    the process that ran it (`worker`: the file's name)."""
    rows = []
    for path in sorted(where.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        rows += [dict(json.loads(line), worker=path.stem) for line in lines if line]
    return rows


def workers(rows: list[dict]) -> str:
    """Markdown: per pytest process, its tests, CPU time and when its last test
    ended, in seconds after the first test of the run started (pytest-xdist's
    workers should end near together; rows recorded before these times were kept
    have none)."""
    timed = [r for r in rows if "started" in r]
    if not timed:
        return ""
    start = min(r["started"] for r in timed)
    lines = ["## Workers", "| process | tests | CPU s | last test ended at s |"]
    lines.append("|---|---|---|---|")
    per = collections.defaultdict(list)
    for r in timed:
        per[r["worker"]].append(r)
    for name, own in sorted(per.items()):
        end = max(r["ended"] for r in own) - start
        cpu = sum(r["cpu_s"] for r in own)
        lines.append(f"| {name} | {len(own)} | {cpu:.1f} | {end:.0f} |")
    return "\n".join(lines) + "\n"


def totals(rows: list[dict]) -> dict[str, float]:
    """Sums of the fields over `rows`, with the number of tests."""
    out = {f: sum(r[f] for r in rows) for f in _FIELDS}
    out["tests"] = len(rows)
    return out


def _line(name: str, t: dict[str, float]) -> str:
    return (
        f"| {name} | {t['tests']} | {t['compiles']:.0f} | {t['cache_hits']:.0f} "
        f"| {t['trace_s']:.1f} | {t['lower_s']:.1f} | {t['compile_s']:.1f} "
        f"| {t['cpu_s']:.1f} |"
    )


def _by_file(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The rows grouped by test file, the costliest (CPU time) first."""
    per_file = collections.defaultdict(list)
    for r in rows:
        per_file[r["nodeid"].split("::")[0]].append(r)
    return sorted(per_file.items(), key=lambda kv: -totals(kv[1])["cpu_s"])


def report(rows: list[dict], top: int) -> str:
    """Markdown: totals per tier, then the `top` files and the `top` tests by CPU
    time (of the quick loop, and of the whole run)."""
    head = (
        "| | tests | compiles | cache reads | trace s | lower s | compile s | CPU s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    quick = [r for r in rows if not r["slow"]]
    slow = [r for r in rows if r["slow"]]
    lines = ["## Tiers", head]
    lines += [_line("quick (not slow)", totals(quick)), _line("slow", totals(slow))]
    lines.append(_line("all", totals(rows)))
    for name, tier in (("quick loop", quick), ("whole run", rows)):
        lines += ["", f"## Top {top} files of the {name} by CPU time", head]
        lines += [_line(f, totals(r)) for f, r in _by_file(tier)[:top]]
    for name, tier in (("quick loop", quick), ("whole run", rows)):
        lines += ["", f"## Top {top} tests of the {name} by CPU time", head]
        costliest = sorted(tier, key=lambda r: -r["cpu_s"])[:top]
        lines += [_line(r["nodeid"], dict(r, tests=1)) for r in costliest]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("where", type=pathlib.Path, help="SOLVERKIT_TEST_PROFILE dir")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", type=pathlib.Path, help="also write report.md here")
    parser.add_argument("--quick-ids", type=pathlib.Path, help="re-tier by these ids")
    args = parser.parse_args()
    rows = load(args.where)
    if args.quick_ids is not None:
        quick = set(args.quick_ids.read_text().splitlines())
        rows = [dict(r, slow=r["nodeid"] not in quick) for r in rows]
    text = report(rows, args.top)
    table = workers(rows)
    text += "\n" + table if table else ""
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)


if __name__ == "__main__":
    main()
