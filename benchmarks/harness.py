"""Timing, compiled memory and error measurement for one benchmark job."""

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Job:
    """One computation to time.

    **Arguments:**

    - `fn`: `fn(*args) -> (result, steps)`; `result` is compared with the reference,
        `steps` is the per-trajectory step count (an array) or `None`.
    - `args`: the arguments.
    - `jit`: `True` when `fn` is a pure JAX function: it is compiled ahead of time with
        `jax.jit(fn).lower(*args).compile()` and the compiled executable is timed.
        `False` for a host-side callable (a library that records on the host), which is
        called as it is.
    - `after`: optionally called with the filled-in `Record` after timing, to add
        what only the job knows (e.g. the compiled memory of a host-side callable's
        JAX part, a note).
    - `explain`: optionally, for a jitted job, called with the compiled executable:
        returns a note for the row (e.g. which code path the program took).
    """

    fn: Callable[..., tuple[Any, Any]]
    args: tuple
    jit: bool = True
    after: Callable[["Record"], None] | None = None
    explain: Callable[[Any], str] | None = None


@dataclasses.dataclass
class Record:
    """One row of the results: one library on one case, variant and size."""

    case: str
    variant: str
    size: int
    library: str
    dtype: str
    status: str = "ok"  # ok | unsupported | unavailable | skipped | error
    # `throw` of the library's solves (None: the library has no such setting)
    throw: bool | None = None
    note: str = ""
    first_call_s: float | None = None
    run_median_s: float | None = None
    run_min_s: float | None = None
    run_max_s: float | None = None
    repeats: int = 0
    memory_bytes: int | None = None
    steps: int | None = None
    max_abs_error: float | None = None


@contextlib.contextmanager
def precision(dtype: str) -> Iterator[None]:
    """Run JAX in float64 when `dtype == "float64"`, in float32 otherwise."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older JAX
        from jax.experimental import enable_x64 as enable
    with enable(dtype == "float64"):
        yield


def compiled_memory(compiled: Any) -> int | None:
    """Temporary + argument + output bytes of a compiled executable, or `None`.

    **Arguments:**

    - `compiled`: what `jax.jit(f).lower(*args).compile()` returns.

    **Returns:**

    The byte count, or `None` where the backend gives no memory analysis.
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if stats is None:
        return None
    parts = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    try:
        return int(sum(getattr(stats, p) for p in parts))
    except (AttributeError, TypeError):
        return None


def first_line(error: BaseException) -> str:
    """The error's type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 200 else text[:199] + "…"


def warm_up() -> float:
    """Compile and run a small JAX program of no ODE library (a vmapped `while_loop`
    around a `custom_vjp`, and the gradient of a checkpointed `scan`), once per
    process before the first row: the process's one-time costs (the compiler's
    start, JAX's lazily built machinery) land here rather than in the first call of
    whichever library's row runs first. Returns the seconds it took."""
    start = time.perf_counter()

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))

    def loop(x):
        body = lambda c: (c[0] + 1, c[1] + 0.01 * f(c[1]))  # noqa: E731
        return jax.lax.while_loop(lambda c: c[0] < 10, body, (0, x))[1]

    def loss(x):
        step = jax.checkpoint(lambda c, _: (0.9 * c + f(c), None))
        return jnp.sum(jax.lax.scan(step, x, None, length=8)[0] ** 2)

    x = jnp.ones((128, 3), jnp.float32)
    jax.block_until_ready(jax.jit(jax.vmap(loop))(x))
    jax.block_until_ready(jax.jit(jax.grad(loss))(x))
    return time.perf_counter() - start


def timed(fn, *args, repeats: int = 3) -> tuple[Any, float, float]:
    """`(fn(*args), first call s, median of `repeats` later calls s)`, each call
    ended by `block_until_ready` (a lighter `measure`, for scripts of their own)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    runs = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return out, first, statistics.median(runs)


def measure(
    job: Job, repeats: int, record: Record, repeat_budget_s: float = 10.0
) -> Any:
    """Time `job` and fill `record` in place.

    The first call is a fresh compile (`jax.clear_caches()` first): trace + lower +
    compile + one run. Then up to `repeats` timed runs, each ended by
    `block_until_ready`, stopping early once they have taken `repeat_budget_s` in all
    (at least one run is always timed).

    **Arguments:**

    - `job`: what to run.
    - `repeats`: number of timed runs after the first call.
    - `record`: the row to fill (`first_call_s`, `run_*_s`, `repeats`,
        `memory_bytes`, `steps`).
    - `repeat_budget_s`: time after which no further repeat is started.

    **Returns:**

    The job's result (first element of `fn`'s output), for the error check.
    """
    jax.clear_caches()
    start = time.perf_counter()
    if job.jit:
        compiled = jax.jit(job.fn).lower(*job.args).compile()

        def call() -> Any:
            return compiled(*job.args)

    else:
        compiled = None

        def call() -> Any:
            return job.fn(*job.args)

    result, steps = jax.block_until_ready(call())
    record.first_call_s = time.perf_counter() - start

    times: list[float] = []
    while len(times) < max(repeats, 1):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t)
        if sum(times) > repeat_budget_s:
            break
    record.run_median_s = statistics.median(times)
    record.run_min_s = min(times)
    record.run_max_s = max(times)
    record.repeats = len(times)

    if compiled is not None:
        record.memory_bytes = compiled_memory(compiled)
        if job.explain is not None:
            record.note = job.explain(compiled)
    if steps is not None:
        record.steps = int(np.max(np.asarray(steps)))
    if job.after is not None:
        job.after(record)
    return result


def max_abs_error(result: Any, reference: Any, rows: np.ndarray | None) -> float:
    """Largest absolute difference between `result` and `reference`.

    **Arguments:**

    - `result`: a pytree of arrays, as a job returns it.
    - `reference`: a pytree of the same structure.
    - `rows`: indices into the leading (batch) axis of every leaf of `result` that the
        reference was computed for, or `None` for all of it.

    **Returns:**

    The maximum over all leaves of `max |result[rows] - reference|`.
    """
    got = jax.tree_util.tree_leaves(result)
    want = jax.tree_util.tree_leaves(reference)
    if len(got) != len(want):
        raise ValueError(f"result has {len(got)} leaves, reference {len(want)}")
    err = 0.0
    for g, w in zip(got, want):
        g = np.asarray(g, dtype=np.float64)
        if rows is not None:
            g = g[rows]
        w = np.asarray(w, dtype=np.float64)
        if g.shape != w.shape:
            raise ValueError(f"result shape {g.shape} != reference shape {w.shape}")
        err = max(err, float(np.max(np.abs(g - w))))
    return err
