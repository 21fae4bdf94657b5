"""The `solverkit-ensemble` peer: a case's ensemble through solverkit's ensemble API,
`solverkit.ensemble_solve(..., kernel=None)`, which takes the whole-solve Pallas
kernel where it supports the solve (on a TPU: an explicit FSAL Runge-Kutta method
with a `PIDController` or `ConstantStepSize`, no per-trajectory times, `SaveAt(t1=True)`
or `ts`) and the lane loop otherwise (any solve off a TPU: on an accelerator its
default is the lockstep loop, on a CPU lane refill).

Each trajectory's parameters go through `args` (a leading batch axis on every array
leaf), as `ensemble_solve` takes them; its gradient with respect to them is that of
`jax.vmap(diffeqsolve)` to round-off. The row's note says which path the compiled
program took (`explain`).
"""

from collections.abc import Callable
from typing import Any

import jax


# `ensemble_solve`'s `kernel=`: None (the library's choice) in the suite; a test sets
# True to run the kernel on a CPU, in Pallas' interpreter.
KERNEL: bool | None = None
# The custom call of a Pallas (Mosaic) kernel in a TPU program's HLO.
_PALLAS_CALL = 'custom_call_target="tpu_custom_call"'


def final(
    sk: Any,
    field: Callable,
    y0: Any,
    args: Any,
    *,
    t1: float,
    dt0: float | None,
    controller: Any,
    throw: bool,
    adjoint: Any = None,
    max_steps: int | None = 4096,
) -> tuple[Any, Any]:
    """Solve the batch `y0`, `args` (leading axis `N`) with Tsit5 from t = 0 to `t1`.

    **Arguments:**

    - `sk`: the solverkit module.
    - `field`: `field(t, y, args)`, one trajectory's vector field.
    - `y0`, `args`: the batch: every array leaf has a leading axis of length `N`.
    - `t1`, `dt0`, `controller`, `throw`, `adjoint`, `max_steps`: as for
        `ensemble_solve` (`adjoint=None`: its default).

    **Returns:**

    `(final states (N, ...), steps per trajectory (N,))`.
    """
    sol = sk.ensemble_solve(
        sk.ODETerm(field), sk.Tsit5(), 0.0, t1, dt0, y0, args,
        stepsize_controller=controller, max_steps=max_steps, throw=throw,
        adjoint=adjoint, kernel=KERNEL,
    )  # fmt: skip
    last = jax.tree_util.tree_map(lambda a: a[:, -1], sol.ys)
    return last, sol.stats["num_steps"]


def explain(grad: bool) -> Callable[[Any], str]:
    """`compiled -> note`: which path a compiled `ensemble_solve` program took, from
    its Pallas calls: none (the lane loop), one (the kernel; for a gradient, with
    the lane loop's backward pass), two (a gradient: the kernel forward, then again
    with forward sensitivities).

    **Arguments:**

    - `grad`: whether the program is a gradient.
    """

    def note(compiled: Any) -> str:
        try:
            text = compiled.as_text()
        except Exception:  # noqa: BLE001 - a backend without HLO text
            return ""
        calls = text.count(_PALLAS_CALL)
        if calls == 0 and "tpu_custom_call" in text:
            return "path: kernel (its calls not counted)"
        if calls == 0:
            interpreted = KERNEL and jax.default_backend() != "tpu"
            return (
                "path: kernel (Pallas' interpreter)"
                if interpreted
                else "path: lane loop"
            )
        if not grad:
            return "path: whole-solve kernel"
        if calls == 1:
            return "path: kernel forward, lane-loop backward"
        # this backward pass does not use the adjoint
        return "path: kernel forward, kernel forward sensitivities (adjoint unused)"

    return note
