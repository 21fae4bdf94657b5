"""The 2-D Brusselator on a 128 x 128 grid (32,768 unknowns) with a sparse Newton.

The reaction-diffusion system of Hairer and Wanner (*Solving Ordinary Differential
Equations II*, §IV.10, the 2-D BRUSS problem), here with zero-flux boundaries:

    u_t = 1 + u^2 v - 4.4 u + alpha Lap(u) + f(x, y, t)
    v_t = 3.4 u - u^2 v + alpha Lap(v)

on the unit square, `u(x, y, 0) = 22 y (1 - y)^1.5`, `v(x, y, 0) = 27 x (1 - x)^1.5`,
and a source `f = 5` switched on at `t = 1.1` in the disc of radius 0.1 about
(0.3, 0.6). The method of lines on `N x N` cells gives `2 N^2` stiff ODEs (the
diffusion's eigenvalues reach `-8 alpha N^2`). `BDF` solves with `I - gamma h J` by
BiCGStab (`sk.KrylovLinearSolver`, matrix-free) preconditioned by operator splitting
(the per-cell `2 x 2` reaction blocks, then the diffusion solved exactly by a 2-D
DCT) where this solverkit has it, else
`Rodas5P` with `sk.SparseLinearSolver`: the Jacobian from 5 Jacobian-vector products
(a colouring of its sparsity pattern) and a sparse (reordered band) LU. The vector field
closes over the diffusion coefficient `alpha`.

Then `jax.grad` of a scalar of the final state (the mean of `u`) with respect to
`alpha`, through the whole solve, checked against central finite differences on a
16 x 16 grid with `Rodas5P` (`--quick`: 8 x 8, with `Ros3P`).

Run: `python examples/brusselator.py [--out DIR] [--n N] [--quick]` (`--quick`: an
8 x 8 grid and a shorter time span). It prints the solve's statistics, timings and
the gradient check, and writes `brusselator.png` (snapshots of `u`).
"""

import argparse
import os
import pathlib
import time

import jax
import numpy as np


jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import solverkit as sk  # noqa: E402


ALPHA = 0.1
T_SNAPSHOTS = (0.0, 1.5, 4.0, 11.5)
T_SNAPSHOTS_QUICK = (0.0, 1.5, 3.0)


def initial_state(n: int) -> jax.Array:
    """`(n, n, 2)`: u and v of each cell side by side (a banded Jacobian)."""
    x = (jnp.arange(n) + 0.5) / n
    xx, yy = jnp.meshgrid(x, x, indexing="ij")
    return jnp.stack([22.0 * yy * (1 - yy) ** 1.5, 27.0 * xx * (1 - xx) ** 1.5], -1)


def laplacian(u: jax.Array) -> jax.Array:
    """The 5-point Laplacian times `dx²`, zero-flux (mirrored ghost cells)."""
    p = jnp.pad(u, 1, mode="edge")
    return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4.0 * u


def brusselator(alpha: jax.Array, n: int):
    """The vector field on `(n, n, 2)`, closing over `alpha` and the source's disc."""
    x = (jnp.arange(n) + 0.5) / n
    xx, yy = jnp.meshgrid(x, x, indexing="ij")
    disc = jnp.where((xx - 0.3) ** 2 + (yy - 0.6) ** 2 <= 0.01, 5.0, 0.0)
    scale = alpha * n * n

    def vector_field(t, y, args):
        u, v = y[..., 0], y[..., 1]
        uuv = u * u * v
        du = 1.0 + uuv - 4.4 * u + scale * laplacian(u) + jnp.where(t >= 1.1, disc, 0)
        dv = 3.4 * u - uuv + scale * laplacian(v)
        return jnp.stack([du, dv], axis=-1)

    return vector_field


def sparsity(n: int):
    """The Jacobian's nonzeros on the ravelled `(n, n, 2)` state, a SciPy sparse
    matrix: u and v of a cell couple; each couples to its four neighbours."""
    import numpy as np
    import scipy.sparse as sps

    idx = np.arange(2 * n * n).reshape(n, n, 2)
    rows, cols = [], []
    for a in (0, 1):
        for b in (0, 1):
            rows.append(idx[..., a].ravel())
            cols.append(idx[..., b].ravel())
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        i = np.clip(np.arange(n)[:, None] + di, 0, n - 1)
        j = np.clip(np.arange(n)[None, :] + dj, 0, n - 1)
        i, j = np.broadcast_arrays(i, j)
        for a in (0, 1):
            rows.append(idx[..., a].ravel())
            cols.append(idx[i, j, a].ravel())
    r, c = np.concatenate(rows), np.concatenate(cols)
    return sps.csr_matrix((np.ones(r.size, bool), (r, c)), shape=(2 * n * n,) * 2)


