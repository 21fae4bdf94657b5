"""Work-precision benchmark of stiff solvers on large systems (10^3 to 3·10^4 unknowns).

`python -m benchmarks.stiff_large [--quick] [--problems a,b] [--solvers a,b]
[--rtols 1e-4,1e-6] [--budget S] [--out DIR] [--no-diffrax]` runs, on each problem of
`benchmarks/problems.py` and each tolerance (`atol = atol_factor * rtol`,
the same for every library, float64):

- solverkit's `BDF`, `Rodas5P` and `Kvaerno5`, each with a banded, a sparse and a
  Krylov linear solver (`BandedLinearSolver`, `SparseLinearSolver`,
  `KrylovLinearSolver`), and `BDF` and `Rodas5P` with the dense default up to
  `DENSE_MAX` unknowns;
  a configuration whose class this solverkit lacks, or that does not accept the
  argument, is recorded as `skipped` with the reason;
- diffrax's `Kvaerno5` (dense Newton) up to `DENSE_MAX` unknowns;
- SciPy's `BDF` with `jac_sparsity` (a finite-difference Jacobian by column groups,
  sparse LU), the reference of the goals.

Each (problem, configuration) runs in its own subprocess, so that its memory is its
own and a solver that hangs is stopped: the peak resident size during the timed
solves (the peak is reset after the first call, so compilation is not counted) and its
growth over the resident size before them. In the subprocess, for the tolerances
from loosest to tightest: the first call (trace, compile, run; once, or per tolerance
for a solver that needs static tolerances) and the best of a few further runs; once a
run takes over `--budget` seconds, the tighter tolerances are skipped. The error is
`max_i |y_i - ref_i| / (|ref_i| + floor)` at `t1` against a
reference computed once (SciPy `Radau` at `rtol = 1e-10`, see `reference`) and cached
in `<out>/references/` (default `--out`: `benchmarks/results/cpu/stiff-large/`;
reuse the folder to skip the references' minutes).

Writes `results.json`, `results.md` (a table per problem, and the ratio of solverkit's
fastest run against SciPy BDF's at equal or smaller error) and one `<problem>.png`
work-precision plot per problem into `--out`, after each configuration (`--quick`:
once, at the end).
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable


ROOT = pathlib.Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "results" / "cpu" / "stiff-large"
RTOLS = (1e-4, 1e-6, 1e-8)
QUICK_RTOLS = (1e-4, 1e-6)
REFERENCE_RTOL = 1e-10
DENSE_MAX = 1024  # dense Jacobians (diffrax Kvaerno5, solverkit's default) up to here
MAX_STEPS = 100_000

PROBLEMS = (
    "bruss2d-32",
    "bruss2d-128",
    "rober-blocks-3334",
    "burgers-1000",
    "burgers-10000",
)
QUICK_PROBLEMS = ("bruss2d-8", "rober-blocks-34", "burgers-100")
LINEAR = ("banded", "sparse", "krylov")
CONFIGS = (
    *(f"BDF+{k}" for k in LINEAR),
    *(f"Rodas5P+{k}" for k in LINEAR),
    *(f"Kvaerno5+{k}" for k in LINEAR),
    "BDF+krylov-pc",
    "Rodas5P+krylov-pc",
    "BDF+dense",
    "Rodas5P+dense",
    "diffrax-Kvaerno5",
    "scipy-BDF",
)
QUICK_CONFIGS = ("BDF+dense", "Rodas5P+dense", "BDF+krylov", "scipy-BDF")


@dataclasses.dataclass
class Row:
    problem: str
    size: int
    config: str
    rtol: float
    atol: float
    status: str = "ok"  # ok | failed | error | skipped | timeout
    note: str = ""
    first_call_s: float | None = None
    run_s: float | None = None
    error: float | None = None
    steps: int | None = None
    stats: dict = dataclasses.field(default_factory=dict)
    peak_rss_mib: float | None = None
    rss_growth_mib: float | None = None


# --- references ---------------------------------------------------------------------


def reference(problem, directory: pathlib.Path):
    """The state at `t1`: from the cache, else SciPy Radau at `REFERENCE_RTOL`
    (`atol = atol_factor * REFERENCE_RTOL`) with the sparse Jacobian pattern, saved
    as `directory/<name>.npz` (the final state only)."""
    import numpy as np
    from scipy.integrate import solve_ivp

    path = directory / f"{problem.name}.npz"
    if path.exists():
        return np.load(path)["y1"]
    start = time.perf_counter()
    sol = solve_ivp(
        problem.np_field,
        (0.0, problem.t1),
        problem.y0.ravel(),
        method="Radau",
        rtol=REFERENCE_RTOL,
        atol=REFERENCE_RTOL * problem.atol_factor,
        jac_sparsity=problem.sparsity(),
    )
    if not sol.success:
        raise RuntimeError(f"reference of {problem.name}: {sol.message}")
    y1 = sol.y[:, -1].reshape(problem.y0.shape)
    directory.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        y1=y1,
        method="scipy Radau",
        rtol=REFERENCE_RTOL,
        seconds=time.perf_counter() - start,
    )
    return y1


# --- configurations -----------------------------------------------------------------


def linear_solver(kind: str, problem):
    """`(linear solver, None)` or `(None, why not)`, built with `getattr(sk, ...)`
    so that a class this solverkit lacks is a recorded skip."""
    import solverkit as sk

    name = {
        "banded": "BandedLinearSolver",
        "sparse": "SparseLinearSolver",
        "krylov": "KrylovLinearSolver",
        "krylov-pc": "KrylovLinearSolver",
    }[kind]
    cls = getattr(sk, name, None)
    if cls is None:
        return None, f"solverkit has no {name}"
    try:
        if kind == "banded":
            return cls(*problem.bandwidths), None
        if kind == "sparse":
            return cls(problem.sparsity()), None
        if kind == "krylov-pc":
            if problem.preconditioner is None:
                return None, f"{problem.name} has no preconditioner"
            # A preconditioner close to the inverse (see the problem's): BiCGStab to
            # a loose relative tolerance (the Newton iteration corrects the rest),
            # usually one or two iterations. lineax's GMRES runs whole restart
            # cycles and at least two, so it applies the preconditioner about 1.5x
            # as often (measured on bruss2d-32, 16 against 11 per BDF step).
            pc = problem.preconditioner(problem.params)
            return cls("bicgstab", 1e-3, 1e-8, 100, 1, pc), None
        return cls("gmres"), None
    except (TypeError, ValueError) as e:
        return None, f"{name}(...): {e}"


def jax_solver(config: str, problem):
    """`(module, solver, None)` or `(None, None, why not)` for a JAX configuration."""
    if config == "diffrax-Kvaerno5":
        import diffrax

        if problem.size > DENSE_MAX:
            return None, None, f"dense Newton: n = {problem.size} > {DENSE_MAX}"
        return diffrax, diffrax.Kvaerno5(), None
    import solverkit as sk

    name, _, kind = config.partition("+")
    cls = getattr(sk, name, None)
    if cls is None:
        return None, None, f"solverkit has no {name}"
    if kind == "dense":
        if problem.size > DENSE_MAX:
            return None, None, f"dense Jacobian: n = {problem.size} > {DENSE_MAX}"
        return sk, cls(), None
    lin, why = linear_solver(kind, problem)
    if lin is None:
        return None, None, why
    try:
        return sk, cls(linear_solver=lin), None
    except TypeError as e:
        return None, None, f"{name}(linear_solver=...): {e}"


# --- the worker (one subprocess per problem and configuration) ------------------------


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak_rss() -> float:
    """Resets the process's peak resident size (Linux `clear_refs`, 5) and returns
    its current resident size (MiB); where the reset is refused, the peak stays the
    process's lifetime peak (`ru_maxrss`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_mib("VmRSS")


