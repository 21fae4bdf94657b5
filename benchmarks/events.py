"""Events that change the state and continue (`Event(effect=...)`)
against the loop of solves that diffrax users write today, on an ensemble of leaky
integrate-and-fire neurons.

`python -m benchmarks.events [--quick] [--size N] [--repeats R] [--json PATH]
[--dtype float32]`

Case (float64, or float32 with `--dtype float32` for accelerators that emulate
float64; one process, whatever device JAX sees): `N` = 1024 neurons (`--quick`:
64), `tau v' = I_k - v` with `tau = 1`, `v(0) = 0`, over t in [0, 10]; a spike where
`v` crosses 1 upward, after which `v = 0`. The input currents `I_k` are
`linspace(1.4, 4, N)` shuffled with a fixed seed: from 7 to 34 spikes a neuron, 21
on average. Tsit5, `PIDController(rtol=atol=1e-8)` (float32: 1e-6), `dt0 = 0.01`;
at most `--max-spikes` (48) spikes recorded by every method. Exact spike times:
`t_j = (j + 1) tau log(I / (I - 1))`.

Methods, each `jax.jit(jax.vmap(...))` over the neurons:

- `solverkit effect`: one `sk.diffeqsolve` with `sk.Event(v - 1, direction=True,
  effect=lambda t, v, args: 0 * v, max_events=48)`; spike times from `sol.events`.
- `diffrax loop`: what diffrax users write today. Forward: a `lax.while_loop` around
  `diffrax.diffeqsolve` with a terminal `diffrax.Event(v - 1, direction=True,
  root_finder=optx.Newton(rtol=atol=1e-12))`, each iteration solving from the last
  spike (with `v = 0`) to the next and writing its time into a buffer of 48.
  Gradient: a `lax.while_loop` is not reverse-differentiable, so the same body in a
  `lax.scan` of 48 iterations (a neuron past its last spike solves an empty interval,
  t0 = t1 = 10); diffrax's default `RecursiveCheckpointAdjoint` inside.
- `solverkit loop`: the same loops with `sk.diffeqsolve` and its terminal
  `sk.Event(v - 1, direction=True)` (built-in bisection) in place of diffrax's.

Variants: `forward` (the spike times) and `grad` (the gradient, w.r.t. the input
currents, of the sum of all recorded spike times; its exact value is
`-tau / (I (I - 1)) * n (n + 1) / 2` for a neuron with `n` spikes).

Before timing, every method's spike counts, spike times and gradient are checked
against the exact ones (and so against each other): spike times within 1e-5 (the
solver's tolerance gives ~6e-8), gradients within 1e-3 relative; a method that fails is
timed anyway and its row's note says `WRONG` and why. Columns: first call (trace,
compile and one run after `jax.clear_caches()`, as `harness.measure` times it;
`--quick`, a smoke run, keeps the caches: its methods share traced helpers, 0.8x
the CPU time, and its first calls are not comparable), run
time (median [min] of the repeats, the methods taking turns), per spike
(run time / number of spikes of the ensemble), steps (the most steps a neuron took,
summed over its solves for a loop), largest error of the spike times / gradient
against the exact values, and the ratios of `solverkit effect` to `diffrax loop`
(the goal: at most 0.5 for run time and first call).
"""

import argparse
import dataclasses
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

import solverkit as sk


TAU = 1.0
THRESHOLD = 1.0
T1 = 10.0
DT0 = 0.01
I_RANGE = (1.4, 4.0)
MAX_SPIKES = 48
MAX_STEPS = 4096


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tolerances of one precision.

    - `tol`: the solvers' rtol = atol.
    - `newton_tol`: diffrax's Newton locates the crossing on the step's dense
        output; its tolerance is on the time, below the solver's so that it is not
        what limits the error (and above what the dtype resolves at t ~ 10).
    - `forward_limit`, `grad_limit`: the largest error the tolerance allows, of the
        spike times (absolute, s) and of the gradient (relative): each spike time
        inherits the errors of the spikes before it (up to 34), each about
        (tol + eps t) / v' with v' = I - 1 >= 0.4 at the crossing.
    """

    dtype: str
    tol: float
    newton_tol: float
    forward_limit: float
    grad_limit: float


SETTINGS = {
    "float64": Settings("float64", 1e-8, 1e-12, 1e-5, 1e-3),
    # 34 spikes x (1e-6 + 1.2e-7 x 10) / 0.4 = 2e-4 s: limit 1e-3 s; gradient 1e-2.
    "float32": Settings("float32", 1e-6, 1e-5, 1e-3, 1e-2),
}


def currents(n: int) -> np.ndarray:
    """The neurons' input currents: evenly spread, shuffled with a fixed seed."""
    return np.random.default_rng(0).permutation(np.linspace(*I_RANGE, n))


