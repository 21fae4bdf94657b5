"""Train a population of spiking neurons by gradient through their spike times.

Eight leaky integrate-and-fire neurons listen to the same four input currents
`I_c(t)` (slow sine waves), each through its own row of a weight table `W`:

    tau dv_k/dt = -v_k + sum_c W[k, c] I_c(t),      at v_k = 1 (rising):  v_k -> 0.

The spike is an `sk.Event` with an `effect` (the reset) and `terminal=False`: the
solve lands a step exactly on each threshold crossing, resets the potential and goes
on; the spike times are in `sol.events.ts[:sol.events.num]`, padded with `inf` to
`max_events` entries. The population is a `jax.vmap` over the neuron's index `k`, an
integer: the vector field closes over that traced index and over the table `W`
being trained, and the gradient reaches `W` through the closure.

The targets are the first five spike times of each neuron under a teacher table
`W_true`. Adam (optax) trains `W` from a random table by gradient of the squared
spike-time errors through the solve (spike times are differentiated by the implicit
function theorem); entries past `num` are masked out of the loss. Spike times depend
on the weights mostly through their sum, an ill-conditioned problem on which Adam
slows down; a few Levenberg-Marquardt steps, with the Jacobian of the spike times
(`jax.jacrev` through the events), then recover the teacher's weights exactly.

Run: `python examples/spiking_neurons.py [--out DIR] [--steps N] [--dtmax MS]
[--quick]`.
It prints a finite-difference check of the gradient and the spike-time errors before
and after training, and writes `spiking_neurons.png`.
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


N_NEURONS = 8
N_INPUTS = 4
TAU = 10.0  # ms, membrane time constant
T_END = 60.0  # ms
PERIODS = jnp.array([23.0, 37.0, 51.0, 79.0])  # ms, of the input currents
PHASES = jnp.array([0.0, 1.3, 2.9, 4.4])
AMPLITUDE = 0.6
N_TARGET = 5  # spikes per neuron fitted
MAX_SPIKES = 24  # recorded per neuron (Event(max_events=...))
NEURONS = jnp.arange(N_NEURONS)
DT_MAX = np.inf  # ms, an optional cap on the step size (`--dtmax`)


def inputs(t):
    """The input currents at time `t`, one per channel."""
    return 1.0 + AMPLITUDE * jnp.sin(2 * jnp.pi * t / PERIODS + PHASES)


def neuron(weights, k, saveat=None):
    """Neuron `k`, driven through row `k` of `weights`, from rest over `T_END`."""

    def vector_field(t, v, args):
        # Closes over the table being trained and over the (vmapped) integer k.
        return (-v + weights[k] @ inputs(t)) / TAU

    spike = sk.Event(
        lambda t, v, args: v - 1.0,  # the threshold
        direction=True,  # rising through it
        effect=lambda t, v, args: jnp.zeros_like(v),  # reset
        terminal=False,  # spike on
        max_events=MAX_SPIKES,
    )
    return sk.diffeqsolve(
        sk.ODETerm(vector_field),
        sk.Tsit5(),
        t0=0.0,
        t1=T_END,
        dt0=0.5,
        y0=jnp.asarray(0.0),
        event=spike,
        stepsize_controller=sk.PIDController(
            rtol=1e-8, atol=1e-8, dtmax=DT_MAX if np.isfinite(DT_MAX) else None
        ),
        saveat=saveat or sk.SaveAt(t1=True),
        max_steps=1024,
    )


def spikes(weights):
    """The population's `EventRecord`: `ts`, `(N_NEURONS, MAX_SPIKES)` spike times,
    `inf` past each neuron's last; `ys`, the potentials just before them."""
    return jax.vmap(lambda k: neuron(weights, k).events)(NEURONS)


def spike_times(weights):
    return spikes(weights).ts


def first_spikes(weights):
    return spike_times(weights)[:, :N_TARGET]


def residuals(weights, targets):
    """The errors (ms) of the first spike times, zero where a spike is missing from
    the solve or from the targets."""
    times = first_spikes(weights)
    both = jnp.isfinite(times) & jnp.isfinite(targets)
    # Masked twice: `inf - target` would make the gradient of `where` a NaN.
    return jnp.where(both, jnp.where(both, times, 0.0) - targets, 0.0), both


def loss(weights, targets):
    """The mean squared error (ms^2) over the spikes that occurred both in the solve
    and in the targets."""
    error, both = residuals(weights, targets)
    return jnp.sum(error**2) / jnp.maximum(jnp.sum(both), 1)


