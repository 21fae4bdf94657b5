"""Work-precision benchmark of the stiff solvers: error against run time.

`python -m benchmarks.stiff --out DIR [--quick]` runs, on each problem of
`benchmarks/problems.py` and each relative tolerance `rtol` (absolute
tolerance `atol = 1e-4 * rtol`, the same for every library):

- solverkit's stiff solvers: `Rosenbrock23`, `Ros3P`, `Rodas4`, `Rodas5P`, and the
  implicit Runge-Kutta ones (`Kvaerno5`, `KenCarp4`, ...) where this solverkit has
  them, all with `PIDController(rtol, atol)`;
- diffrax's `Kvaerno5` (its default root finder, tolerances from the controller);
- SciPy's `Radau`, `BDF` and `LSODA` (`solve_ivp`), with the right-hand side and
  its Jacobian jitted with JAX (the fairest way to give them the same field).

Two modes: `single` (one solve) and `ensemble` (one `jit(vmap(solve))` over `N`
problems whose scaled rate constant runs over [0.5, 2]; SciPy's ensemble time is `N`
times its single-solve time, as it solves one problem at a time). The error is the
largest componentwise `|y - ref| / (|ref| + 1e-10)` at the final time, of the
problem with `scale = 1` (the ensemble's first member). Run time is the minimum
of the timed repeats; the first call (trace, compile and run, after
`jax.clear_caches()`) is timed at the first tolerance a solver runs, which is
`GOAL_RTOL`. Writes `stiff.json` and one
`stiff_<problem>.png` per problem into `--out`, and prints the goal checks.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .problems import PROBLEMS, StiffProblem


GOAL_RTOL = 1e-6
ATOL_FACTOR = 1e-4
RTOLS = (1e-6, 1e-4, 1e-5, 1e-7, 1e-8, 1e-9, 1e-10)
QUICK_RTOLS = (1e-6, 1e-4, 1e-8)
SOLVERKIT = ("Rosenbrock23", "Ros3P", "Rodas4", "Rodas5P")
SOLVERKIT_IMPLICIT = ("Kvaerno3", "Kvaerno4", "Kvaerno5", "KenCarp4", "KenCarp5")
# The loosest tolerance a low-order method is asked for at most (else its step count
# runs away).
MIN_RTOL = {"Rosenbrock23": 1e-6, "Ros3P": 1e-8}
MAX_STEPS = 200_000


@dataclasses.dataclass
class Row:
    problem: str
    mode: str  # single | ensemble
    library: str
    solver: str
    rtol: float
    atol: float
    size: int
    status: str = "ok"
    note: str = ""
    first_call_s: float | None = None
    run_s: float | None = None
    per_solve_s: float | None = None
    error: float | None = None
    steps: int | None = None


def relative_error(y, reference: np.ndarray) -> float:
    y = np.asarray(y, dtype=np.float64)
    return float(np.max(np.abs(y - reference) / (np.abs(reference) + 1e-10)))


def _scales(size: int) -> jnp.ndarray:
    """`1` first (the member with a reference), then `2^u` for `u` in [-1, 1]."""
    rest = 2.0 ** jnp.linspace(-1.0, 1.0, max(size - 1, 1))
    return jnp.concatenate([jnp.ones(1), rest])[:size]


def jax_solve(module, solver_name: str, problem: StiffProblem, mode: str) -> Callable:
    """A jitted `solve(scales, rtol, atol) -> (y1 of member 0, steps of member 0)`
    with diffrax's or solverkit's `diffeqsolve` (same call for both)."""
    y0 = jnp.asarray(problem.y0)

    def one(scale, rtol, atol):
        sol = module.diffeqsolve(
            module.ODETerm(problem.field(scale)),
            getattr(module, solver_name)(),
            0.0,
            problem.t1,
            1e-6,
            y0,
            None,
            stepsize_controller=module.PIDController(rtol=rtol, atol=atol),
            max_steps=MAX_STEPS,
            throw=False,
        )
        return sol.ys[-1], sol.stats["num_steps"]

    if mode == "single":
        return jax.jit(lambda scales, rtol, atol: one(scales[0], rtol, atol))
    batched = jax.vmap(one, in_axes=(0, None, None))
    return jax.jit(
        lambda scales, rtol, atol: jax.tree_util.tree_map(
            lambda x: x[0], batched(scales, rtol, atol)
        )
    )


def _timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def run_jax(row: Row, solve, scales, repeats: int, first: bool) -> None:
    rtol = jnp.asarray(row.rtol)
    atol = jnp.asarray(row.atol)
    if first:  # a cold first call: nothing compiled earlier in the process helps
        jax.clear_caches()
    elapsed, (y1, steps) = _timed(solve, scales, rtol, atol)
    if first:
        row.first_call_s = elapsed
    runs = [elapsed] if not first else []
    while len(runs) < repeats:
        elapsed, _ = _timed(solve, scales, rtol, atol)
        runs.append(elapsed)
        if sum(runs) > 20:
            break
    row.run_s = min(runs)
    row.per_solve_s = row.run_s / row.size
    row.steps = int(steps)
    row.error = relative_error(y1, PROBLEMS[row.problem].reference)
    if not np.all(np.isfinite(np.asarray(y1))) or row.steps >= MAX_STEPS:
        row.status = "failed"
        row.note = "non-finite or max_steps"


def scipy_functions(problem: StiffProblem):
    """Jitted right-hand side and Jacobian, as NumPy callables for `solve_ivp`."""
    field = problem.field(1.0)
    rhs = jax.jit(lambda t, y: field(t, y, None))
    jac = jax.jit(jax.jacfwd(lambda t, y: field(t, y, None), argnums=1))
    y0 = jnp.asarray(problem.y0)
    jax.block_until_ready((rhs(0.0, y0), jac(0.0, y0)))  # compile outside the timing

    def np_rhs(t, y):
        return np.asarray(rhs(t, y))

    def np_jac(t, y):
        return np.asarray(jac(t, y))

    return np_rhs, np_jac


def run_scipy(row: Row, problem: StiffProblem, functions, repeats: int) -> None:
    from scipy.integrate import solve_ivp

    np_rhs, np_jac = functions
    runs = []
    sol = None
    while len(runs) < max(repeats, 1):
        start = time.perf_counter()
        sol = solve_ivp(
            np_rhs,
            (0.0, problem.t1),
            problem.y0,
            method=row.solver,
            rtol=row.rtol,
            atol=row.atol,
            jac=np_jac,
        )
        runs.append(time.perf_counter() - start)
        if sum(runs) > 20:
            break
    assert sol is not None
    row.first_call_s = runs[0]
    single = min(runs)
    row.run_s = single * row.size
    row.per_solve_s = single
    row.steps = int(sol.t.shape[0] - 1)
    row.error = relative_error(sol.y[:, -1], problem.reference)
    if not sol.success:
        row.status = "failed"
        row.note = str(sol.message)


def solvers(quick: bool, only=None) -> list[tuple[str, object, str]]:
    """`(library, module, solver name)` for every JAX solver to run (`only`: these
    solverkit solvers)."""
    import diffrax

    import solverkit

    names = ["Rodas5P", "Rosenbrock23"] if quick else list(SOLVERKIT)
    names += [n for n in SOLVERKIT_IMPLICIT if hasattr(solverkit, n)]
    if quick:
        names = [n for n in names if n in ("Rodas5P", "Rosenbrock23", "Kvaerno5")]
    if only is not None:
        names = list(only)
    out = [("solverkit", solverkit, n) for n in names]
    out.append(("diffrax", diffrax, "Kvaerno5"))
    return out


def goals(rows: list[Row]) -> list[dict]:
    """The goal checks at `GOAL_RTOL` on each ensemble problem (see the report)."""
    out = []
    for problem in sorted({r.problem for r in rows if r.mode == "ensemble"}):
        ens = [r for r in rows if r.problem == problem and r.mode == "ensemble"]
        ens = [r for r in ens if r.status == "ok"]
        ref = [
            r
            for r in ens
            if r.library == "diffrax" and r.solver == "Kvaerno5" and r.rtol == GOAL_RTOL
        ]
        if not ref:
            continue
        ref = ref[0]
        ours = [r for r in ens if r.library == "solverkit" and r.error <= ref.error]
        best = min(ours, key=lambda r: r.run_s, default=None)
        first = [
            r
            for r in ens
            if r.library == "solverkit"
            and r.rtol == GOAL_RTOL
            and r.first_call_s is not None
        ]
        # The first call of the solver that won on run time (timed at GOAL_RTOL).
        first_best = next(
            (r for r in first if best is not None and r.solver == best.solver),
            min(first, key=lambda r: r.first_call_s, default=None),
        )
        sk_at_goal = [r for r in first if r.run_s is not None]
        scipy = [
            r
            for r in rows
            if r.problem == problem
            and r.library == "scipy"
            and r.rtol == GOAL_RTOL
            and r.status == "ok"
        ]
        scipy_best = min(scipy, key=lambda r: r.per_solve_s, default=None)
        sk_best_goal = min(sk_at_goal, key=lambda r: r.run_s, default=None)
        out.append(
            {
                "problem": problem,
                "size": ref.size,
                "diffrax_kvaerno5": {
                    "run_s": ref.run_s,
                    "first_call_s": ref.first_call_s,
                    "error": ref.error,
                },
                "solverkit_best_at_equal_or_smaller_error": None
                if best is None
                else {
                    "solver": best.solver,
                    "rtol": best.rtol,
                    "run_s": best.run_s,
                    "error": best.error,
                    "run_ratio": best.run_s / ref.run_s,
                },
                "first_call": None
                if first_best is None
                else {
                    "solver": first_best.solver,
                    "first_call_s": first_best.first_call_s,
                    "ratio": (first_best.first_call_s or np.nan) / ref.first_call_s,
                },
                "per_solve_vs_scipy": None
                if scipy_best is None or sk_best_goal is None
                else {
                    "solverkit_solver": sk_best_goal.solver,
                    "solverkit_per_solve_s": sk_best_goal.per_solve_s,
                    "scipy_method": scipy_best.solver,
                    "scipy_per_solve_s": scipy_best.per_solve_s,
                    "ratio": sk_best_goal.per_solve_s / scipy_best.per_solve_s,
                },
            }
        )
    return out


def plot(out: pathlib.Path, problem: str, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, mode in zip(axes, ("single", "ensemble")):
        sel = [r for r in rows if r.problem == problem and r.mode == mode]
        for key in sorted({(r.library, r.solver) for r in sel}):
            pts = sorted(
                (r.error, r.per_solve_s if mode == "ensemble" else r.run_s)
                for r in sel
                if (r.library, r.solver) == key and r.status == "ok" and r.error
            )
            if not pts:
                continue
            style = {"solverkit": "-o", "diffrax": "--s", "scipy": ":^"}[key[0]]
            ax.loglog(*zip(*pts), style, label=f"{key[0]} {key[1]}")
        size = max((r.size for r in sel), default=1)
        ax.set_xlabel("error at t1 (max relative)")
        ylabel = "run time per solve (s)" if mode == "ensemble" else "run time (s)"
        ax.set_ylabel(ylabel)
        title = "one solve" if mode == "single" else f"vmapped ensemble, N={size}"
        ax.set_title(f"{problem}: {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"stiff_{problem}.png", dpi=110)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stiff")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--quick", action="store_true", help="a few-minute CPU run")
    parser.add_argument("--problems", default=None, help="comma list (default: all)")
    parser.add_argument("--size", type=int, default=None, help="ensemble size N")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--modes", default="single,ensemble")
    parser.add_argument("--no-scipy", action="store_true")
    parser.add_argument(
        "--budget",
        type=float,
        default=30.0,
        help="seconds: once one run of a solver takes longer, its tighter "
        "tolerances are skipped",
    )
    parser.add_argument(
        "--rtols", default=None, help="comma list (default: 1e-6 first, 1e-4 ... 1e-10)"
    )
    parser.add_argument(
        "--solvers", default=None, help="comma list of solverkit solvers (default: all)"
    )
    args = parser.parse_args(argv)
    if args.problems is None:
        args.problems = "rober,hires" if args.quick else ",".join(PROBLEMS)
    args.problems = [p for p in args.problems.split(",") if p]
    unknown = [p for p in args.problems if p not in PROBLEMS]
    if unknown:
        parser.error(f"--problems: unknown {unknown}; known: {list(PROBLEMS)}")
    args.modes = [m for m in args.modes.split(",") if m]
    if args.solvers is not None:
        args.solvers = [n for n in args.solvers.split(",") if n]
    if args.size is None:
        args.size = 64 if args.quick else 256
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    return args


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)
    args.out.mkdir(parents=True, exist_ok=True)
    rtols = QUICK_RTOLS if args.quick else RTOLS
    if args.rtols:
        rtols = tuple(float(x) for x in args.rtols.split(","))
    rows: list[Row] = []
    for name in args.problems:
        problem = PROBLEMS[name]
        for mode in args.modes:
            size = 1 if mode == "single" else args.size
            scales = _scales(size)
            for library, module, solver in solvers(args.quick, args.solvers):
                solve = jax_solve(module, solver, problem, mode)
                first = True
                too_slow = None  # the loosest tolerance that took over --budget
                for rtol in rtols:
                    if rtol < MIN_RTOL.get(solver, 0):
                        continue
                    atol = rtol * ATOL_FACTOR
                    row = Row(name, mode, library, solver, rtol, atol, size)
                    if too_slow is not None and rtol < too_slow:
                        row.status = "skipped"
                        row.note = f"rtol={too_slow:g} took over --budget"
                        rows.append(row)
                        continue
                    try:
                        run_jax(row, solve, scales, args.repeats, first)
                    except Exception as e:  # noqa: BLE001 - a failure is a result
                        row.status, row.note = "error", str(e).splitlines()[0][:200]
                    if (row.run_s or 0) > args.budget:
                        too_slow = max(too_slow or 0, rtol)
                    first = False
                    rows.append(row)
                    _progress(row)
        if not args.no_scipy:
            rows += _scipy_rows(problem, rtols, args)
        _write(args, rows)
    result = _write(args, rows)
    print(json.dumps(result["goals"], indent=1))
    return rows


def _scipy_rows(problem: StiffProblem, rtols, args) -> list[Row]:
    """SciPy solves each problem once per tolerance; its ensemble rows are the same
    solves, N times over."""
    functions = scipy_functions(problem)
    rows = []
    for method in ("Radau", "BDF", "LSODA"):
        for rtol in rtols:
            atol = rtol * ATOL_FACTOR
            row = Row(problem.name, "single", "scipy", method, rtol, atol, 1)
            run_scipy(row, problem, functions, max(1, args.repeats // 2))
            _progress(row)
            rows.append(row)
            if "ensemble" in args.modes:
                ens = dataclasses.replace(
                    row,
                    mode="ensemble",
                    size=args.size,
                    run_s=None if row.run_s is None else row.run_s * args.size,
                )
                rows.append(ens)
    return rows


def _progress(row: Row) -> None:
    print(
        f"{row.problem:6s} {row.mode:8s} {row.library:9s} {row.solver:12s} "
        f"rtol={row.rtol:.0e} run={row.run_s or float('nan'):.4f}s "
        f"first={row.first_call_s or float('nan'):.2f}s "
        f"err={row.error or float('nan'):.2e} steps={row.steps} {row.status}",
        file=sys.stderr,
        flush=True,
    )


def _write(args, rows: list[Row]) -> None:
    meta = {
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.stiff " + " ".join(sys.argv[1:]),
        "atol": f"{ATOL_FACTOR} * rtol",
        "error": "max_i |y_i - ref_i| / (|ref_i| + 1e-10) at t1, scale = 1",
        "dtype": "float64",
    }
    result = {
        "meta": meta,
        "goals": goals(rows),
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    (args.out / "stiff.json").write_text(json.dumps(result, indent=1))
    for problem in sorted({r.problem for r in rows}):
        plot(args.out, problem, rows)
    return result


if __name__ == "__main__":
    main()
