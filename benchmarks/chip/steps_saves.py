"""`SaveAt(steps=True)` under `vmap` on an accelerator: each step writes its row at
the trajectory's own count of accepted steps, a scatter with batched indices (a
serial loop over the batch on a TPU). Timed against `SaveAt(t1=True)` and diffrax's
`SaveAt(steps=True)`, Lorenz, Tsit5, PID 1e-5, t in [0, 1], float32.

`python -m benchmarks.chip.steps_saves [--sizes 1024,4096]`
"""

import argparse
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


def _lorenz(t, y, rho):
    x, v, z = y[0], y[1], y[2]
    return jnp.stack([10.0 * (v - x), x * (rho - z) - v, x * v - 8.0 / 3.0 * z])


def _solver(lib, saveat):
    def one(rho):
        sol = lib.diffeqsolve(
            lib.ODETerm(_lorenz),
            lib.Tsit5(),
            0.0,
            1.0,
            1e-3,
            jnp.ones(3, jnp.float32),
            rho,
            stepsize_controller=lib.PIDController(rtol=1e-5, atol=1e-5),
            saveat=saveat(lib),
            max_steps=512,
            throw=False,
        )
        return sol.ys

    return jax.jit(jax.vmap(one))


def _time(fn, x, repeats=5):
    jax.block_until_ready(fn(x))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        runs.append(time.perf_counter() - start)
    return min(runs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1024,4096")
    a = parser.parse_args()
    saves = {
        "t1": lambda lib: lib.SaveAt(t1=True),
        "steps": lambda lib: lib.SaveAt(steps=True),
    }
    print(f"device {jax.devices()[0].platform}")
    print("| library | saveat | N | run s |")
    print("| --- | --- | --- | --- |")
    for n in (int(s) for s in a.sizes.split(",")):
        rho = jnp.asarray(np.linspace(20.0, 30.0, n), jnp.float32)
        for lib in (sk, diffrax):
            for name, saveat in saves.items():
                run = _time(_solver(lib, saveat), rho)
                print(f"| {lib.__name__} | {name} | {n} | {run:.4f} |", flush=True)


if __name__ == "__main__":
    main()
