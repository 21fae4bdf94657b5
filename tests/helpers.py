"""Shared test helpers: the lists of solvers (with `make_solver` and `make_terms`),
`tree_allclose`, float64, test problems (the rotation and its solve), compile
counting. (Fixtures are in conftest.py.)

Import from test files as `from helpers import ...` (pytest puts `tests/` on the path,
as it has no `__init__.py`).
"""

import contextlib
import os
import threading
from collections.abc import Iterator

import jax
import jax.monitoring
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import solverkit as sk


# (solver class, order of the propagated solution, has an embedded error estimate),
# by family. The shared matrices (solve/test_integrate.py,
# diffrax_compat/test_diffrax_api.py, ...) run over `ALL_SOLVERS`; build a solver and
# its terms with `make_solver` and `make_terms`,
# which know what each family needs.
EXPLICIT_SOLVERS = [
    (sk.Euler, 1, False),
    (sk.Heun, 2, True),
    (sk.Midpoint, 2, True),
    (sk.Ralston, 2, True),
    (sk.Bosh3, 3, True),
    (sk.Tsit5, 5, True),
    (sk.Dopri5, 5, True),
    (sk.Dopri8, 8, True),
    (sk.ReversibleHeun, 2, True),
    (sk.LeapfrogMidpoint, 2, False),
]
# ESDIRK methods, implicit in the whole vector field: with a constant step size they
# need a root finder with tolerances (`make_solver`).
IMPLICIT_SOLVERS = [
    (sk.ImplicitEuler, 1, True),
    (sk.Kvaerno3, 3, True),
    (sk.Kvaerno4, 4, True),
    (sk.Kvaerno5, 5, True),
]
# IMEX methods: as the implicit ones, and they take `MultiTerm(explicit, implicit)`
# (`make_terms`).
IMEX_SOLVERS = [
    (sk.KenCarp3, 3, True),
    (sk.KenCarp4, 4, True),
    (sk.KenCarp5, 5, True),
    (sk.Sil3, 2, True),
]
# Rosenbrock (linearly implicit) methods: no root finder.
ROSENBROCK_SOLVERS = [
    (sk.Rosenbrock23, 2, True),
    (sk.Ros3P, 3, True),
    (sk.Rodas4, 4, True),
    (sk.Rodas5P, 5, True),
]
ALL_SOLVERS = EXPLICIT_SOLVERS + IMPLICIT_SOLVERS + IMEX_SOLVERS + ROSENBROCK_SOLVERS
ADAPTIVE_SOLVERS = [cls for cls, _, adaptive in ALL_SOLVERS if adaptive]
# The explicit Runge-Kutta methods (one tableau each).
RK_SOLVERS = [
    cls for cls, _, _ in ALL_SOLVERS if issubclass(cls, sk.AbstractRungeKutta)
]
# Solvers with their own dense output (the rest use Hermite or linear interpolation).
DENSE_SOLVERS = [sk.Tsit5, sk.Dopri5, sk.Dopri8, sk.Rosenbrock23, sk.Rodas4, sk.Rodas5P]
# The solvers that the compiling shared matrices keep in the quick loop (`-m "not
# slow"`): three explicit ones of different kinds and one per stiff family, cheap to
# compile; the other cases are marked slow (`solver_params`).
QUICK_SOLVERS = (
    sk.Euler,
    sk.Tsit5,
    sk.LeapfrogMidpoint,
    sk.Kvaerno3,
    sk.KenCarp3,
    sk.Rosenbrock23,
)

_FAMILIES = {
    "explicit": EXPLICIT_SOLVERS,
    "implicit": IMPLICIT_SOLVERS,
    "imex": IMEX_SOLVERS,
    "rosenbrock": ROSENBROCK_SOLVERS,
}


def family(cls) -> str:
    """ "explicit", "implicit" (ESDIRK), "imex" or "rosenbrock"."""
    for name, solvers in _FAMILIES.items():
        if any(cls is c for c, _, _ in solvers):
            return name
    raise ValueError(f"{cls.__name__} is in none of the solver lists")


def make_solver(
    cls, *, root_tol: float | None = 1e-8, root_find_max_steps: int | None = None
):
    """An instance of solver class `cls`. An implicit or IMEX solver gets a `VeryChord`
    root finder with tolerances `root_tol` (needed with a constant step size;
    `root_tol=None` takes them from an adaptive controller instead) and, if given,
    `root_find_max_steps`; other solvers ignore both."""
    if family(cls) not in ("implicit", "imex"):
        return cls()
    kwargs = {}
    if root_tol is not None:
        kwargs["root_finder"] = sk.VeryChord(rtol=root_tol, atol=root_tol)
    if root_find_max_steps is not None:
        kwargs["root_find_max_steps"] = root_find_max_steps
    return cls(**kwargs)


def _zero_vf(t, y, args):
    return jtu.tree_map(jnp.zeros_like, y)


