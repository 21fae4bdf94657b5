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
