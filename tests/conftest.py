"""Settings and fixtures for the whole suite.

Strict settings: implicit rank promotion (broadcasting arrays of different ranks)
raises, so the library must be written without it.

Fixtures shared by several test files live here (pytest finds them without an import);
plain helper functions, problems and solver lists live in `helpers.py`.

Markers (registered in pyproject.toml, `--strict-markers`): `slow` marks the example
and benchmark subprocesses and the long checks; `python -m pytest -q -m "not slow"` is
the quick loop (a couple of minutes), `python -m pytest -q` runs everything.
"""

import inspect

import jax
import pytest
from helpers import float64


jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def x64():
    """The test runs inside `helpers.float64()` (64-bit JAX types).

    Use it as `pytestmark = pytest.mark.usefixtures("x64")` (whole file),
    `@pytest.mark.usefixtures("x64")` (one test), or as an argument.
    """
    with float64():
        yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilation_caches():
    """Each test file starts with JAX's caches emptied. Files share compiled
    functions within themselves, rarely across; without this the whole suite
    (800+ tests in one process) holds every executable it ever compiled, and XLA's
    CPU compiler crashed (a segmentation fault in `backend_compile_and_load`) in
    the last file, `tests/test_user_solver.py`, which passes alone."""
    yield
    jax.clear_caches()


def _float64_reason(item: pytest.Item) -> str | None:
    """Why a test needs float64 (the `x64` fixture, or `float64()` / `enable_x64`
    in its body), or `None`."""
    if "x64" in getattr(item, "fixturenames", ()):
        return "uses the x64 fixture"
    try:
        source = inspect.getsource(getattr(item, "function", None))  # pyright: ignore
    except (OSError, TypeError):
        return None
    for marker in ("float64()", "enable_x64"):
        if marker in source:
            return f"calls {marker}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """On a TPU, float64 is emulated (slow, and some of it unsupported): tests that
    need it are skipped there, with the reason. CPU and GPU runs are unchanged."""
    del config
    if jax.default_backend() != "tpu":
        return
    for item in items:
        reason = _float64_reason(item)
        if reason is not None:
            item.add_marker(
                pytest.mark.skip(reason=f"needs float64 on a TPU: {reason}")
            )
