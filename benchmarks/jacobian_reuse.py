"""Steps, rejected steps, Jacobian evaluations and factorisations of the stiff solvers
that reuse a Jacobian across steps (`BDF`, `Kvaerno5(reuse_jacobian=True)`), on
Robertson and Van der Pol (mu = 1000), float64, with the end state's error against
SciPy's `Radau` at tight tolerances.

Run as `python -m benchmarks.jacobian_reuse [--out DIR]`; compare before and after a
change to the reuse rules. Counts come from a linear solver that wraps
`DenseLinearSolver` and counts its calls on the host (every call the solve makes:
a call inside a branch not taken is not counted).

`--time`: instead, the run time of `Kvaerno5` on Robertson with `reuse_jacobian`
over without it (plain `DenseLinearSolver`), one solve and `--lanes` vmapped ones,
each pair timed alternately in one process (the fastest of `--repeats`: the
solves take milliseconds, so a loaded machine's noise is one-sided): the figures
of `reuse_jacobian`'s docstring.
"""

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.integrate

import solverkit as sk


jax.config.update("jax_enable_x64", True)
_COUNTS = {"linearise": 0, "factorise": 0}


def _count(name):
    def bump():
        _COUNTS[name] += 1

    return lambda: jax.debug.callback(bump, ordered=False)


class CountingLinearSolver(sk.AbstractLinearSolver):
    """`DenseLinearSolver`, counting its Jacobians and factorisations."""

    inner: sk.AbstractLinearSolver = sk.DenseLinearSolver()

    def linearise(self, fn, x):
        _count("linearise")()
        return self.inner.linearise(fn, x)

    def factorise(self, jac, gamma_h, mass):
        _count("factorise")()
        return self.inner.factorise(jac, gamma_h, mass)

    def solve(self, factor, rhs, fn):
        return self.inner.solve(factor, rhs, fn)


def _rober(t, y, args):
    k1, k2, k3 = 0.04, 3e7, 1e4
    a, b, c = y
    return jnp.stack([-k1 * a + k3 * b * c, k1 * a - k2 * b**2 - k3 * b * c, k2 * b**2])


def _vdp(t, y, args):
    mu = 1000.0
    x, v = y
    return jnp.stack([v, mu * ((1 - x**2) * v) - x])


PROBLEMS = {
    "robertson": (_rober, np.array([1.0, 0.0, 0.0]), 1e5, 1e-6, 1e-10),
    "vdp1000": (_vdp, np.array([2.0, 0.0]), 3000.0, 1e-6, 1e-8),
}


def _reference(vf, y0, t1):
    fun = lambda t, y: np.asarray(vf(t, jnp.asarray(y), None))  # noqa: E731
    jac = lambda t, y: np.asarray(jax.jacfwd(vf, 1)(t, jnp.asarray(y), None))  # noqa: E731
    out = scipy.integrate.solve_ivp(
        fun, (0.0, t1), y0, method="Radau", rtol=1e-12, atol=1e-14, jac=jac
    )
    return out.y[:, -1]


def _solvers():
    ls = CountingLinearSolver()
    return {
        "BDF": sk.BDF(linear_solver=ls),
        "Kvaerno5 reuse": sk.Kvaerno5(linear_solver=ls, reuse_jacobian=True),
    }


def run() -> list[dict]:
    rows = []
    for name, (vf, y0, t1, rtol, atol) in PROBLEMS.items():
        ref = _reference(vf, y0, t1)
        for solver_name, solver in _solvers().items():
            _COUNTS.update(linearise=0, factorise=0)
            sol = sk.diffeqsolve(
                sk.ODETerm(vf),
                solver,
                0.0,
                t1,
                None,
                jnp.asarray(y0),
                stepsize_controller=sk.PIDController(rtol=rtol, atol=atol),
                max_steps=200_000,
            )
            jax.effects_barrier()
            y1 = np.asarray(sol.ys[-1])
            scale = atol + rtol * np.abs(ref)
            rows.append(
                dict(
                    problem=name,
                    solver=solver_name,
                    rtol=rtol,
                    atol=atol,
                    steps=int(sol.stats["num_steps"]),
                    rejected=int(sol.stats["num_rejected_steps"]),
                    jacobians=_COUNTS["linearise"],
                    factorisations=_COUNTS["factorise"],
                    error_in_tolerances=float(np.max(np.abs(y1 - ref) / scale)),
                )
            )
            print(json.dumps(rows[-1]))
    return rows


def _kvaerno5_solve(reuse: bool, lanes: int):
    """A jitted Kvaerno5 solve of Robertson (`lanes` of them vmapped over `k1`, or
    one for `lanes == 0`)."""
    _, y0, t1, rtol, atol = PROBLEMS["robertson"]

    def field(t, y, k1):
        a, b, c = y
        fast = k1 * a - 3e7 * b**2 - 1e4 * b * c
        return jnp.stack([-k1 * a + 1e4 * b * c, fast, 3e7 * b**2])

    def solve(k1):
        sol = sk.diffeqsolve(
            sk.ODETerm(field),
            sk.Kvaerno5(reuse_jacobian=reuse),
            0.0,
            t1,
            None,
            jnp.asarray(y0),
            args=k1,
            stepsize_controller=sk.PIDController(rtol=rtol, atol=atol),
            max_steps=200_000,
        )
        return sol.ys, sol.stats["num_steps"]

    k1 = jnp.linspace(0.03, 0.05, lanes) if lanes else jnp.asarray(0.04)
    run = jax.jit(jax.vmap(solve) if lanes else solve)
    return lambda: jax.block_until_ready(run(k1))


def timing(lanes: int, repeats: int) -> list[dict]:
    """Run time with `reuse_jacobian` over without, single and vmapped."""
    rows = []
    for n in (0, lanes):
        calls = {reuse: _kvaerno5_solve(reuse, n) for reuse in (False, True)}
        seconds = {reuse: [] for reuse in calls}
        for call in calls.values():
            call()  # compile
        for _ in range(repeats):
            for reuse, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[reuse].append(time.perf_counter() - start)
        ratio = min(seconds[True]) / min(seconds[False])
        steps = {r: int(np.max(call()[1])) for r, call in calls.items()}
        rows.append(
            dict(
                lanes=n,
                reuse_over_fresh=ratio,
                steps=steps[False],
                steps_reuse=steps[True],
            )
        )
        print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--time", action="store_true", help="time reuse_jacobian")
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    rows = timing(args.lanes, args.repeats) if args.time else run()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "jacobian_reuse_time" if args.time else "jacobian_reuse"
        (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
