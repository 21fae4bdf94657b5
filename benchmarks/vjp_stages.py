"""Why a reverse step costs ~10x a forward step on XLA:CPU: the cotangent of a vector
field that indexes its state (`y[0]`, `jnp.stack`) becomes `pad`s, and XLA:CPU's
fusions of many pads slow down far faster than linearly with the number of Runge-Kutta
stages chained in one step. Pure JAX, no solver: 111 steps of an `s`-stage explicit
scheme on the Lorenz field, vmapped over N = 1024, forward and one VJP per step.

Run: `python -m benchmarks.vjp_stages` (measured at 2da056c on 2 cores: 1 stage
0.4 ms, 2 stages 2.8 ms, 3 stages 39 ms, 7 stages 340 ms for the VJP loop, against
5 ms for the 7-stage forward loop; a field without indexing: 3 ms).
"""

import time

import jax
import jax.numpy as jnp


def _lorenz(y, rho):
    return jnp.stack(
        [10.0 * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - 8 / 3 * y[2]]
    )


def _loops(stages: int, n: int = 1024, steps: int = 111):
    def step(y, rho, h=1e-3):
        k = [_lorenz(y, rho)]
        for i in range(stages - 1):
            k.append(_lorenz(y + h * sum(k) / (i + 1), rho))
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
    print("| stages | forward loop | VJP loop |\n|---|---|---|")
    for stages in (1, 2, 3, 4, 7):
        forward, backward = _loops(stages)
        print(
            f"| {stages} | {_best(forward, rho) * 1e3:.1f} ms "
            f"| {_best(backward, rho) * 1e3:.1f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
