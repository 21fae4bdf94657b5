"""The whole-solve kernel (`ensemble_solve(kernel=True)`) against solverkit's lane
loop (`kernel=False`) and diffrax (`jax.vmap(diffrax.diffeqsolve)`).

`python -m benchmarks.kernel --out DIR [--dtype float32] [--sizes 4096,65536]
[--methods kernel,kernel@32,vmap,diffrax] [--repeats 3] [--grad] [--cases
lorenz,lorenz_grad,lotka_volterra_grad] [--t1 T] [--controller pid|constant]
[--dt0 DT] [--throw] [--smoke]`

Cases (one process, whatever device JAX sees; each case's errors are caught and
written down, the rest go on):

- `lorenz`: the Lorenz system, rho = linspace(0, 21, N) per trajectory, sigma and
  beta closed over, y0 = (1, 0, 0), t in [0, 1], Tsit5, PIDController(rtol = atol =
  1e-5), SaveAt(t1=True); with `--controller constant`, ConstantStepSize with
  `dt0 = --dt0` (default 1e-3: 1000 steps, the suite's fixed-step Lorenz rows).
- `lorenz_grad` (with `--grad`): the gradient of `sum(y(1)^2)` with respect to
  `y0` and rho.
- `lotka_volterra_grad` (with `--grad`): the gradient of a fit, `sum((ys - data)^2)` at
  10 save times, with respect to each trajectory's (alpha, beta, gamma, delta).

Methods (`--methods`): `kernel` (blocks of `DEFAULT_ROWS` rows of 128
trajectories), `kernel@R` (blocks of `R` rows, a multiple of 8), `vmap` (the lane
loop, `kernel=False`), `diffrax`.

Per case, size and method: the first call (trace, compile, run), the median run
time, the steps (max and mean over trajectories), microseconds per step (run time /
max steps: one step of the whole ensemble) and the fraction of the chip's
element-wise peak (FLOPs per step counted from the jaxpr, over a measured peak of
fused multiply-adds). Writes `kernel.json` and `kernel.md` under `--out`. Every
solve runs with `throw=False` (all methods alike); `--throw` times them with the
run-time error check instead.

`--smoke` compiles the kernel on the device, solves one small ensemble and compares
it with the lane loop, then an event (Dopri5) and a gradient, printing which stage
failed (a failed stage does not stop the independent ones).
"""

import argparse
import json
import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk
from solverkit._kernel import _solve

from .harness import timed


def _lorenz_field(sigma, beta):
    def field(t, y, rho):
        x, yy, z = y
        return jnp.stack([sigma * (yy - x), x * (rho - z) - yy, x * yy - beta * z])

    return field


def _lv_field(t, y, p):
    prey, pred = y
    a, b, c, d = p
    return jnp.stack([a * prey - b * prey * pred, d * prey * pred - c * pred])


def _lorenz_inputs(n: int, dtype):
    y0 = jnp.tile(jnp.asarray([1.0, 0.0, 0.0], dtype), (n, 1))
    return y0, jnp.linspace(0.0, 21.0, n, dtype=dtype)


def _rows_of(method: str) -> int | None:
    """`kernel@16`: the kernel with blocks of 16 rows of 128 trajectories."""
    return int(method.split("@")[1]) if "@" in method else None


# The end of the Lorenz solves (`--t1`): 1 as in DiffEqGPU's benchmark (about 34
# steps); longer horizons show the cost of a step rather than of a solve.
_T1 = [1.0]
# `throw` of every solve (`--throw`): False by default, for every method alike. A jitted
# solve with `throw=True` carries a run-time error check, a host callback that costs
# about 2 ms a call on a TPU (benchmarks/results/tpu-v5-lite/kernel_profile), which
# would hide the solvers' own times at small N.
_THROW = [False]
# The Lorenz solves' controller (`--controller`): "pid" (rtol = atol = 1e-5, dt0
# chosen) or "constant" (ConstantStepSize, dt0 = `_DT0`, `--dt0`).
_CONTROLLER = ["pid"]
_DT0 = [1e-3]


def _lorenz_control(lib) -> dict:
    """`dt0` and `stepsize_controller` of the Lorenz solves, for `lib` (solverkit
    or diffrax)."""
    if _CONTROLLER[0] == "constant":
        return dict(dt0=_DT0[0], stepsize_controller=lib.ConstantStepSize())
    return dict(dt0=None, stepsize_controller=lib.PIDController(rtol=1e-5, atol=1e-5))