def check_gradient(weights, targets, value_and_grad) -> None:
    """The gradient against central finite differences, for three weights."""
    plain = lambda w, targets: value_and_grad(w, targets)[0]
    _, grad = value_and_grad(weights, targets)
    h = 1e-6
    print("d loss / d W[k, c] at the initial table (ms^2 per unit weight):")
    for k, c in [(0, 0), (3, 2), (7, 3)]:
        up = plain(weights.at[k, c].add(h), targets)
        down = plain(weights.at[k, c].add(-h), targets)
        difference = (up - down) / (2 * h)
        print(
            f"  W[{k}, {c}]: gradient {float(grad[k, c]): .8e}, finite difference "
            f"{float(difference): .8e} (relative difference "
            f"{abs(float(grad[k, c] / difference) - 1):.1e})"
        )


def train(weights, targets, steps, value_and_grad):
    """Adam through the spike times."""
    optimiser = optax.adam(optax.cosine_decay_schedule(0.05, steps, alpha=0.05))

    @jax.jit
    def update(weights, grad, opt_state):
        updates, opt_state = optimiser.update(grad, opt_state)
        return optax.apply_updates(weights, updates), opt_state

    def step(weights, opt_state):
        value, grad = value_and_grad(weights, targets)  # compiled already
        return *update(weights, grad, opt_state), value

    opt_state = optimiser.init(weights)
    history = []
    progress = tqdm.trange(steps, desc="training W (Adam)", unit="step")
    for i in progress:
        weights, opt_state, value = step(weights, opt_state)
        history.append(float(value))
        if i % 10 == 0 or i == steps - 1:
            progress.set_postfix(rms=f"{np.sqrt(float(value)):.3e} ms")
    history.append(float(value_and_grad(weights, targets)[0]))
    return weights, history


def refine(weights, targets, steps, times_of):
    """Levenberg-Marquardt on the spike-time errors, with their Jacobian (through
    the events, by `jax.jacrev`)."""

    def error_of(w):  # as `residuals`, with the compiled `times_of`
        times = times_of(w)[:, :N_TARGET]
        both = jnp.isfinite(times) & jnp.isfinite(targets)
        return jnp.where(both, times - targets, 0.0).reshape(-1)

    jacobian_of = jax.jit(jax.jacrev(lambda w: residuals(w, targets)[0].reshape(-1)))
    x = weights.reshape(-1)
    error = error_of(weights)
    damping = 1e-3
    history = []
    for _ in tqdm.trange(steps, desc="refining W (Levenberg-Marquardt)", unit="step"):
        jacobian = jacobian_of(x.reshape(weights.shape)).reshape(error.size, x.size)
        normal = jacobian.T @ jacobian + damping * jnp.eye(x.size)
        candidate = x - jnp.linalg.solve(normal, jacobian.T @ error)
        new_error = error_of(candidate.reshape(weights.shape))
        if jnp.sum(new_error**2) < jnp.sum(error**2):  # accept, trust more
            x, error, damping = candidate, new_error, damping / 3
        else:  # reject, trust less
            damping *= 10
        history.append(float(jnp.mean(error**2)))
    return x.reshape(weights.shape), history


def report(name, weights, true_weights, targets, times, teacher) -> None:
    times, targets, teacher = (
        np.asarray(times),
        np.asarray(targets),
        np.asarray(teacher),
    )
    first = times[:, :N_TARGET]
    both = np.isfinite(first) & np.isfinite(targets)
    error = np.abs(first - targets)[both]
    # All spikes in the window, against the teacher's (which were not trained on).
    same = np.array_equal(np.isfinite(times), np.isfinite(teacher))
    shown = np.isfinite(teacher)
    later = np.max(np.abs(np.where(shown, times, 0) - np.where(shown, teacher, 0)))
    print(
        f"  {name:>8}: {int(both.sum())}/{targets.size} present, RMS "
        f"{np.sqrt(np.mean(error**2)):.1e} ms, max {error.max():.1e} ms; "
        f"max |W - W_true| {float(jnp.max(jnp.abs(weights - true_weights))):.1e}; "
        + (
            f"all {int(np.isfinite(teacher).sum())} spikes in {T_END:g} ms as the "
            f"teacher's to {later:.1e} ms"
            if same
            else f"{int(np.isfinite(times).sum())} spikes in {T_END:g} ms, the "
            f"teacher {int(np.isfinite(teacher).sum())}"
        )
    )


