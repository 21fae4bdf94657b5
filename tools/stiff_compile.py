"""How big the stiff solvers' gradient programs are, and what makes them so: for BDF
(dense, banded, GMRES), Kvaerno5 and Rodas5P, checkpointed gradients of small
float64 problems (ROBER, three stiff pairs), each program's

- jaxpr equations (every sub-jaxpr counted: loop bodies, branches, custom rules),
- StableHLO ops after lowering (in all, and the most common by name),
- XLA compile seconds with `jax_disable_most_optimizations` on (the test suite's
  setting) and off (users' default), the programs taking turns in one process,
- with `--by-source`, the equations attributed to the solverkit functions that traced
  them (inclusive: an equation counts for every solverkit frame on its stack).

    python -m tools.stiff_compile [--only bdf_dense,...] [--repeats 1]
        [--by-source] [--out DIR]

Compare versions by running this in each and comparing the counts (deterministic) and
the compile seconds' ratios (noisy on a shared machine; CPU seconds of the process).
"""

import argparse
import collections
import functools
import json
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


def _rober(k1):
    def f(t, y, args):
        a, b, c = y[0], y[1], y[2]
        return jnp.stack(
            [-k1 * a + 1e4 * b * c, k1 * a - 1e4 * b * c - 3e7 * b**2, 3e7 * b**2]
        )

    return f


def _pairs(p, n=6):
    """Three independent stiff pairs (tests/linear/test_linear_solver_grad.py's
    field)."""

    def f(t, y, args):
        u, v = y[0::2], y[1::2]
        return jnp.stack([-20 * p * u + v, 1.5 * u - 2 * v - v**2], 1).reshape(-1)

    return f


def _loss(solver, problem):
    def loss(x):
        if problem == "rober":
            field, y0, t1 = _rober(x), jnp.array([1.0, 0.0, 0.0]), 10.0
        else:
            field, y0, t1 = _pairs(x), jnp.linspace(0.2, 1.0, 6), 0.2
        sol = sk.diffeqsolve(
            sk.ODETerm(field),
            solver,
            0.0,
            t1,
            1e-4,
            y0,
            saveat=sk.SaveAt(ts=jnp.array([0.5 * t1, t1])),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-10),
            adjoint=sk.RecursiveCheckpointAdjoint(),
        )
        return jnp.sum(sol.ys**2)

    return loss


