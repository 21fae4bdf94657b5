"""Train a neural ODE on spiral trajectories.

The data are 2-D trajectories of a damped nonlinear oscillator,
`dy/dt = A tanh(y)`, whose phase portrait is a spiral. A small equinox MLP is the
vector field; it is trained with optax (Adam) to reproduce whole trajectories from
their initial points. The vector field closes over the MLP being trained, so any
adjoint can differentiate with respect to its weights.

Run: `python examples/neural_ode.py [--out DIR] [--steps N]
[--adjoint recursive|backsolve] [--quick]`. Writes `neural_ode.png`.
"""

import argparse
import os
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import optax
import tqdm


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


A = jnp.array([[-0.3, -1.5], [1.5, -0.3]])
TS = jnp.linspace(0.0, 6.0, 60)
ADJOINTS = {
    "recursive": sk.RecursiveCheckpointAdjoint(),
    "backsolve": sk.BacksolveAdjoint(),
}


def solve(vector_field, y0: jax.Array, adjoint, rtol: float) -> jax.Array:
    """`y0`'s trajectory at times `TS`, shape `(len(TS), 2)`."""
    sol = sk.diffeqsolve(
        sk.ODETerm(vector_field),
        sk.Tsit5(),
        t0=TS[0],
        t1=TS[-1],
        dt0=0.1,
        y0=y0,
        saveat=sk.SaveAt(ts=TS),
        stepsize_controller=sk.PIDController(rtol=rtol, atol=1e-6),
        adjoint=adjoint,
    )
    return sol.ys


def true_vector_field(t, y, args):
    return A @ jnp.tanh(y)


@eqx.filter_jit
def rollout(vector_field, y0s: jax.Array, rtol: float, adjoint) -> jax.Array:
    """Trajectories of every initial point, shape `(len(y0s), len(TS), 2)`."""
    return jax.vmap(lambda y0: solve(vector_field, y0, adjoint, rtol))(y0s)


def initial_points(key: jax.Array, size: int) -> jax.Array:
    """`size` points in the annulus 0.5 < |y| < 2."""
    radius_key, angle_key = jax.random.split(key)
    radius = jax.random.uniform(radius_key, (size,), minval=0.5, maxval=2.0)
    angle = jax.random.uniform(angle_key, (size,), maxval=2 * jnp.pi)
    return radius[:, None] * jnp.stack([jnp.cos(angle), jnp.sin(angle)], axis=-1)


class NeuralVectorField(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array, width: int = 64):
        self.mlp = eqx.nn.MLP(2, 2, width, depth=2, activation=jax.nn.softplus, key=key)

    def __call__(self, t, y, args):
        return self.mlp(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--steps", type=int, default=None, help="Adam steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adjoint", choices=sorted(ADJOINTS), default="recursive")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="a few seconds' smoke run (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 1500)
    adjoint = ADJOINTS[args.adjoint]
    args.out.mkdir(parents=True, exist_ok=True)

    data_key, model_key, batch_key = jax.random.split(jax.random.key(args.seed), 3)
    y0s = initial_points(data_key, 256)
    ys = rollout(true_vector_field, y0s, 1e-7, sk.RecursiveCheckpointAdjoint())
    model = NeuralVectorField(model_key)
    optimiser = optax.adam(optax.cosine_decay_schedule(1e-2, steps, alpha=0.05))
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

    def loss(model: NeuralVectorField, y0s: jax.Array, ys: jax.Array) -> jax.Array:
        # `model` is a grad tracer here; the vector field closes over it.
        vector_field = lambda t, y, args: model(t, y, args)
        pred = jax.vmap(lambda y0: solve(vector_field, y0, adjoint, 1e-3))(y0s)
        return jnp.mean((pred - ys) ** 2)

    @eqx.filter_jit
    def step(model, opt_state, key):
        index = jax.random.choice(key, len(y0s), (args.batch,), replace=False)
        value, grads = eqx.filter_value_and_grad(loss)(model, y0s[index], ys[index])
        updates, opt_state = optimiser.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, value

    progress = tqdm.trange(steps, desc="training", unit="step")
    for i, key in zip(progress, jax.random.split(batch_key, steps)):
        model, opt_state, value = step(model, opt_state, key)
        if i % 10 == 0 or i == steps - 1:
            progress.set_postfix(loss=f"{float(value):.3e}")
    print(f"loss {float(value):.4e} (batch of {args.batch}) after {steps} steps")

    # Three of the training trajectories, reproduced from their initial points.
    exact, learned = ys[:3], rollout(model, y0s[:3], 1e-3, adjoint)
    fig, ax = plt.subplots(figsize=(5, 5))
    for i, (e, p) in enumerate(zip(exact, learned)):
        ax.plot(e[:, 0], e[:, 1], "-", color=f"C{i}", alpha=0.5, lw=3)
        ax.plot(p[:, 0], p[:, 1], "--", color=f"C{i}")
    ax.plot(ys[3:20, :, 0].T, ys[3:20, :, 1].T, color="0.85", lw=0.8, zorder=0)
    ax.set(
        xlabel="y[0]",
        ylabel="y[1]",
        aspect="equal",
        title="Neural ODE: truth (thick) vs learned (dashed)",
    )
    fig.tight_layout()
    path = args.out / "neural_ode.png"
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