def _lorenz_solver(method: str, dtype):
    t1 = _T1[0]
    sigma, beta = jnp.asarray(10.0, dtype), jnp.asarray(8 / 3, dtype)
    if method == "diffrax":
        import diffrax

        def one(y0, rho):
            return diffrax.diffeqsolve(
                diffrax.ODETerm(_lorenz_field(sigma, beta)), diffrax.Tsit5(), 0.0,
                t1, y0=y0, args=rho, max_steps=16384, throw=_THROW[0],
                **_lorenz_control(diffrax),
            )  # fmt: skip

        return jax.jit(jax.vmap(one))
    kernel = method.startswith("kernel")

    def solve(y0, rho):
        return sk.ensemble_solve(
            sk.ODETerm(_lorenz_field(sigma, beta)), sk.Tsit5(), 0.0, t1, y0=y0,
            args=rho, kernel=kernel, max_steps=16384, throw=_THROW[0],
            **_lorenz_control(sk),
        )  # fmt: skip

    return jax.jit(solve)


def _lorenz_grad(method: str, dtype):
    """The gradient of `sum(y(1)^2)` with respect to `y0` and rho."""
    solve = _lorenz_solver(method, dtype)
    loss = lambda y0, rho: jnp.sum(solve(y0, rho).ys ** 2)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _lv_loss(method: str, dtype):
    ts = jnp.linspace(0.0, 5.0, 10, dtype=dtype)
    ctrl = dict(rtol=1e-5, atol=1e-5)

    def loss(p, y0, data):
        if method == "diffrax":
            import diffrax

            def one(y, q):
                return diffrax.diffeqsolve(
                    diffrax.ODETerm(_lv_field), diffrax.Tsit5(), 0.0, 5.0, None, y,
                    q, saveat=diffrax.SaveAt(ts=ts),
                    stepsize_controller=diffrax.PIDController(**ctrl),
                    throw=_THROW[0],
                ).ys  # fmt: skip

            ys = jax.vmap(one)(y0, p)
        else:
            ys = sk.ensemble_solve(
                sk.ODETerm(_lv_field), sk.Tsit5(), 0.0, 5.0, None, y0, p,
                saveat=sk.SaveAt(ts=ts), stepsize_controller=sk.PIDController(**ctrl),
                kernel=method.startswith("kernel"), throw=_THROW[0],
            ).ys  # fmt: skip
        return jnp.sum((ys - data) ** 2)

    return jax.jit(jax.grad(loss))


def _time(fn, args, repeats: int):
    return timed(fn, *args, repeats=repeats)


def _field_flops() -> int:
    """Element-wise operations of one Lorenz field evaluation (from its jaxpr)."""
    jaxpr = jax.make_jaxpr(_lorenz_field(10.0, 8 / 3))(0.0, jnp.zeros(3), 1.0)
    skip = {"slice", "squeeze", "stack", "concatenate", "broadcast_in_dim"}
    return sum(1 for e in jaxpr.jaxpr.eqns if e.primitive.name not in skip)


def _flops_per_step(n: int = 3) -> int:
    """One Tsit5 step of one trajectory: 6 field evaluations, the stage
    combinations (2 per nonzero coefficient, per component), the error estimate and
    the controller (about 10 per component, 30 per step)."""
    from solverkit._solver._tableau import TSIT5

    combos = int(np.count_nonzero(TSIT5.a)) + int(np.count_nonzero(TSIT5.b_err))
    return 6 * _field_flops() + n * (2 * combos + 10) + 30


def _peak_flops(dtype) -> float:
    """Measured element-wise peak, in FLOP/s.

    On a TPU: a Pallas kernel whose blocks (64 rows of 128 lanes, in on-chip memory
    as the solver kernel's state is) go through 1024 multiply-adds each, many
    independent vector registers per operation (as the solver kernel's lanes).
    Elsewhere: one XLA fusion of 256 unrolled multiply-adds per element. The first
    version of this measured a loop through memory (a bound of bandwidth, not of
    arithmetic), and an unrolled XLA fusion on the TPU reached only half of what the
    solver kernel did (a chain of dependent operations per element).
    """
    if jax.default_backend() == "tpu":
        return _pallas_peak(dtype)
    x = jnp.ones((2048, 1024), dtype)
    depth = 256

    @jax.jit
    def chain(x):
        for _ in range(depth):  # unrolled: XLA fuses the chain into one kernel
            x = x * 0.999 + 0.001
        return x

    _, _, t = _time(chain, (x,), 5)
    return 2 * depth * x.size / t


