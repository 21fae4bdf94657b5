"""Why a reverse step costs ~10x a forward step on XLA:CPU: the cotangent of a vector
field that indexes its state (`y[0]`, `jnp.stack`) becomes `pad`s, and XLA:CPU's
fusions of many pads slow down far faster than linearly with the number of Runge-Kutta
stages chained in one step. Pure JAX, no solver: 111 steps of an `s`-stage explicit
scheme on the Lorenz field, vmapped over N = 1024, forward and one VJP per step.

Run: `python -m benchmarks.vjp_stages` (measured at 2da056c on 2 cores: 1 stage
0.4 ms, 2 stages 2.8 ms, 3 stages 39 ms, 7 stages 340 ms for the VJP loop, against
5 ms for the 7-stage forward loop; a field without indexing: 3 ms).

The last column takes the components with one `lax.split`, as solverkit's closure
conversion now does with the slices of a vector field
(`_jaxpr_rewrite._split_slices`): its transpose is one `concatenate`, without pads.
Measured in session 6 on 2 cores (JAX 0.10.2): 7 stages, 2.1 ms forward, 42.9 ms VJP
with slices, 3.9 ms with the split.
"""

import time

import jax
import jax.numpy as jnp


def _lorenz(y, rho, split: bool = False):
    if split:
        a, b, c = (p[0] for p in jax.lax.split(y, (1, 1, 1)))
    else:
        a, b, c = y[0], y[1], y[2]
    return jnp.stack([10.0 * (b - a), a * (rho - c) - b, a * b - 8 / 3 * c])


def _loops(stages: int, n: int = 1024, steps: int = 111, split: bool = False):
    def step(y, rho, h=1e-3):
        k = [_lorenz(y, rho, split)]
        for i in range(stages - 1):
            k.append(_lorenz(y + h * sum(k) / (i + 1), rho, split))
        return y + h * sum(k) / stages

    batched = jax.vmap(step)

    def forward(rho):
        y = jnp.ones((n, 3), rho.dtype)
        return jax.lax.fori_loop(0, steps, lambda i, y: batched(y, rho), y)

    def backward(rho):
        y = jnp.ones((n, 3), rho.dtype)

        def body(i, state):
            ct_y, ct_rho = state
            _, pullback = jax.vjp(batched, y, rho)
            a, b = pullback(ct_y)
            return a, ct_rho + b

        return jax.lax.fori_loop(0, steps, body, (y, rho))

    return jax.jit(forward), jax.jit(backward)


def _best(f, x, repeats: int = 5) -> float:
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    rho = jnp.linspace(0.0, 21.0, 1024)
    print("| stages | forward loop | VJP loop | VJP loop, split |\n|---|---|---|---|")
    for stages in (1, 2, 3, 4, 7):
        forward, backward = _loops(stages)
        _, split = _loops(stages, split=True)
        print(
            f"| {stages} | {_best(forward, rho) * 1e3:.1f} ms "
            f"| {_best(backward, rho) * 1e3:.1f} ms "
            f"| {_best(split, rho) * 1e3:.1f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
