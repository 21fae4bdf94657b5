"""Stiff ensembles: vmapped and lane-refilled Rodas5P, Kvaerno5 and BDF against
diffrax's vmapped Kvaerno5, on Van der Pol with a sweep of stiffness.

`python -m benchmarks.stiff_ensemble [--dtype float32] [--sizes 1024,16384]
[--cases ...] [--tols 1e-5,1e-7] [--repeats 3] [--case-timeout 60] [--budget S]
[--out DIR]`

Problem: y'' = mu (1 - y^2) y' - y, y0 = (2, 0), t in [0, 200], mu = logspace(0, 2,
N) (relaxation oscillations, stiff for large mu), PIDController(rtol=atol=1e-5;
solverkit's also at each of `--tols`, to compare at equal error),
dt0 = 1e-3, max_steps 20,000 (`--max-steps`), in `--dtype` (float32 by default: the
accelerator's type).

Cases: `<solver>-vmap` (`jax.jit(jax.vmap(diffeqsolve))`) and `<solver>-ensemble`
(`ensemble_solve`, default lanes) for solverkit's Rodas5P, Kvaerno5 and BDF, and
`diffrax-kvaerno5` (`jax.vmap(diffrax.diffeqsolve)`). Each case and size runs in
its own subprocess with a time limit, so a crash, an out-of-memory error or a solve
that does not finish is recorded (`status`) and the run goes on; once `--budget`
seconds have passed, the cases left are recorded as skipped.

Columns: first call (trace, compile, run), run time (median of `--repeats`), the
ratio of run times to diffrax's at that size, the largest and mean number of steps
(accepted and rejected) of a trajectory, and the error: the largest
`|y(200) - y_ref(200)|` over 16 trajectories spread over the sweep, against SciPy's
LSODA (compiled; Radau in Python takes minutes) at rtol = atol = 1e-10 in float64
on the CPU (computed once and cached in `--out`). Trajectories that did not
succeed are counted (`failed`).

Writes `stiff_ensemble.json` and `stiff_ensemble.md` into `--out` (default
`benchmarks/results/stiff-ensemble-<dtype>/`), rewritten after each case; the
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
CASES = [
    "rodas5p-vmap",
    "rodas5p-ensemble",
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


def _solverkit(name: str, ensemble: bool, dtype, max_steps: int, tol: float):
    import jax

    import solverkit as sk

    solver = {"rodas5p": sk.Rodas5P, "kvaerno5": sk.Kvaerno5, "bdf": sk.BDF}[name]()
    term, ctrl = sk.ODETerm(_vdp), sk.PIDController(rtol=tol, atol=tol)
    t0, t1, dt0 = dtype(0.0), dtype(T1), dtype(DT0)
    if ensemble:

        def batch(y0, mu):
            sol = sk.ensemble_solve(
                term, solver, t0, t1, dt0, y0, mu, stepsize_controller=ctrl,
                max_steps=max_steps, throw=False,
            )  # fmt: skip
            ok = sol.result == sk.RESULTS.successful
            return sol.ys[:, -1], sol.stats["num_steps"], ok

        return jax.jit(batch)

    def one(y0, mu):
        sol = sk.diffeqsolve(
            term, solver, t0, t1, dt0, y0, mu, stepsize_controller=ctrl,
            max_steps=max_steps, throw=False,
        )  # fmt: skip
        ok = sol.result == sk.RESULTS.successful
        return sol.ys[-1], sol.stats["num_steps"], ok

    return jax.jit(jax.vmap(one))


def _diffrax(dtype, max_steps: int):
    import diffrax
    import jax

    term, solver = diffrax.ODETerm(_vdp), diffrax.Kvaerno5()
    ctrl = diffrax.PIDController(rtol=TOL, atol=TOL)

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
        fn = _diffrax(dtype, max_steps)
    else:
        name, kind = case.split("-")
        fn = _solverkit(name, kind == "ensemble", dtype, max_steps, tol)
    y0 = jnp.tile(jnp.asarray(Y0, dtype), (n, 1))
    mu = jnp.asarray(mus(n), dtype)
    start = time.perf_counter()
    out = jax.block_until_ready(fn(y0, mu))
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(y0, mu))
        runs.append(time.perf_counter() - start)
        if sum(runs) > 20:
            break
    ys, steps, ok = (np.asarray(x) for x in out)
    return {
        "first_call_s": first,
        "run_s": statistics.median(runs) if runs else None,
        "repeats": len(runs),
        "steps_max": int(steps.max()),
        "steps_mean": float(steps.mean()),
        "failed": int((~ok).sum()),
        "y_ref_points": ys[reference_indices(n)].astype(np.float64).tolist(),
        "device": jax.devices()[0].device_kind,
    }


# --- the parent: every case in its own subprocess -----------------------------


def run_case(case: str, n: int, tol: float, args, ref: np.ndarray) -> dict:
    cmd = [
        sys.executable, "-m", "benchmarks.stiff_ensemble", "--child", case,
        "--sizes", str(n), "--dtype", args.dtype, "--repeats", str(args.repeats),
        "--max-steps", str(args.max_steps), "--tols", str(tol),
    ]  # fmt: skip
    row = {"case": case, "size": n, "tol": tol, "dtype": args.dtype}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.case_timeout
        )
    except subprocess.TimeoutExpired:
        return row | {"status": f"timeout ({args.case_timeout:g} s)"}
    row["wall_s"] = time.perf_counter() - start
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return row | {"status": f"error (rc {proc.returncode}): " + " | ".join(tail)}
    got = json.loads(lines[-1][len("RESULT ") :])
    points = np.asarray(got.pop("y_ref_points"))
    row |= got
    row["error"] = float(np.nan_to_num(np.abs(points - ref).max(), nan=np.inf))
    row["status"] = "ok"
    return row


def _table(rows: list[dict]) -> str:
    head = (
        "| case | N | tol | dtype | status | first call (s) | run (s) | / diffrax | "
        "steps max | steps mean | error | failed |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    base = {
        r["size"]: r.get("run_s")
        for r in rows
        if r["case"] == "diffrax-kvaerno5" and r["status"] == "ok"
    }

    def cell(r, key, fmt):
        v = r.get(key)
        return "" if v is None else format(v, fmt)

    body = ""
    for r in rows:
        ratio = ""
        if r.get("run_s") and base.get(r["size"]):
            ratio = f"{r['run_s'] / base[r['size']]:.3f}"
        body += (
            f"| {r['case']} | {r['size']} | {r['tol']:g} | {r['dtype']} | "
            f"{r['status']} | "
            f"{cell(r, 'first_call_s', '.2f')} | {cell(r, 'run_s', '.4f')} | {ratio} | "
            f"{cell(r, 'steps_max', 'd')} | {cell(r, 'steps_mean', '.0f')} | "
            f"{cell(r, 'error', '.2e')} | {cell(r, 'failed', 'd')} |\n"
        )
    return head + body


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
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        n = int(args.sizes)
        tol = float(args.tols)
        res = child(args.child, n, args.dtype, args.repeats, args.max_steps, tol)
        print("RESULT " + json.dumps(res), flush=True)
        return
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {CASES}")
    # The parent never touches the accelerator: each child needs it to itself.
    sizes = [int(x) for x in (args.sizes or "256").split(",")]
    out = Path(args.out or f"benchmarks/results/stiff-ensemble-{args.dtype}")
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "dtype": args.dtype, "tol": TOL, "t1": T1}
    tols = [float(x) for x in args.tols.split(",")]
    rows: list[dict] = []
    start = time.perf_counter()
    for n in sizes:
        ref = reference(n, out)
        for case in cases:
            for tol in [TOL] if case == "diffrax-kvaerno5" else tols:
                spent = time.perf_counter() - start
                if args.budget is not None and spent > args.budget:
                    row = {"case": case, "size": n, "tol": tol, "dtype": args.dtype}
                    row["status"] = f"skipped (budget {args.budget:g} s spent)"
                else:
                    row = run_case(case, n, tol, args, ref)
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "stiff_ensemble.json").write_text(
                    json.dumps({"meta": meta, "rows": rows}, indent=1)
                )
                (out / "stiff_ensemble.md").write_text(_table(rows))
    print(_table(rows))


if __name__ == "__main__":
    main()