def programs() -> dict:
    """name -> (jitted gradient, argument)."""
    gmres = sk.KrylovLinearSolver(rtol=1e-12, atol=1e-14)
    cases = {
        "bdf_dense": (sk.BDF(), "rober"),
        "bdf_banded": (sk.BDF(linear_solver=sk.BandedLinearSolver(1, 1)), "pairs"),
        "bdf_gmres": (sk.BDF(linear_solver=gmres), "pairs"),
        "kvaerno5": (sk.Kvaerno5(), "rober"),
        "rodas5p": (sk.Rodas5P(), "rober"),
    }
    out = {}
    for name, (solver, problem) in cases.items():
        out[name] = (jax.jit(jax.grad(_loss(solver, problem))), np.float64(0.04))
    rates = np.array([0.04, 0.08])
    vmapped = jax.vmap(jax.grad(_loss(sk.BDF(), "rober")))
    out["bdf_dense_vmap"] = (jax.jit(vmapped), rates)
    return out


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def walk(jaxpr):
    """Every equation of `jaxpr` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from walk(sub)


def _solverkit_frames(eqn) -> set[str]:
    names = set()
    tb = eqn.source_info.traceback
    if tb is None:
        return names
    for frame in tb.frames:
        path = frame.file_name
        if "/solverkit/" in path and "/_closure/" not in path:
            module = path.split("/solverkit/")[-1].removesuffix(".py")
            names.add(f"{module}:{frame.function_name}")
    return names


def by_source(jaxpr) -> collections.Counter:
    counts = collections.Counter()
    for eqn in walk(jaxpr):
        counts.update(_solverkit_frames(eqn))
    return counts


_OP = re.compile(r"=\s*\"?([a-z_]+\.[a-z_.]+)\"?[\s(<{]|^\s*\"?([a-z_]+\.[a-z_.]+)")


def hlo_ops(text: str) -> collections.Counter:
    counts = collections.Counter()
    for line in text.splitlines():
        m = _OP.search(line)
        if m:
            counts[m.group(1) or m.group(2)] += 1
    return counts


_FUNC = re.compile(r"^\s*func\.func\s+\w+\s+@([\w.$-]+)\(")
_CALL = re.compile(r"func\.call @([\w.$-]+)\(")


def inlined_ops(text: str) -> int:
    """StableHLO ops with every `func.call` replaced by its callee's ops: what XLA
    compiles once it has inlined the calls (a jitted helper is one function, called
    from every place that uses it)."""
    own: dict[str, int] = collections.Counter()
    calls: dict[str, list[str]] = collections.defaultdict(list)
    name = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            continue
        if name is None:
            continue
        c = _CALL.search(line)
        if c:
            calls[name].append(c.group(1))
        elif _OP.search(line):
            own[name] += 1

    @functools.cache
    def total(f: str) -> int:
        return own[f] + sum(total(g) for g in calls[f])

    return total("main")


def _compile_cpu_s(fn, arg, optimize: bool) -> float:
    jax.clear_caches()  # else a second compile returns the first executable
    was = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", not optimize)
    try:
        lowered = fn.lower(arg)
        start = time.process_time()
        lowered.compile()
        return time.process_time() - start
    finally:
        jax.config.update("jax_disable_most_optimizations", was)


def measure(names, repeats: int, sources: bool, save=None) -> dict:
    progs = programs()
    rows = {}
    for name in names:
        fn, arg = progs[name]
        jaxpr = jax.make_jaxpr(fn)(arg).jaxpr
        text = fn.lower(arg).as_text()
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            (save / f"{name}.mlir").write_text(text)
        ops = hlo_ops(text)
        rows[name] = {
            "jaxpr_eqns": sum(1 for _ in walk(jaxpr)),
            "hlo_ops": sum(ops.values()),
            "hlo_ops_inlined": inlined_ops(text),
            "hlo_top": dict(ops.most_common(12)),
            "compile_s": {"unoptimized": [], "optimized": []},
        }
        if sources:
            rows[name]["by_source"] = dict(by_source(jaxpr).most_common(40))
    for _ in range(repeats):  # in turns: drifts of the machine hit all alike
        for name in names:
            fn, arg = progs[name]
            for key, opt in (("unoptimized", False), ("optimized", True)):
                rows[name]["compile_s"][key].append(_compile_cpu_s(fn, arg, opt))
    return rows


def table(rows: dict) -> str:
    lines = [
        "| program | jaxpr eqns | HLO ops (inlined) | compile CPU s (no opt / opt) |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        c = r["compile_s"]
        un = statistics.median(c["unoptimized"]) if c["unoptimized"] else float("nan")
        op = statistics.median(c["optimized"]) if c["optimized"] else float("nan")
        lines.append(
            f"| {name} | {r['jaxpr_eqns']} | {r['hlo_ops']} ({r['hlo_ops_inlined']}) "
            f"| {un:.2f} / {op:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated program names")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--by-source", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument(
        "--save", type=pathlib.Path, default=None, help="write each program's StableHLO"
    )
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)
    names = args.only.split(",") if args.only else list(programs())
    rows = measure(names, args.repeats, args.by_source, args.save)
    print(table(rows))
    for name, r in rows.items():
        print(f"\n{name} HLO: {r['hlo_top']}")
        if args.by_source:
            for frame, count in r["by_source"].items():
                print(f"  {count:7d}  {frame}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stiff_compile.json").write_text(json.dumps(rows, indent=1))
        (args.out / "stiff_compile.md").write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
