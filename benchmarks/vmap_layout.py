"""Why `jax.vmap(diffeqsolve)` takes ~34 us a step on a TPU: the vmapped Lorenz
loop (Tsit5, float32, rho closed over and vmapped, t in [0, 1]) with its state as
one `(3,)` array (the suite's case: a `(N, 3)` carry) against the same state as a
tuple of three scalars (three `(N,)` carries), and "wrapped": the tuple state with
the array field, stacked for it and split after; adaptive (PID 1e-5) and fixed (1000
steps of 1e-3); per variant and N its first compile (trace included), run time
(median of `--repeats`), the kernels (fusions) in each `while` body, and the loop's
carry as XLA laid it out (the `while` instructions' shapes).

`python -m benchmarks.vmap_layout --out DIR [--sizes 4096,65536] [--repeats 20]`

Stop 50 on a TPU v5e (`benchmarks/results/tpu-v5-lite/stop50_b/vmap_layout`): the
`(N, 3)` carry is laid out batch-minor (`{0,1:T(4,128)}`), but XLA cuts a step into
13 (fixed) / 18 (adaptive) kernels; as components, 2 / 3, and "wrapped" the same (XLA
folds the stack and the split away): fixed 1000 steps 2.48 / 25.6 ms -> 0.82 / 3.17
ms at N = 4096 / 65,536, adaptive 1.03 / 4.24 -> 0.81 / 1.48 ms. A `diffeqsolve`
that carried such states as components (tried in stop 50, `stop50_b/accel`) ran
the vmapped forward rows 2-8x faster, but compiled about twice as long on the chip
(the forward first calls 0.59-0.66 of diffrax's, repeated, from ~0.45) and its
gradients ran only 10-20% faster there while compiling 1.5-2.7x longer (first calls
0.89); on a CPU its gradients ran up to 2.8x slower (fixed-step Lorenz, N = 256): so
not taken.
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp

import solverkit as sk

from .hlo_loops import loops


SIGMA, BETA = 10.0, 8.0 / 3.0


def _array_field(rho):
    def field(t, y, args):
        return jnp.stack(
            [
                SIGMA * (y[1] - y[0]),
                y[0] * (rho - y[2]) - y[1],
                y[0] * y[1] - BETA * y[2],
            ]
        )

    return field


def _tuple_field(rho):
    def field(t, y, args):
        x, v, z = y
        return (SIGMA * (v - x), x * (rho - z) - v, x * v - BETA * z)

    return field


def _wrapped_field(rho):
    inner = _array_field(rho)

    def field(t, y, args):
        out = inner(t, jnp.stack(y), args)
        return tuple(out[i] for i in range(3))

    return field


def program(form: str, mode: str):
    """`rho[N] -> sum of final states`, vmapped, jitted."""
    if mode == "fixed":
        controller = sk.ConstantStepSize()
    else:
        controller = sk.PIDController(rtol=1e-5, atol=1e-5)

    def one(rho):
        if form == "array":
            field, y0 = _array_field(rho), jnp.asarray([1.0, 0.0, 0.0], rho.dtype)
        else:
            one_, zero = jnp.ones((), rho.dtype), jnp.zeros((), rho.dtype)
            make = _tuple_field if form == "tuple" else _wrapped_field
            field, y0 = make(rho), (one_, zero, zero)
        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), 0.0, 1.0, 1e-3, y0,
            stepsize_controller=controller, max_steps=4096, throw=False,
        )  # fmt: skip
        return sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(sol.ys))

    return jax.jit(jax.vmap(one))


def _while_shapes(hlo: str) -> list[str]:
    return [
        line.split("=", 1)[1].split(" while(")[0].strip()[:600]
        for line in hlo.splitlines()
        if " while(" in line
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="4096,65536")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    # The lockstep baseline is the vmapped loop: on a TPU `jax.vmap(diffeqsolve)`
    # would run on the whole-solve kernel (`solverkit._kernel._vmap`).
    os.environ.setdefault("SOLVERKIT_VMAP_KERNEL", "0")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        rho = jnp.linspace(0.0, 100.0, n, dtype=jnp.float32)
        for mode in ("adaptive", "fixed"):
            for form in ("array", "tuple", "wrapped"):
                fn = program(form, mode)
                start = time.perf_counter()
                compiled = fn.lower(rho).compile()
                first = time.perf_counter() - start
                jax.block_until_ready(compiled(rho))
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(compiled(rho))
                    times.append(time.perf_counter() - start)
                hlo = compiled.as_text()
                name = f"{mode}-{form}-{n}"
                (out / f"{name}.hlo.txt").write_text(hlo)
                row = dict(
                    name=name,
                    n=n,
                    mode=mode,
                    form=form,
                    compile_s=first,
                    run_ms=1e3 * statistics.median(times),
                    min_ms=1e3 * min(times),
                    loops=loops(hlo),
                    carries=_while_shapes(hlo),
                    value=float(jnp.sum(compiled(rho))),
                )
                rows.append(row)
                print(
                    f"{name}: {row['run_ms']:.3f} ms (min {row['min_ms']:.3f}), "
                    f"fusions per loop {[lp['ops']['fusion'] for lp in row['loops']]}, "
                    f"value {row['value']:.6g}",
                    flush=True,
                )
                (out / "vmap_layout.json").write_text(json.dumps(rows, indent=1))
    pads = [re.findall(r"f32\[\d+,3\]\{[^}]*\}", " ".join(r["carries"])) for r in rows]
    print("(N, 3) carries as laid out:", sorted({p for ps in pads for p in ps}))


if __name__ == "__main__":
    main()
