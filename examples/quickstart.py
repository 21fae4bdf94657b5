"""solverkit in two minutes: closures that JAX's own tools get wrong, made safe.

Part 1 replays JAX issue 21116: a function closes over a value that `jax.vmap` is
batching, it is traced to a jaxpr, and the jaxpr is evaluated again. Whether the
closed-over tracer lands in the jaxpr's constants or its inputs has changed between
JAX versions; `sk.closure_convert` hoists it (and every other closed-over value, of
any dtype) into `closed.consts`, so the same three lines work on every JAX.

Part 2 solves an ODE whose vector field closes over a differentiated float `theta`
and a vmapped integer `k` that indexes a table, and differentiates it with the
continuous adjoint `sk.BacksolveAdjoint()`, checked against the discretise-then-
optimise `sk.RecursiveCheckpointAdjoint()`. (diffrax's `BacksolveAdjoint` raises
`CustomVJPException` here: it cannot differentiate a closed-over value.)

Run: `python examples/quickstart.py [--out DIR] [--quick]`.
"""

import argparse
import os
import pathlib

import jax
import jax.numpy as jnp
import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


def jax_issue_21116() -> jax.Array:
    """Trace a closure over a vmapped integer, then evaluate its jaxpr."""

    def run(k: jax.Array) -> jax.Array:
        g = lambda x: x + k  # `k` is a vmap tracer of integer dtype
        # On JAX 0.4.27, `jax.make_jaxpr(g)` moved `k` from the jaxpr's consts to its
        # inputs, and evaluating the jaxpr with its consts failed.
        x = jnp.array(1)
        closed = sk.closure_convert(g, x)
        # Every closed-over value is an explicit input of the jaxpr now, so the
        # jaxpr can be evaluated (or passed through any JAX transformation) anywhere.
        (out,) = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)
        assert out.dtype == closed.consts[0].dtype == jnp.arange(2).dtype
        return out

    return jax.vmap(run)(jnp.arange(2))


# Stiffnesses, picked per trajectory by an integer index the vector field closes over.
TABLE = jnp.array([0.5, 1.0, 2.0, 4.0])
TS = jnp.linspace(0.0, 10.0, 201)


def oscillator(theta: jax.Array, k: jax.Array, adjoint, ts: jax.Array = TS):
    """A damped oscillator whose damping `theta` and stiffness `TABLE[k]` are closed
    over by the vector field (neither is passed through `args`)."""

    def vector_field(t, y, args):
        position, velocity = y
        return velocity, -TABLE[k] * position - theta * velocity

    y0 = (jnp.array(1.0), jnp.array(0.0))
    return sk.diffeqsolve(
        sk.ODETerm(vector_field),
        sk.Tsit5(),
        t0=ts[0],
        t1=ts[-1],
        dt0=0.05,
        y0=y0,
        saveat=sk.SaveAt(ts=ts),
        stepsize_controller=sk.PIDController(rtol=1e-7, atol=1e-7),
        adjoint=adjoint,
    )


def loss(theta: jax.Array, k: jax.Array, adjoint) -> jax.Array:
    """Energy left at the final time."""
    sol = oscillator(theta, k, adjoint, ts=TS[jnp.array([0, -1])])
    position, velocity = sol.ys
    return 0.5 * (TABLE[k] * position[-1] ** 2 + velocity[-1] ** 2)


@jax.jit
def gradients(theta: jax.Array, ks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """d(loss)/d(theta) for every k at once, with both adjoints."""
    per_k = lambda adjoint: jax.vmap(lambda k: jax.grad(loss)(theta, k, adjoint))(ks)
    return per_k(sk.BacksolveAdjoint()), per_k(sk.RecursiveCheckpointAdjoint())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="a few seconds' smoke run (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print("JAX", jax.__version__)
    print("1. JAX issue 21116, vmap over jnp.arange(2):", jax_issue_21116())

    theta = jnp.array(0.3)
    ks = jnp.arange(2 if args.quick else len(TABLE))
    backsolve, checkpoint = gradients(theta, ks)
    print(f"2. d(energy at t={float(TS[-1]):g})/d(theta), one value per k:")
    print("   BacksolveAdjoint           ", backsolve)
    print("   RecursiveCheckpointAdjoint ", checkpoint)
    assert jnp.allclose(backsolve, checkpoint, rtol=1e-3, atol=1e-5)
    print("   the two adjoints agree.")

    sol = jax.vmap(lambda k: oscillator(theta, k, sk.RecursiveCheckpointAdjoint()))(ks)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, k in enumerate(ks):
        ax.plot(TS, sol.ys[0][i], label=f"k={int(k)}, stiffness {float(TABLE[k])}")
    ax.set(
        xlabel="t",
        ylabel="position",
        title=f"Damped oscillators, theta = {float(theta):g}",
    )
    ax.legend()
    fig.tight_layout()
    path = args.out / "quickstart.png"
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
