"""Lane refill (`ensemble_solve`) against a lockstep batch (`jax.vmap(diffeqsolve)`)
and against diffrax (`jax.vmap(diffrax.diffeqsolve)`), on ensembles whose members
take very different numbers of steps.

`python -m benchmarks.ensemble [--quick] [--sizes 4096] [--lanes 256,n/4,d]
[--refill d,l/8] [--dtype float32] [--grad] [--profile] [--out DIR]`

Cases (float64 unless `--dtype float32`, one process, whatever device JAX sees; the
parameters are shuffled with a fixed seed unless `--sorted`):

- `lorenz28`, `lorenz100`: the Lorenz system, rho = linspace(0, 28 or 100, N),
  y0 = (1, 0, 0), t in [0, 10], Tsit5, PIDController(rtol=atol=1e-6), dt0 = 1e-3.
- `vdp_log`, `vdp_lin`: Van der Pol, y'' = mu (1 - y^2) y' - y, y0 = (2, 0), t in
  [0, 10], mu = logspace(0, 3, N) or linspace(1, 1000, N), Rodas5P,
  PIDController(rtol=atol=1e-6), dt0 = 1e-3 (diffrax: Kvaerno5, the nearest it has;
  its steps differ).

For each case and size it prints a row per lane count: run time (median of the
repeats) of lane refill and of the lockstep batch and their ratio, of a lockstep
batch run in chunks of as many trajectories as there are lanes (`lax.map(...,
batch_size=lanes)`: the same working set, without refill), the first call
(trace, compile, run) of each, the lockstep efficiency (mean steps / max steps of
the batch), and the work: lane steps taken by the refill loop (idle lanes
included) against the sum of the trajectories' steps. `max |diff|` is the largest
difference between the two solutions' final states.

With `--grad`, four more columns: the gradient of `sum(final states ** 2)` with
respect to `y0` and the parameters (the default `RecursiveCheckpointAdjoint`),
through `ensemble_solve` (its refill forward pass, then the backward pass that
solves each trajectory again in chunks of `lanes` sorted by their steps) and through
the lockstep `jit(vmap(diffeqsolve))`, the ratio of the two run times, the work of
the backward pass (lane steps of its chunks, each as long as its longest
trajectory, over the sum of the trajectories' steps; a lockstep `vmap` does
`N * max` of them), and the largest difference between the two gradients relative
to the largest entry.

`--lanes` takes lane counts (`256`), fractions of N (`n/4`, `n`), `d` (the default
lanes, on the lane loop) or `k` (`ensemble_solve` with every default, `kernel=None`:
on a TPU the whole-solve kernel where it supports the solve; its `refill` column
reads -1 when the kernel ran); `--refill` the lanes refilled at once, counts,
fractions of the lanes (`l/8`) or `d`. A peer that fails (a crash, out of memory) is
recorded with its error and the run goes on; `--budget-s` stops starting new
measurements after that many seconds (recorded as skipped). `--out DIR` writes
`ensemble.json` (every row, with the device and the options) and `ensemble.md` (the
table) there.
"""

import argparse
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


def lorenz(t, y, rho):
    x, u, z = y[0], y[1], y[2]
    return jnp.stack([10.0 * (u - x), x * (rho - z) - u, x * u - (8.0 / 3.0) * z])


