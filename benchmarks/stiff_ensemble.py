"""Stiff ensembles: vmapped and lane-refilled Rodas5P, Kvaerno5 and BDF against
diffrax's vmapped Kvaerno5, on Van der Pol with a sweep of stiffness.

`python -m benchmarks.stiff_ensemble [--dtype float32] [--sizes 1024,16384]
[--cases ...] [--tols 1e-5,1e-7] [--diffrax-tols 1e-4,1e-5] [--plan CASE:N:TOL,...]
[--repeats 3] [--case-timeout 60] [--budget S] [--out DIR]`

Problem: y'' = mu (1 - y^2) y' - y, y0 = (2, 0), t in [0, 200], mu = logspace(0, 2,
N) (relaxation oscillations, stiff for large mu), PIDController(rtol = atol = each
of `--tols` for solverkit, of `--diffrax-tols` for diffrax; both 1e-5 by default),
dt0 = 1e-3, max_steps 20,000 (`--max-steps`), in `--dtype` (float32 by default: the
accelerator's type). `--plan` lists the runs one by one instead
(`case:N:tol[:seconds]`, in that order, each with its own time limit if given), e.g.
diffrax only at a size where it finishes; `--plan chip` is the chip's command
(`CHIP_PLAN`, at most 4 minutes on a TPU v5e with `--budget 200`; `--sizes 16`
caps its sizes for a CPU smoke run, each case limited by `--case-timeout`). An
ensemble case may end in `/k`: `ensemble_solve` with `N // k` lanes (refilled),
where the default on an accelerator is lockstep (`lanes, refill` in the table are
its `stats`; `/ vmap` its run time over the same solver's vmapped one). A case
that runs past its limit records how long its first call had run after compiling
(a lower bound of its run time; for diffrax, `/ diffrax` is then an upper bound
`< x`).

Cases: `<solver>-vmap` (`jax.jit(jax.vmap(diffeqsolve))`) and `<solver>-ensemble`
(`ensemble_solve`, default lanes) for solverkit's Rodas5P, Kvaerno5 and BDF,
`rodas5p-kernel` (`ensemble_solve(kernel=True)`: the whole-solve Pallas kernel; on
a CPU in Pallas' interpreter, slow: a smoke run only; `rodas5p-kernel@R` in blocks
of `R` rows of 128 trajectories, default `_kernel._solve.default_rows(N)`: 64 at
N = 16,384, two blocks, which one TensorCore runs in sequence), and `diffrax-kvaerno5`
(`jax.vmap(diffrax.diffeqsolve)`). Each run has its own
subprocess with a time limit, so a crash, an out-of-memory error or a solve that
does not finish is recorded (`status`) and the run goes on; once `--budget`
seconds have passed, the runs left are recorded as skipped.

Columns: first call (trace, compile, run), run time (median of `--repeats`), the
ratio of run times to diffrax's at that size, the largest and mean number of steps
(accepted and rejected) of a trajectory, and the error at t = 200 of 16 trajectories
spread over the sweep (each trajectory's largest `|y - y_ref|`; the largest of them
and their median: the largest is often one trajectory that is inside a fast jump at
t = 200), against SciPy's LSODA (compiled; Radau in Python takes minutes) at
rtol = atol = 1e-10 in float64 on the CPU (computed once per N and cached in
`--out`). Trajectories that did not succeed are counted (`failed`) and the first
64 listed by mu (`failed_mu`, with `failed_steps`). Below the table: per diffrax
run, the fastest tolerance of each solverkit case at equal or better error (both
the largest and the median) and no failure, and its run time over diffrax's.

Diffrax's Kvaerno5 takes 5-7x the steps of solverkit's at the same tolerance (about
half of them rejected) and is that much more accurate, so equal error needs a
tighter tolerance for solverkit or a looser one for diffrax: run both at several.

Writes `stiff_ensemble.json` and `stiff_ensemble.md` into `--out` (default
`benchmarks/results/stiff-ensemble-<dtype>/`), rewritten after each run; the
reference is cached there. Default size 256 (a CPU run); on a chip, `--sizes 16384`.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


T1 = 200.0
TOL = 1e-5
DT0 = 1e-3
Y0 = (2.0, 0.0)
REF_TRAJECTORIES = 16
FAILED_LISTED = 64
CASES = [
    "rodas5p-vmap",
    "rodas5p-ensemble",
    "rodas5p-kernel",
    "kvaerno5-vmap",
    "kvaerno5-ensemble",
    "bdf-vmap",
    "bdf-ensemble",
    "diffrax-kvaerno5",
]


def mus(n: int) -> np.ndarray:
    return np.logspace(0, 2, n)


def reference_indices(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, REF_TRAJECTORIES)).astype(int))


def reference(n: int, out: Path) -> np.ndarray:
    """`y(T1)` of the reference trajectories, SciPy LSODA at 1e-10 (cached)."""
    from scipy.integrate import solve_ivp

    cache = out / f"reference-{n}.npy"
    if cache.exists():
        return np.load(cache)

    def one(mu):
        def f(t, y):
            return [y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]]

        def jac(t, y):
            return [[0.0, 1.0], [-2 * mu * y[0] * y[1] - 1.0, mu * (1 - y[0] ** 2)]]

        sol = solve_ivp(f, (0.0, T1), Y0, "LSODA", rtol=1e-10, atol=1e-10, jac=jac)
        assert sol.success, sol.message
        return sol.y[:, -1]

    ref = np.stack([one(mu) for mu in mus(n)[reference_indices(n)]])
    np.save(cache, ref)
    return ref


# --- the child: one case at one size ------------------------------------------


def _vdp(t, y, mu):
    import jax.numpy as jnp

    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def _solverkit(name: str, kind: str, dtype, max_steps: int, tol: float, lanes=None):
    import jax

    import solverkit as sk

    solver = {"rodas5p": sk.Rodas5P, "kvaerno5": sk.Kvaerno5, "bdf": sk.BDF}[name]()
    term, ctrl = sk.ODETerm(_vdp), sk.PIDController(rtol=tol, atol=tol)
    t0, t1, dt0 = dtype(0.0), dtype(T1), dtype(DT0)
    if kind.startswith("kernel"):  # Python times: the kernel needs a known direction
        from solverkit._kernel import _solve

        rows = kind.partition("@")[2]
        _solve.DEFAULT_ROWS = int(rows) if rows else None

        def kernel(y0, mu):
            sol = sk.ensemble_solve(
                term, solver, 0.0, T1, DT0, y0, mu, stepsize_controller=ctrl,
                max_steps=max_steps, throw=False, kernel=True,
            )  # fmt: skip
            ok = sol.result == sk.RESULTS.successful
            return sol.ys[:, -1], sol.stats["num_steps"], ok

        return jax.jit(kernel)
    if kind == "ensemble":

        def batch(y0, mu):
            sol = sk.ensemble_solve(
                term, solver, t0, t1, dt0, y0, mu, stepsize_controller=ctrl,
                max_steps=max_steps, throw=False, lanes=lanes,
            )  # fmt: skip
            ok = sol.result == sk.RESULTS.successful
            # refill -1: the whole-solve kernel (the default on a TPU), no refill
            policy = (sol.stats.get("lanes", -1), sol.stats.get("refill", -1))
            return sol.ys[:, -1], sol.stats["num_steps"], ok, policy

        return jax.jit(batch)

    def one(y0, mu):
        sol = sk.diffeqsolve(
            term, solver, t0, t1, dt0, y0, mu, stepsize_controller=ctrl,
            max_steps=max_steps, throw=False,
        )  # fmt: skip
        ok = sol.result == sk.RESULTS.successful
        return sol.ys[-1], sol.stats["num_steps"], ok

    return jax.jit(jax.vmap(one))


def _diffrax(dtype, max_steps: int, tol: float):
    import diffrax
    import jax

    term, solver = diffrax.ODETerm(_vdp), diffrax.Kvaerno5()
    ctrl = diffrax.PIDController(rtol=tol, atol=tol)

    def one(y0, mu):
        sol = diffrax.diffeqsolve(
            term, solver, dtype(0.0), dtype(T1), dtype(DT0), y0, mu,
            stepsize_controller=ctrl, max_steps=max_steps, throw=False,
        )  # fmt: skip
        assert sol.ys is not None and sol.stats is not None
        ok = sol.result == diffrax.RESULTS.successful
        return sol.ys[-1], sol.stats["num_steps"], ok

    return jax.jit(jax.vmap(one))


def child(
    case: str, n: int, dtype_name: str, repeats: int, max_steps: int, tol: float
) -> dict:
    import jax

    if dtype_name == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    dtype = getattr(jnp, dtype_name)
    if case == "diffrax-kvaerno5":
        fn = _diffrax(dtype, max_steps, tol)
    else:
        name, kind = case.split("-")
        kind, _, div = kind.partition("/")
        lanes = n // int(div) if div else None
        fn = _solverkit(name, kind, dtype, max_steps, tol, lanes)
    y0 = jnp.tile(jnp.asarray(Y0, dtype), (n, 1))
    mu = jnp.asarray(mus(n), dtype)
    start = time.perf_counter()
    compiled = fn.lower(y0, mu).compile()
    # Printed as it happens: a parent that times this child out knows how long the
    # first call had run (a lower bound of the run time).
    print(f"COMPILED {time.time():.3f}", flush=True)
    out = jax.block_until_ready(compiled(y0, mu))
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(y0, mu))
        runs.append(time.perf_counter() - start)
        if sum(runs) > 20:
            break
    policy = {}
    if len(out) == 4:  # ensemble_solve's lanes and refill (0: lockstep)
        policy = {"lanes": int(out[3][0]), "refill": int(out[3][1])}
    ys, steps, ok = (np.asarray(x) for x in out[:3])
    failed = np.nonzero(~ok)[0]
    return policy | {
        "first_call_s": first,
        "run_s": statistics.median(runs) if runs else None,
        "repeats": len(runs),
        "steps_max": int(steps.max()),
        "steps_mean": float(steps.mean()),
        "failed": int((~ok).sum()),
        # Which trajectories failed (the first `FAILED_LISTED`), by mu, and their steps.
        "failed_mu": [float(m) for m in np.asarray(mu)[failed][:FAILED_LISTED]],
        "failed_steps": [int(x) for x in steps[failed][:FAILED_LISTED]],
        "y_ref_points": ys[reference_indices(n)].astype(np.float64).tolist(),
        "device": jax.devices()[0].device_kind,
    }


# --- the parent: every case in its own subprocess -----------------------------


def _timed_out(row: dict, exc: subprocess.TimeoutExpired, limit: float) -> dict:
    """The row of a child that ran past `limit`: how long its first call had run
    (from its `COMPILED` line), a lower bound of the run time."""
    now = time.time()
    out = exc.stdout or b""
    text = out.decode() if isinstance(out, bytes) else out
    stamps = [
        float(x.split()[1]) for x in text.splitlines() if x.startswith("COMPILED ")
    ]
    row = row | {"status": f"timeout ({limit:g} s)"}
    if stamps:
        row["run_s_min"] = now - stamps[-1]
        row["status"] += f", first call > {row['run_s_min']:.1f} s after compiling"
    else:
        row["status"] += ", still compiling"
    return row


def run_case(
    case: str, n: int, tol: float, args, ref: np.ndarray, limit: float | None = None
) -> dict:
    limit = args.case_timeout if limit is None else limit
    cmd = [
        sys.executable, "-m", "benchmarks.stiff_ensemble", "--child", case,
        "--sizes", str(n), "--dtype", args.dtype, "--repeats", str(args.repeats),
        "--max-steps", str(args.max_steps), "--tols", str(tol),
    ]  # fmt: skip
    row = {"case": case, "size": n, "tol": tol, "dtype": args.dtype}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        return _timed_out(row, exc, limit)
    row["wall_s"] = time.perf_counter() - start
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return row | {"status": f"error (rc {proc.returncode}): " + " | ".join(tail)}
    got = json.loads(lines[-1][len("RESULT ") :])
    points = np.asarray(got.pop("y_ref_points"))
    row |= got
    # Per reference trajectory, its largest error; their largest and their median
    # (the largest is often one trajectory whose t1 falls inside a fast jump).
    each = np.nan_to_num(np.abs(points - ref).max(axis=1), nan=np.inf)
    row["error"] = float(each.max())
    row["error_median"] = float(np.median(each))
    row["status"] = "ok"
    return row


def _table(rows: list[dict]) -> str:
    head = (
        "| case | N | tol | dtype | status | first call (s) | run (s) | / diffrax | "
        "/ vmap | lanes, refill | steps max | steps mean | error | error (median) "
        "| failed | failed mu |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- | --- | --- |\n"
    )
    base = {}  # diffrax's run time per size: at `TOL` where it ran, else the first
    bound = {}  # where it timed out: how long its first call had run, at least
    for r in rows:
        if r["case"] == "diffrax-kvaerno5" and r["status"] == "ok":
            if r["size"] not in base or r["tol"] == TOL:
                base[r["size"]] = r.get("run_s")
        elif r["case"] == "diffrax-kvaerno5" and r.get("run_s_min"):
            bound[r["size"]] = max(bound.get(r["size"], 0), r["run_s_min"])
    vmap = {  # each solver's vmap run time per size and tolerance
        (r["case"].split("-")[0], r["size"], r["tol"]): r["run_s"]
        for r in rows
        if r["case"].endswith("-vmap") and r.get("run_s")
    }

    def cell(r, key, fmt):
        v = r.get(key)
        return "" if v is None else format(v, fmt)

    body = ""
    for r in rows:
        ratio = per_vmap = policy = ""
        if r.get("run_s") and base.get(r["size"]):
            ratio = f"{r['run_s'] / base[r['size']]:.3f}"
        elif r.get("run_s") and bound.get(r["size"]):
            ratio = f"< {r['run_s'] / bound[r['size']]:.3f}"
        own = vmap.get((r["case"].split("-")[0], r["size"], r["tol"]))
        if (
            ("-ensemble" in r["case"] or "-kernel" in r["case"])
            and r.get("run_s")
            and own
        ):
            per_vmap = f"{r['run_s'] / own:.3f}"
        if "lanes" in r:
            policy = f"{r['lanes']}, {r['refill']}" if r["refill"] >= 0 else "kernel"
        body += (
            f"| {r['case']} | {r['size']} | {r['tol']:g} | {r['dtype']} | "
            f"{r['status']} | "
            f"{cell(r, 'first_call_s', '.2f')} | {cell(r, 'run_s', '.4f')} | {ratio} | "
            f"{per_vmap} | {policy} | "
            f"{cell(r, 'steps_max', 'd')} | {cell(r, 'steps_mean', '.0f')} | "
            f"{cell(r, 'error', '.2e')} | {cell(r, 'error_median', '.2e')} | "
            f"{cell(r, 'failed', 'd')} | "
            f"{_listed(r.get('failed_mu', []))} |\n"
        )
    return head + body + _equal_error(rows)


def _listed(mus: list, most: int = 6) -> str:
    more = f" (+{len(mus) - most})" if len(mus) > most else ""
    return ", ".join(f"{m:.4g}" for m in mus[:most]) + more


def _equal_error(rows: list[dict]) -> str:
    """Per diffrax row and solverkit case at its size: of the case's tolerances
    whose largest and median errors are both at most diffrax's (with no failed
    trajectory), the fastest, and its run time and first call over diffrax's."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("run_s")]
    lines = []
    for ref in (r for r in ok if r["case"] == "diffrax-kvaerno5"):
        n, err, med = ref["size"], ref["error"], ref["error_median"]
        bound = f"{err:.2e} / {med:.2e}"
        mine = (r["case"] for r in ok if r["case"] != "diffrax-kvaerno5")
        for case in dict.fromkeys(mine):
            fit = [
                r
                for r in ok
                if r["case"] == case
                and r["size"] == n
                and r["error"] <= err
                and r["error_median"] <= med
                and r["failed"] == 0
            ]
            if not fit:
                lines.append(f"| {case} | {n} | {ref['tol']:g} ({bound}) | none | | |")
                continue
            r = min(fit, key=lambda r: r["run_s"])
            lines.append(
                f"| {case} | {n} | {ref['tol']:g} ({bound}) | {r['tol']:g} "
                f"({r['error']:.2e} / {r['error_median']:.2e}) | "
                f"{r['run_s'] / ref['run_s']:.3f} | "
                f"{r['first_call_s'] / ref['first_call_s']:.3f} |"
            )
    if not lines:
        return ""
    return (
        "\nAt equal or better error (largest / median) than diffrax's Kvaerno5:\n\n"
        "| case | N | diffrax tol (error) | fastest tol (error) | run / diffrax | "
        "first call / diffrax |\n| --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(lines)
        + "\n"
    )


