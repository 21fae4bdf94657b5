"""Compiled memory of a gradient through each adjoint, against the number of steps;
and (`--lorenz`) bytes per trajectory of the Lorenz ensemble's gradients.

Run: `python -m benchmarks.adjoint_memory` (CPU is fine: the figures are XLA's
`memory_analysis()` of the compiled program, not measurements).

`python -m benchmarks.adjoint_memory --lorenz [--sizes 4096,65536] [--out DIR]`
compiles (never runs) the Lorenz ensemble gradients of `python -m benchmarks`
(fixed step dt = 1e-3, 1000 steps, and adaptive PID rtol = atol = 1e-5, float32,
default `RecursiveCheckpointAdjoint`, `max_steps=4096`) for solverkit and diffrax on
the default device, and reports temporary + argument + output bytes divided by N,
with the largest arrays of solverkit's program (what the bytes are). On an
accelerator this is that device's layout (a TPU pads narrow minor dimensions), in
seconds: nothing runs. Writes `lorenz_memory.json` and `.md` into `--out`.
"""

import argparse
import json
import pathlib
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

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


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8, "u8": 1}


def largest_arrays(hlo: str, n: int, count: int = 6) -> list[str]:
    """The largest array shapes of a compiled program's text with a dimension `n`,
    as `"f32[n,129,10] x3: 10.1 KiB per trajectory"` (x: how often the shape occurs)."""
    shapes = Counter(
        (m.group(1), m.group(2))
        for m in re.finditer(r"\b(f32|s32|u32|pred|f64|s64|u8)\[([0-9,]+)\]", hlo)
        if str(n) in m.group(2).split(",")
    )

    def size(key):
        return _BYTES[key[0]] * int(np.prod([int(d) for d in key[1].split(",")]))

    out = []
    for key in sorted(shapes, key=size, reverse=True)[:count]:
        per = size(key) / n
        dims = key[1].replace(str(n), "N", 1)
        out.append(f"{key[0]}[{dims}] x{shapes[key]}: {per / 1024:.2f} KiB/trajectory")
    return out


def lorenz(sizes: list[int]) -> list[dict]:
    """Bytes per trajectory of the Lorenz gradients (see the module docstring)."""
    import diffrax

    from .cases import _lorenz_solve, _sum_of_squares_grad, LORENZ_TOL_32
    from .harness import compiled_memory

    rows = []
    for mode in ("fixed", "adaptive"):
        for name, lib in (("solverkit", sk), ("diffrax", diffrax)):
            for n in sizes:
                solve = _lorenz_solve(lib, lib is sk, mode, tol=LORENZ_TOL_32)
                rho = jnp.linspace(0.0, 21.0, n, dtype=jnp.float32)
                try:
                    compiled = jax.jit(_sum_of_squares_grad(solve)).lower(rho).compile()
                except Exception as e:  # noqa: BLE001 - a failure is a result
                    rows.append(dict(mode=mode, library=name, n=n, error=str(e)[:200]))
                    continue
                total = compiled_memory(compiled)
                row = dict(
                    mode=mode,
                    library=name,
                    n=n,
                    device=jax.devices()[0].device_kind,
                    bytes=total,
                    bytes_per_trajectory=None if total is None else total / n,
                    largest=largest_arrays(compiled.as_text(), n),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def lorenz_markdown(rows: list[dict]) -> str:
    lines = [
        "| gradient | library | N | bytes per trajectory | at N = 2^20 | "
        "largest arrays |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['mode']} | {r['library']} | {r['n']} | error | | {r['error']} |"
            )
            continue
        per = r["bytes_per_trajectory"]
        cells = "" if per is None else f"{per:,.0f} | {per * 2**20 / 1e9:.1f} GB"
        lines.append(
            f"| {r['mode']} | {r['library']} | {r['n']} | {cells} | "
            + "; ".join(r["largest"][:3])
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", default="100,1000,10000,100000")
    parser.add_argument("--lorenz", action="store_true")
    parser.add_argument("--sizes", default="4096,65536")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if args.lorenz:
        rows = lorenz([int(s) for s in args.sizes.split(",")])
        text = lorenz_markdown(rows)
        print(text)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "lorenz_memory.json").write_text(json.dumps(rows, indent=1))
            (args.out / "lorenz_memory.md").write_text(text)
        return
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
