"""`python -m benchmarks`: run the benchmark cases and write the results."""

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
from tqdm import tqdm

from . import report
from .cases import Case, CASES, load_peers, PEERS, Reference, Task
from .harness import first_line, max_abs_error, measure, precision, Record, warm_up


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _deadlines(text: str) -> dict[str | None, float]:
    """`"100"` -> {None: 100.0}; `"lorenz=200,neural_ode=80"` -> per case."""
    out: dict[str | None, float] = {}
    for item in _csv(text):
        name, _, seconds = item.rpartition("=")
        out[name or None] = float(seconds)
    return out


def _bool(text: str) -> bool:
    """`"true"` / `"false"` (any case) -> bool, for `--throw`."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value == "true"


def spread(sizes: list[int]) -> list[int]:
    """Sizes in the order they run: the smallest, the largest, then the middle ones
    by bisection, so that a --deadline leaves a coarser sweep, not a truncated one."""
    sizes = sorted(set(sizes))
    order = [0, len(sizes) - 1] if len(sizes) > 1 else [0]
    spans = [(0, len(sizes) - 1)]
    while spans:
        lo, hi = spans.pop(0)
        if hi - lo > 1:
            mid = (lo + hi) // 2
            order.append(mid)
            spans += [(lo, mid), (mid, hi)]
    return [sizes[i] for i in order]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run solverkit and its peers on the same problems, in one process.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: a CPU smoke run (< 3 min)"
    )
    parser.add_argument(
        "--cases",
        type=_csv,
        default=list(CASES),
        help=f"comma list of cases (default: all of {','.join(CASES)})",
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in _csv(s)],
        default=None,
        help="comma list of ensemble sizes for every case (default: per case and "
        "device; see README)",
    )
    parser.add_argument(
        "--variants",
        type=_csv,
        default=None,
        help="comma list of variants to run, in this order at each size, e.g. "
        "forward,grad-backsolve (default: all, in the case's order; see README)",
    )
    parser.add_argument(
        "--peers",
        type=_csv,
        default=None,
        help=f"comma list of libraries (default: {','.join(PEERS)}; with --quick "
        "solverkit,diffrax); missing ones are skipped with a note",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="output folder (default: benchmarks/results/<device-kind>/)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs after the first call (default 5, 3 with --quick)",
    )
    parser.add_argument(
        "--repeat-budget",
        type=float,
        default=None,
        help="seconds: no further timed run of a row starts once its timed runs "
        "have taken this long (at least one always runs; default 10, 2 with --quick)",
    )
    parser.add_argument(
        "--throw",
        type=_bool,
        default=True,
        metavar="{true,false}",
        help="`throw` of every solverkit and diffrax solve alike (default true, both "
        "libraries' default; gradsolve has no such setting). A jitted solve with "
        "throw=True carries a run-time error check, a host callback (about 2 ms a "
        "call on a TPU); false measures the solvers without it",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds: once one size of a (case, variant, library) series takes "
        "longer than this (first call + repeats), its larger sizes are skipped",
    )
    parser.add_argument(
        "--deadline",
        type=_deadlines,
        default={},
        help="seconds per case, as one number for every case or as "
        "case=seconds,...: once a case has run this long, its tasks not yet "
        "started are skipped",
    )
    parser.add_argument(
        "--grad-max-size",
        type=int,
        default=None,
        help="largest ensemble size N for gradient variants; larger ones are "
        "recorded as skipped (checkpoints take memory: the Lorenz gradient needs "
        "about 16 KiB per trajectory)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32",),
        default=None,
        help="float32: every solverkit and diffrax variant in float32 (adaptive "
        "tolerances loosened to what float32 resolves; on a TPU float64 is emulated); "
        "tasks that exist only in float64 are recorded as skipped",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows already in --out's results.json that this run does not "
        "measure (other cases, sizes or variants: to run parts of the suite in "
        "separate processes into one folder)",
    )
    args = parser.parse_args(argv)
    if not args.cases:
        parser.error("--cases: name at least one case")
    for names, flag in ((args.cases, "--cases"), (args.deadline, "--deadline")):
        unknown = [c for c in names if c is not None and c not in CASES]
        if unknown:
            parser.error(f"{flag}: unknown case(s) {unknown}; known: {list(CASES)}")
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeat_budget is None:
        args.repeat_budget = 2.0 if args.quick else 10.0
    if args.peers is None:
        args.peers = ["solverkit", "diffrax"] if args.quick else list(PEERS)
    return args


def device_slug() -> str:
    """The device kind as a folder name, e.g. `cpu` or `nvidia-h200`."""
    kind = jax.devices()[0].device_kind
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The repository's commit (with `+` if the tree has changes), if git can say."""
    root = pathlib.Path(__file__).parent.parent
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return None
    return (head + ("+" if dirty else "")) or None