def make_terms(cls, vf, split=None):
    """The terms that solver class `cls` takes for `y' = vf(t, y, args)`:
    `ODETerm(vf)`, or for an IMEX solver `MultiTerm(ODETerm(explicit),
    ODETerm(implicit))` with `split = (explicit, implicit)` (two fields that add up to
    `vf`), by default `vf` explicit and a zero implicit part."""
    if family(cls) != "imex":
        return sk.ODETerm(vf)
    explicit, implicit = (vf, _zero_vf) if split is None else split
    return sk.MultiTerm(sk.ODETerm(explicit), sk.ODETerm(implicit))


def quick_params(values, quick, ids=None, unpack: bool = True) -> list:
    """`values` as `pytest.param`s for `pytest.mark.parametrize`, each marked slow
    except those in `quick` (the cases the quick loop, `-m "not slow"`, keeps). A value
    that is a tuple is one case of several arguments (unless `unpack=False`: one
    argument, a tuple); `ids` as in `parametrize`."""
    params = []
    for i, value in enumerate(values):
        args = value if unpack and isinstance(value, tuple) else (value,)
        marks = [] if value in quick else [pytest.mark.slow]
        case_id = ids[i] if isinstance(ids, list) else ids(value) if ids else None
        params.append(pytest.param(*args, marks=marks, id=case_id))
    return params


def solver_params(solvers, quick=QUICK_SOLVERS):
    """`pytest.param`s of `solvers` (classes, or tuples that start with one), those
    whose class is not in `quick` marked slow."""
    classes = [entry[0] if isinstance(entry, tuple) else entry for entry in solvers]
    kept = [entry for cls, entry in zip(classes, solvers) if cls in quick]
    return quick_params(solvers, kept)


def tree_allclose(x, y, *, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
    """Whether two pytrees have the same structure and allclose leaves (NaN == NaN)."""
    if jtu.tree_structure(x) != jtu.tree_structure(y):
        return False
    for a, b in zip(jtu.tree_leaves(x), jtu.tree_leaves(y)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


def assert_tree_allclose(x, y, *, rtol: float = 1e-5, atol: float = 1e-8) -> None:
    """`tree_allclose`, with a readable message on failure."""
    assert jtu.tree_structure(x) == jtu.tree_structure(y), (
        f"structures differ: {jtu.tree_structure(x)} vs {jtu.tree_structure(y)}"
    )
    for i, (a, b) in enumerate(zip(jtu.tree_leaves(x), jtu.tree_leaves(y))):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=f"leaf {i}"
        )


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """Context manager: 64-bit JAX types inside (`jax.enable_x64`)."""
    with jax.enable_x64(True):
        yield


# --- Test problems ------------------------------------------------------------------

# y' = cos(t) A y with A = [[-0.2, 1], [-1, -0.2]]: non-autonomous (so every stage's
# node c_i matters), linear, and exactly y(t) = expm(sin(t) A) y0.
LINEAR_A = np.array([[-0.2, 1.0], [-1.0, -0.2]])


def linear_vf(t, y, args):
    return jnp.cos(t) * (jnp.asarray(LINEAR_A) @ y)


# The same field split for IMEX solvers (`make_terms(cls, linear_vf, LINEAR_SPLIT)`):
# the rotation explicit, the decay (-0.2 I) implicit.
def _linear_rotation(t, y, args):
    return jnp.cos(t) * (jnp.asarray(LINEAR_A + 0.2 * np.eye(2)) @ y)


def _linear_decay(t, y, args):
    return -0.2 * jnp.cos(t) * y


LINEAR_SPLIT = (_linear_rotation, _linear_decay)


# y'' = -y as a first-order system: y(t) = (cos t, -sin t) from (1, 0).
def rotation(t, y, args):
    return jnp.stack([y[1], -y[0]])


def rotation_exact(t):
    """The rotation's exact solution from (1, 0): shape `t.shape + (2,)`."""
    t = np.asarray(t)
    return np.stack([np.cos(t), -np.sin(t)], axis=-1)


ROTATION_Y0 = np.array([1.0, 0.0])  # a NumPy array: made a JAX one at each solve
ROTATION_PID = sk.PIDController(rtol=1e-9, atol=1e-9)


def solve_rotation(saveat, t0=0.0, t1=3.0, dt0=0.1, solver=sk.Tsit5(), **kwargs):
    """The rotation from (1, 0) at `t0`, by Tsit5 under a tight PID controller
    (override with `kwargs`), at most 512 steps."""
    kwargs.setdefault("stepsize_controller", ROTATION_PID)
    kwargs.setdefault("max_steps", 512)
    return sk.diffeqsolve(
        sk.ODETerm(rotation),
        solver,
        t0,
        t1,
        dt0,
        jnp.asarray(ROTATION_Y0),
        saveat=saveat,
        **kwargs,
    )


# --- Counting XLA compilations -------------------------------------------------------

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
_compiles_lock = threading.Lock()


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        with _compiles_lock:
            _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)


class CompileCounter:
    """Counts XLA backend compilations inside a `with count_compiles() as c:` block;
    read `c.count` afterwards."""

    def __init__(self):
        self.start = _compiles[0]
        self.count = 0


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCounter]:
    counter = CompileCounter()
    try:
        yield counter
    finally:
        counter.count = _compiles[0] - counter.start