def _peak_rss_mib() -> float:
    peak = _status_mib("VmHWM")
    if peak != peak:  # no /proc: the lifetime peak
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return peak


def _emit(row: Row) -> None:
    print("ROW " + json.dumps(dataclasses.asdict(row)), flush=True)


def _jax_runner(module, solver, problem):
    """`(traced, static)`: `solve(params, y0, rtol, atol) -> (y1, stats, ok)` jitted
    with traced tolerances (one compilation), and jitted once per tolerance (static
    tolerances, for solvers that read them in Python); the vector field closes over
    `params`, traced arguments of the jit."""
    import jax

    def solve(params, y0, rtol, atol):
        sol = module.diffeqsolve(
            module.ODETerm(problem.field(params)),
            solver,
            0.0,
            problem.t1,
            None,
            y0,
            None,
            saveat=module.SaveAt(t1=True),
            stepsize_controller=module.PIDController(rtol=rtol, atol=atol),
            max_steps=MAX_STEPS,
            throw=False,
        )
        stats = {k: v for k, v in sol.stats.items() if jax.numpy.ndim(v) == 0}
        return sol.ys[-1], stats, sol.result == module.RESULTS.successful

    return jax.jit(solve), jax.jit(solve, static_argnums=(2, 3))


def _scipy_run(problem, rtol, atol, sparsity):
    from scipy.integrate import solve_ivp

    sol = solve_ivp(
        problem.np_field,
        (0.0, problem.t1),
        problem.y0.ravel(),
        method="BDF",
        rtol=rtol,
        atol=atol,
        jac_sparsity=sparsity,
    )
    stats = {"nfev": sol.nfev, "njev": sol.njev, "nlu": sol.nlu}
    return sol.y[:, -1], stats, sol.success, sol.t.shape[0] - 1


