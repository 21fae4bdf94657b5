"""Benchmark of the linear solvers of the stiff solvers: one Jacobian, one
factorisation of `I - γh J` and one solve, jitted, in float64.

`python -m benchmarks.linear_solvers [--quick] [--repeats R]` prints a Markdown table
of run times (median of `R` calls after a compiling one) and each time's ratio to the
case's first solver:

- tridiagonal fields, n = 100 ... 10⁴: `BandedLinearSolver(1, 1)` against
  `DenseLinearSolver` (up to n = 2000) and SciPy's `solve_banded` (the factorisation
  and solve only, of bands given to it: no Jacobian);
- a block-diagonal ROBER-like system of 3333 copies (n = 9999):
  `SparseLinearSolver` (3x3 blocks) against `BandedLinearSolver(2, 2)`;
- the 2-D 5-point Laplacian plus a cubic reaction on 32² and 64² grids:
  `SparseLinearSolver` (reordered band) against `KrylovLinearSolver` (GMRES, with
  and without a `BandedLinearSolver` preconditioner of the grid's bands) and, on
  32², `DenseLinearSolver`.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import solverkit as sk


GAMMA_H = 0.1


def _tridiagonal(x):
    padded = jnp.concatenate([jnp.zeros(1), x, jnp.zeros(1)])
    return padded[:-2] - 2 * x + padded[2:] - x**3


def _rober(y):
    a, b, c = y[0::3], y[1::3], y[2::3]
    da = -0.04 * a + 1e4 * b * c
    dc = 3e7 * b**2
    return jnp.stack([da, -da - dc, dc], axis=1).reshape(-1)


def _laplacian(m):
    def fn(x):
        u = x.reshape(m, m)
        padded = jnp.pad(u, 1)
        lap = (
            padded[:-2, 1:-1]
            + padded[2:, 1:-1]
            + padded[1:-1, :-2]
            + padded[1:-1, 2:]
            - 4 * u
        )
        return (lap * m**2 - u**3).reshape(-1)

    return fn


def _laplacian_pattern(m):
    i = np.arange(m * m)
    rows, cols = [i], [i]
    for di, dj in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        r, c = i // m + di, i % m + dj
        ok = (r >= 0) & (r < m) & (c >= 0) & (c < m)
        rows.append(i[ok])
        cols.append((r * m + c)[ok])
    pattern = np.zeros((m * m, m * m), bool)
    pattern[np.concatenate(rows), np.concatenate(cols)] = True
    return pattern


def _time(fn, args, repeats):
    """(compile-and-first-run seconds, median run seconds)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def _solve_fn(solver, fn):
    @jax.jit
    def run(x, rhs):
        _, jac = solver.linearise(fn, x)
        factor = solver.factorise(jac, jnp.asarray(GAMMA_H), None)
        return solver.solve(factor, rhs, fn)

    return run


def _case(name, fn, n, solvers, repeats, extra=None):
    x = jnp.linspace(0.1, 1.0, n)
    rhs = jnp.cos(jnp.arange(n, dtype=jnp.float64))
    rows = []
    reference = None
    for label, solver in solvers:
        run = _solve_fn(solver, fn)
        first, median = _time(run, (x, rhs), repeats)
        sol = np.asarray(run(x, rhs))
        if reference is None:
            reference = sol
        error = float(np.max(np.abs(sol - reference)) / np.max(np.abs(reference)))
        rows.append((name, n, label, first, median, error))
    if extra is not None:
        label, call = extra
        first, median = _time(call, (), repeats)
        rows.append((name, n, label, first, median, float("nan")))
    base = rows[0][4]
    for name_, n_, label, first, median, error in rows:
        print(
            f"| {name_} | {n_} | {label} | {first:.3f} | {median * 1e3:.3f} | "
            f"{median / base:.2f} | {error:.1e} |",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description="Benchmark of the linear solvers.")
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    print(
        "| case | n | solver | first call (s) | run (ms) | ratio | rel. diff |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    sizes = (100, 1000) if args.quick else (100, 1000, 10_000)
    for n in sizes:
        solvers: list[tuple[str, sk.AbstractLinearSolver]] = [
            ("banded(1,1)", sk.BandedLinearSolver(1, 1))
        ]
        if n <= 2000:
            solvers.append(("dense", sk.DenseLinearSolver()))
        extra = None
        try:
            import scipy.linalg

            ab = np.zeros((3, n))
            ab[0, 1:], ab[1], ab[2, :-1] = -GAMMA_H, 1 + 2 * GAMMA_H, -GAMMA_H
            b = np.cos(np.arange(n))
            extra = (
                "scipy solve_banded (no Jacobian)",
                lambda ab=ab, b=b: scipy.linalg.solve_banded((1, 1), ab, b),
            )
        except ImportError:
            pass
        _case("tridiagonal", _tridiagonal, n, solvers, args.repeats, extra)

    copies = 100 if args.quick else 3333
    blocks = np.kron(np.eye(copies, dtype=bool), np.ones((3, 3), bool))
    _case(
        "ROBER blocks",
        _rober,
        3 * copies,
        [
            ("sparse (blocks)", sk.SparseLinearSolver(blocks)),
            ("banded(2,2)", sk.BandedLinearSolver(2, 2)),
        ],
        args.repeats,
    )

    for m in (16,) if args.quick else (32, 64):
        n = m * m
        precondition = sk.BandedLinearSolver(m, m, check=False)
        solvers: list[tuple[str, sk.AbstractLinearSolver]] = [
            ("sparse (RCM band)", sk.SparseLinearSolver(_laplacian_pattern(m))),
            ("krylov gmres", sk.KrylovLinearSolver(rtol=1e-8, atol=1e-12)),
            (
                "krylov gmres + banded precond.",
                sk.KrylovLinearSolver(
                    rtol=1e-8, atol=1e-12, preconditioner=precondition
                ),
            ),
        ]
        if n <= 1024:
            solvers.append(("dense", sk.DenseLinearSolver()))
        _case(f"2-D Laplacian {m}²", _laplacian(m), n, solvers, args.repeats)


if __name__ == "__main__":
    main()
