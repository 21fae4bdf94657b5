"""Robertson's stiff chemical kinetics (ROBER): solve, check, fit two rate constants.

Three species react with rate constants nine orders of magnitude apart:

    A -> B (k1 = 0.04),   B + B -> C + B (k2 = 3e7),   B + C -> A + C (k3 = 1e4):

    dA/dt = -k1 A + k3 B C
    dB/dt =  k1 A - k2 B^2 - k3 B C
    dC/dt =  k2 B^2.

An explicit solver needs millions of steps to reach t = 1e5; the stiff solvers need a
few hundred. This solves it on a logarithmic time grid with `sk.Rodas5P()`
(Rosenbrock) and `sk.Kvaerno5()` (ESDIRK), PIDController rtol 1e-6, atol 1e-10, in
float64, and compares both with SciPy's Radau at tight tolerances. Then Adam (optax)
fits `k1` and `k3` (closed over by the vector field) to synthetic measurements of the
three species with 5% multiplicative noise, by gradient descent through the Rodas5P
solve.

Run: `python examples/stiff_chemistry.py [--out DIR] [--steps N] [--quick]`.
It prints the solvers' errors and step counts and the fit, and writes
`stiff_chemistry.png`.
"""

import argparse
import os
import pathlib
import time

import jax


jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import scipy.integrate  # noqa: E402
import tqdm  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


NAMES = ("k1", "k2", "k3")
TRUE_RATES = jnp.array([0.04, 3e7, 1e4])
FITTED = jnp.array([0, 2])  # indices of the fitted rates: k1 and k3
INITIAL_GUESS = jnp.array([0.1, 3e7, 3e3])
Y0 = jnp.array([1.0, 0.0, 0.0])
T_END = 1e5
TS = jnp.logspace(-5, 5, 81)  # the plot grid
T_OBS = jnp.logspace(-4, 5, 19)  # the measurement times
NOISE = 0.05
SOLVERS = {"Rodas5P": sk.Rodas5P(), "Kvaerno5": sk.Kvaerno5()}


def field(rates):
    """The ROBER vector field, closing over `rates = (k1, k2, k3)`."""
    k1, k2, k3 = rates[0], rates[1], rates[2]

    def vector_field(t, y, args):
        a, b, c = y[0], y[1], y[2]
        return jnp.stack(
            [-k1 * a + k3 * b * c, k1 * a - k2 * b**2 - k3 * b * c, k2 * b**2]
        )

    return vector_field


def solve(rates, ts, solver):
    """The concentrations at times `ts` (rows), and the solution's statistics."""
    sol = sk.diffeqsolve(
        sk.ODETerm(field(rates)),
        solver,
        t0=0.0,
        t1=T_END,
        dt0=1e-6,
        y0=Y0,
        saveat=sk.SaveAt(ts=ts),
        stepsize_controller=sk.PIDController(rtol=1e-6, atol=1e-10),
        max_steps=4096,
    )
    return sol.ys, sol.stats["num_accepted_steps"], sol.stats["num_rejected_steps"]


def radau(ts, rtol=1e-10, atol=1e-14):
    """SciPy's Radau IIA (order 5) reference at times `ts`."""
    f = jax.jit(field(TRUE_RATES))
    jac = jax.jit(jax.jacfwd(f, argnums=1))
    out = scipy.integrate.solve_ivp(
        lambda t, y: np.asarray(f(t, y, None)),
        (0.0, T_END),
        np.asarray(Y0),
        method="Radau",
        t_eval=np.asarray(ts),
        rtol=rtol,
        atol=atol,
        jac=lambda t, y: np.asarray(jac(t, y, None)),
    )
    return out.y.T, out.nfev


