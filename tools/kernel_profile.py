"""Where the whole-solve kernel's time goes: the pieces of one
`ensemble_solve(kernel=True)` call timed separately, side by side in one process.

`python -m tools.kernel_profile --out DIR [--sizes 4096,65536] [--t1 1,10]
[--repeats 20] [--big] [--grad] [--trace] [--interpret]`

Lorenz, Tsit5, PIDController(rtol = atol = 1e-5), SaveAt(t1=True), float32 (as
`benchmarks.kernel`). Pieces (each a jitted function on the same inputs):

- `dispatch`: `y0 * 2`: the floor of a jitted call and its result's transfer.
- `callback`: the same with an `equinox.error_if` on a scalar that never fires: what
  a host callback in the program costs (JAX's C++ dispatch is off for such programs).
- `kernel_only`: the `pallas_call` alone, on inputs already in the lane layout.
- `kernel`, `kernel_throw`: `ensemble_solve(kernel=True)`, throw=False / True.
- `vmap`, `vmap_throw`: `kernel=False` (the lockstep loop), throw=False / True.
- with `--grad`: the gradient of `sum(y(t1)^2)` with respect to y0 and rho:
  `grad_vmap` (kernel=False), `grad_loop` (the kernel forward, the lane loop's
  backward pass: `_solve.BACKWARD = "loop"`, the default), `grad_tangent` (forward
  sensitivities in the kernel, `BACKWARD = "tangent"`: 6 directions here), at
  the largest `--t1` only.

Per piece: the first call (trace, compile, run), `latency` (median over `--repeats`
of a call and `block_until_ready`) and `pipelined` (`--repeats` calls back to back,
then one block, per call): latency minus pipelined is the host's share. `--big` adds
the kernel at N = 2^20 (throw=False and True); `--trace` writes a `jax.profiler`
trace of a few calls of `kernel` and `kernel_throw` under `DIR/trace`. Writes
`kernel_profile.json` and `kernel_profile.md` after every piece (a run cut short
keeps what it measured); a piece that fails is written down with its error and the
rest go on. `--interpret` runs the kernel in Pallas'
interpreter (a CPU check of the script with tiny sizes).
"""

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time
import traceback

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk
from benchmarks.kernel import _lorenz_field, _lorenz_inputs
from solverkit import _kernel
from solverkit._kernel import _pallas, _solve


_DTYPE = jnp.float32


def _solver(kernel: bool, throw: bool, t1: float):
    sigma, beta = jnp.asarray(10.0, _DTYPE), jnp.asarray(8 / 3, _DTYPE)

    def solve(y0, rho):
        return sk.ensemble_solve(
            sk.ODETerm(_lorenz_field(sigma, beta)), sk.Tsit5(), 0.0, t1, None, y0,
            rho, stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5),
            kernel=kernel, throw=throw, max_steps=16384,
        )  # fmt: skip

    return jax.jit(solve)


def _kernel_only(t1: float, y0, rho, interpret: bool):
    """The `pallas_call` alone as a jitted function, and its lane-layout inputs."""
    captured = {}
    original = _kernel.kernel_solve

    def capture(problem, y0, args, *rest, **kwargs):
        captured["problem"], captured["y0"], captured["args"] = problem, y0, args
        return original(problem, y0, args, *rest, **kwargs)

    _kernel.kernel_solve = capture
    try:  # eagerly: the problem's arrays are concrete
        _solver(True, False, t1).__wrapped__(y0, rho)
    finally:
        _kernel.kernel_solve = original
    problem, y0, args = captured["problem"], captured["y0"], captured["args"]
    rows = _solve.default_rows(y0.shape[0])
    args_dynamic = eqx.filter(args, eqx.is_array)
    spec, *inputs = eqx.filter_jit(_solve.lane_inputs)(problem, y0, args_dynamic, rows)
    call = functools.partial(_pallas.solve_blocks, spec, interpret=interpret)
    return jax.jit(call), tuple(inputs)