def main() -> None:
    global DT_MAX
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--steps", type=int, default=None, help="Adam steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtmax", type=float, default=DT_MAX, help="step-size cap, ms (inf: none)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="a few seconds' smoke run (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    DT_MAX = args.dtmax
    steps = args.steps or (3 if args.quick else 200)
    # --quick: no Levenberg-Marquardt step (its Jacobian through the events, a
    # jacrev, was a third of the quick run's CPU time;
    # tests/events/test_continuing_events.py's
    # test_gradient_of_later_spike_times_under_an_adaptive_controller checks jacrev
    # through spike times).
    refinements = 0 if args.quick else 8
    args.out.mkdir(parents=True, exist_ok=True)

    teacher_key, student_key = jax.random.split(jax.random.key(args.seed))
    shape = (N_NEURONS, N_INPUTS)
    true_weights = jax.random.uniform(teacher_key, shape, minval=0.2, maxval=0.8)
    weights = jax.random.uniform(student_key, shape, minval=0.2, maxval=0.8)

    record = jax.jit(spikes)
    times_of = lambda w: record(w).ts
    teacher = jax.block_until_ready(record(true_weights))  # compiles
    start = time.perf_counter()
    jax.block_until_ready(record(true_weights))
    print(
        f"teacher: {N_NEURONS} neurons (vmapped) solved in "
        f"{1e3 * (time.perf_counter() - start):.1f} ms"
    )
    teacher, states = teacher.ts, teacher.ys
    targets = teacher[:, :N_TARGET]
    assert bool(jnp.all(jnp.isfinite(targets))), "a teacher neuron spiked too little"
    # The recorded states are those just before each spike: at the threshold.
    gap = jnp.max(jnp.abs(jnp.where(jnp.isfinite(teacher), states - 1.0, 0.0)))
    print(f"  |v - 1| just before its spikes: at most {float(gap):.1e}")

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    check_gradient(weights, targets, value_and_grad)

    before = times_of(weights)
    start = time.perf_counter()
    trained, history = train(weights, targets, steps, value_and_grad)
    print(f"{steps} Adam steps in {time.perf_counter() - start:.1f} s")
    after_adam = times_of(trained)
    start = time.perf_counter()
    refined, polish = refine(trained, targets, refinements, times_of)
    print(
        f"{refinements} Levenberg-Marquardt steps in "
        f"{time.perf_counter() - start:.1f} s"
    )
    after = times_of(refined)
    print(f"errors of the first {N_TARGET} spike times of each neuron:")
    for name, w, times in [
        ("initial", weights, before),
        ("Adam", trained, after_adam),
        ("refined", refined, after),
    ]:
        report(name, w, true_weights, targets, times, teacher)

    plot(
        args.out / "spiking_neurons.png",
        weights,
        refined,
        *(np.asarray(x) for x in (teacher, before, after)),
        history,
        polish,
    )


def plot(path, weights, trained, targets, before, after, history, polish) -> None:
    ts = jnp.linspace(0.0, T_END, 1201)
    trace = jax.jit(lambda w, k: neuron(w, k, saveat=sk.SaveAt(ts=ts)).ys)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, times, title in [
        (axes[0, 0], before, "Spikes before training"),
        (axes[0, 1], after, "Spikes after training (Adam, then LM)"),
    ]:
        for k in range(N_NEURONS):
            target = targets[k][np.isfinite(targets[k])]
            spikes = times[k][np.isfinite(times[k])]
            ax.plot(target, np.full_like(target, k), "|", ms=14, color="0.6")
            ax.plot(spikes, np.full_like(spikes, k), ".", color="C0", ms=7)
            ax.plot(target[:N_TARGET], np.full(N_TARGET, k), "|", ms=14, color="C3")
        ax.set_ylim(-0.7, N_NEURONS + 0.8)  # room for the legend
        ax.set_yticks(range(N_NEURONS))
        ax.set_xlim(0, T_END)
        ax.set_xlabel("t (ms)")
        ax.set_ylabel("neuron")
        ax.set_title(title)
    axes[0, 0].plot([], [], "|", color="C3", label=f"targets (first {N_TARGET})")
    axes[0, 0].plot([], [], "|", color="0.6", label="teacher's later spikes")
    axes[0, 0].plot([], [], ".", color="C0", label="the student's spikes")
    axes[0, 0].legend(fontsize="small", loc="upper center", ncol=3, framealpha=0.9)

    ax = axes[1, 0]
    k = 0
    ax.plot(ts, trace(weights, k), ":", color="C0", alpha=0.7, label="before")
    ax.plot(ts, trace(trained, k), "-", color="C0", label="after")
    for t in targets[k][:N_TARGET]:
        ax.axvline(t, color="C3", lw=0.8)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set_xlabel("t (ms)")
    ax.set_ylabel(f"membrane potential v_{k}")
    ax.set_title(f"Neuron {k}: threshold (dashed), target spikes (red)")
    ax.legend(fontsize="small", loc="lower right")

    ax = axes[1, 1]
    adam = np.arange(len(history))
    ax.semilogy(adam, np.sqrt(history), color="C0", label="Adam")
    refined = np.arange(len(history) - 1, len(history) + len(polish))
    rms = np.sqrt(np.maximum([history[-1], *polish], 1e-30))
    ax.semilogy(refined, rms, "o-", ms=3, color="C3", label="Levenberg-Marquardt")
    ax.set_xlabel("step")
    ax.set_ylabel("RMS spike-time error (ms)")
    ax.set_title("Training through the spike times")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
