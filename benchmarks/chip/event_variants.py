"""Where the continuing-event forward solve's time goes on an accelerator: the spiking
network of `benchmarks.events` (float32, `vmap` over the neurons), timed with parts of
the occurrence's work replaced (results then may be wrong: timing only).

`python -m benchmarks.chip.event_variants [--size N]`

Variants: `base`; `no-settle` (the located time taken as it is); `secant` (the
crossing at the secant point, no search loops); `no-settle+secant`; `always` (the
occurrence branches computed on every step, no `lax.cond`); `no-after` (the effect
applied without the solver, controller and condition restart); and `base` at other
sizes and without `vmap` (N = 1).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import events as E
from solverkit._event import _continuing as C
from solverkit._tree import tree_where


def _secant(problem, t0, t1, info, fired, values):
    fa, fb = (jax.tree.leaves(v)[0].astype(t1.dtype) for v in values)
    return jnp.clip((t0 * fb - t1 * fa) / (fb - fa), t0, t1)


def _no_settle(problem, t0, t1, info, fired, starts, y1, t):
    return t, problem.solver.interpolator(info, t0, t1)(t)


def _no_after(problem, t1, y, masks, reference, states):
    found, apply = masks
    return tree_where(apply, 0 * y, y), states, reference


def _time(fn, x, repeats=3):
    jax.clear_caches()
    start = time.perf_counter()
    out = jax.block_until_ready(fn(x))
    first = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(x))
        runs.append(time.perf_counter() - start)
    return first, min(runs), out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=1024)
    a = parser.parse_args()
    s = E.SETTINGS["float32"]
    originals = {k: getattr(C, k) for k in ("crossing", "settle", "unvmap_any")}
    originals["_after_occurrence"] = C._after_occurrence
    variants = {
        "base": {},
        "no-settle": {"settle": _no_settle},
        "secant": {"crossing": _secant},
        "no-settle+secant": {"settle": _no_settle, "crossing": _secant},
        "always": {"unvmap_any": lambda x: jnp.asarray(True)},
        "no-after": {"_after_occurrence": _no_after},
    }
    print(f"device {jax.devices()[0].platform}, float32")
    print("| variant | N | first call s | run s | steps | spikes |")
    print("| --- | --- | --- | --- | --- | --- |")
    cases = [(name, a.size) for name in variants] + [("base", 64), ("base", 1)]
    for name, n in cases:
        for k, v in originals.items():
            setattr(C, k, v)
        for k, v in variants[name].items():
            setattr(C, k, v)
        one = E.solverkit_effect(E.MAX_SPIKES, s)
        cur = jnp.asarray(E.currents(max(n, 2))[:n], jnp.float32)
        if n == 1:
            fn, x = jax.jit(one), cur[0]
        else:
            fn, x = jax.jit(jax.vmap(one)), cur
        first, run, (ts, steps) = _time(fn, x)
        spikes = int(np.sum(np.isfinite(np.asarray(ts))))
        print(
            f"| {name} | {n} | {first:.2f} | {run:.4f} | {int(np.max(steps))} "
            f"| {spikes} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