def compare(args) -> tuple[dict, dict]:
    """Solve with each stiff solver and SciPy's Radau; print the differences.
    Returns the solutions and each solver's compiled solve (a function of the
    rates)."""
    reference, nfev = radau(TS)
    print(f"SciPy Radau (rtol 1e-10, atol 1e-14): {nfev} function evaluations")
    solutions, runs = {}, {}
    for name, solver in SOLVERS.items():
        run = runs[name] = jax.jit(
            lambda rates, solver=solver: solve(rates, TS, solver)
        )
        ys, accepted, rejected = run(TRUE_RATES)  # compiles
        start = time.perf_counter()
        jax.block_until_ready(run(TRUE_RATES))
        seconds = time.perf_counter() - start
        # Relative error per species, where the species is above 1e-7 (1000 atol).
        err = jnp.abs(ys - reference) / jnp.maximum(jnp.abs(reference), 1e-7)
        print(
            f"{name:>9}: {int(accepted)} steps ({int(rejected)} rejected), "
            f"{1e3 * seconds:.1f} ms; max relative difference from Radau per "
            "species " + ", ".join(f"{float(e):.1e}" for e in jnp.max(err, axis=0))
        )
        solutions[name] = ys
    return {"Radau": reference, **solutions}, runs


def fit(data, steps):
    """Adam on the logarithms of k1 and k3, through the Rodas5P solve."""

    def rates_of(log_fitted):
        return TRUE_RATES.at[FITTED].set(jnp.exp(log_fitted))

    def loss(log_fitted):
        ys, _, _ = solve(rates_of(log_fitted), T_OBS, SOLVERS["Rodas5P"])
        # Relative errors: the species span ten orders of magnitude.
        return jnp.mean((jnp.log(ys) - jnp.log(data)) ** 2)

    optimiser = optax.adam(optax.cosine_decay_schedule(0.1, steps, alpha=0.05))

    @jax.jit
    def step(log_fitted, opt_state):
        value, grad = jax.value_and_grad(loss)(log_fitted)
        updates, opt_state = optimiser.update(grad, opt_state)
        return optax.apply_updates(log_fitted, updates), opt_state, value

    log_fitted = jnp.log(INITIAL_GUESS[FITTED])
    opt_state = optimiser.init(log_fitted)
    progress = tqdm.trange(steps, desc="fitting k1, k3", unit="step")
    for i in progress:
        log_fitted, opt_state, value = step(log_fitted, opt_state)
        if i % 10 == 0 or i == steps - 1:
            progress.set_postfix(loss=f"{float(value):.3e}")
    print(f"loss {float(value):.4e} after {steps} Adam steps")
    return rates_of(log_fitted)


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
    steps = args.steps or (3 if args.quick else 150)
    args.out.mkdir(parents=True, exist_ok=True)

    solutions, runs = compare(args)

    clean = solve(TRUE_RATES, T_OBS, SOLVERS["Rodas5P"])[0]
    noise = jax.random.normal(jax.random.key(args.seed), clean.shape)
    data = clean * jnp.exp(NOISE * noise)
    fitted = fit(data, steps)
    print(f"{'':>4} {'true':>9} {'initial':>9} {'fitted':>9}")
    for i in FITTED.tolist():
        print(
            f"{NAMES[i]:>4} {float(TRUE_RATES[i]):9.4g} "
            f"{float(INITIAL_GUESS[i]):9.4g} {float(fitted[i]):9.4g}"
        )
    fitted_ys = runs["Rodas5P"](fitted)[0]  # compiled in `compare`
    plot(args.out / "stiff_chemistry.png", solutions, data, fitted_ys)


def plot(path, solutions, data, fitted_ys) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "Radau": ("-", 4, 0.35),
        "Rodas5P": ("--", 1.5, 1),
        "Kvaerno5": (":", 2, 1),
    }
    for name, ys in solutions.items():
        line, width, alpha = styles[name]
        for j, species in enumerate("ABC"):
            left.loglog(
                TS,
                jnp.abs(ys[:, j]),
                line,
                lw=width,
                alpha=alpha,
                color=f"C{j}",
                label=f"{species} ({name})" if name != "Kvaerno5" or j == 0 else None,
            )
    left.set_xlabel("t")
    left.set_ylabel("concentration")
    left.set_title("ROBER: Rodas5P, Kvaerno5 and SciPy Radau")
    left.legend(fontsize="x-small", ncol=3)
    for j, species in enumerate("ABC"):
        right.loglog(T_OBS, data[:, j], "o", ms=4, color=f"C{j}", label=species)
        right.loglog(TS, fitted_ys[:, j], "-", color=f"C{j}")
    right.set_xlabel("t")
    right.set_title("Measurements (5% noise) and the fit of k1, k3")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
