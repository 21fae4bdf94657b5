"""Quick stiff measurement (a plain script, not a test): solverkit's Kvaerno5 against
diffrax's on a vmapped ROBER ensemble and on HIRES, float64, PIDController(rtol=1e-6,
atol=1e-10). Prints first-call time (trace + compile + run), run time (median of
repeats), steps, and the error against scipy's Radau at rtol=atol=1e-12 (ROBER: the
first ensemble member, k1 scale 0.5).

Run: `python benchmarks/stiff_implicit_quick.py [--n 256] [--solver Kvaerno5]`.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import scipy.integrate  # noqa: E402

import solverkit  # noqa: E402


def rober(t, y, args):
    k1 = 0.04 * args
    k2, k3 = 3e7, 1e4
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def hires(t, y, args):
    y1, y2, y3, y4, y5, y6, y7, y8 = (y[i] for i in range(8))
    return jnp.stack(
        [
            -1.71 * y1 + 0.43 * y2 + 8.32 * y3 + 0.0007,
            1.71 * y1 - 8.75 * y2,
            -10.03 * y3 + 0.43 * y4 + 0.035 * y5,
            8.32 * y2 + 1.71 * y3 - 1.12 * y4,
            -1.745 * y5 + 0.43 * y6 + 0.43 * y7,
            -280.0 * y6 * y8 + 0.69 * y4 + 1.71 * y5 - 0.43 * y6 + 0.69 * y7,
            280.0 * y6 * y8 - 1.81 * y7,
            -280.0 * y6 * y8 + 1.81 * y7,
        ]
    )


HIRES_Y0 = np.array([1.0, 0, 0, 0, 0, 0, 0, 0.0057])


def reference(fn, t1, y0, args):
    sol = scipy.integrate.solve_ivp(
        lambda t, y: np.asarray(fn(t, jnp.asarray(y), args)),
        (0.0, t1),
        y0,
        method="Radau",
        rtol=1e-12,
        atol=1e-12,
        jac=lambda t, y: np.asarray(jax.jacfwd(fn, 1)(t, jnp.asarray(y), args)),
    )
    return sol.y[:, -1]


def make(lib, solver_name, fn, t1, batched):
    def solve(y0, args):
        return lib.diffeqsolve(
            lib.ODETerm(fn),
            getattr(lib, solver_name)(),
            0.0,
            t1,
            1e-6,
            y0,
            args,
            stepsize_controller=lib.PIDController(rtol=1e-6, atol=1e-10),
            max_steps=100_000,
        )

    solve = jax.vmap(solve) if batched else solve

    @jax.jit
    def run(y0, args):
        sol = solve(y0, args)
        return sol.ys[..., -1, :], sol.stats["num_steps"]

    return run


def measure(run, *inputs, repeats=5):
    start = time.perf_counter()
    out = jax.block_until_ready(run(*inputs))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*inputs))
        times.append(time.perf_counter() - start)
    return first, float(np.median(times)), out


def case(name, fn, t1, y0, args, batched, ref, solver_name):
    rows = {}
    for lib in (solverkit, diffrax):
        first, run_time, (ys, steps) = measure(
            make(lib, solver_name, fn, t1, batched), y0, args
        )
        y_first = np.asarray(ys[0] if batched else ys)
        err = float(np.max(np.abs(y_first - ref) / (1e-10 + np.abs(ref))))
        steps = np.asarray(steps)
        rows[lib.__name__] = (first, run_time, int(steps.max()), steps.mean(), err)
    print(f"\n{name} ({solver_name})")
    print(
        f"{'':10s} {'first call s':>12s} {'run s':>10s} {'max steps':>9s} "
        f"{'mean':>8s} {'rel err':>9s}"
    )
    for lib, (first, run_time, smax, smean, err) in rows.items():
        print(
            f"{lib:10s} {first:12.3f} {run_time:10.4f} {smax:9d} {smean:8.1f} "
            f"{err:9.2e}"
        )
    sk, dx = rows["solverkit"], rows["diffrax"]
    print(
        f"ratios solverkit/diffrax: first call {sk[0] / dx[0]:.2f}, "
        f"run {sk[1] / dx[1]:.2f}"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--solver", default="Kvaerno5")
    opts = parser.parse_args()
    scales = jnp.linspace(0.5, 2.0, opts.n)
    y0 = jnp.broadcast_to(jnp.array([1.0, 0.0, 0.0]), (opts.n, 3))
    ref = reference(rober, 1e5, np.array([1.0, 0.0, 0.0]), 0.5)
    case(f"ROBER x{opts.n} (vmap)", rober, 1e5, y0, scales, True, ref, opts.solver)
    ref = reference(hires, 321.8122, HIRES_Y0, None)
    case("HIRES", hires, 321.8122, jnp.asarray(HIRES_Y0), None, False, ref, opts.solver)


if __name__ == "__main__":
    main()
