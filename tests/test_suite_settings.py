"""The test suite's own machinery (conftest.py, helpers.py): compile counting stays
right with the persistent compilation cache on; the `quick_cases` marker; the
per-test profile (`SOLVERKIT_TEST_PROFILE`); the session's compile settings."""

import ast
import os
import pathlib
import subprocess
import sys

import conftest
import jax
import jax.numpy as jnp
import pytest
from helpers import count_compiles, full_matrix_only
from jax._src import compiler

from tools import suite_profile as profile


def test_count_compiles_counts_persistent_cache_reads():
    # A program read back from the persistent cache after `jax.clear_caches()` is a
    # jit-cache miss: the "compiles once" tests must see it. JAX reports the
    # backend-compile event for a cache read too (0.10); this pins that.
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the persistent compilation cache is off")
    f = jax.jit(lambda x: jnp.sin(x) * 3.25 - jnp.cos(x) ** 3)
    x, y = jnp.float32(1.0), jnp.float32(2.0)
    f(x).block_until_ready()
    jax.clear_caches()
    with count_compiles() as counter:
        f(x).block_until_ready()
    assert counter.count == 1
    with count_compiles() as counter:
        f(y).block_until_ready()
    assert counter.count == 0


_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pytest(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.slow
def test_quick_cases_keep_the_listed_cases_only():
    # test_krylov_matches_dense: 12 cases, 3 named in its `quick_cases` marker.
    proc = _pytest(
        "--collect-only", "-q", "-m", "not slow",
        "tests/linear/test_linear_solver.py", "-k", "krylov_matches_dense",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = {
        line.split("[")[1].rstrip("]") for line in proc.stdout.split() if "::" in line
    }
    assert ids == {"0-none-gmres", "2-banded-bicgstab", "2-callable-gmres"}


@pytest.mark.slow
def test_profile_records_every_test(tmp_path: pathlib.Path):
    where = tmp_path / "profile"
    proc = _pytest(
        "-q", "tests/test_suite_settings.py", "-k", "persistent_cache_reads",
        env={"SOLVERKIT_TEST_PROFILE": str(where)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = profile.load(where)
    assert [r["nodeid"].split("::")[1] for r in rows] == [
        "test_count_compiles_counts_persistent_cache_reads"
    ]
    # At least the test's program twice: compiled, then read back after clearing.
    assert rows[0]["compiles"] >= 2 and rows[0]["cpu_s"] > 0
    assert "| quick (not slow) | 1 |" in profile.report(rows, top=1)


def _optimization_level() -> int:
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    return options.executable_build_options.debug_options.xla_backend_optimization_level


def test_session_compiles_with_most_optimizations_off():
    # conftest's `_quick_compiles`, unless SOLVERKIT_TEST_OPTIMIZE=1; subprocesses
    # inherit it through the environment.
    if os.environ.get("SOLVERKIT_TEST_OPTIMIZE", "") not in ("", "0"):
        pytest.skip("SOLVERKIT_TEST_OPTIMIZE is set")
    assert _optimization_level() == 0
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
    given = os.environ.get("XLA_FLAGS", "").split()
    known = conftest._known_xla_flags()
    assert all(flag in given for flag in known)


# Quick loop: (suite settings; no public feature).
@pytest.mark.slow
def test_xla_flags_set_after_importing_jax_are_read():
    # conftest sets `XLA_FLAGS` after `import jax`, before the first array: XLA
    # must read them when the backend is made (an unknown flag aborts).
    code = (
        "import os, jax; os.environ['XLA_FLAGS'] = '--xla_no_such_flag=1'; "
        "import jax.numpy as jnp; jnp.ones(1).block_until_ready()"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert proc.returncode != 0 and "xla_no_such_flag" in proc.stderr


# `SOLVERKIT_FULL_MATRIX=1` only (three subprocesses that start JAX): every session
# runs the probe, and a flag it wrongly kept would abort the session
# (test_session_compiles_with_most_optimizations_off checks the flags it set).
@pytest.mark.slow
@full_matrix_only(
    "every session's probe, test_session_compiles_with_most_optimizations_off"
)
def test_only_known_xla_flags_are_set():
    # An unknown flag aborts XLA: the fusion-emitter flag is in jaxlib 0.10 and not in
    # 0.4.38 or 0.12.1. The probe keeps a flag that this jaxlib takes and drops one it
    # does not know.
    # A flag every jaxlib knows, or on 0.10 (the fusion-emitter flag's jaxlib) the
    # suite's own: one process a flag.
    known = ("--xla_cpu_enable_fast_math=false",)
    if jax.__version_info__[:2] == (0, 10):
        known = conftest._XLA_FLAGS
    flags = ("--xla_no_such_flag=1", *known)
    assert conftest._accepted_xla_flags(flags) == list(known)


def test_optimized_compiles_fixture(optimized_compiles):
    assert _optimization_level() > 0


def _import_time_calls(tree: ast.Module) -> list[ast.Call]:
    """The calls a module makes when it is imported: in its and its classes'
    statements, decorators and default arguments (not in function or lambda
    bodies)."""
    calls, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            stack.extend(args.defaults + [d for d in args.kw_defaults if d])
            stack.extend(getattr(node, "decorator_list", []))
            continue
        if isinstance(node, ast.Call):
            calls.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return calls


def _dtype_given(call: ast.Call) -> bool:
    """Whether a `jnp` call names its dtype (`dtype=`, a `jnp.`/`np.` dtype among its
    arguments, or is one: `jnp.float32(1.0)`)."""
    names = [ast.unparse(a) for a in call.args] + [ast.unparse(call.func)]
    dtypes = ("float", "int", "uint", "complex", "bool")
    return any(k.arg == "dtype" for k in call.keywords) or any(
        n.split(".")[-1].startswith(dtypes) and n.startswith(("jnp.", "np."))
        for n in names
    )


def test_float64_files_build_no_jnp_arrays_at_import():
    # A file that runs under the `x64` fixture is imported before x64 is on: a
    # `jnp` array it makes at import, without a dtype, is silently float32 (as
    # test_linear_solver_grad's parameters once were). Such constants are NumPy.
    wrong = []
    for path in sorted((_ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if 'pytestmark = pytest.mark.usefixtures("x64")' not in text:
            continue
        for call in _import_time_calls(ast.parse(text)):
            if ast.unparse(call.func).startswith("jnp.") and not _dtype_given(call):
                wrong.append(f"{path.name}:{call.lineno}: {ast.unparse(call)}")
    assert not wrong, "\n".join(wrong)