def worker(args) -> None:
    """Runs one configuration on one problem at each tolerance; prints `ROW {json}`
    lines."""
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)
    import jax.numpy as jnp
    import numpy as np

    from .problems import large_problem as build, relative_error

    problem = build(args.worker_problem)
    config = args.worker_config
    ref = reference(problem, args.out / "references")
    rows = [
        Row(problem.name, problem.size, config, r, r * problem.atol_factor)
        for r in args.rtols
    ]
    sparsity = None
    mode = {"static": False}
    run: Callable | None = None
    if config == "scipy-BDF":
        sparsity = problem.sparsity()
    else:
        module, solver, why = jax_solver(config, problem)
        if solver is None:
            for row in rows:
                row.status, row.note = "skipped", why or ""
                _emit(row)
            return
        traced, static = _jax_runner(module, solver, problem)
        params = jax.tree_util.tree_map(jnp.asarray, problem.params)
        y0 = jnp.asarray(problem.y0)

        def run_jax(r, a):
            if not mode["static"]:
                try:
                    out = traced(params, y0, jnp.asarray(r), jnp.asarray(a))
                    return jax.block_until_ready(out)
                except jax.errors.JAXTypeError:  # rtol used in Python: static
                    mode["static"] = True
            return jax.block_until_ready(static(params, y0, r, a))

        run = run_jax

    baseline = _reset_peak_rss()
    too_slow = None
    for row in rows:
        if too_slow is not None:
            row.status = "skipped"
            row.note = f"rtol={too_slow:g} took over --budget {args.budget:g} s"
            _emit(row)
            continue
        times = []
        try:
            if run is not None and (row is rows[0] or mode["static"]):
                # trace, compile, run; then the peak of the solves
                start = time.perf_counter()
                run(row.rtol, row.atol)
                row.first_call_s = time.perf_counter() - start
                baseline = _reset_peak_rss()
            while True:
                start = time.perf_counter()
                if run is None:
                    y1, stats, ok, steps = _scipy_run(
                        problem, row.rtol, row.atol, sparsity
                    )
                else:
                    y1, stats, ok = run(row.rtol, row.atol)
                    stats = {k: int(v) for k, v in stats.items()}
                    steps = stats.get("num_steps")
                    ok = bool(ok)
                times.append(time.perf_counter() - start)
                if len(times) >= args.repeats or sum(times) > args.budget / 2:
                    break
        except Exception as e:  # noqa: BLE001 - a failure is a result
            row.status, row.note = "error", str(e).splitlines()[0][:300]
            _emit(row)
            too_slow = row.rtol
            continue
        run_s = row.run_s = min(times)
        row.steps = int(steps) if steps is not None else None
        row.stats = stats
        row.error = relative_error(np.asarray(y1), ref, problem.error_floor)
        if not ok or not np.all(np.isfinite(np.asarray(y1))):
            row.status, row.note = "failed", "solver did not succeed"
        row.peak_rss_mib = _peak_rss_mib()
        row.rss_growth_mib = row.peak_rss_mib - baseline
        if run_s > args.budget:
            too_slow = row.rtol
        _emit(row)


# --- the driver -----------------------------------------------------------------------


