"""float32 solves on the default device (a TPU, say) against float64 references on
the host CPU, within a tolerance derived from the solver's tolerance and the problem.

`python -m benchmarks.precision --out DIR [--size N]`

Each problem is solved in float32 on `jax.devices()[0]` and in float64 on the CPU
(tolerances 1e-6 times tighter). The float32 error of component `i` must stay below

    bound_i = kappa * (SAFETY * (rtol * |y_i| + atol) + steps * eps32 * max|y|)

- `kappa`: how much the problem amplifies an error made on the way, the largest
  `||dy(T)/dy(s)||_inf` over s in {0, T/4, T/2, 3T/4}, computed in float64 (reverse
  mode through the reference solve from s to T);
- `SAFETY = 10`: a PID-controlled embedded Runge-Kutta or Rosenbrock method keeps each
  step's local error under its tolerance, and their sum reaching the end is the global
  error; 10 allows for the steps' errors adding up in one direction;
- `steps * eps32 * max|y|`: float32 rounding, once per step.

A product at bfloat16 precision (8 bits) in the engine would give errors near
`4e-3 |y|`, far above these bounds. The last problem (`linear-user-matmul`) shows what
a user's own `A @ y` does: at JAX's default precision (bfloat16 on a TPU) and under
`jax.default_matmul_precision("highest")`; only the second counts for the verdict.

Writes `precision.json` (every row, the verdict) and `precision.md` into `--out`.
"""

import argparse
import contextlib
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


SAFETY = 10.0
EPS32 = float(np.finfo(np.float32).eps)
T1 = 1.0


def _lorenz(t, y, rho):
    return jnp.stack(
        [10.0 * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - 8 / 3 * y[2]]
    )


def _lotka_volterra(t, y, p):
    return jnp.stack([p * y[0] - 0.4 * y[0] * y[1], 0.3 * y[0] * y[1] - 0.8 * y[1]])


_A = np.diag([-1.0, -10.0, -100.0, -1000.0]) + np.diag([0.5, 0.5, 0.5], 1)


def _linear_stiff(t, y, p):  # elementwise, so that only the engine has products
    a = jnp.asarray(_A, y.dtype)
    return jnp.sum(a * y[None, :], axis=1) * p


def _linear_matmul(t, y, p):  # the user's own product, at the default precision
    return (jnp.asarray(_A, y.dtype) @ y) * p


# name -> (field, solver, rtol, atol, y0, parameters over the ensemble)
PROBLEMS: dict[str, tuple[Callable, Any, float, float, list[float], tuple]] = {
    "lorenz-tsit5": (_lorenz, sk.Tsit5(), 1e-5, 1e-5, [1.0, 0.0, 0.0], (0.0, 21.0)),
    "lv-dopri5": (_lotka_volterra, sk.Dopri5(), 1e-6, 1e-6, [1.0, 1.0], (0.8, 1.2)),
    "linear-stiff-rodas5p": (
        _linear_stiff,
        sk.Rodas5P(),
        1e-5,
        1e-7,
        [1.0, 1.0, 1.0, 1.0],
        (0.5, 1.0),
    ),
    "linear-user-matmul": (
        _linear_matmul,
        sk.Rodas5P(),
        1e-5,
        1e-7,
        [1.0, 1.0, 1.0, 1.0],
        (0.5, 1.0),
    ),
}


def _solve(name: str, rtol: float, atol: float, t0=0.0, t1=T1) -> Callable:
    """`(p, y0) -> (y(t1), steps)` of one trajectory from `t0`, closing over `p`."""
    field, solver = PROBLEMS[name][:2]

    def one(p, y0):
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, y, args: field(t, y, p)),
            solver,
            t0,
            t1,
            0.01,
            y0,
            stepsize_controller=sk.PIDController(rtol=rtol, atol=atol),
            max_steps=100_000,
        )
        return sol.ys[-1], sol.stats["num_steps"]

    return one


def _reference(name: str, ps: np.ndarray, y0: np.ndarray) -> tuple[np.ndarray, float]:
    """float64 final states on the CPU, and `kappa` (see the module docstring)."""
    rtol, atol = (tol * 1e-6 for tol in PROBLEMS[name][2:4])
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        p64 = jnp.asarray(ps, jnp.float64)
        y64 = jnp.broadcast_to(jnp.asarray(y0, jnp.float64), (len(ps), len(y0)))
        ys = jax.jit(jax.vmap(_solve(name, rtol, atol)))(p64, y64)[0]
        kappa = 1.0
        for s in (0.0, T1 / 4, T1 / 2, 3 * T1 / 4):
            to_s = jax.vmap(_solve(name, rtol, atol, 0.0, s)) if s > 0 else None
            start = y64 if to_s is None else jax.jit(to_s)(p64, y64)[0]
            flow = _solve(name, rtol, atol, s)
            jac = jax.jit(jax.vmap(jax.jacrev(lambda p, y: flow(p, y)[0], 1)))
            norm = jnp.max(jnp.sum(jnp.abs(jac(p64, start)), axis=2))  # inf-norm
            kappa = max(kappa, float(norm))
    return np.asarray(ys), kappa


def check(name: str, size: int, precision: str | None) -> dict:
    """One problem's float32 solve on the default device against its reference."""
    rtol, atol, y0, span = PROBLEMS[name][2:]
    ps = np.linspace(*span, size)
    want, kappa = _reference(name, ps, np.asarray(y0))
    setting = (
        contextlib.nullcontext()
        if precision is None
        else jax.default_matmul_precision(precision)
    )
    with jax.enable_x64(False), setting:
        fn = jax.jit(jax.vmap(_solve(name, rtol, atol), (0, None)))
        got, steps = fn(jnp.asarray(ps, jnp.float32), jnp.asarray(y0, jnp.float32))
    got, steps = np.asarray(got, np.float64), int(np.max(steps))
    scale = np.max(np.abs(want))
    bound = kappa * (SAFETY * (rtol * np.abs(want) + atol) + steps * EPS32 * scale)
    err = np.abs(got - want)
    return {
        "problem": name,
        "matmul_precision": precision or "default",
        "size": size,
        "device": jax.devices()[0].device_kind,
        "rtol": rtol,
        "atol": atol,
        "steps": steps,
        "kappa": kappa,
        "max_error": float(err.max()),
        "max_error_over_bound": float(np.max(err / bound)),
        "ok": bool(np.all(err <= bound)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--size", type=int, default=1024, help="ensemble size")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in PROBLEMS:
        settings = [None, "highest"] if name == "linear-user-matmul" else [None]
        for precision in settings:
            rows.append(check(name, args.size, precision))
            print(json.dumps(rows[-1]), flush=True)
    counted = [
        r
        for r in rows
        if r["problem"] != "linear-user-matmul" or r["matmul_precision"] == "highest"
    ]
    verdict = "pass" if all(r["ok"] for r in counted) else "FAIL"
    (args.out / "precision.json").write_text(
        json.dumps({"verdict": verdict, "rows": rows}, indent=1) + "\n"
    )
    lines = [
        f"# float32 on {rows[0]['device']} vs float64 on the CPU: **{verdict}**",
        "",
        "| problem | user matmul precision | steps | kappa | max error | "
        "error / bound | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['problem']} | {r['matmul_precision']} | {r['steps']} | "
            f"{r['kappa']:.3g} | {r['max_error']:.2e} | "
            f"{r['max_error_over_bound']:.3f} | {r['ok']} |"
        )
    (args.out / "precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
