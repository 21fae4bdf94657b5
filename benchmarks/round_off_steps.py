"""The vmapped checkpointed gradient of a float32 oscillator whose first step's error
estimate is round-off (issue of stop 49, helper B1), against the exact 2 cos(2 omega).

y' = 2 omega [y1, -y0], y0 = [0, 1] on [199, 200], Tsit5, PID rtol = atol = 1e-5,
dt0 = 1e-3: u(omega) = y0(200) = sin(2 omega). Under `vmap` the longest trajectory
fills the 128 default slots, so every trajectory's steps are recomputed in chunks;
the first step's error (~1e-10) is below float32 round-off, so the next step's size
is round-off too, and a recomputation compiled otherwise sized it differently
(0.01009 against 0.00911: 66 floats of `t`). With 6 recorded low bits of each step
end it took other steps, and the gradient was 0.25 off (64 trajectories in
[15, 60]); with the full step end recorded (`_adjoint/_replay.py`) it takes the
forward pass's. Shows with the test suite's settings (tests/conftest.py: both on by
default here):

    XLA_FLAGS=--xla_cpu_use_fusion_emitters=false python -m benchmarks.round_off_steps

`--optimized` compiles with XLA's default optimizations instead; `--lo/--hi/--n`
pick the omegas (`jnp.linspace(lo, hi, n)`); `--out DIR` writes `round_off.json`.
"""

import argparse
import json
import os
import pathlib


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lo", type=float, default=15.0)
    parser.add_argument("--hi", type=float, default=60.0)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--optimized", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    import jax

    jax.config.update("jax_disable_most_optimizations", not args.optimized)
    import jax.numpy as jnp
    import numpy as np

    import solverkit as sk

    def u(omega, adjoint):
        field = lambda t, y, a: jnp.stack([2 * omega * y[1], -2 * omega * y[0]])  # noqa: E731
        sol = sk.diffeqsolve(
            sk.ODETerm(field), sk.Tsit5(), jnp.float32(199.0), jnp.float32(200.0),
            jnp.float32(1e-3), jnp.asarray([0.0, 1.0], jnp.float32),
            stepsize_controller=sk.PIDController(rtol=1e-5, atol=1e-5),
            adjoint=adjoint,
        )  # fmt: skip
        return sol.ys[-1, 0], sol.stats["num_steps"]

    omegas = jnp.linspace(args.lo, args.hi, args.n, dtype=jnp.float32)
    exact = 2 * np.cos(2 * np.asarray(omegas, np.float64))
    adjoints = {
        "checkpointed": sk.RecursiveCheckpointAdjoint(),
        "stored (checkpoints=4096)": sk.RecursiveCheckpointAdjoint(checkpoints=4096),
        "direct": sk.DirectAdjoint(),
    }
    rows = {}
    for name, adjoint in adjoints.items():
        grad = jax.grad(lambda w, a=adjoint: u(w, a)[0])
        got = np.asarray(jax.jit(jax.vmap(grad))(omegas))
        err = np.abs(got - exact)
        worst = [(int(i), float(err[i])) for i in np.argsort(-err)[:3]]
        rows[name] = worst
        print(f"{name:28s} worst |grad - 2cos(2 omega)|: {worst}", flush=True)
    steps = jax.jit(jax.vmap(lambda w: u(w, sk.DirectAdjoint())[1]))(omegas)
    print("steps per trajectory (plain forward):", np.asarray(steps).tolist())
    # The solve's own error: rtol per radian, twice, at the largest phase 2 omega.
    bound = 2 * 1e-5 * 2 * args.hi
    print(f"bound from rtol and the phase: {bound:.2g}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        info = {
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "optimized": args.optimized,
            "omegas": [args.lo, args.hi, args.n],
            "worst": rows,
            "bound": bound,
        }
        (args.out / "round_off.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