def splitting_preconditioner(alpha: float, n: int):
    """An approximate `(I - γh J)^{-1} v` for the Krylov solve, by operator
    splitting: `(I - γh D)^{-1} (I - γh R)^{-1} v`, with `R` the reaction's Jacobian
    (a `2 x 2` block per cell, solved in closed form) and `D = alpha n² Δ` the
    diffusion. The zero-flux Laplacian `Δ` is diagonalised by the orthonormal
    DCT-II along each grid axis (eigenvalues `2 cos(πk/n) - 2` per axis), so its
    solve is exact: transform, divide, transform back (here as matrix products, on
    CPU faster than FFTs at these sizes). `P` differs from `I - γh J` by
    `γh² R D` only, so the Krylov solver needs an iteration or two. A problem-specific
    preconditioner, as CVODE's users write them. `alpha` is a Python float: the
    preconditioner only steers the iteration."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    dct = np.where(k == 0, np.sqrt(1 / n), np.sqrt(2 / n)) * np.cos(
        np.pi * k * (i + 0.5) / n
    )
    lam = 2 * np.cos(np.pi * np.arange(n) / n) - 2
    eigenvalues = alpha * n * n * (lam[:, None] + lam[None, :])

    def apply(v, point, gamma_h):
        y, r = point.reshape(n, n, 2), v.reshape(n, n, 2)
        u, w = y[..., 0], y[..., 1]
        a11 = 1 - gamma_h * (2 * u * w - 4.4)
        a12 = -gamma_h * u * u
        a21 = -gamma_h * (3.4 - 2 * u * w)
        a22 = 1 + gamma_h * u * u
        det = a11 * a22 - a12 * a21
        x0 = (a22 * r[..., 0] - a12 * r[..., 1]) / det
        x1 = (a11 * r[..., 1] - a21 * r[..., 0]) / det
        x = jnp.stack([x0, x1], axis=-1)
        c = jnp.asarray(dct, x.dtype)
        x = jnp.einsum("bj,ajs->abs", c, jnp.einsum("ai,ijs->ajs", c, x))
        x = x / (1 - gamma_h * jnp.asarray(eigenvalues, x.dtype))[..., None]
        x = jnp.einsum("jb,ajs->abs", c, jnp.einsum("ia,ijs->ajs", c, x))
        return x.reshape(v.shape)

    return apply


def stiff_solver(
    n: int, method: str = "BDF", krylov_rtol: float = 1e-3
) -> sk.AbstractSolver:
    """`method` (`BDF` or `Rodas5P`) with a Krylov Newton (BiCGStab to the relative
    tolerance `krylov_rtol`: by default a loose 1e-3, which the Newton iteration
    corrects), preconditioned by operator splitting: `BDF` so is the
    fastest configuration of `benchmarks/stiff_large.py` on the 128 x 128 grid at
    rtol 1e-4, where a sparse LU's band is too wide) where this solverkit has one,
    else `Rodas5P` with a sparse direct one (the pattern coloured: 5
    Jacobian-vector products per Jacobian), else with dense Jacobians, which only
    small grids can afford."""
    krylov = getattr(sk, "KrylovLinearSolver", None)
    sparse = getattr(sk, "SparseLinearSolver", None)
    if krylov is not None:
        pc = splitting_preconditioner(ALPHA, n)
        atol = 1e-5 * krylov_rtol
        linear = krylov("bicgstab", krylov_rtol, atol, 100, 1, pc)  # pyright: ignore
        return getattr(sk, method)(linear_solver=linear)
    if sparse is not None:
        return sk.Rodas5P(linear_solver=sparse(sparsity(n)))  # pyright: ignore
    if 2 * n * n > 2048:
        raise SystemExit(
            f"--n {n}: 2n² = {2 * n * n} unknowns need sk.KrylovLinearSolver or "
            "sk.SparseLinearSolver; this solverkit has neither"
        )
    print("note: no sparse or Krylov Newton in this solverkit; dense Jacobians")
    return sk.Rodas5P()


def make_solve(
    n: int,
    t1: float,
    ts: tuple[float, ...],
    rtol: float,
    method: str = "BDF",
    krylov_rtol: float = 1e-3,
):
    solver = stiff_solver(n, method, krylov_rtol)
    y0 = initial_state(n)

    def solve(alpha, saveat):
        return sk.diffeqsolve(
            sk.ODETerm(brusselator(alpha, n)),
            solver,
            0.0,
            t1,
            None,
            y0,
            None,
            saveat=saveat,
            stepsize_controller=sk.PIDController(rtol=rtol, atol=rtol),
            max_steps=20_000,
        )

    snapshots = jax.jit(lambda alpha: solve(alpha, sk.SaveAt(ts=jnp.asarray(ts))))

    def mean_u(alpha):
        ys = solve(alpha, sk.SaveAt(t1=True)).ys
        assert ys is not None
        return jnp.mean(ys[-1, ..., 0])

    # One program for the gradient and the values of the difference quotient.
    return solver, snapshots, jax.jit(jax.value_and_grad(mean_u))


def main() -> None:
    parser = argparse.ArgumentParser(description="The 2-D Brusselator.")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--n", type=int, default=None, help="grid size (default 128)")
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("SOLVERKIT_EXAMPLE_QUICK") == "1",
        help="an 8 x 8 grid, t in [0, 3] (also SOLVERKIT_EXAMPLE_QUICK=1)",
    )
    args = parser.parse_args()
    n = args.n or (8 if args.quick else 128)
    ts = T_SNAPSHOTS_QUICK if args.quick else T_SNAPSHOTS
    args.out.mkdir(parents=True, exist_ok=True)
    alpha = jnp.asarray(ALPHA)

    solver, snapshots, _ = make_solve(n, ts[-1], ts, rtol=1e-6)
    print(f"{n} x {n} grid, {2 * n * n} unknowns, {type(solver).__name__}")
    start = time.perf_counter()
    sol = jax.block_until_ready(snapshots(alpha))
    first = time.perf_counter() - start
    start = time.perf_counter()
    sol = jax.block_until_ready(snapshots(alpha))
    run = time.perf_counter() - start
    stats = {k: int(v) for k, v in sol.stats.items() if jnp.ndim(v) == 0}
    print(f"first call {first:.1f} s, run {run:.2f} s, stats {stats}")

    # The gradient of the mean of u at t1 with respect to alpha, through the solve
    # (reverse mode through every step), against central differences; on a small
    # grid, in float64.
    m = 8 if args.quick else 16
    # Reverse mode works through either solver and any Krylov tolerance, but the
    # difference quotient needs a loss smooth in alpha: BiCGStab stopped at 1e-3 is
    # not (8 x 8, quotient vs gradient: 2e-4 with Rodas5P at rtol 1e-10; 1e-6 to
    # 1.5e-4 with BDF at rtol 1e-8 to 1e-9), so the check uses Rodas5P (a linearly
    # implicit method: it needs accurate linear solves) with BiCGStab to 1e-8. (GMRES
    # to 1e-5 agrees to 3e-10 but its reverse mode compiles twice as long.) With
    # `--quick`, the three-stage Ros3P at rtol 1e-9, another linearly implicit method
    # through the same Krylov solve: 1.6e-6 (quotient noise ~rtol / eps = 1e-5), its
    # gradient compiled in half the CPU time.
    _, _, value_and_grad = make_solve(
        m,
        3.0,
        (3.0,),
        rtol=1e-9 if args.quick else 1e-10,
        method="Ros3P" if args.quick else "Rodas5P",
        krylov_rtol=1e-8,
    )
    g = float(value_and_grad(alpha)[1])
    # The adaptive steps change with alpha, so the quotient carries noise of about
    # rtol / eps; the central difference's own error is O((eps / alpha)²).
    eps = 1e-4
    plus, minus = value_and_grad(alpha + eps)[0], value_and_grad(alpha - eps)[0]
    fd = float((plus - minus) / (2 * eps))
    rel = abs(g - fd) / abs(fd)
    print(f"d mean(u(t=3)) / d alpha on {m} x {m}: grad {g:.8e}, FD {fd:.8e}")
    print(f"relative difference {rel:.1e}")
    if rel > 1e-4:
        raise SystemExit(f"gradient check failed: {rel:.1e}")
    plot(args.out / "brusselator.png", sol.ys, ts, n)


def plot(path: pathlib.Path, ys: jax.Array, ts: tuple[float, ...], n: int) -> None:
    fig, axes = plt.subplots(1, len(ts), figsize=(3.2 * len(ts), 3.2))
    vmax = float(jnp.max(ys[..., 0]))
    image = []
    for ax, t, y in zip(axes, ts, ys):
        image = [
            ax.imshow(
                y[..., 0].T,
                origin="lower",
                extent=(0, 1, 0, 1),
                vmin=0,
                vmax=vmax,
                cmap="viridis",
            )
        ]
        ax.set_title(f"u at t = {t:g}")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"2-D Brusselator, {n} x {n} cells, {2 * n * n} unknowns")
    fig.colorbar(image[0], ax=list(axes), shrink=0.8)
    fig.savefig(path, dpi=100)
    print("wrote", path)


if __name__ == "__main__":
    main()