def metadata(
    argv: list[str], args: argparse.Namespace, profile: str, missing: dict[str, str]
) -> dict:
    """What ran where: device, versions, commit, command, settings."""
    packages = (
        "jax",
        "jaxlib",
        "solverkit",
        "diffrax",
        "equinox",
        "gradsolve",
        "torchdiffeq",
    )
    return {
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in packages},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "command": "python -m benchmarks " + shlex.join(argv),
        "profile": profile,
        "repeats": args.repeats,
        "throw": args.throw,
        "missing_peers": missing,
    }


def failure_status(error: BaseException, library: str) -> str:
    """`"oom"` when the device ran out of memory (for every library alike), else
    `"error"` for solverkit (either way of running it) and `"unsupported"` for a
    peer."""
    text = f"{type(error).__name__} {error}"
    if any(m in text for m in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")):
        return "oom"
    return "error" if library.startswith("solverkit") else "unsupported"


def run_task(
    task: Task,
    record: Record,
    reference: Reference | None,
    repeats: int,
    repeat_budget_s: float,
) -> None:
    """Build and measure one task into `record`; a failure becomes its status."""
    try:
        with precision(task.dtype):
            result = measure(task.make(), repeats, record, repeat_budget_s)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run a case is a result
        for field in (
            "first_call_s",
            "run_median_s",
            "run_min_s",
            "run_max_s",
            "memory_bytes",
            "steps",
        ):
            setattr(record, field, None)
        record.status = failure_status(e, task.library)
        record.note = first_line(e)
        return
    if reference is None:
        record.note = "no reference"
        return
    try:
        want = reference.values[task.compare]
        record.max_abs_error = max_abs_error(result, want, reference.rows)
    except Exception as e:  # noqa: BLE001
        record.note = f"error check failed: {first_line(e)}"


def _references(
    case: Case, sizes: list[int], deadline: float = math.inf
) -> dict[int, Reference | None]:
    """Every size's reference, computed before any timing (timing clears JAX's
    caches, and the reference compiles once for all sizes); none past `deadline`
    (`time.monotonic()`'s), where no row would run."""
    references: dict[int, Reference | None] = {}
    # On the host CPU where JAX has one: references are float64, which an
    # accelerator may lack or emulate (diffrax's float64 solves fail on a TPU).
    cpus = jax.devices("cpu") if _has_cpu() else []
    where = jax.default_device(cpus[0]) if cpus else contextlib.nullcontext()
    for size in sizes:
        if time.monotonic() > deadline:
            references[size] = None
            continue
        try:
            with where:
                references[size] = case.reference(size)
        except Exception as e:  # noqa: BLE001
            print(
                f"note: {case.name} N={size}: no reference ({first_line(e)})",
                file=sys.stderr,
            )
            references[size] = None
    return references


def _has_cpu() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:  # JAX_PLATFORMS excludes the CPU
        return False


def _grad_size(sizes: list[int]) -> int:
    """With --quick, gradients run at one size: the largest one up to 1024."""
    return max([s for s in sizes if s <= 1024] or [min(sizes)])


def plan(
    case: Case, sizes: list[int], libs: dict[str, Any], args: argparse.Namespace
) -> list[tuple[int, Task]]:
    """The (size, task) pairs to run, in order: sizes spread (see `spread`), and at
    each size the libraries of one variant one after the other (in the tables'
    order)."""
    out = []
    for size in spread(sizes):
        tasks = case.tasks(size, libs, args.dtype, args.throw)
        variants = list(dict.fromkeys(t.variant for t in tasks))
        if args.variants is not None:  # the order asked for
            variants = [v for v in args.variants if v in variants]
        for task in sorted(  # solverkit's rows first: the cheaper first calls
            (t for t in tasks if t.variant in variants),
            key=lambda t: (variants.index(t.variant), report.library_rank(t.library)),
        ):
            if args.quick and args.variants is None and case.quick_variants:
                if task.variant not in case.quick_variants:
                    continue
            if args.quick and not args.sizes and "grad" in task.variant:
                if size != _grad_size(sizes):
                    continue
            out.append((size, task))
    return out


def run_case(
    case: Case,
    sizes: list[int],
    libs: dict[str, Any],
    args: argparse.Namespace,
    records: list[Record],
    progress: Callable[[str], None],
    done: Callable[[], None] = lambda: None,
) -> None:
    """Run every planned task of `case`, appending a `Record` for each and calling
    `done()` after each (to write the rows so far: a run cut by a time limit keeps
    them)."""
    seconds = args.deadline.get(case.name, args.deadline.get(None, math.inf))
    deadline = time.monotonic() + seconds
    too_slow: dict[tuple[str, str], int] = {}  # (variant, library) -> size past budget
    todo = plan(case, sizes, libs, args)
    progress(f"{case.name}: references")
    references = _references(case, sorted({size for size, _ in todo}), deadline)
    for size, task in todo:
        progress(f"{case.name} N={size} {task.variant} {task.library}")
        record = Record(case.name, task.variant, size, task.library, task.dtype)
        record.throw = task.throw
        records.append(record)
        slow = too_slow.get((task.variant, task.library))
        too_big = args.grad_max_size is not None and size > args.grad_max_size
        if too_big and "grad" in task.variant:
            record.status = "skipped"
            record.note = f"N over --grad-max-size {args.grad_max_size}"
        elif args.dtype == "float32" and task.dtype == "float64":
            record.status = "skipped"
            record.note = "float64 only (--dtype float32)"
        elif time.monotonic() > deadline:
            record.status = "skipped"
            record.note = f"past --deadline ({seconds:g} s for this case)"
        elif slow is not None and size > slow:
            record.status = "skipped"
            record.note = f"N={slow} took over --budget {args.budget:g} s"
        else:
            run_task(task, record, references[size], args.repeats, args.repeat_budget)
            spent = (record.first_call_s or 0) + (
                record.run_median_s or 0
            ) * record.repeats
            if spent > args.budget:
                too_slow[task.variant, task.library] = min(size, slow or size)
        done()


def _kept_records(out: pathlib.Path, args: argparse.Namespace) -> list[Record]:
    """The rows in `out/results.json` that this run does not replace, if any: those
    of other cases, and with `--sizes` (`--variants`) those of a case's other sizes
    (variants); without `--sizes` a case's rows are all replaced."""
    try:
        rows = json.loads((out / "results.json").read_text())["results"]
    except (OSError, ValueError, KeyError):
        return []
    fields = {f.name for f in dataclasses.fields(Record)}

    def measured(row: dict) -> bool:
        if row.get("case") not in args.cases:
            return False
        size_ok = args.sizes is None or row.get("size") in args.sizes
        return size_ok and (
            args.variants is None or row.get("variant") in args.variants
        )

    return [
        Record(**{k: v for k, v in row.items() if k in fields})
        for row in rows
        if not measured(row)
    ]


def main(argv: list[str] | None = None) -> list[Record]:
    """Run the suite; write and print the results. Returns the rows."""
    args = parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # first calls are cold
    on_cpu = jax.default_backend() == "cpu"
    profile = "quick" if args.quick else ("cpu" if on_cpu else "gpu")
    libs, missing = load_peers(args.peers)
    for name, why in missing.items():
        print(f"note: {name} skipped ({why})", file=sys.stderr)
    out = args.out or pathlib.Path(__file__).parent / "results" / device_slug()
    meta = metadata(sys.argv[1:] if argv is None else argv, args, profile, missing)
    meta["warm_up_s"] = round(warm_up(), 3)  # one-time costs out of the first row
    records = _kept_records(out, args) if args.append else []
    names = dict.fromkeys([*(r.case for r in records), *args.cases])
    descriptions = {name: CASES[name].description for name in names}
    bar = tqdm(args.cases, desc="cases", unit="case", file=sys.stderr)
    for name in bar:
        case = CASES[name]
        run_case(
            case,
            args.sizes or case.sizes[profile],
            libs,
            args,
            records,
            bar.set_postfix_str,
            lambda: report.write_tables(out, meta, records, descriptions),
        )
        text = report.write_all(out, meta, records, descriptions)  # and the plots
    bar.close()
    print(text)
    print(f"wrote {out}/results.json, results.md and plots", file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
