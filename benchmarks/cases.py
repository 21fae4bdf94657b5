"""The benchmark cases, and how each library runs them.

A case builds, for one ensemble size, a list of `Task`s (one per variant and library)
and a `Reference` to measure errors against. solverkit's vector fields close over
their parameters; diffrax receives them through `args` (the only way its
`BacksolveAdjoint` accepts them), plus a `diffrax-closure` row that closes over them
as solverkit does, to show where diffrax refuses. gradsolve runs its own
record-and-replay engines. References are diffrax solves in float64 at
rtol = atol = 1e-10 (of the forward sensitivity equations where the parameters are
few), on at most `REFERENCE_ROWS` trajectories of the ensemble.

The `solverkit-ensemble` peer runs the ensemble cases (Lorenz, Lotka-Volterra)
through `solverkit.ensemble_solve` instead of `jax.vmap(solverkit.diffeqsolve)`
(`ensemble_peer`). Every solverkit and diffrax solve takes the suite's `throw`.
"""

import dataclasses
import importlib
import os
import statistics
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from . import ensemble_peer
from .harness import compiled_memory, Job, precision, Record
from .problems import PROBLEMS as STIFF_PROBLEMS, StiffProblem


PEERS = ("solverkit", "solverkit-ensemble", "diffrax", "gradsolve", "torchdiffeq")
# variant name suffix -> adjoint class name
ADJOINTS = {
    "checkpoint": "RecursiveCheckpointAdjoint",
    "backsolve": "BacksolveAdjoint",
    "direct": "DirectAdjoint",
}
REFERENCE_ROWS = 256
REFERENCE_TOL = 1e-10
REFERENCE_MAX_STEPS = 100_000


