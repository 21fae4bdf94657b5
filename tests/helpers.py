"""Shared test helpers: the list of solvers, `tree_allclose`, float64, test problems
(the rotation and its solve), compile counting.

Import from test files as `from helpers import ...` (pytest puts `tests/` on the path,
as it has no `__init__.py`).
"""

import contextlib
import threading
from collections.abc import Iterator

import jax
import jax.monitoring
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import solverkit as sk


# (solver class, order of the propagated solution, has an embedded error estimate)
ALL_SOLVERS = [
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
ADAPTIVE_SOLVERS = [cls for cls, _, adaptive in ALL_SOLVERS if adaptive]
# The explicit Runge-Kutta methods (one tableau each).
RK_SOLVERS = [
    cls for cls, _, _ in ALL_SOLVERS if issubclass(cls, sk.AbstractRungeKutta)
]
# Solvers with their own dense output (the rest use cubic Hermite interpolation).
DENSE_SOLVERS = [sk.Tsit5, sk.Dopri5, sk.Dopri8]


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
