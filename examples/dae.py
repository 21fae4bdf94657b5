"""Differential-algebraic equations with a singular mass matrix: ROBER and a pendulum.

A constant mass matrix `M` turns `y' = f(t, y)` into `M y' = f(t, y)`; where `M` has a
zero row the equation is algebraic, `0 = f_i(t, y)`, and the problem is a DAE. The
stiffly accurate Rosenbrock methods `sk.Rodas4` and `sk.Rodas5P` solve those of index
one (`mass_matrix=` a vector for a diagonal `M`, or a matrix).

1. ROBER as a DAE: the third species follows from conservation of mass,
   `0 = y1 + y2 + y3 - 1`, instead of its rate equation. Solved with Rodas5P and
   `M = diag(1, 1, 0)`, and compared with the ODE form.
2. A pendulum of length 1 in index-1 form: positions `(x, y)`, velocities
   `(u, v)`, and the rod's tension `λ` from the twice-differentiated constraint
   `u² + v² - g y - λ (x² + y²) = 0`. The vector field closes over gravity `g`;
   the gradient of the final horizontal position with respect to `g` (through the
   solve) is checked against central finite differences.

Run: `python examples/dae.py [--out DIR] [--quick]`. It prints the differences and
writes `dae.png`.
"""

import argparse
import os
import pathlib

import jax


jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


RATES = jnp.array([0.04, 3e7, 1e4])


def rober(t, y, k):
    """ROBER's three rate equations."""
    return jnp.stack(
        [
            -k[0] * y[0] + k[2] * y[1] * y[2],
            k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
            k[1] * y[1] ** 2,
        ]
    )


def rober_dae(t, y, k):
    """ROBER with the third equation replaced by conservation of mass."""
    return rober(t, y, k).at[2].set(y[0] + y[1] + y[2] - 1)


@jax.jit
def solve_rober(ts):
    """`(ODE form, DAE form)` at times `ts`, with their numbers of steps."""

    def run(field, mass):
        sol = sk.diffeqsolve(
            sk.ODETerm(field),
            sk.Rodas5P(mass_matrix=mass),
            0.0,
            ts[-1],
            1e-6,
            jnp.array([1.0, 0.0, 0.0]),
            RATES,
            saveat=sk.SaveAt(ts=ts),
            stepsize_controller=sk.PIDController(rtol=1e-8, atol=1e-12),
        )
        return sol.ys, sol.stats["num_steps"]

    return run(rober, None), run(rober_dae, jnp.array([1.0, 1.0, 0.0]))


PENDULUM_MASS = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])
THETA0 = 0.9  # initial angle from the vertical


def pendulum_field(g):
    """The pendulum's index-1 vector field, closing over gravity `g`."""

    def field(t, s, args):
        x, y, u, v, lam = s[0], s[1], s[2], s[3], s[4]
        return jnp.stack(
            [
                u,
                v,
                -lam * x,
                -lam * y - g,
                u**2 + v**2 - g * y - lam * (x**2 + y**2),
            ]
        )

    return field


def pendulum_y0(g):
    """A consistent start: at rest at angle `THETA0`, tension `g cos(THETA0)`."""
    x, y = jnp.sin(THETA0), -jnp.cos(THETA0)
    return jnp.stack([x, y, 0.0 * g, 0.0 * g, -g * y])


def solve_pendulum(g, ts):
    sol = sk.diffeqsolve(
        sk.ODETerm(pendulum_field(g)),
        sk.Rodas5P(mass_matrix=PENDULUM_MASS),
        0.0,
        ts[-1],
        1e-3,
        pendulum_y0(g),
        saveat=sk.SaveAt(ts=ts),
        stepsize_controller=sk.PIDController(rtol=1e-9, atol=1e-11),
    )
    return sol.ys


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

    # 1. ROBER: the DAE against the ODE form.
    ts = jnp.logspace(-5, 3 if args.quick else 5, 41 if args.quick else 81)
    (ode, ode_steps), (dae, dae_steps) = solve_rober(ts)
    rel = jnp.max(jnp.abs(dae - ode) / jnp.maximum(jnp.abs(ode), 1e-10), axis=0)
    print(f"ROBER, Rodas5P: ODE form {int(ode_steps)} steps, DAE {int(dae_steps)}")
    print(
        "max relative difference DAE vs ODE per species: "
        + ", ".join(f"{float(r):.1e}" for r in rel)
    )
    drift = jnp.max(jnp.abs(jnp.sum(dae, axis=1) - 1))
    print(f"max |y1 + y2 + y3 - 1| along the DAE solution: {float(drift):.1e}")

    # 2. The pendulum, and d x(T) / d g against central differences.
    t_end = 2.0 if args.quick else 10.0
    pts = jnp.linspace(0.0, t_end, 201)
    g = jnp.asarray(9.81)

    def final_x(g):
        path = solve_pendulum(g, pts)
        return path[-1, 0], path

    # One program: x(T), its gradient, and the path (plotted below).
    value_and_grad = jax.jit(jax.value_and_grad(final_x, has_aux=True))
    (_, path), grad = value_and_grad(g)
    eps = 1e-6
    plus, minus = value_and_grad(g + eps)[0][0], value_and_grad(g - eps)[0][0]
    fd = (plus - minus) / (2 * eps)
    print(
        f"pendulum: d x({t_end:g}) / d g = {float(grad):.8f} (through the solve), "
        f"{float(fd):.8f} (central differences), relative difference "
        f"{float(jnp.abs(grad - fd) / jnp.abs(fd)):.1e}"
    )
    length = jnp.max(jnp.abs(path[:, 0] ** 2 + path[:, 1] ** 2 - 1))
    print(
        f"pendulum: max |x² + y² - 1| (the index-1 form's drift): {float(length):.1e}"
    )
    plot(args.out / "dae.png", ts, ode, dae, pts, path)


def plot(path, ts, ode, dae, pts, pendulum) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6), layout="constrained")
    scale = jnp.array([1.0, 1e4, 1.0])
    for j, species in enumerate(("y1", "y2 × 1e4", "y3")):
        left.semilogx(ts, ode[:, j] * scale[j], "-", lw=4, alpha=0.35, color=f"C{j}")
        left.semilogx(ts, dae[:, j] * scale[j], "--", color=f"C{j}", label=species)
    left.set_xlabel("t")
    left.set_ylabel("concentration")
    left.set_title("ROBER: ODE form (thick) and DAE, Rodas5P")
    # Legends under the panels, off the data.
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    for j, name in enumerate(("x", "y", "u", "v")):
        right.plot(pts, pendulum[:, j], label=name)
    right.plot(pts, pendulum[:, 4] / 10, ":", label="λ / 10")
    right.set_xlabel("t")
    right.set_ylabel("position x, y; velocity u, v; tension λ / 10")
    right.set_title("Pendulum, index-1 form, Rodas5P")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