def load_peers(names: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Import the requested libraries.

    **Arguments:**

    - `names`: library names from `PEERS`.

    **Returns:**

    `(available, missing)`: library name to module, and library name to why it could
    not be imported.
    """
    available: dict[str, Any] = {}
    missing: dict[str, str] = {}
    for name in names:
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
        try:
            if name == "gradsolve":
                # gradsolve switches float64 on globally at import unless told not to;
                # every job here chooses its own precision instead.
                before = os.environ.get("GRADSOLVE_X64")
                os.environ["GRADSOLVE_X64"] = "0"
                try:
                    with warnings.catch_warnings():  # its float64 constants, in float32
                        warnings.simplefilter("ignore")
                        module = importlib.import_module("gradsolve")
                finally:
                    if before is None:
                        del os.environ["GRADSOLVE_X64"]
                    else:
                        os.environ["GRADSOLVE_X64"] = before
                jax.config.update("jax_enable_x64", False)
            else:  # solverkit-ensemble: solverkit's ensemble API
                module = importlib.import_module(name.removesuffix("-ensemble"))
            available[name] = module
        except Exception as e:  # noqa: BLE001 - any import failure means "skip it"
            missing[name] = f"{type(e).__name__}: {e}".splitlines()[0]
    return available, missing


@dataclasses.dataclass(frozen=True)
class Task:
    """One library on one variant of a case: `make()` builds the `Job` (it may raise,
    which records the library as unsupported); `compare` names the reference entry
    (`"y"` final states, `"grad"` the gradient) its result is checked against;
    `throw` the `throw` of its solves (`None`: the library has no such setting)."""

    variant: str
    library: str
    dtype: str
    make: Callable[[], Job]
    compare: str
    throw: bool | None = None


@dataclasses.dataclass(frozen=True)
class Reference:
    """Reference values (`"y"`, `"grad"`) for the trajectories `rows` of the ensemble
    (`None`: the whole result, for a gradient with respect to shared parameters)."""

    rows: np.ndarray | None
    values: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Case:
    """A benchmark problem: its ensemble sizes per profile, how to build its tasks
    for one size, its reference solution for one size, and the variants that
    `--quick` runs (`None`: all)."""

    name: str
    description: str
    sizes: dict[str, list[int]]  # profile ("quick", "cpu", "gpu") -> sizes
    # (size, libraries, dtype, throw) -> tasks; dtype None: the case's own
    # precisions, "float32": solverkit's and diffrax's float64 variants in float32
    # (accelerators); throw: every solverkit and diffrax solve's `throw`
    tasks: Callable[[int, dict[str, Any], str | None, bool], list[Task]]
    reference: Callable[[int], Reference]
    quick_variants: tuple[str, ...] | None = None


# ---------------------------------------------------------------- shared helpers


def _final(
    lib: Any,
    field: Callable,
    y0: Any,
    args: Any,
    *,
    solver: Any,
    t1: float,
    dt0: float,
    **kw: Any,
) -> tuple:
    """Solve from t = 0 to `t1` with a library of diffrax's API (`kw`: the rest of
    `diffeqsolve`'s keywords); return `(final state, number of steps)`."""
    sol = lib.diffeqsolve(lib.ODETerm(field), solver, 0.0, t1, dt0, y0, args, **kw)
    return jax.tree_util.tree_map(lambda a: a[-1], sol.ys), sol.stats["num_steps"]


def _subsample(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Trajectories the reference is computed for: `rows` (at most `REFERENCE_ROWS`,
    spread over the ensemble), and the same padded to `REFERENCE_ROWS` so that the
    reference compiles once for every ensemble size."""
    rows = np.unique(np.linspace(0, n - 1, min(n, REFERENCE_ROWS)).round().astype(int))
    padded = np.concatenate([rows, np.full(REFERENCE_ROWS - len(rows), rows[-1])])
    return rows, padded


def _sensitivity_reference(
    key: str, field: Callable, t1: float, params: np.ndarray, y0: np.ndarray
) -> Reference:
    """Final states and gradients of `sum(final states ** 2)` with respect to each
    trajectory's parameters, from the forward sensitivity equations (no automatic
    differentiation through a solver): `S' = df/dy S + df/dp`, `grad = 2 S^T y`.

    **Arguments:**

    - `key`: names the jitted function, so that it compiles once per process.
    - `field`: `field(y, p)`, one trajectory's vector field.
    - `t1`: final time (the start is 0).
    - `params`, `y0`: `(n, P)` and `(n, d)`, the whole ensemble.

    **Returns:**

    The `Reference` on a subsample of the ensemble, in float64.
    """
    rows, padded = _subsample(len(y0))

    def build() -> Callable:
        def augmented(t, z, p):
            y, s = z
            dfdy, dfdp = jax.jacfwd(field, argnums=(0, 1))(y, p)
            return field(y, p), dfdy @ s + dfdp

        def one(p, y0):
            z0 = (y0, jnp.zeros((y0.shape[0], p.shape[0]), y0.dtype))
            (y, s), _ = _final(
                diffrax,
                augmented,
                z0,
                p,
                solver=diffrax.Tsit5(),
                t1=t1,
                dt0=1e-3,
                stepsize_controller=diffrax.PIDController(
                    rtol=REFERENCE_TOL, atol=REFERENCE_TOL
                ),
                max_steps=REFERENCE_MAX_STEPS,
            )
            return {"y": y, "grad": 2.0 * s.T @ y}

        return jax.jit(jax.vmap(one))

    with precision("float64"):
        fn = _reference_fn(key, build)
        out = fn(jnp.asarray(params[padded]), jnp.asarray(y0[padded]))
        out = {k: np.asarray(v)[: len(rows)] for k, v in out.items()}
    return Reference(rows=rows, values=out)


def _gradsolve_problem(f_jax: Callable, dim: int, t1: float) -> Any:
    """A gradsolve problem (its protocol is duck-typed: these six attributes)."""
    return types.SimpleNamespace(
        name="solverkit_benchmark", dim=dim, t0=0.0, t1=t1, is_stiff=False, f_jax=f_jax
    )


def _gradsolve_device() -> str:
    return "cpu" if jax.default_backend() == "cpu" else "cuda"


def _gradsolve_forward(gs: Any, problem: Any, y0: Any, p: Any, tol: float) -> Job:
    """gradsolve's adaptive forward solve (its own Tsit5 record-and-replay engine)."""

    def run(y0, p):
        res = gs.solve(
            problem,
            y0,
            p,
            engine="tsit5_replay",
            fused=False,
            rtol=tol,
            atol=tol,
            device=_gradsolve_device(),
        )
        return res.y_final, res.accepted_steps + res.rejected_steps

    return Job(run, (np.asarray(y0, np.float64), np.asarray(p, np.float64)), jit=False)


def _gradsolve_grad(
    gs: Any,
    problem: Any,
    y0: Any,
    p: Any,
    tol: float,
    loss: Callable,
    finish: Callable = lambda g: g,
) -> Job:
    """gradsolve's gradient: `grad_closure` records the accepted steps at `p`, then
    `jax.grad` differentiates `loss(closure(p))` through the replay. Both are timed,
    as a gradient at new parameters needs both. `finish` maps the gradient with
    respect to `p` to the reported result."""
    y0 = np.asarray(y0, np.float64)
    last: dict[str, Callable] = {}

    def run(p):
        closure = gs.grad_closure(
            problem, y0, p, fused=False, rtol=tol, atol=tol, device=_gradsolve_device()
        )
        last["closure"] = closure
        return finish(jax.grad(lambda q: loss(closure(q)))(jnp.asarray(p))), None

    def replay_only(record: Record) -> None:
        """Memory and run time of the replayed gradient alone (jitted, with the
        steps recorded by the last call): what a caller pays while the recording
        stays valid."""
        p = jnp.asarray(args[0])
        compiled = jax.jit(jax.grad(lambda q: loss(last["closure"](q)))).lower(p)
        compiled = compiled.compile()
        record.memory_bytes = compiled_memory(compiled)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(compiled(p))
            times.append(time.perf_counter() - start)
        record.note = (
            "run = record + replayed gradient; replay alone (jitted, steps "
            f"recorded once) {statistics.median(times) * 1e3:.3g} ms"
        )

    args = (np.asarray(p, np.float64),)
    return Job(run, args, jit=False, after=replay_only)


def _unsupported_in_library(library: str, reason: str) -> Callable[[], Job]:
    def make() -> Job:
        raise NotImplementedError(f"{library}: {reason}")

    return make


def _torchdiffeq_tasks(libs: dict[str, Any], variants: list[tuple[str, str, str]]):
    """torchdiffeq rows: no case has a PyTorch port yet, so each says so."""
    if "torchdiffeq" not in libs:
        return []
    make = _unsupported_in_library("torchdiffeq", "no PyTorch port of this case")
    return [Task(v, "torchdiffeq", d, make, c) for v, d, c in variants]


# ------------------------------------------------------ (a) Lotka-Volterra ensemble

LV_T1, LV_TOL, LV_DT0 = 10.0, 1e-6, 0.01


def _lv_field(y: jax.Array, p: jax.Array) -> jax.Array:
    prey, predator = y[0], y[1]
    return jnp.stack(
        [p[0] * prey - p[1] * prey * predator, p[3] * prey * predator - p[2] * predator]
    )


def _lv_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-trajectory parameters (alpha, beta, gamma, delta) and initial states."""
    s = np.linspace(0.0, 1.0, n)[:, None]
    params = np.array([1.5, 1.0, 3.0, 1.0]) * (1.0 + 0.2 * s)
    y0 = np.concatenate([1.0 + s, np.ones_like(s)], axis=1)
    return params, y0


def _lv_solve(lib: Any, closed: bool, adjoint: Any, throw: bool = True) -> Callable:
    """`(params[n, 4], y0[n, 2]) -> (final states, steps)`, vmapped over trajectories.

    With `closed=True` the vector field closes over the parameters (solverkit's way);
    otherwise they go through `args` (diffrax's way)."""
    controller = lib.PIDController(rtol=LV_TOL, atol=LV_TOL)
    common = dict(
        solver=lib.Tsit5(),
        t1=LV_T1,
        dt0=LV_DT0,
        stepsize_controller=controller,
        adjoint=adjoint,
        throw=throw,
    )

    def one(p, y0):
        if closed:
            return _final(lib, lambda t, y, args: _lv_field(y, p), y0, None, **common)
        return _final(lib, lambda t, y, p: _lv_field(y, p), y0, p, **common)

    return jax.vmap(one)


def _sum_of_squares(solve: Callable) -> Callable:
    """`(x, *rest) -> (sum(final states ** 2), (final states, steps))`."""

    def loss(*args):
        y, steps = solve(*args)
        return jnp.sum(y**2), (y, steps)

    return loss


def _sum_of_squares_grad(solve: Callable) -> Callable:
    """`(x, *rest) -> (d/dx sum(final states ** 2), steps)`."""

    def grad(*args):
        g, (_, steps) = jax.grad(_sum_of_squares(solve), has_aux=True)(*args)
        return g, steps

    return grad


def _lv_ensemble(sk: Any, adjoint: Any, throw: bool) -> Callable:
    """`_lv_solve`'s problem through `ensemble_solve`: the parameters in `args`."""
    controller = sk.PIDController(rtol=LV_TOL, atol=LV_TOL)

    def solve(p, y0):
        field = lambda t, y, q: _lv_field(y, q)  # noqa: E731
        return ensemble_peer.final(
            sk, field, y0, p, t1=LV_T1, dt0=LV_DT0, controller=controller,
            throw=throw, adjoint=adjoint,
        )  # fmt: skip

    return solve


def lotka_volterra_tasks(
    n: int, libs: dict[str, Any], dtype: str | None = None, throw: bool = True
) -> list[Task]:
    """Forward solve, and the gradient with each adjoint, of the vmapped ensemble
    (float32 whatever `dtype` says; gradsolve's engines are float64), and of the
    same through `ensemble_solve` (`solverkit-ensemble`)."""
    del dtype
    params, y0 = _lv_data(n)
    data = (jnp.asarray(params, jnp.float32), jnp.asarray(y0, jnp.float32))
    # library -> closes over params?
    styles = {"solverkit": True, "solverkit-ensemble": False, "diffrax": False}
    tasks = []
    for library, closed in styles.items():
        if library not in libs:
            continue
        lib = libs[library]
        ensemble = library == "solverkit-ensemble"

        def forward(lib=lib, closed=closed, ensemble=ensemble):
            adjoint = lib.RecursiveCheckpointAdjoint()
            if ensemble:
                solve = _lv_ensemble(lib, adjoint, throw)
                return Job(solve, data, explain=ensemble_peer.explain(False))
            return Job(_lv_solve(lib, closed, adjoint, throw), data)

        tasks.append(Task("forward", library, "float32", forward, "y", throw))
        for short, adjoint in ADJOINTS.items():
            libraries = [library]
            if library == "diffrax" and short == "backsolve":
                libraries.append("diffrax-closure")
            for label in libraries:

                def grad(lib=lib, adjoint=adjoint, label=label):
                    if label == "solverkit-ensemble":
                        solve = _lv_ensemble(lib, getattr(lib, adjoint)(), throw)
                        why = ensemble_peer.explain(True)
                        return Job(_sum_of_squares_grad(solve), data, explain=why)
                    closed = label != "diffrax"
                    solve = _lv_solve(lib, closed, getattr(lib, adjoint)(), throw)
                    return Job(_sum_of_squares_grad(solve), data)

                task = Task(f"grad-{short}", label, "float32", grad, "grad", throw)
                tasks.append(task)
    if "gradsolve" in libs:
        tasks += _lv_gradsolve_tasks(libs["gradsolve"], params, y0)
    variants = [("forward", "float32", "y")]
    variants += [(f"grad-{a}", "float32", "grad") for a in ADJOINTS]
    return tasks + _torchdiffeq_tasks(libs, variants)


def _lv_gradsolve_tasks(gs: Any, params: np.ndarray, y0: np.ndarray) -> list[Task]:
    """gradsolve's adaptive forward solve and record-and-replay gradient."""
    problem = _gradsolve_problem(lambda t, y, p: _lv_field(y, p), 2, LV_T1)
    return [
        Task(
            "forward",
            "gradsolve",
            "float64",
            lambda: _gradsolve_forward(gs, problem, y0, params, LV_TOL),
            "y",
        ),
        Task(
            "grad-record-replay",
            "gradsolve",
            "float64",
            lambda: _gradsolve_grad(
                gs, problem, y0, params, LV_TOL, lambda y: jnp.sum(y**2)
            ),
            "grad",
        ),
    ]


def lotka_volterra_reference(n: int) -> Reference:
    """Final states and gradients for a subsample of the ensemble."""
    params, y0 = _lv_data(n)
    return _sensitivity_reference("lv", lambda y, p: _lv_field(y, p), LV_T1, params, y0)


# ------------------------------------------------------------ (b) Lorenz ensemble

LORENZ_T1, LORENZ_DT, LORENZ_TOL = 1.0, 1e-3, 1e-8
# The adaptive tolerance in float32 (`--dtype float32`): 1e-8 is below float32's
# resolution (eps 1.2e-7) times the state's size (|y| up to ~20).
LORENZ_TOL_32 = 1e-5


def _lorenz_field(y: jax.Array, rho: jax.Array) -> jax.Array:
    sigma, beta = 10.0, 8.0 / 3.0
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


# The `max_steps` sweep of the adaptive gradient: variant suffix ->
# (max_steps, dt0). With `max_steps=None` both libraries need a number of checkpoints.
LORENZ_GRAD_SWEEP = {
    "": (4096, LORENZ_DT),
    "-dt0-none": (4096, None),
    "-max-1e4": (10_000, LORENZ_DT),
    "-max-1e5": (100_000, LORENZ_DT),
    "-max-none": (None, LORENZ_DT),
}
LORENZ_UNBOUNDED_CHECKPOINTS = 64


def _lorenz_controller(lib: Any, mode: str, tol: float) -> Any:
    if mode == "fixed":
        return lib.ConstantStepSize()
    return lib.PIDController(rtol=tol, atol=tol)


def _lorenz_solve(
    lib: Any,
    closed: bool,
    mode: str,
    max_steps=4096,
    dt0=LORENZ_DT,
    tol=LORENZ_TOL,
    throw: bool = True,
) -> Callable:
    """`rho[n] -> (final states[n, 3], steps)`, vmapped; `mode` is "fixed" (dt 1e-3)
    or "adaptive" (PID, rtol = atol = `tol`)."""
    controller = _lorenz_controller(lib, mode, tol)
    common = dict(
        solver=lib.Tsit5(), t1=LORENZ_T1, dt0=dt0, stepsize_controller=controller
    )
    common["max_steps"] = max_steps
    common["throw"] = throw
    if max_steps is None:
        checkpoints = LORENZ_UNBOUNDED_CHECKPOINTS
        common["adjoint"] = lib.RecursiveCheckpointAdjoint(checkpoints=checkpoints)

    def one(rho):
        y0 = jnp.array([1.0, 0.0, 0.0], dtype=rho.dtype)
        if closed:
            return _final(
                lib, lambda t, y, args: _lorenz_field(y, rho), y0, None, **common
            )
        return _final(lib, lambda t, y, r: _lorenz_field(y, r), y0, rho, **common)

    return jax.vmap(one)


def _lorenz_ensemble(sk: Any, mode: str, tol: float, throw: bool) -> Callable:
    """`_lorenz_solve`'s problem (`max_steps=4096`, dt0 1e-3) through
    `ensemble_solve`: rho in `args`."""
    controller = _lorenz_controller(sk, mode, tol)

    def solve(rho):
        y0 = jnp.broadcast_to(jnp.array([1.0, 0.0, 0.0], rho.dtype), (len(rho), 3))
        field = lambda t, y, r: _lorenz_field(y, r)  # noqa: E731
        return ensemble_peer.final(
            sk, field, y0, rho, t1=LORENZ_T1, dt0=LORENZ_DT, controller=controller,
            throw=throw,
        )  # fmt: skip

    return solve


def _lorenz_ensemble_tasks(
    sk: Any, rho: np.ndarray, dtypes: dict[str, str], tol: float, throw: bool
) -> list[Task]:
    """`solverkit-ensemble`: each mode's forward solve and gradient (not the
    adaptive gradient's `max_steps` sweep)."""
    tasks = []
    for mode, dtype in dtypes.items():
        # The arrays are made when a job is (in its precision), as for the others.

        def forward(mode=mode, dtype=dtype):
            solve = _lorenz_ensemble(sk, mode, tol, throw)
            x = (jnp.asarray(rho, dtype),)
            return Job(solve, x, explain=ensemble_peer.explain(False))

        def grad(mode=mode, dtype=dtype):
            solve = _lorenz_ensemble(sk, mode, tol, throw)
            x = (jnp.asarray(rho, dtype),)
            return Job(
                _sum_of_squares_grad(solve), x, explain=ensemble_peer.explain(True)
            )

        name = "solverkit-ensemble"
        tasks.append(Task(f"{mode}-forward", name, dtype, forward, "y", throw))
        tasks.append(Task(f"{mode}-grad", name, dtype, grad, "grad", throw))
    return tasks


def lorenz_tasks(
    n: int, libs: dict[str, Any], dtype: str | None = None, throw: bool = True
) -> list[Task]:
    """Fixed-step (float32) and adaptive (float64; with `dtype="float32"` float32 at
    rtol = atol = `LORENZ_TOL_32`) forward solves and gradients."""
    rho = np.linspace(0.0, 21.0, n)
    dtypes = {"fixed": "float32", "adaptive": dtype or "float64"}
    tol = LORENZ_TOL_32 if dtype == "float32" else LORENZ_TOL
    styles = {"solverkit": True, "diffrax": False}
    tasks = []
    for mode, dtype in dtypes.items():
        for library, closed in styles.items():
            if library not in libs:
                continue
            lib = libs[library]

            def forward(lib=lib, closed=closed, mode=mode, dtype=dtype):
                solve = _lorenz_solve(lib, closed, mode, tol=tol, throw=throw)
                return Job(solve, (jnp.asarray(rho, dtype),))

            sweep = LORENZ_GRAD_SWEEP if mode == "adaptive" else {"": (4096, LORENZ_DT)}
            tasks.append(Task(f"{mode}-forward", library, dtype, forward, "y", throw))
            for suffix, (max_steps, dt0) in sweep.items():

                def grad(
                    lib=lib, closed=closed, mode=mode, dtype=dtype, m=max_steps, d=dt0
                ):
                    solve = _lorenz_solve(lib, closed, mode, m, d, tol, throw)
                    return Job(_sum_of_squares_grad(solve), (jnp.asarray(rho, dtype),))

                variant = f"{mode}-grad{suffix}"
                tasks.append(Task(variant, library, dtype, grad, "grad", throw))
    if "solverkit-ensemble" in libs:
        sk = libs["solverkit-ensemble"]
        tasks += _lorenz_ensemble_tasks(sk, rho, dtypes, tol, throw)
    if "gradsolve" in libs:
        tasks += _lorenz_gradsolve_tasks(libs["gradsolve"], rho)
    variants = [
        (f"{m}-{k}", d, c)
        for m, d in dtypes.items()
        for k, c in (("forward", "y"), ("grad", "grad"))
    ]
    return tasks + _torchdiffeq_tasks(libs, variants)


def _lorenz_gradsolve_tasks(gs: Any, rho: np.ndarray) -> list[Task]:
    """gradsolve: its fixed-step Tsit5 scan for the fixed-step variants, its
    record-and-replay engine for the adaptive ones."""
    problem = _gradsolve_problem(lambda t, y, p: _lorenz_field(y, p[0]), 3, LORENZ_T1)
    y0 = np.tile([1.0, 0.0, 0.0], (len(rho), 1))
    p = rho[:, None]
    n_steps = round(LORENZ_T1 / LORENZ_DT)
    from gradsolve.solvers import fixed_step_tsit5

    def fixed_solve(p):
        y = fixed_step_tsit5.solve_jax(
            problem, jnp.asarray(y0, p.dtype), p, n_steps=n_steps
        )
        return y, None

    def fixed_grad(p):
        g = jax.grad(lambda q: jnp.sum(fixed_solve(q)[0] ** 2))(p)
        return g[:, 0], None

    p32 = jnp.asarray(p, jnp.float32)
    return [
        Task(
            "fixed-forward",
            "gradsolve",
            "float32",
            lambda: Job(fixed_solve, (p32,)),
            "y",
        ),
        Task(
            "fixed-grad",
            "gradsolve",
            "float32",
            lambda: Job(fixed_grad, (p32,)),
            "grad",
        ),
        Task(
            "adaptive-forward",
            "gradsolve",
            "float64",
            lambda: _gradsolve_forward(gs, problem, y0, p, LORENZ_TOL),
            "y",
        ),
        Task(
            "adaptive-grad",
            "gradsolve",
            "float64",
            lambda: _gradsolve_grad(
                gs,
                problem,
                y0,
                p,
                LORENZ_TOL,
                lambda y: jnp.sum(y**2),
                lambda g: g[:, 0],
            ),
            "grad",
        ),
    ]


def lorenz_reference(n: int) -> Reference:
    """The Lorenz solution (the same for the fixed and the adaptive variants)."""
    rho = np.linspace(0.0, 21.0, n)[:, None]
    y0 = np.tile([1.0, 0.0, 0.0], (n, 1))
    ref = _sensitivity_reference(
        "lorenz", lambda y, p: _lorenz_field(y, p[0]), LORENZ_T1, rho, y0
    )
    return Reference(ref.rows, {"y": ref.values["y"], "grad": ref.values["grad"][:, 0]})


# ---------------------------------------------------------- (c) small neural ODE

NODE_T1, NODE_TOL, NODE_DT0 = 10.0, 1e-6, 0.1


def _node_model() -> tuple[Any, Any]:
    """The MLP 2 -> 64 -> 64 -> 2 (tanh), split into (float arrays, static rest).

    Its weight matrices are equinox's initialisation times 2: at plain initialisation
    the field is nearly linear and a solve takes a handful of steps; this one takes
    7 to 30 (median 16), more like a trained model."""
    mlp = eqx.nn.MLP(2, 2, 64, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    mlp = jax.tree_util.tree_map(
        lambda a: 2.0 * a if eqx.is_inexact_array(a) and a.ndim == 2 else a, mlp
    )
    return eqx.partition(mlp, eqx.is_inexact_array)


def _node_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Initial states and regression targets (the states rotated and shrunk)."""
    y0 = np.random.default_rng(0).normal(size=(n, 2))
    c, s = np.cos(1.0), np.sin(1.0)
    target = 0.8 * y0 @ np.array([[c, -s], [s, c]])
    return y0, target


def _node_loss(lib: Any, closed: bool, adjoint: Any, static: Any, tol=NODE_TOL, **kw):
    """`(mlp arrays, y0, target) -> (mean squared error at t1, steps)`."""
    common = dict(
        solver=lib.Dopri5(),
        t1=NODE_T1,
        dt0=NODE_DT0,
        stepsize_controller=lib.PIDController(rtol=tol, atol=tol),
        adjoint=adjoint,
        **kw,
    )

    def loss(params, y0, target):
        model = eqx.combine(params, static)
        if closed:
            solve = jax.vmap(
                lambda y0: _final(lib, lambda t, y, args: model(y), y0, None, **common)
            )
            y, steps = solve(y0)
        else:
            solve = jax.vmap(
                lambda y0, m: _final(lib, lambda t, y, m: m(y), y0, m, **common),
                in_axes=(0, None),
            )
            y, steps = solve(y0, model)
        return jnp.mean((y - target) ** 2), steps

    return loss


def neural_ode_tasks(
    n: int, libs: dict[str, Any], dtype: str | None = None, throw: bool = True
) -> list[Task]:
    """Gradient of a regression loss with respect to the MLP, with each adjoint
    (float32 whatever `dtype` says; gradsolve's engine is float64)."""
    del dtype
    params, static = _node_model()
    y0, target = _node_data(n)
    data = (params, jnp.asarray(y0, jnp.float32), jnp.asarray(target, jnp.float32))
    styles = {"solverkit": True, "diffrax": False}
    tasks = []
    for library, closed in styles.items():
        if library not in libs:
            continue
        lib = libs[library]
        for short, adjoint in ADJOINTS.items():
            labels = [library]
            if library == "diffrax" and short == "backsolve":
                labels.append("diffrax-closure")
            for label in labels:

                def grad(lib=lib, adjoint=adjoint, closed=label != "diffrax"):
                    adj = getattr(lib, adjoint)()
                    loss = _node_loss(lib, closed, adj, static, throw=throw)
                    return Job(jax.grad(loss, has_aux=True), data)

                task = Task(f"grad-{short}", label, "float32", grad, "grad", throw)
                tasks.append(task)
    if "gradsolve" in libs:
        gs = libs["gradsolve"]
        tasks.append(_node_gradsolve_task(gs, params, static, y0, target))
    variants = [(f"grad-{a}", "float32", "grad") for a in ADJOINTS]
    return tasks + _torchdiffeq_tasks(libs, variants)


def _node_gradsolve_task(gs, params, static, y0, target) -> Task:
    """gradsolve takes parameters per trajectory: the flattened MLP is tiled over the
    batch and the per-trajectory gradients summed. It has Tsit5, not Dopri5."""

    def make() -> Job:
        flat, unravel = ravel_pytree(
            jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        )
        problem = _gradsolve_problem(
            lambda t, y, p: eqx.combine(unravel(p), static)(y), 2, NODE_T1
        )
        tiled = np.tile(np.asarray(flat), (len(y0), 1))
        target64 = jnp.asarray(target, jnp.float64)
        return _gradsolve_grad(
            gs,
            problem,
            y0,
            tiled,
            NODE_TOL,
            lambda y: jnp.mean((y - target64) ** 2),
            lambda g: unravel(g.sum(axis=0)),
        )

    return Task("grad-record-replay", "gradsolve", "float64", make, "grad")


def _node_reference_fn():
    params, static = _node_model()
    loss = _node_loss(
        diffrax,
        False,
        diffrax.RecursiveCheckpointAdjoint(),
        static,
        tol=REFERENCE_TOL,
        max_steps=REFERENCE_MAX_STEPS,
    )
    return jax.jit(
        lambda p, y0, target: {"grad": jax.grad(loss, has_aux=True)(p, y0, target)[0]}
    )


def neural_ode_reference(n: int) -> Reference:
    """The gradient with respect to the (shared) MLP, in float64."""
    params, _ = _node_model()
    y0, target = _node_data(n)
    with precision("float64"):
        p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        out = _reference_fn("node", _node_reference_fn)(
            p64, jnp.asarray(y0), jnp.asarray(target)
        )
        out = jax.tree_util.tree_map(np.asarray, out)
    return Reference(rows=None, values=out)


_REFERENCE_FNS: dict[str, Callable] = {}


# ------------------------------------------------------- (d) stiff ensembles

STIFF_RTOL, STIFF_ATOL, STIFF_MAX_STEPS = 1e-6, 1e-10, 100_000
# library -> its stiff solver in this case
STIFF_SOLVERS = {"solverkit": "Rodas5P", "diffrax": "Kvaerno5"}


def _stiff_scales(n: int) -> np.ndarray:
    """`1` first (the published problem, which has a reference), then `2^u` for
    `u` in [-1, 1]: the scale of one rate constant over the ensemble."""
    return np.concatenate([[1.0], 2.0 ** np.linspace(-1.0, 1.0, max(n - 1, 1))])[:n]


def _stiff_solve(
    lib: Any, solver: str, problem: StiffProblem, throw: bool = True
) -> Callable:
    def one(scale):
        return _final(
            lib,
            problem.field(scale),
            jnp.asarray(problem.y0),
            None,
            solver=getattr(lib, solver)(),
            t1=problem.t1,
            dt0=1e-6,
            stepsize_controller=lib.PIDController(rtol=STIFF_RTOL, atol=STIFF_ATOL),
            max_steps=STIFF_MAX_STEPS,
            throw=throw,
        )

    return jax.vmap(one)


def stiff_tasks(
    n: int, libs: dict[str, Any], dtype: str | None = None, throw: bool = True
) -> list[Task]:
    """ROBER and HIRES ensembles (vector fields closing over their rate constants):
    solverkit's Rodas5P against diffrax's Kvaerno5; float64 only (atol = 1e-10), so
    `dtype="float32"` leaves them float64 and the suite skips them."""
    del dtype
    tasks = []
    for problem in (STIFF_PROBLEMS["rober"], STIFF_PROBLEMS["hires"]):
        for library, solver in STIFF_SOLVERS.items():
            if library not in libs:
                continue

            def make(lib=libs[library], solver=solver, problem=problem):
                scales = jnp.asarray(_stiff_scales(n), jnp.float64)
                return Job(_stiff_solve(lib, solver, problem, throw), (scales,))

            name = problem.name
            tasks.append(Task(name, library, "float64", make, name, throw))
    return tasks


def stiff_reference(n: int) -> Reference:
    """The Test Set's published solutions, for the ensemble's first member."""
    del n
    values = {name: STIFF_PROBLEMS[name].reference[None] for name in ("rober", "hires")}
    return Reference(np.array([0]), values)


def _reference_fn(key: str, build: Callable[[], Callable]) -> Callable:
    """Build each jitted reference function once, so it compiles once per shape."""
    if key not in _REFERENCE_FNS:
        _REFERENCE_FNS[key] = build()
    return _REFERENCE_FNS[key]


def _lorenz_sizes(largest: int) -> list[int]:
    sizes = [2**k for k in range(3, 25, 2) if 2**k <= largest]
    return sizes + ([largest] if sizes[-1] != largest else [])


CASES = {
    case.name: case
    for case in (
        Case(
            "lotka_volterra",
            "vmapped Lotka-Volterra, Tsit5, PID rtol=atol=1e-6, t in [0, 10], "
            "parameters closed over (solverkit) or in args (diffrax); loss = sum of "
            "squared final states, gradient w.r.t. the per-trajectory parameters",
            {
                "quick": [1024],
                "cpu": [1024, 4096, 16384],
                "gpu": [2**10, 2**12, 2**14, 2**16, 2**18, 2**20],
            },
            lotka_volterra_tasks,
            lotka_volterra_reference,
            ("forward", "grad-checkpoint", "grad-backsolve", "grad-record-replay"),
        ),
        Case(
            "lorenz",
            "Lorenz ensemble (DiffEqGPU.jl): rho = linspace(0, 21, N), t in [0, 1], "
            "Tsit5; fixed dt=1e-3 (float32) and PID rtol=atol=1e-8 (float64; "
            "1e-5 in float32 with --dtype float32); loss = "
            "sum of squared final states, gradient w.r.t. rho",
            {
                "quick": [16, 256, 4096],
                "cpu": _lorenz_sizes(2**16),
                "gpu": _lorenz_sizes(2**24),
            },
            lorenz_tasks,
            lorenz_reference,
            ("fixed-forward", "adaptive-forward", "adaptive-grad"),
        ),
        Case(
            "neural_ode",
            "neural ODE, equinox MLP 2->64->64->2 (tanh, weights x2), vmapped "
            "over the batch, Dopri5, PID rtol=atol=1e-6, t in [0, 10]; gradient of "
            "a mean squared error w.r.t. the MLP",
            {"quick": [256], "cpu": [256], "gpu": [256, 4096, 65536]},
            neural_ode_tasks,
            neural_ode_reference,
            ("grad-backsolve", "grad-record-replay"),
        ),
        Case(
            "stiff",
            "vmapped stiff ensembles ROBER (t1 = 1e5) and HIRES of the Test Set for "
            "IVP Solvers, one rate constant scaled over [0.5, 2], closed over; "
            "PID rtol=1e-6, atol=1e-10, float64; solverkit Rodas5P, diffrax "
            "Kvaerno5; error against the published solution (first member). The "
            "work-precision sweep is `python -m benchmarks.stiff`",
            {"quick": [64], "cpu": [256], "gpu": [256, 4096, 65536]},
            stiff_tasks,
            stiff_reference,
        ),
    )
}