def finite_difference(f, x, eps: float = 1e-6):
    """Central finite-difference gradient of a scalar `f` at array `x` (float64)."""
    x = np.asarray(x, dtype=np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        grad[i] = (float(f(jnp.asarray(x + e))) - float(f(jnp.asarray(x - e)))) / (
            2 * eps
        )
    return grad


def grad_and_central_difference(loss, x: float, eps: float):
    """The gradient of a scalar `loss` at the scalar `x`, and its central
    difference with step `eps`, from one jitted `value_and_grad`: a jitted `loss`
    for the difference would be a second compiled solve.

    **Arguments:**

    - `loss`: a function of one scalar array.
    - `x`, `eps`: the point and the step.

    **Returns:**

    `(gradient, central difference)`, two scalar arrays.
    """
    both = jax.jit(jax.value_and_grad(loss))
    grad = both(jnp.asarray(x))[1]
    plus, minus = both(jnp.asarray(x + eps))[0], both(jnp.asarray(x - eps))[0]
    return grad, (plus - minus) / (2 * eps)


def count_equations(jaxpr, name: str) -> int:
    """The equations of primitive `name` in `jaxpr` and in its sub-jaxprs (loop
    bodies, branches, custom rules), for tests of what a program traces."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += count_equations(sub, name)
    return count


def lv_batch():
    """Three Lotka-Volterra trajectories: their rates `(3, 4)` and initial states
    `(3, 2)` (tests of the checkpointed gradient's tracing)."""
    rates = jnp.array(
        [[1.5, 1.0, 3.0, 1.0], [1.2, 0.8, 2.5, 1.1], [1.7, 1.1, 3.2, 0.9]]
    )
    y0 = jnp.array([[1.0, 1.0], [1.2, 0.9], [0.8, 1.1]])
    return rates, y0


def lv_closing_over(rates, y0, adjoint, controller=None, saveat=None, throw=True):
    """Lotka-Volterra to t = 3 whose field closes over `rates` (the data's dtype), a
    float32 scale and an int32 index into a table, and ignores `t` (so the stage
    times are dead equations of its step); `PIDController(1e-8)` by default,
    `SaveAt(t1=True)`; the saved states (tests of the checkpointed gradient's
    programs)."""
    table = jnp.array([0.5, 1.0, 2.0])
    index = jnp.asarray(1, jnp.int32)
    scale = jnp.asarray(1.0, jnp.float32)

    def field(t, y, args):
        factor = jax.lax.dynamic_index_in_dim(table, index, keepdims=False)
        a, b, c, d = rates * scale.astype(rates.dtype) * factor
        return jnp.stack([a * y[0] - b * y[0] * y[1], -c * y[1] + d * y[0] * y[1]])

    controller = controller or sk.PIDController(rtol=1e-8, atol=1e-8)
    sol = sk.diffeqsolve(
        sk.ODETerm(field), sk.Tsit5(), 0.0, 3.0, 0.05, y0,
        saveat=saveat or sk.SaveAt(t1=True),
        stepsize_controller=controller, adjoint=adjoint, max_steps=256, throw=throw,
    )  # fmt: skip
    return sol.ys


def lv_loss(rates, y0, adjoint=None, **kwargs):
    """The sum of squares of `lv_closing_over`'s states, vmapped over the batch
    (`adjoint`: `RecursiveCheckpointAdjoint()` by default)."""
    adjoint = adjoint or sk.RecursiveCheckpointAdjoint()
    ys = jax.vmap(lambda r, y: lv_closing_over(r, y, adjoint, **kwargs))(rates, y0)
    return jnp.sum(ys**2)


# --- Cases left to the full matrix ---------------------------------------------------

# `SOLVERKIT_FULL_MATRIX=1` runs every case of the matrices; by default a case whose
# feature x transformation another test checks is skipped, naming that test.
FULL_MATRIX = os.environ.get("SOLVERKIT_FULL_MATRIX", "") not in ("", "0")


def full_matrix_only(covered_by: str) -> pytest.MarkDecorator:
    """A mark for a test (or a `pytest.param`) that runs only with
    `SOLVERKIT_FULL_MATRIX=1`, skipped otherwise.

    **Arguments:**

    - `covered_by`: the test that covers it in the suite (the skip reason names it).

    **Returns:**

    The mark (a `skipif`).
    """
    return pytest.mark.skipif(
        not FULL_MATRIX, reason=f"SOLVERKIT_FULL_MATRIX=1 only: covered by {covered_by}"
    )


def skip_unless_full_matrix(covered_by: str) -> None:
    """`full_matrix_only` from inside a test (for a case of a parametrization known
    only in its body): skips it unless `SOLVERKIT_FULL_MATRIX=1`."""
    if not FULL_MATRIX:
        pytest.skip(f"SOLVERKIT_FULL_MATRIX=1 only: covered by {covered_by}")