def _pieces(n: int, t1: float, interpret: bool):
    y0, rho = _lorenz_inputs(n, _DTYPE)
    plain = jax.jit(lambda y0, rho: y0 * 2)

    @jax.jit
    def callback(y0, rho):
        return eqx.error_if(y0 * 2, jnp.any(rho < -1.0), "never")

    pieces = dict(dispatch=(plain, (y0, rho)), callback=(callback, (y0, rho)))
    pieces["kernel_only"] = lambda: _kernel_only(t1, y0, rho, interpret)
    for name, kernel, throw in [
        ("kernel", True, False),
        ("kernel_throw", True, True),
        ("vmap", False, False),
        ("vmap_throw", False, True),
    ]:
        pieces[name] = (_solver(kernel, throw, t1), (y0, rho))
    for name, kernel, backward in [
        ("grad_vmap", False, "loop"),
        ("grad_loop", True, "loop"),
        ("grad_tangent", True, "tangent"),
    ]:
        pieces[name] = (_grad(kernel, backward, t1), (y0, rho))
    return pieces


def _grad(kernel: bool, backward: str, t1: float):
    solve = _solver(kernel, False, t1)
    loss = lambda y0, rho: jnp.sum(solve(y0, rho).ys ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def call(y0, rho):  # the backward pass is chosen when traced (first call)
        _solve.BACKWARD = backward
        try:
            return grad(y0, rho)
        finally:
            _solve.BACKWARD = "loop"

    return call


def _time(fn, args, repeats: int) -> dict:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    latency = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        latency.append(time.perf_counter() - start)
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(repeats)]
    jax.block_until_ready(outs)
    pipelined = (time.perf_counter() - start) / repeats
    row = dict(first_s=first, latency_s=statistics.median(latency))
    row.update(pipelined_s=pipelined, min_latency_s=min(latency))
    if isinstance(out, sk.Solution):
        row["max_steps"] = int(np.max(np.asarray(out.stats["num_steps"])))
    return row


def _save(out: pathlib.Path, meta: dict, rows: list) -> None:
    (out / "kernel_profile.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    (out / "kernel_profile.md").write_text(_markdown(rows))


def _run(rows: list, n: int, t1: float, names, args) -> None:
    """Time `names` at this size and horizon, appending to `rows` and writing the
    files after each (a run cut short keeps what it measured)."""
    pieces = _pieces(n, t1, args.interpret)
    for name in names:
        row = dict(piece=name, n=n, t1=t1)
        try:
            piece = pieces[name]
            fn, inputs = piece() if callable(piece) else piece
            row.update(_time(fn, inputs, args.repeats))
        except Exception as e:  # noqa: BLE001 - written down, the rest go on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        _save(pathlib.Path(args.out), args.meta, rows)


def _trace(out: pathlib.Path, n: int, t1: float) -> None:
    y0, rho = _lorenz_inputs(n, _DTYPE)
    fns = [_solver(True, throw, t1) for throw in (False, True)]
    for fn in fns:
        jax.block_until_ready(fn(y0, rho))
    with jax.profiler.trace(str(out / "trace")):
        for fn in fns:
            for _ in range(3):
                jax.block_until_ready(fn(y0, rho))


def _markdown(rows: list) -> str:
    lines = [
        "| piece | N | t1 | first (s) | latency (ms) | pipelined (ms) | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['piece']} | {r['n']} | {r['t1']} | {r['error']} |||")
            continue
        lines.append(
            f"| {r['piece']} | {r['n']} | {r['t1']} | {r['first_s']:.2f} | "
            f"{1e3 * r['latency_s']:.3f} | {1e3 * r['pipelined_s']:.3f} | "
            f"{r.get('max_steps', '')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="4096,65536")
    parser.add_argument("--t1", default="1,10")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--big", action="store_true")
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.interpret or jax.default_backend() != "tpu":
        args.interpret = _solve.DEFAULT_INTERPRET = True
    names = ["dispatch", "callback", "kernel_only", "kernel", "kernel_throw"]
    names += ["vmap", "vmap_throw"]
    grads = ["grad_vmap", "grad_loop", "grad_tangent"] if args.grad else []
    rows: list = []
    args.meta = dict(device=str(jax.devices()[0]), argv=sys.argv[1:])
    t1s = [float(s) for s in args.t1.split(",")]
    for i, n in enumerate([int(s) for s in args.sizes.split(",")]):
        for t1 in t1s:  # gradients at the longest horizon only
            _run(rows, n, t1, names + (grads if t1 == max(t1s) else []), args)
        if args.big and i == 0:  # after the first size: N = 2^20 compiles?
            _run(rows, 2**20, 1.0, ["kernel_only", "kernel", "kernel_throw"], args)
    if args.trace:
        _trace(out, int(args.sizes.split(",")[0]), 1.0)
    _save(out, args.meta, rows)
    print(_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
