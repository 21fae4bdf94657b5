"""`jax.vmap(diffeqsolve)` on the kernel route against the loop, and diffrax: values,
gradients (`grad` of the summed loss, per-example `vmap(grad)`), which path each
took (`kernel_routes`), and run times, side by side in one process.

`python -m tools.route_check --n 4096 [--out FILE]` (on a TPU; on a CPU the route
runs in Pallas' interpreter: use a small `--n`).
"""

import argparse
import json

import diffrax
import jax
import jax.numpy as jnp

import solverkit as sk
from benchmarks.harness import timed
from solverkit._kernel import _vmap


def _lorenz(lib, rho, y0, sigma):
    def field(t, y, args):
        x, u, z = y[0], y[1], y[2]
        return jnp.stack([sigma * (u - x), x * (rho - z) - u, x * u - 8 / 3 * z])

    sol = lib.diffeqsolve(
        lib.ODETerm(field), lib.Tsit5(), 0.0, 1.0, 1e-3, y0,
        saveat=lib.SaveAt(ts=jnp.linspace(0.0, 1.0, 8)),
        stepsize_controller=lib.PIDController(rtol=1e-6, atol=1e-6),
        throw=False,
    )  # fmt: skip
    return sol.ys


def _programs(lib):
    solve = jax.vmap(lambda r, y, s: _lorenz(lib, r, y, s), in_axes=(0, 0, None))
    loss = lambda s, r, y: jnp.sum(solve(r, y, s)[:, -1] ** 2)  # noqa: E731
    one = lambda s, r, y: jnp.sum(_lorenz(lib, r, y, s)[-1] ** 2)  # noqa: E731
    per_example = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))
    return dict(
        forward=jax.jit(lambda s, r, y: solve(r, y, s)),
        gradient=jax.jit(jax.grad(loss, argnums=(0, 1))),
        per_example=jax.jit(per_example),
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--out", default=None)
    n = parser.parse_args().n
    rho = jnp.linspace(10.0, 28.0, n)
    y0 = jnp.ones((n, 3)) + 0.01 * jnp.arange(n)[:, None] / n
    sigma = jnp.asarray(10.0)
    rows = []
    for name in ("forward", "gradient", "per_example"):
        row = dict(case=name, n=n)
        results = {}
        for label, lib, enabled in (
            ("route", sk, True),
            ("loop", sk, False),
            ("diffrax", diffrax, None),
        ):
            _vmap.ENABLED = enabled
            with sk.kernel_routes() as routes:
                out, first, run = timed(_programs(lib)[name], sigma, rho, y0, repeats=5)
            results[label] = out
            row[f"{label}_first_s"], row[f"{label}_run_ms"] = first, 1e3 * run
            if label == "route":
                row["paths"] = [(r.stage, r.kernel, r.reason) for r in routes]
        ref = jax.tree_util.tree_leaves(results["loop"])
        got = jax.tree_util.tree_leaves(results["route"])
        row["route_vs_loop_rel"] = max(
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30))
            for a, b in zip(ref, got)
        )
        row["route_over_diffrax_run"] = row["route_run_ms"] / row["diffrax_run_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    args = parser.parse_args()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
