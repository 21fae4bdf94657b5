"""How often `vmap` re-batches loop bodies while a program is traced.

`lax.while_loop`'s batching rule finds which parts of the carry are batched by a
fixed point: it batches the body, and again while a round batches more of the carry
than the round before; nested loops are batched again in every round of the loop
around them. This counts, for each library's program of a `first_call` case, the
while loops batched, the fixed-point rounds they took, the bodies actually traced by
`vmap` (JAX caches a batching by its batched inputs and outputs, so a repeated round
can cost nothing) and the seconds spent inside the outermost batching rules, beside
the trace and lower times of the same call.

```bash
python -m benchmarks.batch_rounds                       # LV checkpointed gradient
python -m benchmarks.batch_rounds --only lorenz/adaptive-grad --size 8 --repeats 3
python -m benchmarks.batch_rounds --out DIR             # batch_rounds.md / .json
```
"""

import argparse
import collections
import contextlib
import gc
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from jax._src.interpreters import batching
from jax._src.lax.control_flow import loops

from .cases import CASES, load_peers
from .harness import precision


class _Counter:
    """Counts, while installed, while-loop batchings, their fixed-point rounds, the
    bodies traced by `vmap`, and the seconds inside the outermost while rule."""

    def __init__(self):
        self.loops = 0
        self.rounds = collections.Counter()  # rounds -> loops that took that many
        self.traced = 0  # `vmap` batchings of any jaxpr actually traced
        self.seconds = 0.0
        self._depth = 0
        self._active = []  # [jaxpr, traced?] being batched (nested)
        self.misses = []  # jaxprs whose batching was traced, in order

    def repeated(self, eqns: int = 100) -> int:
        """Batchings traced again for a jaxpr of more than `eqns` equations."""
        large = [c for c in self.misses if len(c.jaxpr.eqns) > eqns]
        return len(large) - len({id(c) for c in large})

    @contextlib.contextmanager
    def installed(self):
        rule = batching.fancy_primitive_batchers[loops.while_p]
        inner = batching._batch_jaxpr_inner
        batch_jaxpr = batching.batch_jaxpr

        cached = batching._batch_jaxpr_axes

        def counted_inner(*args, **kwargs):
            self.traced += 1
            if self._active:
                self._active[-1][1] = True
            return inner(*args, **kwargs)

        def counted_cached(closed, *args):
            self._active.append([closed, False])
            try:
                return cached(closed, *args)
            finally:
                closed, missed = self._active.pop()
                if missed:
                    self.misses.append(closed)

        def counted_rule(axis_data, args, dims, **params):
            body = params["body_jaxpr"]
            rounds = [0]

            def counted_batch_jaxpr(closed, *rest, **kw):
                rounds[0] += closed is body
                return batch_jaxpr(closed, *rest, **kw)

            outer = batching.batch_jaxpr  # a loop around this one counts its own
            batching.batch_jaxpr = counted_batch_jaxpr
            self._depth += 1
            start = time.perf_counter()
            try:
                return rule(axis_data, args, dims, **params)
            finally:
                if self._depth == 1:
                    self.seconds += time.perf_counter() - start
                self._depth -= 1
                batching.batch_jaxpr = outer
                self.loops += 1
                self.rounds[rounds[0]] += 1

        batching.fancy_primitive_batchers[loops.while_p] = counted_rule
        batching._batch_jaxpr_inner = counted_inner
        batching._batch_jaxpr_axes = counted_cached
        try:
            yield self
        finally:
            batching.fancy_primitive_batchers[loops.while_p] = rule
            batching._batch_jaxpr_inner = inner
            batching._batch_jaxpr_axes = cached
            batching.batch_jaxpr = batch_jaxpr


def measure(job) -> dict:
    """Trace and lower `job` once from cleared caches, counting as `_Counter` does.

    **Returns:**

    The counts and seconds of one first call's trace and lower.
    """
    jax.clear_caches()
    gc.collect()
    counter = _Counter()
    with counter.installed():
        start = time.perf_counter()
        traced = jax.jit(job.fn).trace(*job.args)
        middle = time.perf_counter()
        traced.lower()
        end = time.perf_counter()
    return {
        "trace_s": middle - start, "lower_s": end - middle,
        "while_rule_s": counter.seconds, "loops_batched": counter.loops,
        "rounds": dict(sorted(counter.rounds.items())),
        "jaxprs_batched": counter.traced, "large_rebatched": counter.repeated(),
    }  # fmt: skip


def _jobs(args, libs, names):
    case, variant = args.only.split("/")
    for task in CASES[case].tasks(args.size, libs, "float32"):
        if task.variant == variant and task.library in names:
            with precision(task.dtype):
                yield task.library, task.make(), task.dtype


def _line(name: str, runs: list[dict]) -> str:
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    last = runs[-1]
    return (
        f"| {name} | {med('trace_s'):.2f} | {med('lower_s'):.2f} | "
        f"{med('while_rule_s'):.2f} | {last['loops_batched']} | {last['rounds']} | "
        f"{last['jaxprs_batched']} | {last['large_rebatched']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="lotka_volterra/grad-checkpoint")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--peers", default="solverkit,solverkit-ensemble,diffrax")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder")
    args = parser.parse_args()
    libs, _ = load_peers(args.peers.split(","))
    names = [n for n in args.peers.split(",") if n in libs]
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()  # JAX's own start-up
    jobs = list(_jobs(args, libs, names))
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in jobs}
    for _ in range(args.repeats):  # libraries in turn
        for name, job, dtype in jobs:
            with precision(dtype):
                rows[name].append(measure(job))
    head = (
        f"{args.only}, N = {args.size} (medians of {args.repeats})\n\n"
        "| library | trace s | lower s | in while batching s | while loops batched "
        "| fixed-point rounds: loops | jaxprs batched | large jaxprs batched again |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    table = "\n".join([head] + [_line(n, r) for n, r in rows.items()])
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch_rounds.md").write_text(table + "\n")
        (args.out / "batch_rounds.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
