"""The gradient of a fit at `SaveAt(ts=...)`: `ensemble_solve(kernel=False)` against
`jax.vmap(diffeqsolve)` (shared and per-trajectory save times) and diffrax.

`python -m benchmarks.ts_grad [--out DIR] [--sizes 4096,65536] [--methods ...]
[--repeats 5] [--micro] [--census]`

The problem is `benchmarks.kernel`'s `lotka_volterra_grad`: Lotka-Volterra, Tsit5,
PIDController(rtol = atol = 1e-5), t in [0, 5], float32, the gradient of
`sum((ys - data)^2)` at 10 save times with respect to each trajectory's
(alpha, beta, gamma, delta). Methods:

- `ens`: `ensemble_solve(kernel=False)` with its default lanes; `ens_lock`: with
  `lanes=N` (the lockstep loop, the default on an accelerator); `ens_bts`: save
  times given per trajectory, `(N, 10)`.
- `vmap`, `vmap_bts`: `jax.vmap(diffeqsolve)`, save times shared / per trajectory.
- `ens_t1`, `vmap_t1`: the same with `SaveAt(t1=True)` (no save times), the floor.
- `diffrax`: `jax.vmap(diffrax.diffeqsolve)`, shared save times.
- `METHOD@index`, `METHOD@onehot`: solverkit's methods with the rows at the save
  times read and written by index (by default off a TPU), or by
  one-hot selects (by default on a TPU): an A/B comparison in one process.

The run times (wall clock, and the process's CPU time: all threads, less sensitive
to a loaded machine) are the minimum over `--repeats` calls, the methods interleaved
call by call (so that a loaded machine slows them alike). `--census` counts, per method,
the gathers and scatters inside loops whose indices differ per trajectory (batched
indices: a serial loop over the batch on a TPU). `--micro` times one such scatter
against a one-hot select, 100 times in a loop, at each size.
Writes `ts_grad.json` and `ts_grad.md` under `--out`.
"""

import argparse
import collections
import contextlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

import solverkit as sk
from solverkit import _save

from .kernel import _lv_field


_T1 = 5.0
_TS = 10


def _inputs(n: int):
    dtype = jnp.float32
    base = jnp.asarray([1.5, 1.0, 3.0, 1.0], dtype)
    spread = 1 + 0.1 * jnp.linspace(0, 1, n, dtype=dtype)[:, None]
    p = jnp.tile(base, (n, 1)) * spread
    y0 = jnp.tile(jnp.asarray([1.0, 1.0], dtype), (n, 1))
    return p, y0, jnp.ones((n, _TS, 2), dtype)


def _loss(method: str, n: int):
    """`loss(p, y0, data)` of `method` (see the module's docstring)."""
    ts = jnp.linspace(0.0, _T1, _TS, dtype=jnp.float32)
    t1_only = method.endswith("_t1")
    bts = method.endswith("_bts")

    def fit(ys, data):
        return jnp.sum((ys - (data[:, -1:] if t1_only else data)) ** 2)

    if method == "diffrax":
        import diffrax

        def one_dfx(y, q):
            return diffrax.diffeqsolve(
                diffrax.ODETerm(_lv_field), diffrax.Tsit5(), 0.0, _T1, None, y, q,
                saveat=diffrax.SaveAt(ts=ts), throw=False,
                stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
            ).ys  # fmt: skip

        return lambda p, y0, data: fit(jax.vmap(one_dfx)(y0, p), data)

    def saveat(times):
        return sk.SaveAt(t1=True) if t1_only else sk.SaveAt(ts=times)

    common = dict(
        stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5), throw=False
    )
    if method.startswith("ens"):
        lanes = n if method == "ens_lock" else None
        times = jnp.tile(ts, (n, 1)) if bts else ts

        def ens(p, y0, data):
            ys = sk.ensemble_solve(
                sk.ODETerm(_lv_field), sk.Tsit5(), 0.0, _T1, None, y0, p,
                saveat=saveat(times), kernel=False, lanes=lanes, **common,
            ).ys  # fmt: skip
            return fit(ys, data)

        return ens

    def one(y, q, times):
        return sk.diffeqsolve(
            sk.ODETerm(_lv_field), sk.Tsit5(), 0.0, _T1, None, y, q,
            saveat=saveat(times), **common,
        ).ys  # fmt: skip

    def vm(p, y0, data):
        if bts:
            ys = jax.vmap(one)(y0, p, jnp.tile(ts, (n, 1)))
        else:
            ys = jax.vmap(one, in_axes=(0, 0, None))(y0, p, ts)
        return fit(ys, data)

    return vm


def batched_index_ops(jaxpr) -> collections.Counter:
    """Gathers and scatters inside loops whose indices are batched (differ per
    trajectory), by primitive name."""
    counts = collections.Counter()

    def walk(jaxpr, loops: int):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if loops and (name == "gather" or name.startswith("scatter")):
                numbers = eqn.params["dimension_numbers"]
                if getattr(numbers, "operand_batching_dims", ()):
                    counts[name] += 1
            inner = loops + (name == "while")
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr, inner)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub, inner)

    walk(jaxpr, 0)
    return counts


