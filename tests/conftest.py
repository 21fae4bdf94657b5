"""Settings and fixtures for the whole suite.

Strict settings: implicit rank promotion (broadcasting arrays of different ranks)
raises, so the library must be written without it.

Fixtures shared by several test files live here (pytest finds them without an import);
plain helper functions, problems and solver lists live in `helpers.py`.

Markers (registered in pyproject.toml, `--strict-markers`): `slow` marks what only the
full suite runs: the example and benchmark subprocesses, and all but one check per
public feature and transformation (tests/README.md has the table and the rule);
`python -m pytest -q -m "not slow"` is the quick loop (budget: 2 minutes on two
cores), `python -m pytest -q` runs everything (budget: 10).
`quick_cases(...)` on a parametrized test keeps the named cases in the quick loop and
marks the others slow: one representative per feature there, the products in the full
suite. `SOLVERKIT_TEST_PROFILE=DIR` records each test's compilations and CPU time.

Compiled programs are kept in JAX's persistent compilation cache, in `.jax_cache/` at
the repository root (ignored by git; `SOLVERKIT_TEST_JAX_CACHE=DIR` moves it,
`SOLVERKIT_TEST_JAX_CACHE=` with an empty value turns it off). A rerun reads programs
back instead of compiling them, and so does a run that compiles a program again after
the per-file cache clearing below; but JAX caches no program with a host callback, and
every `diffeqsolve` with `throw=True` (the default) has one, its run-time error check.
The settings go through environment variables too, so the examples and benchmarks
that tests run in subprocesses share the cache. Compile counting
(`helpers.count_compiles`) counts a cache read as a compilation
(tests/test_suite_settings.py).
"""

import inspect
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from _profile_plugin import Profile
from helpers import float64


# A vmapped solve tests the vmapped loop: on a TPU it would take the whole-solve
# kernel (`solverkit/_kernel/_vmap.py`), which tests/kernel/test_vmap_kernel.py
# turns on.
os.environ.setdefault("SOLVERKIT_VMAP_KERNEL", "0")


jax.config.update("jax_numpy_rank_promotion", "raise")


def _persistent_compilation_cache() -> None:
    default = pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"
    where = os.environ.setdefault("SOLVERKIT_TEST_JAX_CACHE", str(default))
    if not where:
        return
    # Every program is cached, however quick its compile: most in this suite take
    # well under JAX's default threshold of one second.
    settings = {
        "jax_compilation_cache_dir": where,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    for name, value in settings.items():
        os.environ.setdefault(name.upper(), str(value))
        jax.config.update(name, value)


_persistent_compilation_cache()


# XLA's CPU flags for quicker compiles, on top of `jax_disable_most_optimizations`.
# `--xla_cpu_use_fusion_emitters=false` (the older loop emitters) cuts the CPU time
# to 0.71x (26 files, 623 tests, the same 2,950 programs; measure with
# `SOLVERKIT_TEST_PROFILE=DIR` and `python -m tools.suite_profile DIR`). It rounds
# float32 differently in one program and not in
# another; the comparisons of two programs that it broke now allow what round-off
# allows (tests/kernel/test_kernel_float32_steps.py, test_kernel_outside.py,
# test_kernel_tangent.py's float64 state). The float32 gradients it put off were
# wrong, not imprecise: steps pulled back through the branch their recompilation
# chose, and chunks recomputed from a checkpoint deciding their steps again and
# drifting from the forward pass's step ends (both fixed: the backward passes replay
# the forward pass's steps, tests/kernel/test_replayed_decisions.py). The event settle
# tests it put off (a recorded state one ulp short of the threshold) pass since the
# search and `settle` evaluate the dense output the same way. Splitting
# codegen into one part and the legacy runtime did not help (1.06x, 1.26x); side by
# side (58 quick tests, same load): 117.6 -> 71.1 CPU s with the flag. XLA aborts
# on a flag it does not know, and that one is not in
# every jaxlib (0.10.2 has it; 0.4.38 and 0.12.1 do not): `_known_xla_flags` keeps
# those that this jaxlib accepts. `SOLVERKIT_TEST_XLA_FLAGS=` (empty) turns them
# off; a value there is taken as given, not probed.
_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def _accepted_xla_flags(flags: tuple[str, ...]) -> list[str]:
    """Those of `flags` that this jaxlib's XLA accepts, each tried in a subprocess
    (an unknown flag aborts the process that makes a backend)."""
    code = "import jax.numpy as jnp; jnp.ones(1).block_until_ready()"
    ok = []
    for flag in flags:
        env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True
        )
        ok += [flag] if proc.returncode == 0 else []
    return ok


