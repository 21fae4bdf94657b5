"""How the memory of a large stiff solve grows with the number of unknowns.

`python -m benchmarks.stiff_memory [--sizes 1000,3000,10000,30000,100000] [--json PATH]`
compiles (does not run) one `diffeqsolve` per (problem, configuration, size) of
`benchmarks/problems.py` and reads XLA's memory analysis of the compiled
program: the bytes of its temporaries, arguments and outputs. Compiled sizes are
exact and free of the noise of a resident-size measurement; they are what the solve
allocates, whatever the number of steps (the loop's state is fixed in size).

The configurations: `BDF` and `Rodas5P` with `BandedLinearSolver` (Burgers,
tridiagonal) and `SparseLinearSolver` (Burgers; ROBER blocks, block-diagonal), and,
for contrast, `Rodas5P` with `DenseLinearSolver` on the smaller sizes (quadratic).
The report gives bytes per unknown: constant for linear growth.
"""

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

from benchmarks import problems, stiff_large


CONFIGS = (
    ("burgers", "BDF", "banded"),
    ("burgers", "Rodas5P", "banded"),
    ("burgers", "BDF", "sparse"),
    ("rober-blocks", "BDF", "sparse"),
    ("rober-blocks", "Rodas5P", "sparse"),
    ("burgers", "Rodas5P", "dense"),
)
DENSE_MAX = 3000


def _problem(kind: str, size: int):
    if kind == "rober-blocks":
        return problems.large_problem(f"rober-blocks-{max(size // 3, 1)}")
    return problems.large_problem(f"{kind}-{size}")


def compiled_bytes(kind: str, solver_name: str, linear: str, size: int) -> dict:
    """XLA's memory analysis of one compiled solve (bytes), the solve of
    `benchmarks.stiff_large` (traced tolerances)."""
    import solverkit as sk

    problem = _problem(kind, size)
    if linear == "dense":
        linear_solver = sk.DenseLinearSolver()
    else:
        linear_solver, why = stiff_large.linear_solver(linear, problem)
        if linear_solver is None:
            raise ValueError(why)
    solver = getattr(sk, solver_name)(linear_solver=linear_solver)
    solve, _ = stiff_large._jax_runner(sk, solver, problem)
    params = jax.tree.map(jnp.asarray, problem.params)
    y0 = jnp.asarray(problem.y0)
    compiled = solve.lower(params, y0, 1e-6, 1e-6).compile()
    m = compiled.memory_analysis()
    return {
        "problem": kind,
        "config": f"{solver_name}+{linear}",
        "n": problem.size,
        "temp": int(m.temp_size_in_bytes),
        "arguments": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,3000,10000,30000,100000")
    parser.add_argument("--quick", action="store_true", help="sizes 300,1000,3000")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    sizes = [300, 1000, 3000] if args.quick else [int(s) for s in args.sizes.split(",")]
    rows = []
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, float64")
    print(f"{'problem':14} {'config':16} {'n':>7} {'temp MiB':>9} {'B/unknown':>10}")
    with jax.enable_x64(True):
        for kind, solver_name, linear in CONFIGS:
            for size in sizes:
                if linear == "dense" and size > DENSE_MAX:
                    continue
                row = compiled_bytes(kind, solver_name, linear, size)
                rows.append(row)
                total = row["temp"] + row["arguments"] + row["output"]
                print(
                    f"{row['problem']:14} {row['config']:16} {row['n']:7d} "
                    f"{row['temp'] / 2**20:9.2f} {total / row['n']:10.0f}",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
