"""Per-test cost of the suite that does not depend on the machine's load: XLA
compilations, persistent-cache reads, seconds spent tracing, lowering and compiling,
and the CPU time of the process and of the subprocesses a test waited for.

On when `SOLVERKIT_TEST_PROFILE=DIR` is set (conftest.py registers it): each pytest
process appends one JSON line per test to `DIR/<worker>.jsonl`. Summarise with
`python -m tools.suite_profile DIR`.
"""

import json
import os
import pathlib
import resource
import threading
import time

import jax
import pytest


_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_COUNTS = {
    "/jax/core/compile/backend_compile_duration": "compiles",
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}


class Profile:
    """Counters the JAX monitoring listeners add to, and the per-test writer."""

    def __init__(self, where: pathlib.Path):
        self.lock = threading.Lock()
        self.totals = dict.fromkeys([*_DURATIONS.values(), *_COUNTS.values()], 0.0)
        where.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.out = open(where / f"{worker}-{os.getpid()}.jsonl", "a")  # noqa: SIM115
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        with self.lock:
            if event in _DURATIONS:
                self.totals[_DURATIONS[event]] += duration
            if event in _COUNTS:
                self.totals[_COUNTS[event]] += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event in _COUNTS:
            with self.lock:
                self.totals[_COUNTS[event]] += 1

    @staticmethod
    def _cpu() -> float:
        """CPU seconds of this process and of the subprocesses it has waited for
        (the examples and benchmarks that tests run)."""
        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            total += usage.ru_utime + usage.ru_stime
        return total

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        with self.lock:
            before = dict(self.totals)
        cpu, started = self._cpu(), time.time()
        yield
        cpu = self._cpu() - cpu
        with self.lock:
            row = {k: round(v - before[k], 4) for k, v in self.totals.items()}
        row["cpu_s"] = round(cpu, 4)
        # Wall-clock times (seconds since the epoch): how the workers' ends line up.
        row["started"], row["ended"] = round(started, 2), round(time.time(), 2)
        row["nodeid"] = item.nodeid
        row["slow"] = item.get_closest_marker("slow") is not None
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()
