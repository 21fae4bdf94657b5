"""Writing results: `results.json`, `results.md` (Markdown tables) and PNG plots."""

import dataclasses
import json
import math
import pathlib
from collections import defaultdict
from typing import Any

from .harness import Record


try:  # optional: without matplotlib the tables are written and the plots left out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None


LIBRARY_ORDER = (
    "solverkit",
    "solverkit-ensemble",
    "diffrax",
    "diffrax-closure",
    "gradsolve",
    "torchdiffeq",
)
# The rows that get ratios against diffrax's row: solverkit's two ways to run an
# ensemble (`jax.vmap(diffeqsolve)` and `ensemble_solve`).
RATIO_LIBRARIES = ("solverkit", "solverkit-ensemble")


def library_rank(library: str) -> int:
    order = LIBRARY_ORDER
    return order.index(library) if library in order else len(order)


def ratios(records: list[Record]) -> dict[int, tuple[float | None, float | None]]:
    """solverkit / diffrax ratios of run time (median) and first call.

    **Arguments:**

    - `records`: all rows.

    **Returns:**

    For each row of a library in `RATIO_LIBRARIES` (by its index in `records`) whose
    diffrax row on the same case, variant, size and `throw` ran: `(run ratio,
    first-call ratio)`.
    """
    diffrax = {
        (r.case, r.variant, r.size, r.throw): r
        for r in records
        if r.library == "diffrax" and r.status == "ok"
    }
    out = {}
    for i, r in enumerate(records):
        peer = diffrax.get((r.case, r.variant, r.size, r.throw))
        if r.library not in RATIO_LIBRARIES or r.status != "ok" or peer is None:
            continue
        run = r.run_median_s / peer.run_median_s if peer.run_median_s else None
        first = r.first_call_s / peer.first_call_s if peer.first_call_s else None
        out[i] = (run, first)
    return out


def write_json(path: pathlib.Path, meta: dict[str, Any], records: list[Record]) -> None:
    """Write `{"meta": ..., "results": [...]}`, each result with its ratios."""
    rat = ratios(records)
    rows = []
    for i, r in enumerate(records):
        row = dataclasses.asdict(r)
        run, first = rat.get(i, (None, None))
        row["run_ratio_vs_diffrax"] = run
        row["first_call_ratio_vs_diffrax"] = first
        rows.append(row)
    path.write_text(dump_json(meta, rows))


def dump_json(meta: dict, rows: list[dict]) -> str:
    """`{"meta": ..., "results": [...]}` as text, one result a line (short diffs)."""
    lines = ",\n".join(f"  {json.dumps(row)}" for row in rows)
    return f'{{"meta": {json.dumps(meta, indent=1)},\n "results": [\n{lines}\n]}}\n'



