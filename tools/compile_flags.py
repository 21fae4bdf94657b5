"""XLA compile cost of a few of the test suite's kinds of program under compiler
settings: the measurement behind the test session's `jax_disable_most_optimizations`
(tests/conftest.py).

    python -m tools.compile_flags [--repeats 3] [--out DIR]

Each setting runs in its own process (XLA_FLAGS are read once, when the backend
starts); in it every program is lowered and compiled `--repeats` times, JAX's caches
cleared in between and the persistent cache off. Reported:
the median CPU seconds of the process during one compile (all threads; a loaded
machine stretches wall time far more than CPU time). Settings are compared by ratio
to the default, measured in turns on the same machine.

Measured on the shared 2-core machine under a load of ~17 (`--repeats 2`; CPU s of
one compile, ratio to the default; the settings ran one after another, so their
ratios carry the load's drift too):

| setting | Tsit5 fwd | grad | vmap grad | BDF grad |
|---|---|---|---|---|
| default | 0.70 | 2.75 | 3.60 | 9.00 |
| disable_most_optimizations | 0.58 (0.83) | 2.12 (0.77) | 2.41 (0.67) | 6.57 (0.73) |
| xla_flags_o0 | 0.46 (0.66) | 1.79 (0.65) | 2.16 (0.60) | 5.82 (0.65) |

On top of the JAX setting the suite turns off XLA's CPU fusion emitters (the older
loop emitters: 0.60x the CPU time, tests/conftest.py). Splitting no module for
parallel LLVM codegen (`--xla_cpu_parallel_codegen_split_count=1`, `suite_split1`)
compiles these four programs in 0.86x the CPU s (load ~10, five
alternating pairs, `--repeats 1`, the four together: 5.25 / 5.00 / 5.50 / 4.62 /
5.42 against 4.60 / 4.73 / 4.49 / 4.03 / 4.08, every pair lower), but a test run is
more than its compiles: five quick test files (170 tests, one process, empty cache,
alternating) took 64.5 / 73.5 CPU s without it and 65.3 / 69.4 with it, within the
noise (an earlier measurement gave 1.06x), so the suite does not set it.

The suite takes the JAX setting: it is read at each compile (a test can opt out) and
is part of the persistent cache's key; XLA_FLAGS hold for the whole process.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time


SETTINGS = {
    "default": {},
    "disable_most_optimizations": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    "xla_flags_o0": {
        "XLA_FLAGS": "--xla_backend_optimization_level=0 "
        "--xla_llvm_disable_expensive_passes=true"
    },
    "suite": {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false",
    },
    "suite_split1": {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false "
        "--xla_cpu_parallel_codegen_split_count=1",
    },
}


def _programs():
    """(name, jitted function, argument) for a Tsit5 + PID solve, its gradient, the
    vmapped gradient, and a BDF gradient (float64)."""
    import jax
    import jax.numpy as jnp

    import solverkit as sk

    def solve(theta, solver, rtol):
        vf = lambda t, y, args: -theta * y + jnp.sin(t)
        return sk.diffeqsolve(
            sk.ODETerm(vf), solver, 0.0, 1.0, 0.1, jnp.ones(3),
            stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
            saveat=sk.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)),
        )  # fmt: skip

    loss = lambda theta: jnp.sum(solve(theta, sk.Tsit5(), 1e-6).ys)
    bdf = lambda theta: jnp.sum(solve(theta, sk.BDF(), 1e-6).ys)
    one, four = jnp.asarray(1.0), jnp.ones(4)
    return [
        ("tsit5_fwd", jax.jit(loss), one),
        ("tsit5_grad", jax.jit(jax.grad(loss)), one),
        ("tsit5_vmap_grad", jax.jit(jax.vmap(jax.grad(loss))), four),
        ("bdf_grad", jax.jit(jax.grad(bdf)), one),
    ]


def _measure(repeats: int) -> dict[str, float]:
    """Median CPU seconds of one compile of each program, in this process."""
    import jax

    jax.config.update("jax_enable_x64", True)
    out = {}
    for name, fn, arg in _programs():
        cpu = []
        for _ in range(repeats):
            jax.clear_caches()  # else a second compile returns the first executable
            lowered = fn.lower(arg)
            start = time.process_time()
            lowered.compile()
            cpu.append(time.process_time() - start)
        out[name] = statistics.median(cpu)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_measure(args.repeats)))
        return
    results = {}
    for name, env in SETTINGS.items():
        clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
        clean.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        proc = subprocess.run(
            [sys.executable, "-m", "tools.compile_flags", "--child", name,
             "--repeats", str(args.repeats)],
            env={**clean, **env, "JAX_COMPILATION_CACHE_DIR": ""},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["default"]
    lines = ["| setting | " + " | ".join(base) + " |", "|---" * (len(base) + 1) + "|"]
    for name, row in results.items():
        cells = [f"{row[p]:.2f} s ({row[p] / base[p]:.2f})" for p in base]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile_flags.json").write_text(json.dumps(results, indent=1))
        (args.out / "compile_flags.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
