"""Lane refill (`ensemble_solve`) against a lockstep batch (`jax.vmap(diffeqsolve)`)
and against diffrax (`jax.vmap(diffrax.diffeqsolve)`), on ensembles whose members
take very different numbers of steps.

`python -m benchmarks.ensemble [--quick] [--sizes 4096] [--lanes 256,512] [--grad]
[--profile]`

Cases (float64, one process, whatever device JAX sees; the parameters are shuffled
with a fixed seed unless `--sorted`):

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
"""

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


jax.config.update("jax_enable_x64", True)


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


def refill(case: Case, lanes: int | None):
    term, solver = sk.ODETerm(case.vf), getattr(sk, case.solver)()

    def solve(y0, p):
        sol = sk.ensemble_solve(
            term, solver, 0.0, case.t1, DT0, y0, p,
            stepsize_controller=_controller(), max_steps=MAX_STEPS, lanes=lanes,
        )  # fmt: skip
        return sol.ys[:, -1], sol.stats["num_steps"], sol.stats["lane_steps"]

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


def simulate_refill(steps: np.ndarray, lanes: int, refill_at: int) -> tuple[int, int]:
    """The lane loop of `ensemble_solve` replayed from each trajectory's steps (queue
    in the order of `steps`): `(iterations, refills)`. It matches the real loop's
    `lane_steps / lanes` exactly (each iteration steps every occupied lane; finished
    lanes wait until `refill_at` of them, or all occupied ones, have finished)."""
    n = len(steps)
    lanes = min(lanes, n)
    left = np.asarray(steps[:lanes], dtype=np.int64).copy()
    occupied = np.ones(lanes, bool)
    queue, iterations, refills = lanes, 0, 0
    while occupied.any():
        left[occupied] -= 1
        iterations += 1
        finished = occupied & (left <= 0)
        count = int(finished.sum())
        if count and ((count >= refill_at and queue < n) or count == occupied.sum()):
            refills += 1
            idle = np.flatnonzero(finished)
            take = min(len(idle), n - queue)
            left[idle[:take]] = steps[queue : queue + take]
            queue += take
            occupied[idle[take:]] = False
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
    print("| lanes | refill at | iterations | refills | utilisation | longest-first "
          "utilisation | ratio bound (eff. / util.) |")  # fmt: skip
    print("|" + " --- |" * 7)
    longest = np.sort(steps)[::-1]
    for lanes in (64, 128, 256, 512):
        for at in sorted({1, max(1, lanes // 32), max(1, lanes // 8)}):
            its, refills = simulate_refill(steps, lanes, at)
            util = steps.sum() / (its * min(lanes, n))
            its_l, _ = simulate_refill(longest, lanes, at)
            util_l = steps.sum() / (its_l * min(lanes, n))
            print(
                f"| {lanes} | {at} | {its} | {refills} | {util:.3f} | {util_l:.3f} | "
                f"{eff / util:.3f} |"
            )


def run_case(
    case: Case,
    n: int,
    lane_counts,
    repeats: int,
    with_diffrax: bool,
    shuffle: bool,
    with_grad: bool = False,
):
    args = _inputs(case, n, shuffle)
    first_l, run_l, (y_l, steps_l) = _time(lockstep(case), args, repeats)
    steps_l = np.asarray(steps_l)
    eff = steps_l.mean() / steps_l.max()
    diffrax_s = "-"
    if with_diffrax:
        _, run_d, _ = _time(diffrax_lockstep(case), args, repeats)
        diffrax_s = f"{run_d:.3f}"
    if with_grad:
        _, run_gl, grad_l = _time(lockstep_grad(case), args, repeats)
    rows = []
    for lanes in lane_counts:
        first_r, run_r, (y_r, steps_r, lane_steps) = _time(
            refill(case, lanes), args, repeats
        )
        used = sk.default_lanes(n) if lanes is None else min(lanes, n)
        _, run_c, _ = _time(lockstep(case, used), args, repeats)
        label = f"{used} (default)" if lanes is None else str(used)
        work = int(lane_steps) / int(np.sum(steps_r))
        diff = float(jnp.max(jnp.abs(y_r - y_l)))
        same = bool(np.all(np.asarray(steps_r) == steps_l))
        row = (
            f"| {case.name} | {n} | {label} | {run_r:.3f} | {run_l:.3f} | "
            f"{run_r / run_l:.2f} | {run_c:.3f} | {diffrax_s} | "
            f"{first_r:.2f} | {first_l:.2f} | "
            f"{eff:.2f} | {work:.3f} | {diff:.1e}{'' if same else ' (steps differ)'} |"
        )
        if with_grad:
            _, run_gr, grad_r = _time(refill_grad(case, lanes), args, repeats)
            row += (
                f" {run_gr:.3f} | {run_gl:.3f} | {run_gr / run_gl:.2f} | "
                f"{_backward_work(np.asarray(steps_r), used):.3f} | "
                f"{_relative_diff(grad_r, grad_l):.1e} |"
            )
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N=512, 1 repeat")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sizes", default=None, help="e.g. 1024,4096")
    parser.add_argument(
        "--lanes", default=None, help="lane counts, e.g. 128,256 ('d': default)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-diffrax", action="store_true")
    parser.add_argument(
        "--sorted", action="store_true", help="parameters in order, not shuffled"
    )
    parser.add_argument(
        "--grad",
        action="store_true",
        help="also time the gradient (refill forward + backward vs lockstep vmap)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="no timing: lane utilisation and refills, replayed from step counts",
    )
    opts = parser.parse_args(argv)
    sizes = [512] if opts.quick else [4096]
    if opts.sizes:
        sizes = [int(s) for s in opts.sizes.split(",")]
    lane_counts: list[int | None] = [None]
    if opts.lanes:
        lane_counts = [None if s == "d" else int(s) for s in opts.lanes.split(",")]
    repeats = opts.repeats or (1 if opts.quick else 3)
    if opts.profile:
        for name in opts.cases.split(","):
            for n in sizes:
                profile(CASES[name], n, not opts.sorted)
        return
    print(f"device: {jax.devices()[0].device_kind}, float64, repeats {repeats}")
    header = HEADER + (GRAD_HEADER if opts.grad else "")
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for name in opts.cases.split(","):
        for n in sizes:
            run_case(
                CASES[name], n, lane_counts, repeats, not opts.no_diffrax,
                not opts.sorted, opts.grad,
            )  # fmt: skip


if __name__ == "__main__":
    main()