def _known_xla_flags() -> list[str]:
    """`_accepted_xla_flags(_XLA_FLAGS)`, asked once: the answer is kept in
    `SOLVERKIT_TEST_XLA_FLAGS` for pytest-xdist's workers and subprocesses (set by
    hand, it is taken as given)."""
    known = os.environ.get("SOLVERKIT_TEST_XLA_FLAGS")
    if known is None:
        known = " ".join(_accepted_xla_flags(_XLA_FLAGS))
        os.environ["SOLVERKIT_TEST_XLA_FLAGS"] = known
    return known.split()


def _quick_compiles() -> None:
    """XLA compiles the suite's programs with most optimizations off
    (`jax_disable_most_optimizations`: backend optimization level 0, no expensive
    LLVM passes) and with those flags of `_XLA_FLAGS` that XLA knows: compiling is
    most of the suite's time. Set in the environment too, so that the examples and
    benchmarks the tests run in subprocesses compile the same way; XLA reads
    `XLA_FLAGS` when JAX first makes its CPU backend, after this.
    `SOLVERKIT_TEST_OPTIMIZE=1` compiles as users' programs do (XLA's defaults); a
    test that needs the optimized compile takes the `optimized_compiles` fixture
    (which keeps the flags: they are read once).
    """
    if os.environ.get("SOLVERKIT_TEST_OPTIMIZE", "") not in ("", "0"):
        return
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    jax.config.update("jax_disable_most_optimizations", True)
    given = os.environ.get("XLA_FLAGS", "").split()
    names = {flag.split("=")[0] for flag in given}
    extra = [flag for flag in _known_xla_flags() if flag.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(given + extra)


_quick_compiles()


def pytest_configure(config: pytest.Config) -> None:
    """`SOLVERKIT_TEST_PROFILE=DIR` records each test's compilations and CPU time
    (tests/_profile_plugin.py; summary: `python -m tools.suite_profile DIR`)."""
    where = os.environ.get("SOLVERKIT_TEST_PROFILE")
    if where:
        config.pluginmanager.register(Profile(pathlib.Path(where)), "solverkit-profile")


@pytest.fixture
def optimized_compiles():
    """The test's programs compile with XLA's default optimizations, as users'
    programs do (the session turns most of them off: `_quick_compiles`). JAX's
    in-memory caches are emptied on the way in and out, so no executable compiled
    the other way is reused."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
        jax.clear_caches()


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
    the last file, `tests/solvers/test_user_solver.py`, which passes alone. A program
    that a later file compiles again is read back from the persistent cache where JAX
    caches it (see above)."""
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


def _is_quick_case(item: pytest.Item) -> bool | None:
    """For a test marked `quick_cases(case, ...)`, whether this parametrization is one
    of the cases the quick loop keeps (`None` for a test without the marker). A case is
    a test id (`"gmres-0"`) or a dict of parameter values (`dict(method="gmres")`)."""
    marker = item.get_closest_marker("quick_cases")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None:
        return None
    for case in marker.args:
        if isinstance(case, dict):
            if all(callspec.params.get(k, object()) == v for k, v in case.items()):
                return True
        elif case == callspec.id:
            return True
    return False


def _mark_slow_unless_quick_case(items: list[pytest.Item]) -> None:
    """Marks slow the cases that `quick_cases` leaves out; a marker that keeps no case
    is an error (a typo in a case would otherwise drop the test from the quick loop)."""
    kept: dict[str, bool] = {}
    for item in items:
        quick = _is_quick_case(item)
        if quick is None:
            continue
        name = item.nodeid.split("[")[0]
        kept[name] = kept.get(name, False) or quick
        if not quick:
            item.add_marker(pytest.mark.slow)
    lost = [name for name, any_kept in kept.items() if not any_kept]
    if lost:
        raise pytest.UsageError(f"`quick_cases` matches no case of {lost}")


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Marks the cases that `quick_cases` leaves out slow. On a TPU, float64 is
    emulated (slow, and some of it unsupported): tests that need it are skipped
    there, with the reason. CPU and GPU runs are unchanged."""
    del config
    _mark_slow_unless_quick_case(items)
    if jax.default_backend() != "tpu":
        return
    for item in items:
        reason = _float64_reason(item)
        if reason is not None:
            item.add_marker(
                pytest.mark.skip(reason=f"needs float64 on a TPU: {reason}")
            )