def _pallas_peak(dtype, rows: int = 64, blocks: int = 512, depth: int = 1024) -> float:
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        def fma(i, x):
            return x * 0.999 + 0.001

        o_ref[...] = jax.lax.fori_loop(0, depth, fma, x_ref[...], unroll=8)

    spec = pl.BlockSpec((rows, 128), lambda i: (i, 0))
    call = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((rows * blocks, 128), dtype),
        grid=(blocks,),
        in_specs=[spec],
        out_specs=spec,
    )
    x = jnp.ones((rows * blocks, 128), dtype)
    _, _, t = _time(jax.jit(call), (x,), 5)
    return 2 * depth * x.size / t


def _case(name, method, n, dtype, repeats, grad):
    if name == "lorenz_grad":
        fn = _lorenz_grad(method, dtype)
        _, first, run = _time(fn, _lorenz_inputs(n, dtype), repeats)
        return dict(first_s=first, run_s=run)
    if grad:
        fn = _lv_loss(method, dtype)
        p = jnp.tile(jnp.asarray([1.5, 1.0, 3.0, 1.0], dtype), (n, 1))
        p = p * (1 + 0.1 * jnp.linspace(0, 1, n, dtype=dtype))[:, None]
        y0 = jnp.tile(jnp.asarray([1.0, 1.0], dtype), (n, 1))
        data = jnp.ones((n, 10, 2), dtype)
        _, first, run = _time(fn, (p, y0, data), repeats)
        return dict(first_s=first, run_s=run)
    fn = _lorenz_solver(method, dtype)
    sol, first, run = _time(fn, _lorenz_inputs(n, dtype), repeats)
    steps = np.asarray(sol.stats["num_steps"])
    return dict(
        first_s=first,
        run_s=run,
        max_steps=int(steps.max()),
        mean_steps=float(steps.mean()),
        us_per_step=1e6 * run / int(steps.max()),
        y1=np.asarray(sol.ys[:, -1]).tolist() if n <= 8 else None,
        _ys=np.asarray(sol.ys),
        _steps=steps,
    )


