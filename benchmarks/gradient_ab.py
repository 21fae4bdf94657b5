"""One line of gradient timings for A/B runs of two solverkit versions in turn.

The CPU of a shared machine drifts by tens of percent within minutes, so compare two
checkouts by alternating them:

```bash
git worktree add /tmp/old <commit>
for i in 1 2; do
    (cd /tmp/old && python -m benchmarks.gradient_ab old)
    python -m benchmarks.gradient_ab new
done
```

(`python -m` puts the current directory first on `sys.path`, ahead of `PYTHONPATH`:
run the old version from its own checkout.)

Cases (N = 1024, `RecursiveCheckpointAdjoint`, jitted `jax.grad`, best of 10 runs after
the first call): the Lotka-Volterra ensemble of `benchmarks --quick` (float32) and the
Lorenz ensemble gradient (float64, PID 1e-8) at `max_steps` 4096 and 1e4, or at those
of an optional second argument (`python -m benchmarks.gradient_ab new 4096,100000`).

Checkpoint memory is filled on every call, and programs compiled in one process can
reuse each other's buffers, which hides part of that cost: compare `max_steps`
settings in separate processes.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


def _best(f, x, repeats: int = 10) -> tuple[float, float]:
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
    return first, min(times)


def _lotka_volterra(p):
    def one(p):
        def f(t, y, args):
            prey, pred = y[0], y[1]
            return jnp.stack(
                [p[0] * prey - p[1] * prey * pred, -p[2] * pred + p[3] * prey * pred]
            )

        controller = sk.PIDController(rtol=1e-6, atol=1e-6)
        y0 = jnp.ones(2, p.dtype)
        sol = sk.diffeqsolve(
            sk.ODETerm(f),
            sk.Tsit5(),
            0.0,
            10.0,
            0.1,
            y0,
            stepsize_controller=controller,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return jax.vmap(one)(p).sum()


def _lorenz(rho, max_steps: int):
    def one(r):
        def f(t, y, args):
            return jnp.stack(
                [
                    10 * (y[1] - y[0]),
                    y[0] * (r - y[2]) - y[1],
                    y[0] * y[1] - 8 / 3 * y[2],
                ]
            )

        controller = sk.PIDController(rtol=1e-8, atol=1e-8)
        y0 = jnp.array([1.0, 0.0, 0.0], rho.dtype)
        sol = sk.diffeqsolve(
            sk.ODETerm(f),
            sk.Tsit5(),
            0.0,
            1.0,
            1e-3,
            y0,
            stepsize_controller=controller,
            max_steps=max_steps,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return jax.vmap(one)(rho).sum()


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "solverkit"
    rng = np.random.default_rng(0)
    p = np.array([1.5, 1.0, 3.0, 1.0]) * (1 + 0.2 * rng.random((1024, 4)))
    rows = [
        ("lv", _best(jax.jit(jax.grad(_lotka_volterra)), jnp.asarray(p, "float32")))
    ]
    jax.config.update("jax_enable_x64", True)
    rho = jnp.linspace(0.0, 21.0, 1024)
    sweep = sys.argv[2] if len(sys.argv) > 2 else "4096,10000"
    for max_steps in [int(float(m)) for m in sweep.split(",")]:
        grad = jax.jit(jax.grad(lambda r, m=max_steps: _lorenz(r, m)))
        rows.append((f"lorenz-{max_steps}", _best(grad, rho)))
    cells = [f"{k}: first {a:.2f} s, run {b * 1e3:.1f} ms" for k, (a, b) in rows]
    print(label, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
