"""Fit a pharmacokinetic model driven by a measured dosing signal.

A drug is given by intravenous infusion at a rate that is only known at sample times
(every half hour, from a pump log), so the rate is a `sk.CubicInterpolation` of the
log. The drug moves between a central compartment (blood, where its concentration is
measured) and a peripheral one (tissue), and is eliminated from the blood:

    dA_c/dt = u(t) - (k_e + k_cp) A_c + k_pc A_p
    dA_p/dt = k_cp A_c - k_pc A_p,          concentration C = A_c / V.

From 24 noisy concentration measurements (10% multiplicative noise, synthetic), Adam
(optax) fits the four parameters k_e, k_cp, k_pc, V by gradient descent through
`sk.diffeqsolve`. The vector field closes over both the parameters being fitted and
the interpolated dosing signal; no `args` plumbing is needed.

Run: `python examples/forced_system.py [--out DIR] [--steps N] [--quick]`.
It prints the true and fitted parameters and writes `forced_system.png`.
"""

import argparse
import os
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import optax
import tqdm


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


NAMES = ("k_e", "k_cp", "k_pc", "V")
TRUE_PARAMS = jnp.array([0.3, 0.8, 0.4, 12.0])  # 1/h, 1/h, 1/h, litres
INITIAL_GUESS = jnp.array([0.6, 0.3, 0.8, 6.0])
T_END = 24.0  # hours
PUMP_TS = jnp.linspace(0.0, T_END, 49)  # the pump logs its rate every 30 minutes
T_OBS = jnp.linspace(0.5, T_END, 24)  # one blood sample an hour
TS = jnp.linspace(0.0, T_END, 241)  # for the plot
NOISE = 0.1


def pump_rate(t: jax.Array) -> jax.Array:
    """The infusion rate (mg/h): a loading dose, then two maintenance infusions."""
    loading = 30.0 * jnp.exp(-(((t - 1.5) / 0.8) ** 2))
    maintenance = 8.0 * (jax.nn.sigmoid(4 * (t - 6)) - jax.nn.sigmoid(4 * (t - 10)))
    second = 8.0 * (jax.nn.sigmoid(4 * (t - 14)) - jax.nn.sigmoid(4 * (t - 18)))
    return loading + maintenance + second


def dosing() -> sk.CubicInterpolation:
    """The pump log as a smooth function of time: a backward Hermite cubic."""
    rates = pump_rate(PUMP_TS)
    return sk.CubicInterpolation(
        PUMP_TS, sk.backward_hermite_coefficients(PUMP_TS, rates)
    )


def concentration(params: jax.Array, drive: sk.CubicInterpolation, ts: jax.Array):
    """Blood concentration (mg/l) at times `ts`."""
    k_e, k_cp, k_pc, volume = params

    def vector_field(t, amounts, args):
        central, peripheral = amounts
        return jnp.stack(
            [
                drive.evaluate(t) - (k_e + k_cp) * central + k_pc * peripheral,
                k_cp * central - k_pc * peripheral,
            ]
        )

    sol = sk.diffeqsolve(
        sk.ODETerm(vector_field),
        sk.Tsit5(),
        t0=0.0,
        t1=T_END,
        dt0=None,
        y0=jnp.zeros(2),
        saveat=sk.SaveAt(ts=ts),
        # The dosing signal has kinks at the pump's sample times: step to them.
        stepsize_controller=sk.ClipStepSizeController(
            sk.PIDController(rtol=1e-6, atol=1e-6), step_ts=PUMP_TS
        ),
        max_steps=1024,
    )
    return sol.ys[:, 0] / volume


@jax.jit
def predict(params: jax.Array, ts: jax.Array) -> jax.Array:
    return concentration(params, dosing(), ts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--steps", type=int, default=None, help="Adam steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="a few seconds' smoke run (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 600)
    args.out.mkdir(parents=True, exist_ok=True)

    clean = predict(TRUE_PARAMS, T_OBS)
    noise = jax.random.normal(jax.random.key(args.seed), clean.shape)
    data = clean * (1 + NOISE * noise)

    # Fit the logarithms, so that the parameters stay positive; relative errors,
    # since concentrations span two orders of magnitude.
    def loss(log_params: jax.Array) -> jax.Array:
        pred = concentration(jnp.exp(log_params), dosing(), T_OBS)
        return jnp.mean((jnp.log(pred) - jnp.log(data)) ** 2)

    optimiser = optax.adam(optax.cosine_decay_schedule(0.05, steps, alpha=0.05))

    @jax.jit
    def step(log_params, opt_state):
        value, grad = jax.value_and_grad(loss)(log_params)
        updates, opt_state = optimiser.update(grad, opt_state)
        return optax.apply_updates(log_params, updates), opt_state, value

    log_params = jnp.log(INITIAL_GUESS)
    opt_state = optimiser.init(log_params)
    progress = tqdm.trange(steps, desc="fitting", unit="step")
    for i in progress:
        log_params, opt_state, value = step(log_params, opt_state)
        if i % 10 == 0 or i == steps - 1:
            progress.set_postfix(loss=f"{float(value):.3e}")
    fitted = jnp.exp(log_params)

    print(f"loss {float(value):.4e} after {steps} Adam steps")
    print(f"{'':>6} {'true':>8} {'initial':>8} {'fitted':>8}")
    for name, t, g, f in zip(NAMES, TRUE_PARAMS, INITIAL_GUESS, fitted):
        print(f"{name:>6} {float(t):8.3f} {float(g):8.3f} {float(f):8.3f}")

    plot(args.out / "forced_system.png", data, fitted)


def plot(path: pathlib.Path, data: jax.Array, fitted: jax.Array) -> None:
    drive = dosing()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    top.plot(TS, jax.vmap(drive.evaluate)(TS), "-", color="C2", label="interpolated")
    top.plot(PUMP_TS, pump_rate(PUMP_TS), ".", color="C2", label="pump log")
    top.set_ylabel("infusion rate (mg/h)")
    top.legend(fontsize="small")
    top.set_title("Two-compartment model driven by a CubicInterpolation of the dose")
    bottom.plot(T_OBS, data, "o", ms=4, color="C0", label="measured")
    bottom.plot(TS, predict(fitted, TS), "-", color="C0", label="fitted")
    bottom.plot(
        TS,
        predict(INITIAL_GUESS, TS),
        ":",
        color="C0",
        alpha=0.6,
        label="initial guess",
    )
    bottom.set_ylabel("concentration (mg/l)")
    bottom.set_xlabel("t (hours)")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
