"""How many iterations the in-step crossing search's loops take per step, on the
spiking network of `benchmarks.events` (the continuing event, `vmap` over the
neurons): each loop's iteration count (the batch's, as `vmap` runs it) per step that
searched, as a histogram, and how often `settle` nudged.

`python -m benchmarks.chip.event_loops [--size N] [--dtype float32]`

A diagnostic for the chip, where the continuing-event forward solve ran 5x diffrax's
restart loop (stop 46) while it ran 0.3-0.6x on the CPU: a loop iteration costs tens
of microseconds there.
"""

import argparse
import collections
import time

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from benchmarks import events as E
from solverkit._closure._unvmap import unvmap_any
from solverkit._event import _search


def _counting(hist):
    def loop(active, step, s):
        name = getattr(step, "func", step).__name__

        def live(s):
            return active(s) & (s.count < _search._MAX_STEPS)

        def body(c):
            s, k = c
            new = step(s)
            pick = lambda n, o: jnp.where(live(s), n, o)  # noqa: E731
            return jax.tree.map(pick, new, s), k + 1

        zero = jnp.zeros((), jnp.int32)
        s, k = lax.while_loop(lambda c: unvmap_any(live(c[0])), body, (s, zero))
        jax.debug.callback(lambda k: hist.update([(name, int(np.max(k)))]), k)
        return s

    return loop


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dtype", default="float32")
    a = parser.parse_args()
    s = E.SETTINGS[a.dtype]
    with jax.enable_x64(a.dtype == "float64"):
        cur = jnp.asarray(E.currents(a.size), a.dtype)
        fn = jax.jit(jax.vmap(E.solverkit_effect(E.MAX_SPIKES, s)))
        start = time.perf_counter()
        jax.block_until_ready(fn(cur))
        print(f"plain: first call {time.perf_counter() - start:.2f} s")
        for _ in range(2):
            start = time.perf_counter()
            ts, steps = jax.block_until_ready(fn(cur))
            print(f"plain: run {time.perf_counter() - start:.4f} s")
        hist = collections.Counter()
        _search._loop = _counting(hist)
        jax.clear_caches()
        fn = jax.jit(jax.vmap(E.solverkit_effect(E.MAX_SPIKES, s)))
        ts, steps = jax.block_until_ready(fn(cur))
        counts = np.sum(np.isfinite(np.asarray(ts)), axis=1)
        exact = E.exact_spikes(np.asarray(cur, np.float64), E.MAX_SPIKES)[1]
        print(f"device {jax.devices()[0].platform}, N = {a.size}, {a.dtype}")
        print(
            f"steps (most) {int(np.max(steps))}, spikes {int(counts.sum())} "
            f"(exact {int(exact.sum())}), wrong counts {int(np.sum(counts != exact))}"
        )
        print("loop, iterations per search: number of searches")
        for key, n in sorted(hist.items()):
            print(f"  {key[0]} {key[1]}: {n}")


if __name__ == "__main__":
    main()
