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

`--run` runs each compiled gradient too (after one warm-up call: `--repeats`
timed calls, their median in `run_ms`, and the device's peak bytes in use where it
reports them); a run out of memory is recorded with its error. `--modes` and
`--libraries` pick the cases (say `--modes adaptive --libraries solverkit`). The
chip command for the vmapped adaptive float32 gradient at N = 65,536 and 2^20:
`python -m benchmarks.adjoint_memory --lorenz --run --modes adaptive
--libraries solverkit --sizes 65536,1048576 --out DIR`.
"""

import argparse
import json
import pathlib
import re
import statistics
import time
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


def _peak_bytes() -> int | None:
    """The default device's peak bytes in use so far, where it reports them."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has them
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def _run(compiled, rho, repeats: int) -> dict:
    """Median milliseconds of `repeats` calls after a warm-up, mean steps, peak
    bytes; or the error of a failed call (out of memory, say)."""
    try:
        _, steps = jax.block_until_ready(compiled(rho))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(rho))
            times.append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - a failure is a result
        return dict(run_error=str(e)[:200])
    return dict(
        run_ms=1e3 * statistics.median(times),
        repeats=repeats,
        mean_steps=float(np.mean(np.asarray(steps))),
        peak_bytes=_peak_bytes(),
    )


def lorenz(
    sizes: list[int],
    modes: tuple[str, ...] = ("fixed", "adaptive"),
    libraries: tuple[str, ...] = ("solverkit", "diffrax"),
    repeats: int | None = None,
) -> list[dict]:
    """Bytes per trajectory of the Lorenz gradients (see the module docstring);
    with `repeats`, their run times too."""
    from .cases import _lorenz_solve, _sum_of_squares_grad, LORENZ_TOL_32
    from .harness import compiled_memory

    libs = {"solverkit": sk}
    if "diffrax" in libraries:
        import diffrax

        libs["diffrax"] = diffrax
    rows = []
    for mode in modes:
        for name in libraries:
            lib = libs[name]
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
                if repeats is not None:
                    row.update(_run(compiled, rho, repeats))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def lorenz_markdown(rows: list[dict]) -> str:
    lines = [
        "| gradient | library | N | bytes per trajectory | at N = 2^20 | "
        "run (with --run; peak: the process so far); largest arrays |",
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
        ran = ""
        if "run_ms" in r:
            peak = r["peak_bytes"]
            peak = "" if peak is None else f", peak {peak / 1e9:.2f} GB"
            ran = f"{r['run_ms']:.2f} ms ({r['mean_steps']:.0f} steps{peak}); "
        elif "run_error" in r:
            ran = f"run: {r['run_error']}; "
        lines.append(
            f"| {r['mode']} | {r['library']} | {r['n']} | {cells} | {ran}"
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
    parser.add_argument("--run", action="store_true", help="time the gradients too")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="fixed,adaptive")
    parser.add_argument("--libraries", default="solverkit,diffrax")
    args = parser.parse_args()
    if args.lorenz:
        rows = lorenz(
            [int(s) for s in args.sizes.split(",")],
            tuple(args.modes.split(",")),
            tuple(args.libraries.split(",")),
            args.repeats if args.run else None,
        )
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
