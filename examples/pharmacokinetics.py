"""Fit a pharmacokinetic model to concentrations measured under repeated oral doses.

A one-compartment model with first-order absorption: a dose goes into the gut, is
absorbed with rate `ka` into the central compartment (volume `V`), and is eliminated
with clearance `CL`:

    d(gut)/dt     = -ka gut
    d(central)/dt =  ka gut - (CL / V) central,      concentration C = central / V

Three patients take different regimens (100 mg every 8 h, 150 mg every 12 h, 300 mg
every 24 h, six doses each, from t = 0); their concentrations are measured at a few
times over 72 h (synthetic, 10% multiplicative noise). Each solve applies its
patient's doses with `sk.TimedEvent(start=0, interval=..., count=6, amount=...)`
(doses after 72 h are skipped); the three patients are one `jax.vmap`, the vector
field closes over the parameters being fitted and the event over the patient's
integer index into a table of regimens. Adam (optax) fits `log(ka, CL, V)` by
gradient through the solves, and the fit is checked against the model's analytic
solution (a sum over doses).

Run: `python examples/pharmacokinetics.py [--out DIR] [--steps N] [--quick]`.
It prints the fit and the error against the analytic solution, and writes
`pharmacokinetics.png`.
"""

import argparse
import os
import pathlib

import jax


jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import optax  # noqa: E402
import tqdm  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


NAMES = ("ka [1/h]", "CL [L/h]", "V [L]")
TRUE_PARAMS = jnp.array([1.1, 4.0, 40.0])
INITIAL_GUESS = jnp.array([0.5, 8.0, 20.0])
# The regimens: dose (mg) and interval (h); six doses each, from t = 0.
AMOUNTS = jnp.array([100.0, 150.0, 300.0])
INTERVALS = jnp.array([8.0, 12.0, 24.0])
COUNT = 6
T1 = 72.0
# Sampling times (h): dense after the first dose, where absorption shows.
OBSERVED = jnp.array([0.5, 1.0, 2.0, 4.0, 7.5, 23.5, 25.0, 47.5, 49.0, 71.5])
NOISE = 0.1


def concentrations(params, patient, ts):
    """The central concentration (mg/L) of `patient` at times `ts`."""
    ka, clearance, volume = params

    def rates(t, y, args):
        gut, central = y[0], y[1]
        return jnp.stack([-ka * gut, ka * gut - clearance / volume * central])

    doses = sk.TimedEvent(
        start=0.0,
        interval=INTERVALS[patient],
        count=COUNT,
        amount=jnp.stack([AMOUNTS[patient], 0.0]),  # into the gut
    )
    sol = sk.diffeqsolve(
        sk.ODETerm(rates),
        sk.Tsit5(),
        0.0,
        T1,
        0.1,
        jnp.zeros(2),
        saveat=sk.SaveAt(ts=ts),
        stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-8),
        event=doses,
    )
    return sol.ys[:, 1] / volume


def analytic(params, patient, ts):
    """The same, summed over doses in closed form."""
    ka, clearance, volume = params
    ke = clearance / volume
    times = INTERVALS[patient] * jnp.arange(COUNT)
    since = ts[:, None] - times[None, :]
    given = since > 0  # the value at a dose time is the one just before it
    since = jnp.where(given, since, 0.0)
    each = ka / (ka - ke) * (jnp.exp(-ke * since) - jnp.exp(-ka * since))
    return AMOUNTS[patient] * jnp.where(given, each, 0.0).sum(-1) / volume


PATIENTS = jnp.arange(3)
all_patients = jax.vmap(concentrations, (None, 0, None))


@jax.jit
def loss_and_grad(log_params, data):
    def loss(log_params):
        predicted = all_patients(jnp.exp(log_params), PATIENTS, OBSERVED)
        return jnp.mean((jnp.log(predicted) - jnp.log(data)) ** 2)

    return jax.value_and_grad(loss)(log_params)


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
    steps = args.steps or (3 if args.quick else 300)
    args.out.mkdir(parents=True, exist_ok=True)

    clean = all_patients(TRUE_PARAMS, PATIENTS, OBSERVED)
    exact = jax.vmap(analytic, (None, 0, None))(TRUE_PARAMS, PATIENTS, OBSERVED)
    print(f"solve vs analytic at the true parameters: max relative error "
          f"{float(jnp.max(jnp.abs(clean / exact - 1))):.1e}")  # fmt: skip
    noise = jax.random.normal(jax.random.key(args.seed), clean.shape)
    data = clean * jnp.exp(NOISE * noise)

    optimiser = optax.adam(optax.cosine_decay_schedule(0.1, steps, alpha=0.05))
    log_params = jnp.log(INITIAL_GUESS)
    opt_state = optimiser.init(log_params)
    progress = tqdm.trange(steps, desc="fitting", unit="step")
    for i in progress:
        value, grad = loss_and_grad(log_params, data)
        updates, opt_state = optimiser.update(grad, opt_state)
        log_params = optax.apply_updates(log_params, updates)
        if i % 10 == 0 or i == steps - 1:
            progress.set_postfix(loss=f"{float(value):.3e}")
    fitted = jnp.exp(log_params)
    print(f"loss {float(value):.4e} after {steps} Adam steps")
    print(f"{'':>9} {'true':>8} {'initial':>8} {'fitted':>8}")
    for name, t, g, f in zip(NAMES, TRUE_PARAMS, INITIAL_GUESS, fitted):
        print(f"{name:>9} {float(t):8.3f} {float(g):8.3f} {float(f):8.3f}")

    ts = jnp.linspace(0.0, T1, 721)
    curves_of = jax.jit(all_patients)  # the fitted and the true curves: one program
    curves = curves_of(fitted, PATIENTS, ts)
    exact = jax.vmap(analytic, (None, 0, None))(fitted, PATIENTS, ts)
    print(f"fitted curves vs analytic: max abs error "
          f"{float(jnp.max(jnp.abs(curves - exact))):.1e} mg/L")  # fmt: skip

    fig, axes = plt.subplots(3, 1, figsize=(7, 7.4), sharex=True, layout="constrained")
    truth = curves_of(TRUE_PARAMS, PATIENTS, ts)
    for k, ax in enumerate(axes):
        label = f"{int(AMOUNTS[k])} mg every {int(INTERVALS[k])} h"
        ax.plot(ts, truth[k], "--", color="k", lw=1, label="true")
        ax.plot(ts, curves[k], color=f"C{k}", label="fitted")
        ax.plot(OBSERVED, data[k], "o", color=f"C{k}", label="measured (10% noise)")
        for t in INTERVALS[k] * jnp.arange(COUNT):
            if t < T1:
                ax.axvline(float(t), color="0.85", lw=0.8, zorder=0)
        ax.set_ylabel("concentration [mg/L]")
        ax.set_title(label, fontsize="medium")
    axes[-1].set_xlabel("time [h] (grey: doses)")
    fig.suptitle("Oral dosing, one-compartment model fitted with optax")
    # Below the panels, off the data.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
               ncol=3, fontsize="small")  # fmt: skip
    path = args.out / "pharmacokinetics.png"
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
