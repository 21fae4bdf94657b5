"""Lines of the traced program of three solves: how much the engine makes JAX trace
and XLA compile. Run as `python -m benchmarks.jaxpr_size`; compare before and after a
change to the engine (the architecture must not make these grow).

- LV forward: `vmap` over 1024 Lotka-Volterra solves, Tsit5, PIDController(1e-6).
- LV grad: `vmap(grad)` of the same, RecursiveCheckpointAdjoint.
- constant step: one LV solve with ConstantStepSize.
"""

import jax
import jax.numpy as jnp

import solverkit as sk


def _vf(t, y, args):
    a, b, c, d = args
    x, z = y
    return jnp.stack([a * x - b * x * z, -c * z + d * x * z])


def _solve(y0, args, controller):
    term = sk.ODETerm(_vf)
    return sk.diffeqsolve(
        term, sk.Tsit5(), 0.0, 10.0, 0.1, y0, args, stepsize_controller=controller
    ).ys


def main() -> None:
    y0, args = jnp.ones((1024, 2)), jnp.ones((1024, 4))
    pid = sk.PIDController(rtol=1e-6, atol=1e-6)
    forward = jax.vmap(lambda y, a: _solve(y, a, pid))
    grad = jax.vmap(jax.grad(lambda y, a: _solve(y, a, pid).sum()))
    constant = lambda y, a: _solve(y, a, sk.ConstantStepSize())
    for name, fn, inputs in [
        ("LV forward", forward, (y0, args)),
        ("LV grad", grad, (y0, args)),
        ("constant step", constant, (y0[0], args[0])),
    ]:
        lines = len(str(jax.make_jaxpr(fn)(*inputs)).splitlines())
        print(f"{name}: {lines} jaxpr lines")


if __name__ == "__main__":
    main()