def vdp(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


T_LORENZ = 10.0


@dataclass(frozen=True)
class Case:
    name: str
    vf: Callable
    y0: tuple[float, ...]
    params: Callable[[int], np.ndarray]
    solver: str  # solverkit's
    diffrax_solver: str
    t1: float


CASES = {
    "lorenz28": Case(
        "lorenz28", lorenz, (1.0, 0.0, 0.0), lambda n: np.linspace(0, 28, n),
        "Tsit5", "Tsit5", T_LORENZ,
    ),
    "lorenz100": Case(
        "lorenz100", lorenz, (1.0, 0.0, 0.0), lambda n: np.linspace(0, 100, n),
        "Tsit5", "Tsit5", T_LORENZ,
    ),
    "vdp_log": Case(
        "vdp_log", vdp, (2.0, 0.0), lambda n: np.logspace(0, 3, n),
        "Rodas5P", "Kvaerno5", 10.0,
    ),
    "vdp_lin": Case(
        "vdp_lin", vdp, (2.0, 0.0), lambda n: np.linspace(1, 1000, n),
        "Rodas5P", "Kvaerno5", 10.0,
    ),
}  # fmt: skip
TOL = 1e-6
DT0 = 1e-3
MAX_STEPS = 100_000


def _inputs(case: Case, n: int, shuffle: bool):
    y0 = jnp.tile(jnp.asarray(case.y0), (n, 1))
    params = case.params(n)
    if shuffle:  # as random parameters come: no order a chunking could exploit
        params = np.random.default_rng(0).permutation(params)
    return y0, jnp.asarray(params)


def _controller():
    return sk.PIDController(rtol=TOL, atol=TOL)


def lockstep(case: Case, chunk: int | None = None):
    """`jit(vmap(solve))`; with `chunk`, `lax.map` over chunks of that many
    trajectories, each chunk a lockstep `vmap` (the working set of `chunk` lanes,
    without refill)."""
    term, solver = sk.ODETerm(case.vf), getattr(sk, case.solver)()

    def one(y0, p):
        sol = sk.diffeqsolve(
            term, solver, 0.0, case.t1, DT0, y0, p,
            stepsize_controller=_controller(), max_steps=MAX_STEPS,
        )  # fmt: skip
        return sol.ys[-1], sol.stats["num_steps"]

    if chunk is None:
        return jax.jit(jax.vmap(one))
    return jax.jit(
        lambda y0, p: jax.lax.map(lambda a: one(*a), (y0, p), batch_size=chunk)
    )


KERNEL = -1  # `--lanes k`: `ensemble_solve` with every default (its `refill` column)


def refill(case: Case, lanes: int | None, size: int | None = None):
    """`ensemble_solve` on the lane loop with `lanes` and refill `size`; with
    `lanes == KERNEL`, with every default instead (`kernel=None`: the whole-solve
    kernel where it supports the solve, on a TPU), the path a user gets."""
    term, solver = sk.ODETerm(case.vf), getattr(sk, case.solver)()
    default = lanes == KERNEL

    def solve(y0, p):
        sol = sk.ensemble_solve(
            term, solver, 0.0, case.t1, DT0, y0, p,
            stepsize_controller=_controller(), max_steps=MAX_STEPS,
            lanes=None if default else lanes, refill=None if default else size,
            kernel=None if default else False,  # False: the lane loop
        )  # fmt: skip
        stats = sol.stats
        # The kernel's stats have no `refill`: KERNEL marks its rows.
        mode = stats.get("refill", KERNEL)
        return sol.ys[:, -1], stats["num_steps"], stats["lane_steps"], mode

    return jax.jit(solve)


def _final_sum(ys):
    return jnp.sum(ys**2)


def lockstep_grad(case: Case):
    """`jit(grad)` of a loss on the final states of `vmap(diffeqsolve)`, with
    respect to `y0` and the parameters."""
    term, solver = sk.ODETerm(case.vf), getattr(sk, case.solver)()

    def one(y0, p):
        sol = sk.diffeqsolve(
            term, solver, 0.0, case.t1, DT0, y0, p,
            stepsize_controller=_controller(), max_steps=MAX_STEPS,
        )  # fmt: skip
        return sol.ys[-1]

    return jax.jit(jax.grad(lambda y0, p: _final_sum(jax.vmap(one)(y0, p)), (0, 1)))


def refill_grad(case: Case, lanes: int | None):
    """The same gradient through `ensemble_solve`."""
    term, solver = sk.ODETerm(case.vf), getattr(sk, case.solver)()

    def loss(y0, p):
        sol = sk.ensemble_solve(
            term, solver, 0.0, case.t1, DT0, y0, p,
            stepsize_controller=_controller(), max_steps=MAX_STEPS, lanes=lanes,
            kernel=False,
        )  # fmt: skip
        return _final_sum(sol.ys[:, -1])

    return jax.jit(jax.grad(loss, (0, 1)))


def diffrax_lockstep(case: Case):
    import diffrax

    term, solver = diffrax.ODETerm(case.vf), getattr(diffrax, case.diffrax_solver)()

    def one(y0, p):
        sol = diffrax.diffeqsolve(
            term, solver, 0.0, case.t1, DT0, y0, p,
            stepsize_controller=diffrax.PIDController(rtol=TOL, atol=TOL),
            max_steps=MAX_STEPS,
        )  # fmt: skip
        assert sol.ys is not None and sol.stats is not None
        return sol.ys[-1], sol.stats["num_steps"]

    return jax.jit(jax.vmap(one))


def _time(fn, args, repeats: int):
    """(first call, median run time, output)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return first, statistics.median(runs), out


HEADER = (
    "| case | N | lanes | refill s | lockstep s | ratio | chunked lockstep s | "
    "diffrax s | "
    "refill 1st s | lockstep 1st s | lockstep eff. | lane steps / sum steps | "
    "max abs diff |"
)
GRAD_HEADER = (
    " refill grad s | lockstep grad s | grad ratio | backward lane steps / sum "
    "steps | grad rel diff |"
)


def _relative_diff(a, b) -> float:
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
    a, b = flat(a), flat(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _backward_work(steps: np.ndarray, lanes: int) -> float:
    """The lane steps of the backward pass's chunks (`lanes` trajectories each,
    sorted by steps, longest first; each runs as long as its longest) over the sum
    of the steps."""
    steps = np.sort(steps)[::-1]
    return float(np.sum(steps[::lanes]) * lanes / np.sum(steps))


def simulate_refill(
    steps: np.ndarray, lanes: int, size: int, wait: int | None = None
) -> tuple[int, int]:
    """The lane loop of `ensemble_solve` replayed from each trajectory's steps (queue
    in the order of `steps`): `(iterations, refills)`, as the real loop's
    `lane_steps / lanes`: each iteration steps every running lane; while the queue
    lasts, once `wait` (default `size`) lanes have finished, or none runs, up to
    `size` of them are refilled; with the queue empty finished lanes go idle."""
    n, wait = len(steps), size if wait is None else wait
    lanes = min(lanes, n)
    left = np.asarray(steps[:lanes], dtype=np.int64).copy()
    queue, iterations, refills = lanes, 0, 0
    if lanes == n:
        return int(left.max()), 0
    while (left > 0).any() or queue < n:
        iterations += 1
        left[left > 0] -= 1
        finished = np.flatnonzero(left == 0)
        due = len(finished) >= wait or not (left > 0).any()
        if queue < n and len(finished) and due:
            refills += 1
            take = finished[: min(size, n - queue)]
            left[take] = steps[queue : queue + len(take)]
            queue += len(take)
    return iterations, refills


def profile(case: Case, n: int, shuffle: bool) -> None:
    """Where lane refill's time goes, from the lockstep's step counts (no timing):
    per lane count and refill threshold, the lane utilisation (sum of steps over
    lane steps), the number of refills, the utilisation with the queue taken longest
    first (an oracle order), and the run-time ratio to the lockstep vmap that the
    utilisation allows if a lane step costs the same in both (lockstep efficiency /
    utilisation)."""
    _, steps = lockstep(case)(*_inputs(case, n, shuffle))
    steps = np.asarray(steps)
    eff = steps.mean() / steps.max()
    print(
        f"\n{case.name}, N = {n}: sum of steps {steps.sum()}, max {steps.max()}, "
        f"mean {steps.mean():.1f}, lockstep efficiency {eff:.3f}\n"
    )
    print("| lanes | refill | wait | iterations | refills | utilisation | "
          "longest-first utilisation | ratio bound (eff. / util.) |")  # fmt: skip
    print("|" + " --- |" * 8)
    longest = np.sort(steps)[::-1]
    for lanes in (64, 128, 256, 512):
        if lanes >= n:
            continue
        pairs = {(1, 1), (lanes // 32, lanes // 32), (lanes // 8, lanes // 32),
                 (lanes // 8, lanes // 8), (lanes // 2, lanes // 32)}  # fmt: skip
        for size, wait in sorted((max(a, 1), max(b, 1)) for a, b in pairs):
            its, refills = simulate_refill(steps, lanes, size, wait)
            util = steps.sum() / (its * lanes)
            its_l, _ = simulate_refill(longest, lanes, size, wait)
            util_l = steps.sum() / (its_l * lanes)
            print(
                f"| {lanes} | {size} | {wait} | {its} | {refills} | {util:.3f} | "
                f"{util_l:.3f} | {eff / util:.3f} |"
            )


def _attempt(fn, args, repeats: int, deadline: float):
    """`_time(fn, args, repeats)`, or `(None, why)`: the error of a peer that fails
    (a crash, out of memory), recorded so that the run goes on, or a skip past the
    time budget."""
    if time.perf_counter() > deadline:
        return None, "skipped: time budget spent"
    try:
        return _time(fn, args, repeats), None
    except Exception as e:  # noqa: BLE001  (any failure is a result to record)
        text = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _count(spec: str, whole: int, default=None) -> int | None:
    """A count from `256`, `n/4` or `l/8` (a fraction of `whole`), `n` or `l`
    (`whole`), or `d` (`default`)."""
    if spec == "d":
        return default
    if spec == "k":
        return KERNEL
    if spec[0] in "nl":
        div = int(spec[2:]) if "/" in spec else 1
        return max(1, whole // div)
    return int(spec)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


ROW_KEYS = (
    "case", "n", "dtype", "lanes", "refill", "refill_s", "lockstep_s", "ratio",
    "chunked_s", "diffrax_s", "refill_first_s", "lockstep_first_s",
    "lockstep_eff", "work", "max_abs_diff", "error",
)  # fmt: skip


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (`refill 0`: the lockstep loop, no refill)."""
    lines = [
        "| case | N | dtype | lanes | refill (0: lockstep) | refill s | lockstep s | "
        "ratio | chunked lockstep s | diffrax s | refill 1st s | lockstep 1st s | "
        "lockstep eff. | lane steps / sum steps | max abs diff | error |",
        "|" + " --- |" * 16,
    ]
    for r in rows:
        cells = [
            r["case"], r["n"], r["dtype"], r["lanes"], _fmt(r["refill"], "d"),
            _fmt(r["refill_s"], ".4f"), _fmt(r["lockstep_s"], ".4f"),
            _fmt(r["ratio"], ".2f"), _fmt(r["chunked_s"], ".4f"),
            _fmt(r["diffrax_s"], ".3f"), _fmt(r["refill_first_s"], ".2f"),
            _fmt(r["lockstep_first_s"], ".2f"), _fmt(r["lockstep_eff"], ".2f"),
            _fmt(r["work"], ".3f"), _fmt(r["max_abs_diff"], ".1e"), r["error"] or "",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _refill_row(case, n, args, lanes, size, base: dict, opts, deadline) -> dict:
    """One row: `ensemble_solve` with `lanes` and refill `size` against the
    lockstep run in `base`."""
    timed, error = _attempt(refill(case, lanes, size), args, opts.repeats, deadline)
    used = sk.default_lanes(n) if lanes in (None, KERNEL) else min(lanes, n)
    row = dict(base, lanes=f"{used} (default)" if lanes is None else str(used))
    if lanes == KERNEL:
        row["lanes"] = "defaults (kernel=None)"
    row.update(refill=None, refill_s=None, ratio=None, chunked_s=None, work=None)
    row.update(refill_first_s=None, max_abs_diff=None, error=error)
    if timed is None:
        return row
    first_r, run_r, (y_r, steps_r, lane_steps, mode) = timed
    row.update(refill=int(mode), refill_s=run_r, refill_first_s=first_r)
    row["work"] = int(lane_steps) / max(int(np.sum(steps_r)), 1)
    if base["lockstep_s"] is not None:
        row["ratio"] = run_r / base["lockstep_s"]
        row["max_abs_diff"] = float(jnp.max(jnp.abs(y_r - base["_y"])))
    if opts.chunked and used < n and lanes != KERNEL:
        chunked, _ = _attempt(lockstep(case, used), args, opts.repeats, deadline)
        row["chunked_s"] = None if chunked is None else chunked[1]
    return row


def run_case(case: Case, n: int, opts, deadline: float) -> list[dict]:
    """Every lane count and refill size of `opts` for one case and size."""
    args = _inputs(case, n, not opts.sorted)
    base = dict(case=case.name, n=n, dtype=opts.dtype, diffrax_s=None)
    timed, error = _attempt(lockstep(case), args, opts.repeats, deadline)
    base.update(lockstep_s=None, lockstep_first_s=None, lockstep_eff=None)
    if timed is not None:
        first_l, run_l, (y_l, steps_l) = timed
        steps_l = np.asarray(steps_l)
        base.update(lockstep_s=run_l, lockstep_first_s=first_l, _y=y_l)
        base["lockstep_eff"] = float(steps_l.mean() / steps_l.max())
    if opts.diffrax:
        timed_d, _ = _attempt(diffrax_lockstep(case), args, opts.repeats, deadline)
        base["diffrax_s"] = None if timed_d is None else timed_d[1]
    rows = []
    if error is not None:  # the lockstep peer failed: say so, go on
        row = dict(base, lanes="lockstep", error=error)
        rows.append({k: row.get(k) for k in ROW_KEYS})
    done = set()
    for lane_spec in opts.lanes.split(","):
        lanes = _count(lane_spec, n)
        used = sk.default_lanes(n) if lanes in (None, KERNEL) else min(lanes, n)
        if lanes == KERNEL:
            used = -1  # its own row, whatever the default lanes
        for refill_spec in opts.refill.split(",") if used < n else ["d"]:
            size = _count(refill_spec, used)
            if (used, size) in done:  # e.g. `d` and `n/2`: measured once
                continue
            done.add((used, size))
            row = _refill_row(case, n, args, lanes, size, base, opts, deadline)
            rows.append({k: row.get(k) for k in ROW_KEYS})
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def _grad_rows(case: Case, n: int, opts) -> None:
    """`--grad`: the gradient through `ensemble_solve` against the lockstep one."""
    args = _inputs(case, n, not opts.sorted)
    _, run_gl, grad_l = _time(lockstep_grad(case), args, opts.repeats)
    for spec in opts.lanes.split(","):
        lanes = _count(spec, n)
        used = sk.default_lanes(n) if lanes is None else min(lanes, n)
        _, run_gr, grad_r = _time(refill_grad(case, lanes), args, opts.repeats)
        _, steps = lockstep(case)(*args)
        print(
            f"| {case.name} | {n} | {used} | {run_gr:.3f} | {run_gl:.3f} | "
            f"{run_gr / run_gl:.2f} | "
            f"{_backward_work(np.asarray(steps), used):.3f} | "
            f"{_relative_diff(grad_r, grad_l):.1e} |",
            flush=True,
        )


def _options(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="N=512, 1 repeat")
    add("--cases", default=",".join(CASES))
    add("--sizes", default=None, help="e.g. 1024,4096")
    add(
        "--lanes",
        default="d",
        help="e.g. 128,n/4,n,d,k ('d': default lanes on the lane loop; 'k': every "
        "default, kernel=None)",
    )
    add("--refill", default="d", help="lanes refilled at once, e.g. 1,l/8,d")
    add("--dtype", default="float64", choices=("float32", "float64"))
    add("--repeats", type=int, default=None)
    add("--no-diffrax", dest="diffrax", action="store_false")
    add("--no-chunked", dest="chunked", action="store_false")
    add("--sorted", action="store_true", help="parameters in order, not shuffled")
    add("--grad", action="store_true", help="time the gradient instead")
    add("--profile", action="store_true", help="no timing: replayed lane use")
    add("--budget-s", type=float, default=None, help="start nothing after this")
    add("--out", default=None, help="write ensemble.json and ensemble.md here")
    opts = parser.parse_args(argv)
    opts.sizes = [int(s) for s in opts.sizes.split(",")] if opts.sizes else None
    opts.sizes = opts.sizes or ([512] if opts.quick else [4096])
    opts.repeats = opts.repeats or (1 if opts.quick else 3)
    return opts


def main(argv=None) -> None:
    opts = _options(argv)
    # The lockstep baseline is the vmapped loop: on a TPU `jax.vmap(diffeqsolve)`
    # would run on the whole-solve kernel (`solverkit._kernel._vmap`).
    os.environ.setdefault("SOLVERKIT_VMAP_KERNEL", "0")
    jax.config.update("jax_enable_x64", opts.dtype == "float64")
    if opts.profile:
        for name in opts.cases.split(","):
            for n in opts.sizes:
                profile(CASES[name], n, not opts.sorted)
        return
    device = jax.devices()[0].device_kind
    print(f"device: {device}, {opts.dtype}, repeats {opts.repeats}")
    if opts.grad:
        print("| case | N | lanes |" + GRAD_HEADER + "\n|" + " --- |" * 8)
        for name in opts.cases.split(","):
            for n in opts.sizes:
                _grad_rows(CASES[name], n, opts)
        return
    deadline = time.perf_counter() + (opts.budget_s or float("inf"))
    print(markdown([]))
    rows = []
    for name in opts.cases.split(","):
        for n in opts.sizes:
            rows += run_case(CASES[name], n, opts, deadline)
            if opts.out:  # after each case, so that a cut run keeps what it did
                _write(pathlib.Path(opts.out), device, opts, rows)


def _write(out: pathlib.Path, device: str, opts, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=device, backend=jax.default_backend(), jax=jax.__version__)
    meta.update(vars(opts), tol=TOL, dt0=DT0)
    text = json.dumps(dict(meta=meta, rows=rows), indent=1)
    (out / "ensemble.json").write_text(text)
    table = markdown(rows)
    (out / "ensemble.md").write_text(f"device: {device}, {opts.dtype}\n\n{table}\n")


if __name__ == "__main__":
    main()
