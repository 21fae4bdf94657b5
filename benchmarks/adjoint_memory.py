"""Compiled memory of a gradient through each adjoint, against the number of steps.

Run: `python -m benchmarks.adjoint_memory` (CPU is fine: the figures are XLA's
`memory_analysis()` of the compiled program, not measurements).
"""

import argparse
import json

import jax
import jax.numpy as jnp

import solverkit as sk


ADJOINTS = {
    "RecursiveCheckpointAdjoint": sk.RecursiveCheckpointAdjoint,
    "BacksolveAdjoint": sk.BacksolveAdjoint,
    "DirectAdjoint": sk.DirectAdjoint,
}


def _loss(theta, y0, adjoint, steps):
    # A 64-dimensional linear ODE closing over its differentiated parameter.
    f = lambda t, y, args: -theta * y + jnp.sin(t)
    sol = sk.diffeqsolve(
        sk.ODETerm(f),
        sk.Tsit5(),
        0.0,
        1.0,
        1.0 / steps,
        y0,
        adjoint=adjoint,
        max_steps=steps,
    )
    return jnp.sum(sol.ys**2)


def measure(steps: int, name: str) -> dict:
    y0 = jnp.ones(64)
    grad = jax.jit(jax.grad(lambda th: _loss(th, y0, ADJOINTS[name](), steps)))
    compiled = grad.lower(jnp.asarray(0.5)).compile()
    stats = compiled.memory_analysis()
    temp = None if stats is None else int(stats.temp_size_in_bytes)
    return dict(adjoint=name, steps=steps, temp_bytes=temp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", default="100,1000,10000,100000")
    args = parser.parse_args()
    rows = []
    for steps in [int(s) for s in args.steps.split(",")]:
        for name in ADJOINTS:
            row = measure(steps, name)
            rows.append(row)
            print(json.dumps(row), flush=True)
    sizes = args.steps.split(",")
    print("\n| adjoint | " + " | ".join(f"{s} steps" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name in ADJOINTS:
        cells = [
            f"{r['temp_bytes'] / 1024:.0f} KiB" for r in rows if r["adjoint"] == name
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