# The chip command's runs (`--plan chip`), most wanted first, with their own time
# limits: BDF (which did not finish in 40 s before its steps were element-wise) at
# both tolerances, Rodas5P and Kvaerno5 at the tolerances that matched diffrax's
# error on the chip, diffrax's Kvaerno5 at N = 16,384 (a time limit: before, it did
# not finish in 40 s at 1e-3; the row then says how long its first call had run)
# and at N = 1024 (its error at 1e-3 and 1e-2: on the CPU, N = 32, float32, BDF's
# largest error at 1e-7 was 3.1e-2 (float64: 2.1e-2) against diffrax's 8.1e-3 at
# 1e-3, its median 5.4e-5 against 1.6e-4), then `ensemble_solve` by default
# (lockstep on an accelerator: its stats say so) and with a quarter of the lanes
# refilled. Rodas5P in the whole-solve kernel follows its vmapped row (a limit of
# 60 s: its Mosaic compile is not yet measured).
CHIP_PLAN = (
    "bdf-vmap:16384:1e-5:40,bdf-vmap:16384:1e-7:30,rodas5p-vmap:16384:1e-6:25,"
    "rodas5p-kernel:16384:1e-6:60,kvaerno5-vmap:16384:1e-7:25,diffrax-kvaerno5:16384:1e-3:30,"
    "diffrax-kvaerno5:1024:1e-3:25,diffrax-kvaerno5:1024:1e-2:25,"
    "bdf-ensemble:16384:1e-5:30,rodas5p-ensemble/4:16384:1e-6:25,"
    "bdf-ensemble/4:16384:1e-5:30"
)
PLANS = {"chip": CHIP_PLAN}