def _micro(n: int, repeats: int) -> dict:
    """100 row updates of an `(n, 10)` array at a per-row index: a scatter against
    a one-hot select (the question: is a batched scatter serial here?)."""
    rows = (jnp.arange(n) % _TS).astype(jnp.int32)
    x = jnp.zeros((n, _TS), jnp.float32)

    def scatter(x, rows):
        def body(i, x):
            return jax.vmap(lambda r, v: r.at[v].add(1.0))(x, (rows + i) % _TS)

        return jax.lax.fori_loop(0, 100, body, x)

    def onehot(x, rows):
        def body(i, x):
            hit = jnp.arange(_TS) == ((rows + i) % _TS)[:, None]
            return x + jnp.where(hit, 1.0, 0.0)

        return jax.lax.fori_loop(0, 100, body, x)

    out = {}
    for name, fn in (("scatter", scatter), ("onehot", onehot)):
        fn = jax.jit(fn)
        jax.block_until_ready(fn(x, rows))
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x, rows))
            runs.append(time.perf_counter() - start)
        out[f"micro_{name}_s"] = min(runs)
    return out


@contextlib.contextmanager
def _rows_by(variant: str):
    """`variant` `"index"`: the rows at `SaveAt(ts=...)` read, written and added to by
    index (gathers and scatters with batched indices under `vmap`); `"onehot"`: by
    one-hot selects; `""`: as this backend does by default (one-hot on a TPU)."""
    saved = _save.ONE_HOT_BACKENDS
    if variant == "index":
        _save.ONE_HOT_BACKENDS = ()
    elif variant == "onehot":
        _save.ONE_HOT_BACKENDS = (jax.default_backend(),)
    try:
        yield
    finally:
        _save.ONE_HOT_BACKENDS = saved


def _compiled(method: str, n: int, args, census: bool, row: dict):
    """`method`'s gradient, traced (`@index`, `@onehot`: rows so) and compiled
    ahead of time, so that later traces of other variants can't change it."""
    name, _, variant = method.partition("@")
    jax.clear_caches()  # no trace of another variant reused
    with _rows_by(variant):
        grad = jax.grad(_loss(name, n))
        if census:
            jaxpr = jax.make_jaxpr(grad)(*args).jaxpr
            row["batched_index_ops_in_loops"] = dict(batched_index_ops(jaxpr))
        return jax.jit(grad).lower(*args).compile()


def _measure(methods, n: int, repeats: int, census: bool) -> list[dict]:
    args = _inputs(n)
    rows, fns = [], {}
    for method in methods:
        row = dict(n=n, method=method)
        try:
            start = time.perf_counter()
            fn = _compiled(method, n, args, census, row)
            row["grad_sum"] = float(jnp.sum(jax.block_until_ready(fn(*args))))
            row["first_s"] = time.perf_counter() - start
            fns[method] = fn
            row["runs"], row["cpu"] = [], []
        except Exception as e:  # a failed method is recorded, the others go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    for _ in range(repeats):  # interleaved: a loaded machine slows each alike
        for row in rows:
            if row["method"] in fns:
                start, cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(fns[row["method"]](*args))
                row["runs"].append(time.perf_counter() - start)
                row["cpu"].append(time.process_time() - cpu)
    for row in rows:
        if row.get("runs"):
            row["run_s"] = min(row.pop("runs"))
            row["cpu_s"] = min(row.pop("cpu"))
        print(json.dumps(row), flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    head = "| N | method | run (ms) | CPU (ms) | first (s) | batched gathers/scatters |"
    lines = [head]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "method" not in r:
            continue
        run = f"{1e3 * r['run_s']:.2f}" if "run_s" in r else r.get("error", "-")
        first = f"{r['first_s']:.1f}" if "first_s" in r else "-"
        cpu = f"{1e3 * r['cpu_s']:.2f}" if "cpu_s" in r else "-"
        ops = r.get("batched_index_ops_in_loops", "-")
        lines.append(f"| {r['n']} | {r['method']} | {run} | {cpu} | {first} | {ops} |")
    micro = [r for r in rows if "micro_scatter_s" in r]
    if micro:
        lines += ["", "| N | 100 batched scatters (ms) | 100 one-hot selects (ms) |"]
        lines.append("| --- | --- | --- |")
        for r in micro:
            s, o = 1e3 * r["micro_scatter_s"], 1e3 * r["micro_onehot_s"]
            lines.append(f"| {r['n']} | {s:.3f} | {o:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--sizes", default="4096,65536")
    parser.add_argument(
        "--methods",
        default="ens_lock,ens_lock@index,ens_bts,vmap,vmap@index,vmap_bts,ens_t1,"
        "vmap_t1,diffrax",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--census", action="store_true")
    ns = parser.parse_args(argv)
    rows = []
    for n in [int(s) for s in ns.sizes.split(",")]:
        rows += _measure(ns.methods.split(","), n, ns.repeats, ns.census)
        if ns.micro:
            rows.append(dict(n=n, **_micro(n, ns.repeats)))
            print(json.dumps(rows[-1]), flush=True)
        if ns.out is not None:  # after each size: a run cut short keeps what it had
            ns.out.mkdir(parents=True, exist_ok=True)
            meta = dict(device=str(jax.devices()[0]), jax=jax.__version__)
            data = json.dumps(dict(meta=meta, rows=rows))
            (ns.out / "ts_grad.json").write_text(data)
            (ns.out / "ts_grad.md").write_text(_table(rows))
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