def exact_spikes(current: np.ndarray, max_spikes: int) -> tuple[np.ndarray, np.ndarray]:
    """`(times, counts)`: the exact spike times (padded with inf) and counts."""
    period = TAU * np.log(current / (current - THRESHOLD))
    j = np.arange(1, max_spikes + 1)
    times = period[:, None] * j[None, :]
    times = np.where(times < T1, times, np.inf)
    return times, np.sum(np.isfinite(times), axis=1)


def exact_gradient(current: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """d(sum of the recorded spike times)/dI per neuron (counts held fixed)."""
    return -TAU / (current * (current - THRESHOLD)) * counts * (counts + 1) / 2


def _vf(t, v, current):
    return (current - v) / TAU


def _cond(t, y, args, **kwargs):  # diffrax passes these by name
    return y - THRESHOLD


# --- the methods: one neuron, current -> (spike times padded with inf, steps) ------


def solverkit_effect(max_spikes: int, s: Settings) -> Callable:
    """One solve; the event resets `v` and the solve goes on."""

    def one(current):
        event = sk.Event(
            _cond,
            direction=True,
            effect=lambda t, v, args: 0 * v,
            max_events=max_spikes,
        )
        sol = sk.diffeqsolve(
            sk.ODETerm(lambda t, v, args: _vf(t, v, current)),  # closes over I
            sk.Tsit5(),
            0.0,
            T1,
            DT0,
            jnp.asarray(0.0),
            event=event,
            stepsize_controller=sk.PIDController(rtol=s.tol, atol=s.tol),
            saveat=sk.SaveAt(t1=True),
            max_steps=MAX_STEPS,
            throw=False,
        )
        return sol.events.ts, sol.stats["num_steps"]

    return one


def _diffrax_segment(s: Settings):
    """A solve from `t0` (with `v = 0`) to the next spike or `T1`, in diffrax:
    `(t_end, spiked, steps)`."""
    term = diffrax.ODETerm(_vf)
    event = diffrax.Event(
        _cond,
        root_finder=optx.Newton(rtol=s.newton_tol, atol=s.newton_tol),
        direction=True,
    )

    def segment(t0, current):
        sol = diffrax.diffeqsolve(
            term,
            diffrax.Tsit5(),
            t0,
            T1,
            DT0,
            jnp.zeros_like(t0),
            current,
            event=event,
            stepsize_controller=diffrax.PIDController(rtol=s.tol, atol=s.tol),
            saveat=diffrax.SaveAt(t1=True),
            max_steps=MAX_STEPS,
            throw=False,
        )
        assert sol.ts is not None and sol.stats is not None
        spiked = sol.result == diffrax.RESULTS.event_occurred
        return sol.ts[-1], spiked, sol.stats["num_steps"]

    return segment


def _solverkit_segment(s: Settings):
    """As `_diffrax_segment`, with solverkit's terminal event."""
    term = sk.ODETerm(_vf)
    event = sk.Event(_cond, direction=True)

    def segment(t0, current):
        sol = sk.diffeqsolve(
            term,
            sk.Tsit5(),
            t0,
            T1,
            DT0,
            jnp.zeros_like(t0),
            current,
            event=event,
            stepsize_controller=sk.PIDController(rtol=s.tol, atol=s.tol),
            saveat=sk.SaveAt(t1=True),
            max_steps=MAX_STEPS,
            throw=False,
        )
        spiked = sol.result == sk.RESULTS.event_occurred
        return sol.ts[-1], spiked, sol.stats["num_steps"]

    return segment


def while_loop(segment: Callable, max_spikes: int) -> Callable:
    """Solve to the next spike, record it, reset, again: a `lax.while_loop`."""

    def one(current):
        t0 = jnp.asarray(0.0)
        buf = jnp.full(max_spikes, jnp.inf)

        def cond(carry):
            _, n, _, going, _ = carry
            return going & (n < max_spikes)

        def body(carry):
            t, n, buf, _, steps = carry
            t_end, spiked, s = segment(t, current)
            buf = buf.at[n].set(jnp.where(spiked, t_end, jnp.inf))
            return t_end, n + spiked, buf, spiked, steps + s.astype(jnp.int32)

        zero = jnp.asarray(0, jnp.int32)
        init = (t0, zero, buf, jnp.asarray(True), zero)
        _, _, buf, _, steps = jax.lax.while_loop(cond, body, init)
        return buf, steps

    return one


def scan_loop(segment: Callable, max_spikes: int) -> Callable:
    """The same loop as a `lax.scan` of `max_spikes` solves (reverse-differentiable);
    a neuron past its last spike solves the empty interval `[T1, T1]`."""

    def one(current):
        def body(carry, _):
            t, going, steps = carry
            t_end, spiked, s = segment(t, current)
            spiked = spiked & going
            spike = jnp.where(spiked, t_end, jnp.inf)
            return (t_end, spiked, steps + s.astype(jnp.int32)), spike

        zero = jnp.asarray(0, jnp.int32)
        init = (jnp.asarray(0.0), jnp.asarray(True), zero)
        (_, _, steps), buf = jax.lax.scan(body, init, None, length=max_spikes)
        return buf, steps

    return one


def _loss(times):
    """The sum of the recorded spike times (the padding, inf, left out)."""
    return jnp.sum(jnp.where(jnp.isfinite(times), times, 0.0))


def forward(one: Callable) -> Callable:
    return jax.vmap(one)


def gradient(one: Callable) -> Callable:
    def loss(currents):
        times, steps = jax.vmap(one)(currents)
        return _loss(times), steps

    def fn(currents):
        grad, steps = jax.grad(loss, has_aux=True)(currents)
        return grad, steps

    return fn


def methods(max_spikes: int, variant: str, s: Settings) -> dict[str, Callable]:
    """The methods of a variant: name -> one neuron's function."""
    diffrax_seg, solverkit_seg = _diffrax_segment(s), _solverkit_segment(s)
    loop = while_loop if variant == "forward" else scan_loop
    return {
        "solverkit effect": solverkit_effect(max_spikes, s),
        "diffrax loop": loop(diffrax_seg, max_spikes),
        "solverkit loop": loop(solverkit_seg, max_spikes),
    }


def check(
    variant: str, result, current, times, counts, s: Settings
) -> tuple[float, str]:
    """The largest error against the exact values, and a note: empty, or why the
    result is wrong (a spike count that differs, or an error beyond what the
    tolerance allows)."""
    if variant == "forward":
        got = np.asarray(result)
        got_counts = np.sum(np.isfinite(got), axis=1)
        if not np.array_equal(got_counts, counts):
            bad = np.flatnonzero(got_counts != counts)[:3]
            return math.inf, (
                f"WRONG: spike counts {got_counts[bad]} where exact {counts[bad]}"
            )
        finite = np.isfinite(times)
        error = float(np.max(np.abs(got[finite] - times[finite])))
        limit = s.forward_limit
    else:
        want = exact_gradient(current, counts)
        error = float(np.max(np.abs(np.asarray(result) - want) / np.abs(want)))
        limit = s.grad_limit
    if not error < limit:
        return error, f"WRONG: error {error:.1e} >= {limit:.0e}"
    return error, ""


def first_call(fn: Callable, args: tuple, fresh: bool = True):
    """`(seconds, compiled, output)`: trace, lower, compile and one run after
    `jax.clear_caches()` (`fresh`), as `harness.measure` times a first call."""
    if fresh:
        jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    return time.perf_counter() - start, compiled, out


HEADER = (
    "| variant | method | first call s | run s median [min] | per spike us | "
    "steps | max error | run / diffrax loop | first / diffrax loop | note |"
)


def run(
    size: int,
    repeats: int,
    max_spikes: int,
    variants: list[str],
    s: Settings,
    fresh: bool = True,
) -> list[dict]:
    """The rows; `fresh=False` (`--quick`) keeps JAX's caches between first calls."""
    current = currents(size)
    times, counts = exact_spikes(current, max_spikes)
    if counts.max() >= max_spikes:
        raise ValueError(f"--max-spikes {max_spikes} <= the most spikes {counts.max()}")
    spikes = int(counts.sum())
    print(
        f"device: {jax.devices()[0].device_kind}, {s.dtype}, N = {size}, "
        f"{spikes} spikes ({spikes / size:.1f} a neuron, {counts.min()} to "
        f"{counts.max()}), repeats {repeats}"
    )
    print(HEADER)
    print("|" + " --- |" * (HEADER.count("|") - 1))
    rows = []
    args = (jnp.asarray(current, s.dtype),)
    for variant in variants:
        wrap = forward if variant == "forward" else gradient
        fns = {name: wrap(one) for name, one in methods(max_spikes, variant, s).items()}
        # Each method's first call and its check against the exact values (so that
        # every method is seen to compute the same thing before it is timed) ...
        first, compiled, errors, notes, steps = {}, {}, {}, {}, {}
        for name, fn in fns.items():
            first[name], compiled[name], (result, n_steps) = first_call(fn, args, fresh)
            errors[name], notes[name] = check(
                variant, result, current, times, counts, s
            )
            steps[name] = int(np.max(np.asarray(n_steps)))
        # ... then the run times, the methods taking turns (a shared machine's load
        # then weighs on all alike).
        runs: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in compiled.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                runs[name].append(time.perf_counter() - start)
        base = "diffrax loop"
        for name in fns:
            median = statistics.median(runs[name])
            row = {
                "variant": variant,
                "method": name,
                "size": size,
                "spikes": spikes,
                "first_call_s": first[name],
                "run_median_s": median,
                "run_min_s": min(runs[name]),
                "repeats": repeats,
                "per_spike_us": median / spikes * 1e6,
                "steps": steps[name],
                "max_error": errors[name],
                "run_ratio": median / statistics.median(runs[base]),
                "first_ratio": first[name] / first[base],
                "note": notes[name],
            }
            rows.append(row)
            print(
                f"| {variant} | {name} | {row['first_call_s']:.2f} | "
                f"{median:.4f} [{row['run_min_s']:.4f}] | "
                f"{row['per_spike_us']:.2f} | {row['steps']} | "
                f"{row['max_error']:.1e} | {row['run_ratio']:.2f} | "
                f"{row['first_ratio']:.2f} | {row['note']} |",
                flush=True,
            )
    return rows


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="N=64, 1 repeat, JAX's caches kept between first calls",
    )
    parser.add_argument("--size", type=int, default=None, help="neurons (1024)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-spikes", type=int, default=MAX_SPIKES)
    parser.add_argument("--variants", default="forward,grad")
    parser.add_argument("--json", type=str, default=None, help="write the rows here")
    parser.add_argument("--dtype", choices=tuple(SETTINGS), default="float64")
    opts = parser.parse_args(argv)
    settings = SETTINGS[opts.dtype]
    jax.config.update("jax_enable_x64", opts.dtype == "float64")
    size = opts.size or (64 if opts.quick else 1024)
    repeats = opts.repeats or (1 if opts.quick else 5)
    variants = opts.variants.split(",")
    rows = run(size, repeats, opts.max_spikes, variants, settings, not opts.quick)
    if opts.json:
        meta = {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "diffrax": diffrax.__version__,
            "python": platform.python_version(),
            "commit": _commit(),
            "dtype": opts.dtype,
            "command": " ".join(["python -m benchmarks.events", *sys.argv[1:]]),
        }
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