def _num(x: float | None, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt % x


def _seconds(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _bytes(x: int | None) -> str:
    return "" if x is None else f"{x / 2**20:.3g}"


def _throw_line(records: list[Record]) -> tuple[str, bool]:
    """The header's line on `throw`, and whether rows differ in it (then each row's
    note says its own)."""
    settings = {r.throw for r in records if r.throw is not None}
    if len(settings) != 1:
        return "", len(settings) > 1
    (throw,) = settings
    why = (
        "with the run-time error check of a jitted solve (a host callback)"
        if throw
        else "without the run-time error check (a host callback, about 2 ms a "
        "call on a TPU); a failed trajectory would show in the max abs error column"
    )
    return f"Every solverkit and diffrax solve ran with `throw={throw}`: {why}.", False


def _row(r: Record, ratio: tuple[float | None, float | None], mixed: bool) -> str:
    """One table row."""
    run, first = ratio
    note = r.note
    if mixed and r.throw is not None:
        note = f"throw={r.throw}" + (f"; {note}" if note else "")
    timing = ""
    if r.status == "ok":
        timing = (
            f"{_seconds(r.run_median_s)} [{_seconds(r.run_min_s)}, "
            f"{_seconds(r.run_max_s)}]"
        )
    else:
        note = f"**{r.status}**: {note}".replace("|", "\\|")
    cells = [
        r.variant,
        str(r.size),
        r.library,
        r.dtype,
        _seconds(r.first_call_s),
        timing,
        _bytes(r.memory_bytes),
        "" if r.steps is None else str(r.steps),
        _num(r.max_abs_error, "%.2g"),
        _num(run, "%.2f"),
        _num(first, "%.2f"),
        note,
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(meta: dict[str, Any], records: list[Record], cases: dict[str, str]) -> str:
    """Markdown: a header naming the device and versions, then one table per case.

    **Arguments:**

    - `meta`: run metadata (device, versions, command).
    - `records`: all rows, in the order they ran.
    - `cases`: case name to description, for the tables' captions.

    **Returns:**

    The Markdown text.
    """
    rat = ratios(records)
    lines = [
        f"# Benchmarks on {meta['device_kind']} ({meta['platform']})",
        "",
        f"`{meta['command']}` at commit {meta.get('commit')}; "
        f"jax {meta['versions'].get('jax')}, "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if k != "jax" and v)
        + f"; {meta['date']}.",
        "",
    ]
    throw_line, mixed = _throw_line(records)
    if throw_line:
        lines += [throw_line, ""]
    for name, why in meta.get("missing_peers", {}).items():
        lines.append(f"- {name} skipped: {why}")
    if meta.get("missing_peers"):
        lines.append("")
    header = (
        "| variant | N | library | dtype | first call | run median [min, max] "
        "| memory MiB | steps | max abs error | run / diffrax | first / diffrax "
        "| note |"
    )
    rule = "|" + "---|" * (header.count("|") - 1)
    order = sorted(
        range(len(records)),
        key=lambda i: (
            list(cases).index(records[i].case) if records[i].case in cases else 99,
            records[i].variant,
            records[i].size,
            library_rank(records[i].library),
        ),
    )
    current = None
    for i in order:
        r = records[i]
        if r.case != current:
            current = r.case
            lines += ["", f"## {r.case}", "", cases.get(r.case, ""), "", header, rule]
        lines.append(_row(r, rat.get(i, (None, None)), mixed))
    return "\n".join(lines) + "\n"


def _color(library: str) -> str:
    """The same colour for a library in every panel and plot."""
    return f"C{library_rank(library)}"


def plot(path: pathlib.Path, case: str, records: list[Record]) -> None:
    """One PNG for a case: a panel per variant, run time (median, with min-max bars)
    against ensemble size, log-log, one line per library. A case measured at a single
    size gets one bar chart instead (run time per variant, a bar per library)."""
    ok = [r for r in records if r.case == case and r.status == "ok"]
    if not ok or plt is None:
        return
    if len({r.size for r in ok}) == 1:
        _bars(path, case, ok)
        return
    series: dict[str, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        series[r.variant][r.library].append(r)
    variants = sorted(series)
    cols = min(len(variants), 2)
    rows = math.ceil(len(variants) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, variant in zip(axes.flat, variants):
        for library in sorted(series[variant], key=library_rank):
            pts = sorted(series[variant][library], key=lambda r: r.size)
            y = [r.run_median_s for r in pts]
            err = [
                [r.run_median_s - r.run_min_s for r in pts],
                [r.run_max_s - r.run_median_s for r in pts],
            ]
            ax.errorbar(
                [r.size for r in pts],
                y,
                yerr=err,
                marker="o",
                capsize=3,
                label=library,
                color=_color(library),
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{case}: {variant}", fontsize=10)
        ax.set_xlabel("ensemble size N")
        ax.set_ylabel("run time (s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(variants) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(path: pathlib.Path, case: str, records: list[Record]) -> None:
    """Run time per variant (log scale), a bar per library, min-max as error bars."""
    variants = sorted({r.variant for r in records})
    libraries = sorted({r.library for r in records}, key=library_rank)
    width = 0.8 / len(libraries)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(variants)), 4))
    for j, library in enumerate(libraries):
        by_variant = {r.variant: r for r in records if r.library == library}
        xs = [i for i, v in enumerate(variants) if v in by_variant]
        rs = [by_variant[variants[i]] for i in xs]
        ax.bar(
            [x + (j - (len(libraries) - 1) / 2) * width for x in xs],
            [r.run_median_s for r in rs],
            width,
            yerr=[
                [r.run_median_s - r.run_min_s for r in rs],
                [r.run_max_s - r.run_median_s for r in rs],
            ],
            capsize=2,
            label=library,
            color=_color(library),
        )
    ax.set_xticks(range(len(variants)), variants, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("run time (s)")
    ax.set_title(f"{case}, N = {records[0].size}", fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tables(
    out: pathlib.Path,
    meta: dict[str, Any],
    records: list[Record],
    cases: dict[str, str],
) -> str:
    """Write `results.json` and `results.md` into `out`.

    **Returns:**

    The Markdown text.
    """
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", meta, records)
    text = markdown(meta, records, cases)
    (out / "results.md").write_text(text)
    return text


def write_all(
    out: pathlib.Path,
    meta: dict[str, Any],
    records: list[Record],
    cases: dict[str, str],
) -> str:
    """Write `results.json`, `results.md` and `<case>.png` into `out`.

    **Returns:**

    The Markdown text.
    """
    text = write_tables(out, meta, records, cases)
    for case in dict.fromkeys(r.case for r in records):
        plot(out / f"{case}.png", case, records)
    return text


def read_json(path: pathlib.Path) -> tuple[dict[str, Any], list[Record]]:
    """The `(meta, records)` of a `results.json` (its ratio columns dropped: they are
    recomputed from the rows)."""
    data = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Record)}
    records = [
        Record(**{k: v for k, v in row.items() if k in fields})
        for row in data["results"]
    ]
    return data["meta"], records


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.report DIR`: write DIR's `results.md` and plots afresh
    from its `results.json`: a run on a machine without matplotlib (the accelerator
    suite installs none) gets its plots drawn afterwards, anywhere."""
    import argparse

    from .cases import CASES

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("dir", type=pathlib.Path, help="a folder with results.json")
    args = parser.parse_args(argv)
    if plt is None:
        raise SystemExit("benchmarks.report: needs matplotlib to draw the plots")
    meta, records = read_json(args.dir / "results.json")
    names = dict.fromkeys(r.case for r in records)
    cases = {n: CASES[n].description for n in names if n in CASES}
    write_all(args.dir, meta, records, cases)
    print(f"wrote {args.dir}/results.md and its plots")


if __name__ == "__main__":
    main()
