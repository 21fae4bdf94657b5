"""Lines of the traced program of a few solves: how much the engine makes JAX trace
and XLA compile. Run as `python -m tools.jaxpr_size`; compare before and after a
change to the engine (the architecture must not make these grow).

- LV forward: `vmap` over 1024 Lotka-Volterra solves, Tsit5, PIDController(1e-6).
- LV grad: `vmap(grad)` of the same, RecursiveCheckpointAdjoint; and through
  BacksolveAdjoint (vmapped) and DirectAdjoint (one solve).
- constant step: one LV solve with ConstantStepSize.
- ROBER with Kvaerno5 (forward and gradient) and Rodas5P, and a linear IMEX solve
  with KenCarp4: the implicit, Rosenbrock and IMEX steps.
"""

import jax
import jax.numpy as jnp

import solverkit as sk


def _vf(t, y, args):
    a, b, c, d = args
    x, z = y
    return jnp.stack([a * x - b * x * z, -c * z + d * x * z])


def _solve(y0, args, controller, adjoint=sk.RecursiveCheckpointAdjoint()):
    term = sk.ODETerm(_vf)
    return sk.diffeqsolve(
        term,
        sk.Tsit5(),
        0.0,
        10.0,
        0.1,
        y0,
        args,
        stepsize_controller=controller,
        adjoint=adjoint,
    ).ys


def _rober(t, y, args):
    a, b, c = y
    return jnp.stack(
        [-0.04 * a + 1e4 * b * c, 0.04 * a - 1e4 * b * c - 3e7 * b**2, 3e7 * b**2]
    )


def _stiff(y0, solver, controller):
    term = sk.ODETerm(_rober)
    return sk.diffeqsolve(
        term, solver, 0.0, 1.0, 1e-4, y0, stepsize_controller=controller
    ).ys


def _imex(y0, controller):
    terms = sk.MultiTerm(
        sk.ODETerm(lambda t, y, args: -0.1 * y),
        sk.ODETerm(lambda t, y, args: -100.0 * y),
    )
    return sk.diffeqsolve(
        terms, sk.KenCarp4(), 0.0, 1.0, 1e-3, y0, stepsize_controller=controller
    ).ys


def main() -> None:
    y0, args = jnp.ones((1024, 2)), jnp.ones((1024, 4))
    r0 = jnp.array([1.0, 0.0, 0.0])
    pid = sk.PIDController(rtol=1e-6, atol=1e-6)
    back = sk.BacksolveAdjoint()
    cases = [
        ("LV forward", jax.vmap(lambda y, a: _solve(y, a, pid)), (y0, args)),
        (
            "LV grad",
            jax.vmap(jax.grad(lambda y, a: _solve(y, a, pid).sum())),
            (y0, args),
        ),
        (
            "constant step",
            lambda y, a: _solve(y, a, sk.ConstantStepSize()),
            (y0[0], args[0]),
        ),
        (
            "LV grad backsolve",
            jax.vmap(jax.grad(lambda y, a: _solve(y, a, pid, back).sum())),
            (y0, args),
        ),
        (
            "LV grad direct",
            jax.grad(lambda y, a: _solve(y, a, pid, sk.DirectAdjoint()).sum()),
            (y0[0], args[0]),
        ),
        ("ROBER Kvaerno5", lambda y: _stiff(y, sk.Kvaerno5(), pid), (r0,)),
        ("ROBER Rodas5P", lambda y: _stiff(y, sk.Rodas5P(), pid), (r0,)),
        (
            "ROBER Kvaerno5 grad",
            jax.grad(lambda y: _stiff(y, sk.Kvaerno5(), pid).sum()),
            (r0,),
        ),
        ("IMEX KenCarp4", lambda y: _imex(y, pid), (r0,)),
    ]
    for name, fn, inputs in cases:
        lines = len(str(jax.make_jaxpr(fn)(*inputs)).splitlines())
        print(f"{name}: {lines} jaxpr lines")


if __name__ == "__main__":
    main()
