"""A user-written Crank-Nicolson solver for a nonlinear heat equation, fitted by grad.

The library's solvers are built on a public protocol, `sk.AbstractSolver`, and a user
can write their own, as diffrax's users do. Here it is a Crank-Nicolson (trapezoidal)
solver with its own error estimate, so that `sk.PIDController` adapts its steps, for
the method of lines applied to a heat equation whose conductivity grows with the
temperature:

    u_t = d/dx( kappa (1 + u^2) du/dx ),   0 < x < 1,   u(0, t) = u(1, t) = 0,

on a grid of N interior points (a flux-conservative second difference). The vector
field closes over the diffusivity `kappa`; from a measured temperature profile at
t = T (synthetic, 1% noise), Adam (optax) recovers `kappa` by `jax.grad` through
`sk.diffeqsolve` and through the solver's own stage solve; the gradient is first
checked against finite differences. The solver's arithmetic is written for any
pytree state, as the protocol allows (`sk.BacksolveAdjoint` steps the pair (state,
adjoint) with the same solver; it is not used here, because it re-solves the heat
equation backwards in time, which is ill-posed).

Run: `python examples/heat_pde.py [--out DIR] [--steps N] [--quick]`.
It prints the checks and the fit and writes `heat_pde.png`.
"""

import argparse
import os
import pathlib
from typing import ClassVar

import jax


jax.config.update("jax_enable_x64", True)

import jax.lax as lax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import matplotlib  # noqa: E402
import optax  # noqa: E402
import tqdm  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


class CrankNicolson(sk.AbstractSolver):
    """The trapezoidal rule, y1 = y0 + h/2 (f(t0, y0) + f(t1, y1)), second order and
    A-stable, for any pytree state.

    The implicit equation is solved by a fixed number of fixed-point iterations
    `y <- y0 + h/2 f0 + h/2 f(t1, y)` in a `lax.fori_loop` (so that reverse-mode AD
    goes through it). The iteration contracts only when `h/2 |df/dy| < 1`, so a step
    whose last iterate still moves reports `RESULTS.implicit_nonconvergence`: the
    adaptive loop then rejects it and retries with a smaller step.

    Error estimate: the difference from the explicit Euler step,
    y1 - (y0 + h f0) = h/2 (f1 - f0) = O(h^2), so `error_order` is 2 (the default,
    `order`).
    """

    term_structure: ClassVar = sk.ODETerm
    interpolation_cls: ClassVar = sk.LocalLinearInterpolation
    iterations: int = 25
    # Relative change of the last fixed-point iterate up to which a step is converged.
    tolerance: float = 1e-9

    def order(self, terms):
        return 2

    def init(self, terms, t0, t1, y0, args):
        return None  # a one-step method carries nothing from step to step

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        f0 = terms.vf(t0, y0, args)
        # Cast the step to each leaf's dtype (time may be wider than the state).
        half = lambda y: (0.5 * (t1 - t0)).astype(y.dtype)  # noqa: E731
        known = jtu.tree_map(lambda y, f: y + half(y) * f, y0, f0)

        def iterate(_, y1):
            f1 = terms.vf(t1, y1, args)
            return jtu.tree_map(lambda k, f: k + half(k) * f, known, f1)

        euler = jtu.tree_map(lambda y, f: y + 2 * half(y) * f, y0, f0)
        previous = lax.fori_loop(0, self.iterations - 1, iterate, euler)
        y1 = iterate(None, previous)

        # Converged when, in every leaf, the last iteration moved by at most
        # `tolerance` times the leaf's size (a leaf that is all zeros passes).
        moved = jtu.tree_map(
            lambda a, b: (
                jnp.max(jnp.abs(a - b), initial=0.0)
                <= self.tolerance * jnp.max(jnp.abs(b), initial=0.0)
            ),
            previous,
            y1,
        )
        converged = jnp.all(jnp.stack(jtu.tree_leaves(moved)))
        result = sk.RESULTS.where(
            converged, sk.RESULTS.successful, sk.RESULTS.implicit_nonconvergence
        )
        y_error = jtu.tree_map(lambda a, b: a - b, y1, euler)
        dense_info = dict(y0=y0, y1=y1)
        return y1, y_error, dense_info, None, result

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


N = 32  # interior grid points
DX = 1.0 / (N + 1)
X = jnp.linspace(DX, 1 - DX, N)
T_END = 0.1
T_PLOT = jnp.array([0.0, 0.01, 0.03, T_END])
TRUE_KAPPA = 0.2
INITIAL_KAPPA = 0.05
NOISE = 0.01


