"""Settings and fixtures for the whole suite.

Strict settings: implicit rank promotion (broadcasting arrays of different ranks)
raises, so the library must be written without it.

Fixtures shared by several test files live here (pytest finds them without an import);
plain helper functions, problems and solver lists live in `helpers.py`.

Markers (registered in pyproject.toml, `--strict-markers`): `slow` marks the example
and benchmark subprocesses and the long checks; `python -m pytest -q -m "not slow"` is
the quick loop (a couple of minutes), `python -m pytest -q` runs everything.
"""

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