def run_config(problem, config: str, args) -> list[Row]:
    """One subprocess; its `ROW` lines, and a `timeout` row for each tolerance it did
    not reach. A configuration this solverkit cannot build is skipped here."""
    if config != "scipy-BDF":
        why = jax_solver(config, problem)[2]
        if why is not None:
            return [
                Row(problem.name, problem.size, config, r, r * problem.atol_factor,
                    status="skipped", note=why)
                for r in args.rtols
            ]  # fmt: skip
    command = [
        sys.executable, "-m", "benchmarks.stiff_large",
        "--worker-problem", problem.name, "--worker-config", config,
        "--rtols", ",".join(f"{r:g}" for r in args.rtols),
        "--budget", str(args.budget), "--repeats", str(args.repeats),
        "--out", str(args.out),
    ]  # fmt: skip
    timeout = args.budget * (len(args.rtols) + 1) + 120
    try:
        proc = subprocess.run(
            command,
            cwd=ROOT.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        stderr, code = f"stopped after {timeout:.0f} s", None
    rows = [
        Row(**json.loads(line[4:]))
        for line in stdout.splitlines()
        if line[:4] == "ROW "
    ]
    done = {r.rtol for r in rows}
    for rtol in args.rtols:
        if rtol not in done:
            note = stderr.strip().splitlines()[-1][:300] if stderr.strip() else ""
            rows.append(
                Row(
                    problem.name,
                    problem.size,
                    config,
                    rtol,
                    rtol * problem.atol_factor,
                    status="timeout" if code is None else "error",
                    note=note,
                )
            )
    return rows


def _progress(row: Row) -> None:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    print(
        f"{row.problem:18s} {row.config:17s} rtol={row.rtol:.0e} "
        f"run={f(row.run_s, '.3f')}s first={f(row.first_call_s, '.2f')}s "
        f"err={f(row.error, '.2e')} steps={row.steps} "
        f"mem={f(row.rss_growth_mib, '.0f')}MiB {row.status} {row.note}",
        file=sys.stderr,
        flush=True,
    )


def goals(rows: list[Row]) -> list[dict]:
    """Per problem and SciPy BDF tolerance: solverkit's fastest run whose error is
    at most SciPy's, and the ratio of run times (the goal: <= 0.5 for n >= 1000)."""
    out = []
    for name in dict.fromkeys(r.problem for r in rows):
        ok = [r for r in rows if r.problem == name and r.status == "ok"]
        for ref in [r for r in ok if r.config == "scipy-BDF"]:
            ours = [
                r
                for r in ok
                if r.config not in ("scipy-BDF", "diffrax-Kvaerno5")
                and r.error is not None
                and ref.error is not None
                and r.error <= ref.error
            ]
            best = min(ours, key=lambda r: r.run_s or 0.0, default=None)
            out.append(
                {
                    "problem": name,
                    "size": ref.size,
                    "scipy_rtol": ref.rtol,
                    "scipy_error": ref.error,
                    "scipy_run_s": ref.run_s,
                    "solverkit": None
                    if best is None
                    else {
                        "config": best.config,
                        "rtol": best.rtol,
                        "error": best.error,
                        "run_s": best.run_s,
                        "ratio": (best.run_s or 0.0) / (ref.run_s or 1.0),
                    },
                }
            )
    return out


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: list[Row], meta: dict) -> str:
    lines = [
        "# Large stiff systems: work-precision",
        "",
        f"`{meta['command']}` on {meta['device_kind']} ({meta['cpu_count']} cores), "
        f"jax {meta['jax']}, {meta['date']}. Error: {meta['error']}; "
        f"atol = atol_factor · rtol. Run time: best of the timed runs after the first "
        f"call; memory: the peak resident size of the configuration's own process "
        f"during the timed solves (after compilation), and its growth over the "
        f"resident size before them.",
        "",
        "## solverkit against SciPy BDF (sparse Jacobian) at equal or smaller error",
        "",
        "| problem | n | SciPy rtol | SciPy error | SciPy run (s) | solverkit best "
        "| its rtol | its error | its run (s) | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in goals(rows):
        s = g["solverkit"] or {}
        lines.append(
            f"| {g['problem']} | {g['size']} | {g['scipy_rtol']:.0e} "
            f"| {g['scipy_error']:.1e} | {g['scipy_run_s']:.3f} "
            f"| {s.get('config', 'none reaches its error')} "
            f"| {_fmt(s.get('rtol'), '.0e')} | {_fmt(s.get('error'), '.1e')} "
            f"| {_fmt(s.get('run_s'), '.3f')} | {_fmt(s.get('ratio'), '.2f')} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "| problem | n | configuration | rtol | status | error | run (s) "
        "| first call (s) | steps | peak RSS (MiB) | RSS growth (MiB) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.problem} | {r.size} | {r.config} | {r.rtol:.0e} | {r.status} "
            f"| {_fmt(r.error, '.1e')} | {_fmt(r.run_s, '.3f')} "
            f"| {_fmt(r.first_call_s, '.2f')} | {_fmt(r.steps, 'd')} "
            f"| {_fmt(r.peak_rss_mib, '.0f')} | {_fmt(r.rss_growth_mib, '.0f')} "
            f"| {r.note.replace('|', '/')[:120]} |"
        )
    return "\n".join(lines) + "\n"


def plot(out: pathlib.Path, name: str, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    sel = [r for r in rows if r.problem == name and r.status == "ok" and r.error]
    for config in dict.fromkeys(r.config for r in sel):
        pts = sorted((r.error, r.run_s) for r in sel if r.config == config)
        style = ":^" if config.startswith(("scipy", "diffrax")) else "-o"
        ax.loglog(*zip(*pts), style, label=config)
    size = next((r.size for r in rows if r.problem == name), 0)
    ax.set_xlabel("error at t1 (max relative)")
    ax.set_ylabel("run time (s)")
    ax.set_title(f"{name} (n = {size})")
    ax.grid(True, which="both", alpha=0.3)
    if sel:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)


def write(args, rows: list[Row]) -> dict:
    import os

    import jax

    meta = {
        "device_kind": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.stiff_large " + " ".join(sys.argv[1:]),
        "error": "max_i |y_i - ref_i| / (|ref_i| + floor) at t1",
        "reference": f"SciPy Radau, rtol = {REFERENCE_RTOL:g}, sparse Jacobian",
        "dtype": "float64",
    }
    result = {
        "meta": meta,
        "goals": goals(rows),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    (args.out / "results.md").write_text(markdown(rows, meta))
    for name in dict.fromkeys(r.problem for r in rows):
        plot(args.out, name, rows)
    return result


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stiff_large")
    parser.add_argument("--quick", action="store_true", help="a < 60 s smoke run")
    parser.add_argument("--problems", default=None, help="comma list")
    parser.add_argument("--solvers", default=None, help="comma list of configurations")
    parser.add_argument("--rtols", default=None, help="comma list, loosest first")
    parser.add_argument("--budget", type=float, default=None, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--no-diffrax", action="store_true")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of --out/results.json that this run does not redo",
    )
    parser.add_argument("--worker-problem", help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problems = QUICK_PROBLEMS if args.quick else PROBLEMS
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    args.problems = args.problems.split(",") if args.problems else list(problems)
    args.solvers = args.solvers.split(",") if args.solvers else list(configs)
    if args.no_diffrax:
        args.solvers = [c for c in args.solvers if not c.startswith("diffrax")]
    unknown = [c for c in args.solvers if c not in CONFIGS]
    if unknown:
        parser.error(f"--solvers: unknown {unknown}; known: {list(CONFIGS)}")
    rtols = args.rtols.split(",") if args.rtols else None
    args.rtols = (
        [float(r) for r in rtols]
        if rtols
        else list(QUICK_RTOLS if args.quick else RTOLS)
    )
    if args.budget is None:
        args.budget = 10.0 if args.quick else 120.0
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.out is None:
        args.out = DEFAULT_OUT
    return args


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    if args.worker_problem:
        worker(args)
        return []
    from .problems import large_problem as build

    rows: list[Row] = []
    previous = args.out / "results.json"
    if args.append and previous.exists():
        redo = {(p, c) for p in args.problems for c in args.solvers}
        rows = [
            Row(**r)
            for r in json.loads(previous.read_text())["rows"]
            if (r["problem"], r["config"]) not in redo
        ]
    for name in args.problems:
        problem = build(name)
        start = time.perf_counter()
        reference(problem, args.out / "references")
        print(
            f"{name}: reference ready ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        for config in args.solvers:
            for row in run_config(problem, config, args):
                _progress(row)
                rows.append(row)
            if not args.quick:  # the results so far (a smoke run's: at the end)
                write(args, rows)
    result = write(args, rows)
    print((args.out / "results.md").read_text())
    print(json.dumps(result["goals"], indent=1))
    return rows


if __name__ == "__main__":
    main()