def _known(case: str) -> bool:
    """A case of `CASES`, an ensemble case with `/k` (`N // k` lanes), or a kernel
    case with `@R` (`R` rows per block)."""
    kernel, _, rows = case.partition("@")
    if rows:
        return kernel in CASES and kernel.endswith("-kernel") and rows.isdigit()
    base, _, div = case.partition("/")
    if not div:
        return case in CASES
    return base in CASES and base.endswith("-ensemble") and div.isdigit()


def _plan(p: argparse.ArgumentParser, args) -> list[tuple]:
    """The `(case, size, tol, limit)` runs in order: `--plan` (`limit` its fourth
    field or `None`: `--case-timeout`), else every size, case and tolerance
    (`--diffrax-tols` for diffrax's case, `--tols` for the others)."""
    if args.plan:
        plan = []
        for item in PLANS.get(args.plan, args.plan).split(","):
            parts = item.split(":")
            if len(parts) not in (3, 4):
                p.error(f"--plan: expected case:size:tol[:seconds], got {item!r}")
            limit = float(parts[3]) if len(parts) == 4 else None
            size = int(parts[1])
            if args.plan in PLANS and args.sizes:  # smaller, `--case-timeout` each
                size, limit = min(size, int(args.sizes)), None
            plan.append((parts[0], size, float(parts[2]), limit))
    else:
        tols = [float(x) for x in args.tols.split(",")]
        theirs = [float(x) for x in args.diffrax_tols.split(",")]
        plan = [
            (case, n, tol, None)
            for n in [int(x) for x in (args.sizes or "256").split(",")]
            for case in args.cases.split(",")
            for tol in (theirs if case == "diffrax-kvaerno5" else tols)
        ]
    unknown = sorted({x[0] for x in plan if not _known(x[0])})
    if unknown:
        p.error(
            f"unknown cases {unknown}; choose from {CASES} (an ensemble case may "
            "end in /k: N // k lanes)"
        )
    return plan


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--sizes", default=None, help="comma-separated ensemble sizes")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=20_000)
    p.add_argument("--case-timeout", type=float, default=60.0)
    p.add_argument("--budget", type=float, default=None, help="seconds in all")
    p.add_argument("--tols", default=str(TOL), help="solverkit's rtol=atol, a list")
    p.add_argument("--diffrax-tols", default=str(TOL), help="diffrax's, a list")
    p.add_argument(
        "--plan",
        default=None,
        help="case:size:tol[:seconds],... or 'chip' (replaces the above)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        n, tol = int(args.sizes), float(args.tols)
        res = child(args.child, n, args.dtype, args.repeats, args.max_steps, tol)
        print("RESULT " + json.dumps(res), flush=True)
        return
    plan = _plan(p, args)
    # The parent never touches the accelerator: each child needs it to itself.
    out = Path(args.out or f"benchmarks/results/stiff-ensemble-{args.dtype}")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "dtype": args.dtype, "t1": T1}
    refs = {n: reference(n, out) for n in dict.fromkeys(x[1] for x in plan)}
    rows: list[dict] = []
    start = time.perf_counter()
    for case, n, tol, limit in plan:
        left = (
            None if args.budget is None else args.budget - (time.perf_counter() - start)
        )
        limit = args.case_timeout if limit is None else limit
        if left is not None and left < 5:
            row = {"case": case, "size": n, "tol": tol, "dtype": args.dtype}
            row["status"] = f"skipped (budget {args.budget:g} s spent)"
        else:
            limit = limit if left is None else min(limit, left)
            row = run_case(case, n, tol, args, refs[n], limit)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "stiff_ensemble.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1)
        )
        (out / "stiff_ensemble.md").write_text(_table(rows))
    print(_table(rows))


if __name__ == "__main__":
    main()
