"""Fit a bouncing ball's coefficient of restitution to the times of its bounces.

A ball is dropped from a height `H0 = 2 m` and bounces on the floor; each impact
reverses its velocity and scales it by the coefficient of restitution `e`:

    dh/dt = v,   dv/dt = -g,        at h = 0 (falling):  v -> -e v.

The impact is an `sk.Event` with an `effect`: where the height crosses zero
downwards, the solve lands a step exactly on the crossing, applies the effect and
continues; the impact times are recorded in `sol.events.ts`. `terminal=8` stops the
solve at the eighth impact (before its effect), whatever `e`.

A microphone records the first eight impacts ("clicks") of a ball with `e = 0.8`,
with 3 ms of timing noise (synthetic). Gradient descent (optax) fits `e`, starting
from `e = 0.5`, by `jax.grad` of the squared error of the impact times through the
solve: the event times are differentiated by the implicit function theorem, the
effect like any function, and `e` is closed over by the effect.

Everything is checked against the exact solution: the k-th impact is at
`t_k = t_1 (1 + 2 (e + e^2 + ... + e^(k-1)))`, `t_1 = sqrt(2 H0 / g)` (each bounce
lasts `2 v_k / g` with `v_k = e^k g t_1`), so the gradient at the initial guess and
the least-squares `e` (a root of a polynomial) are known exactly.

Run: `python examples/bouncing_ball.py [--out DIR] [--steps N] [--quick]`.
It prints the checks and the fit, and writes `bouncing_ball.png`.
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
import tqdm  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


G = 9.81  # m/s^2
H0 = 2.0  # drop height, m
TRUE_E = 0.8
INITIAL_E = 0.5
N_IMPACTS = 8  # impacts recorded
NOISE = 3e-3  # s, timing noise of the recording
T_BOUND = 60.0  # a bound: `terminal` ends each solve at its last impact
LEARNING_RATE = 5e-3


def solve(e, impacts=N_IMPACTS, saveat=None, adjoint=None):
    """The ball dropped from `H0`, up to its `impacts`-th impact."""
    impact = sk.Event(
        lambda t, y, args: y[0],  # the height
        direction=False,  # falling through the floor
        effect=lambda t, y, args: jnp.stack([y[0], -e * y[1]]),  # closes over e
        terminal=impacts,  # stop at this impact, before its effect
        max_events=impacts,
    )
    return sk.diffeqsolve(
        sk.ODETerm(lambda t, y, args: jnp.stack([y[1], jnp.full_like(y[1], -G)])),
        sk.Tsit5(),
        t0=0.0,
        t1=T_BOUND,
        dt0=0.01,
        y0=jnp.array([H0, 0.0]),
        event=impact,
        stepsize_controller=sk.PIDController(rtol=1e-10, atol=1e-10),
        saveat=saveat or sk.SaveAt(t1=True),
        adjoint=adjoint or sk.RecursiveCheckpointAdjoint(),
    )


def impact_times(e, adjoint=None):
    """The times of the first `N_IMPACTS` impacts, from the solve."""
    return solve(e, adjoint=adjoint).events.ts


def loss_fn(adjoint=None):
    def loss(e, data):
        return jnp.mean((impact_times(e, adjoint) - data) ** 2)

    return jax.jit(jax.value_and_grad(loss))


# --- the exact solution ---------------------------------------------------------------

T1 = np.sqrt(2 * H0 / G)  # the first impact
P = np.polynomial.Polynomial


def exact_times(e, n=N_IMPACTS):
    """`t_k = t_1 (1 + 2 (e + ... + e^(k-1)))`, `k = 1..n`."""
    return T1 * (1 + 2 * np.concatenate([[0.0], np.cumsum(e ** np.arange(1, n))]))


def exact_loss(data) -> np.polynomial.Polynomial:
    """The loss as a polynomial in `e`."""
    times = [
        T1 * (1 + 2 * sum((P.basis(j) for j in range(1, k)), P([0.0])))
        for k in range(1, N_IMPACTS + 1)
    ]
    return sum((t - d) ** 2 for t, d in zip(times, np.asarray(data))) / len(times)


def least_squares_e(data) -> float:
    """The `e` that minimises the loss: a real root of its derivative."""
    loss = exact_loss(data)
    roots = loss.deriv().roots()
    roots = roots[np.isreal(roots)].real
    roots = roots[(roots > 0) & (roots < 1)]
    return float(roots[np.argmin(loss(roots))])


def check_gradients(data):
    """The loss gradient at the initial guess, from both adjoints and exactly;
    returns the checkpointed one, compiled."""
    exact = exact_loss(data).deriv()(INITIAL_E)
    print(f"d loss / d e at e = {INITIAL_E}:")
    print(f"  {'exact':>26}: {exact: .12e}")
    for adjoint in (sk.RecursiveCheckpointAdjoint(), sk.DirectAdjoint()):
        value_and_grad = loss_fn(adjoint)
        e = jnp.float64(INITIAL_E)
        jax.block_until_ready(value_and_grad(e, data))  # compiles
        seconds = float("inf")
        for _ in range(20):  # the best of 20 runs: the machine may be busy
            start = time.perf_counter()
            _, grad = jax.block_until_ready(value_and_grad(e, data))
            seconds = min(seconds, time.perf_counter() - start)
        print(
            f"  {type(adjoint).__name__:>26}: {float(grad): .12e}  (relative "
            f"error {abs(float(grad) / exact - 1):.1e}, {1e3 * seconds:.2f} ms)"
        )
        if isinstance(adjoint, sk.RecursiveCheckpointAdjoint):
            checkpointed = value_and_grad
    return checkpointed


def fit(value_and_grad, data, steps):
    """Gradient descent on `e` through the solve."""
    optimiser = optax.sgd(LEARNING_RATE)
    e = jnp.float64(INITIAL_E)  # not weakly typed, as the updated e: one compile
    opt_state = optimiser.init(e)
    history = [float(e)]
    progress = tqdm.trange(steps, desc="fitting e", unit="step")
    for i in progress:
        value, grad = value_and_grad(e, data)
        updates, opt_state = optimiser.update(grad, opt_state)
        e = optax.apply_updates(e, updates)
        history.append(float(e))
        if i % 10 == 0 or i == steps - 1:
            progress.set_postfix(loss=f"{float(value):.3e}", e=f"{float(e):.6f}")
    print(f"loss {float(value):.4e} after {steps} gradient-descent steps")
    return float(e), history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--steps", type=int, default=None, help="descent steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="a few seconds' smoke run (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 60)
    args.out.mkdir(parents=True, exist_ok=True)

    run = jax.jit(impact_times)
    clean = run(TRUE_E)
    error = float(jnp.max(jnp.abs(clean - exact_times(TRUE_E))))
    print(f"impact times at e = {TRUE_E}: max error from the exact ones {error:.1e} s")
    noise = jax.random.normal(jax.random.key(args.seed), clean.shape)
    data = clean + NOISE * noise

    value_and_grad = check_gradients(data)
    fitted, history = fit(value_and_grad, data, steps)
    best = least_squares_e(data)
    error = float(jnp.max(jnp.abs(run(fitted) - exact_times(fitted))))
    print(f"{'true e':>24} {TRUE_E:.10f}")
    print(f"{'initial e':>24} {INITIAL_E:.10f}")
    print(f"{'fitted e':>24} {fitted:.10f}")
    print(
        f"{'exact least-squares e':>24} {best:.10f}  (difference {fitted - best:.1e})"
    )
    print(f"impact times at the fitted e: max error from the exact ones {error:.1e} s")
    residuals = 1e3 * (data - run(fitted))
    print("data minus fit (ms): " + ", ".join(f"{float(r):+.1f}" for r in residuals))

    plot(args.out / "bouncing_ball.png", data, fitted, history, best)


def plot(path, data, fitted, history, best) -> None:
    # The plot's solves run on past the data, to the 12th impact.
    ts = jnp.linspace(0.0, 5.6, 1121)
    trajectory = jax.jit(
        lambda e: solve(e, impacts=12, saveat=sk.SaveAt(ts=ts)).ys[:, 0]
    )
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    for e, style, label in [
        (fitted, dict(ls="-", color="C0", lw=2.5), f"fitted, e = {fitted:.4f}"),
        (INITIAL_E, dict(ls=":", color="C0", alpha=0.6), f"initial, e = {INITIAL_E}"),
        (TRUE_E, dict(ls="--", color="k", lw=1), f"true, e = {TRUE_E}"),
    ]:
        heights = trajectory(e)
        shown = jnp.isfinite(heights)  # past the solve's last impact: inf
        left.plot(ts[shown], heights[shown], **style, label=label)
    left.plot(data, np.zeros_like(data), "v", color="C3", label="recorded impacts")
    left.set_xlabel("t (s)")
    left.set_ylabel("height (m)")
    left.set_title("A bouncing ball: impacts recorded, restitution fitted")
    left.legend(fontsize="small")
    distance = np.abs(np.asarray(history) - best)
    right.semilogy(np.maximum(distance, 1e-17), color="C0")
    right.set_xlabel("gradient-descent step")
    right.set_ylabel("|e - exact least-squares e|")
    right.set_title("Fitting e through the events")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