def initial_temperature() -> jax.Array:
    """Two hot spots."""
    return 1.5 * jnp.exp(-(((X - 0.3) / 0.07) ** 2)) + jnp.exp(
        -(((X - 0.7) / 0.1) ** 2)
    )


def solve(kappa, saveat):
    """The solution for diffusivity `kappa`."""

    def vector_field(t, u, args):
        padded = jnp.concatenate([jnp.zeros(1), u, jnp.zeros(1)])
        middle = 0.5 * (padded[1:] + padded[:-1])  # u at the cell faces
        flux = kappa * (1 + middle**2) * (padded[1:] - padded[:-1]) / DX
        return (flux[1:] - flux[:-1]) / DX

    sol = sk.diffeqsolve(
        sk.ODETerm(vector_field),
        CrankNicolson(),
        t0=0.0,
        t1=T_END,
        dt0=1e-4,
        y0=initial_temperature(),
        saveat=saveat,
        stepsize_controller=sk.PIDController(rtol=1e-4, atol=1e-6),
        max_steps=4096,
    )
    return sol


@jax.jit
def final_profile(kappa):
    return solve(kappa, sk.SaveAt(t1=True)).ys[0]


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
    steps = args.steps or (3 if args.quick else 40)
    args.out.mkdir(parents=True, exist_ok=True)

    clean = final_profile(TRUE_KAPPA)
    noise = jax.random.normal(jax.random.key(args.seed), clean.shape)
    data = clean + NOISE * jnp.max(clean) * noise

    def loss(log_kappa):
        pred = solve(jnp.exp(log_kappa), sk.SaveAt(t1=True)).ys[0]
        return jnp.mean((pred - data) ** 2)

    # The gradient through the solver (RecursiveCheckpointAdjoint: reverse mode through
    # every step, stage iterations included), against central differences.
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    # Not weakly typed, as Adam's updated values: one compile of `value_and_grad`.
    log_kappa = jnp.log(jnp.asarray(INITIAL_KAPPA, float))
    _, grad = value_and_grad(log_kappa)
    eps = 1e-6
    plus, minus = value_and_grad(log_kappa + eps)[0], value_and_grad(log_kappa - eps)[0]
    fd = (plus - minus) / (2 * eps)
    print(f"d loss / d log kappa at kappa = {INITIAL_KAPPA}:")
    print(f"  RecursiveCheckpointAdjoint {float(grad): .8e}")
    print(f"  central finite difference  {float(fd): .8e}")

    optimiser = optax.adam(optax.cosine_decay_schedule(0.2, steps, alpha=0.05))
    opt_state = optimiser.init(log_kappa)
    progress = tqdm.trange(steps, desc="fitting kappa", unit="step")
    for i in progress:
        value, grad = value_and_grad(log_kappa)
        updates, opt_state = optimiser.update(grad, opt_state)
        log_kappa = optax.apply_updates(log_kappa, updates)
        if i % 5 == 0 or i == steps - 1:
            progress.set_postfix(loss=f"{float(value):.3e}")
    fitted = float(jnp.exp(log_kappa))
    print(f"loss {float(value):.4e} after {steps} Adam steps")
    print(f"kappa: true {TRUE_KAPPA}, initial {INITIAL_KAPPA}, fitted {fitted:.4f}")

    profiles = jax.jit(lambda k: solve(k, sk.SaveAt(ts=T_PLOT)).ys)(fitted)
    sol = jax.jit(lambda k: solve(k, sk.SaveAt(t0=True, steps=True)))(fitted)
    stats = {k: int(v) for k, v in sol.stats.items() if k.startswith("num")}
    print("fitted solve:", stats)
    ts = sol.ts[jnp.isfinite(sol.ts)]  # unused rows of SaveAt(steps=True) are inf
    plot(args.out / "heat_pde.png", data, fitted, profiles, ts)


def plot(path, data, fitted, profiles, ts) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (t, u) in enumerate(zip(T_PLOT, profiles)):
        left.plot(X, u, "-", color=f"C{i}", label=f"t = {float(t):g}")
    left.plot(X, data, "o", ms=3, color="k", label=f"data at t = {T_END:g}")
    left.set_xlabel("x")
    left.set_ylabel("u")
    left.set_title(f"Nonlinear heat equation, fitted kappa = {fitted:.3f}")
    left.legend(fontsize="small")
    right.semilogy(ts[1:], jnp.diff(ts), ".-")
    right.set_xlabel("t")
    right.set_ylabel("accepted step size")
    right.set_title("Crank-Nicolson + PIDController")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