def _smoke() -> int:
    """Compile the kernel on the device, solve a small ensemble, compare."""
    stages = [("backend", lambda: print("  backend:", jax.default_backend()))]
    state = {}

    def compile_kernel():
        fn = _lorenz_solver("kernel", jnp.float32)
        state["kernel"] = fn.lower(*_lorenz_inputs(2048, jnp.float32)).compile()

    def run_kernel():
        state["k"] = jax.block_until_ready(
            state["kernel"](*_lorenz_inputs(2048, jnp.float32))
        )

    def compare():
        ref = _lorenz_solver("vmap", jnp.float32)(*_lorenz_inputs(2048, jnp.float32))
        k = state["k"]
        diff = np.max(np.abs(np.asarray(k.ys) - np.asarray(ref.ys)))
        scale = np.max(np.abs(np.asarray(ref.ys)))
        sk_, sr = np.asarray(k.stats["num_steps"]), np.asarray(ref.stats["num_steps"])
        print(f"  max |diff| {diff:.3g} (max |y| {scale:.3g}); steps kernel "
              f"{sk_.sum()} vmap {sr.sum()}, max per-trajectory diff "
              f"{np.abs(sk_ - sr).max()}")  # fmt: skip
        assert diff <= 1e-2 * scale, "kernel and vmap path differ"

    def event():  # Dopri5, a terminal event, SaveAt(ts, t1), against the lane loop
        y0 = jnp.stack([jnp.linspace(10.0, 15.0, 1024), jnp.zeros(1024)], axis=1)
        g = jnp.asarray(9.81, jnp.float32)
        sols = [
            sk.ensemble_solve(
                sk.ODETerm(lambda t, y, a: jnp.stack([y[1], -g])),
                sk.Dopri5(),
                0.0,
                5.0,
                None,
                y0,
                None,
                event=sk.Event(lambda t, y, a, **k: y[0]),
                saveat=sk.SaveAt(ts=jnp.linspace(0.0, 5.0, 11), t1=True),
                stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5),
                kernel=kernel,
            )  # fmt: skip
            for kernel in (True, False)
        ]
        diff = float(jnp.max(jnp.abs(sols[0].t1 - sols[1].t1)))
        exact = float(jnp.max(jnp.abs(sols[0].t1 - jnp.sqrt(2 * y0[:, 0] / 9.81))))
        print(
            f"  event times: |kernel - vmap| {diff:.3g}, |kernel - exact| {exact:.3g}"
        )
        assert diff < 1e-3, "event times differ"

    def grad():  # reverse mode: the kernel forward, the lane loop's backward pass
        fn = jax.jit(jax.grad(lambda y0, rho, k: jnp.sum(
            _lorenz_solver(k, jnp.float32)(y0, rho).ys ** 2), argnums=1),
            static_argnums=2)  # fmt: skip
        y0, rho = _lorenz_inputs(2048, jnp.float32)
        got, want = fn(y0, rho, "kernel"), fn(y0, rho, "vmap")
        rel = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        print(f"  d/d rho: max |kernel - vmap| / max |vmap| = {rel:.3g}")
        assert rel < 1e-2, "gradients differ"

    stages += [("compile", compile_kernel), ("run", run_kernel), ("compare", compare)]
    stages += [("event", event), ("grad", grad)]
    failed = []
    for name, stage in stages:
        if name in ("run", "compare") and failed:
            print(f"smoke stage {name}: skipped (an earlier stage failed)")
            continue
        try:
            stage()
            print(f"smoke stage {name}: ok", flush=True)
        except Exception:
            print(f"smoke stage {name}: FAILED", flush=True)
            traceback.print_exc()
            failed.append(name)
    print("smoke: " + ("all stages ok" if not failed else f"FAILED {failed}"))
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--sizes", default="4096,65536")
    parser.add_argument("--methods", default="kernel,vmap,diffrax")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--cases", default=None, help="comma-separated case names")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--throw", action="store_true", help="solves with throw=True (see _THROW)"
    )
    parser.add_argument(
        "--t1", type=float, default=1.0, help="end of the Lorenz solves"
    )
    parser.add_argument(
        "--controller", default="pid", choices=["pid", "constant"],
        help="the Lorenz solves' controller (constant: ConstantStepSize, --dt0)",
    )  # fmt: skip
    parser.add_argument("--dt0", type=float, default=1e-3, help="with constant")
    ns = parser.parse_args(argv)
    _T1[0] = ns.t1
    _CONTROLLER[0], _DT0[0] = ns.controller, ns.dt0
    _THROW[0] = ns.throw
    if ns.smoke:
        return _smoke()
    if ns.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(ns.dtype)
    sizes = [int(s) for s in ns.sizes.split(",")]
    methods = ns.methods.split(",")
    default_rows = _solve.DEFAULT_ROWS
    flops = _flops_per_step()
    peak = _peak_flops(dtype)
    rows = []
    cases = [("lorenz", False)]
    if ns.grad:
        cases += [("lorenz_grad", True), ("lotka_volterra_grad", True)]
    if ns.cases is not None:
        every = dict(lorenz=False, lorenz_grad=True, lotka_volterra_grad=True)
        cases = [(name, every[name]) for name in ns.cases.split(",")]
    for name, grad in cases:
        for n in sizes:
            ref = None
            for method in methods:
                row = dict(case=name, n=n, method=method, dtype=ns.dtype)
                row["controller"] = ns.controller
                rows_ = _rows_of(method)
                _solve.DEFAULT_ROWS = rows_ if rows_ is not None else default_rows
                try:
                    row.update(_case(name, method, n, dtype, ns.repeats, grad))
                except Exception as e:  # per-case error capture
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                ys, steps = row.pop("_ys", None), row.pop("_steps", None)
                if "us_per_step" in row:
                    row["peak_fraction"] = (
                        flops * n / (row["us_per_step"] * 1e-6) / peak
                    )
                if ys is not None and method == "vmap":
                    ref = (ys, steps)
                rows.append((row, ys, steps))
                print(json.dumps(row), flush=True)
            for row, ys, steps in rows:
                if ref is not None and ys is not None and row["n"] == n:
                    row["max_diff_vs_vmap"] = float(np.max(np.abs(ys - ref[0])))
                    row["steps_diff_vs_vmap"] = int(np.abs(steps - ref[1]).max())
    table = [r for r, _, _ in rows]
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        meta = dict(device=str(jax.devices()[0]), flops_per_step=flops, peak=peak)
        meta.update(controller=ns.controller, t1=ns.t1)
        if ns.controller == "constant":
            meta["dt0"] = ns.dt0
        (ns.out / "kernel.json").write_text(json.dumps(dict(meta=meta, rows=table)))
        keys = ["case", "n", "method", "first_s", "run_s", "max_steps",
                "us_per_step", "peak_fraction", "max_diff_vs_vmap",
                "steps_diff_vs_vmap", "error"]  # fmt: skip
        lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        for r in table:
            cells = [r.get(k, "") for k in keys]
            cells = [f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells]
            lines.append("| " + " | ".join(cells) + " |")
        (ns.out / "kernel.md").write_text(f"{meta}\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
