"""Smoke test of the benchmark suite: one tiny case end to end, in a subprocess (the
suite clears JAX's caches, which must not slow the rest of the test run)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FULL_MATRIX, full_matrix_only

from benchmarks.problems import large_problem as build_problem


ROOT = pathlib.Path(__file__).resolve().parents[2]


# The gradient variant (three more programs, diffrax's failing one included) with
# `SOLVERKIT_FULL_MATRIX=1` only: the pipeline is the forward variant's, the gradients
# it times are tests/closure/test_closure_matrix.py's backsolve cells.
_VARIANTS = ["forward", "grad-backsolve"] if FULL_MATRIX else ["forward"]


@pytest.mark.slow
def test_benchmarks_smoke(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "results"
    command = [
        sys.executable, "-m", "benchmarks",
        "--cases", "lotka_volterra", "--sizes", "8", "--repeats", "1",
        "--peers", "solverkit,diffrax", "--variants", ",".join(_VARIANTS),
        "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    for name in ("results.json", "results.md", "lotka_volterra.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "lotka_volterra.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    data = json.loads((out / "results.json").read_text())
    rows = {(r["variant"], r["library"]): r for r in data["results"]}
    want = {("forward", "solverkit"), ("forward", "diffrax")}
    if FULL_MATRIX:
        want |= {
            ("grad-backsolve", "solverkit"),
            ("grad-backsolve", "diffrax"),
            ("grad-backsolve", "diffrax-closure"),
        }
    assert set(rows) == want
    for key in [k for k in rows if k[1] != "diffrax-closure"]:
        row = rows[key]
        assert row["status"] == "ok", (key, row["note"])
        assert row["first_call_s"] > 0 and row["run_median_s"] > 0
        assert row["steps"] > 0
        assert row["max_abs_error"] < 1e-2, (key, row["max_abs_error"])
    assert rows[("forward", "solverkit")]["run_ratio_vs_diffrax"] is not None
    table = (out / "results.md").read_text()
    assert "| forward | 8 | solverkit |" in table
    if FULL_MATRIX:
        # diffrax cannot backsolve through a closure: reported, not dropped.
        closure = rows[("grad-backsolve", "diffrax-closure")]
        assert closure["status"] == "unsupported" and closure["note"]
        assert "unsupported" in table
    assert "| forward | 8 | solverkit |" in proc.stdout  # the table is printed


# `SOLVERKIT_FULL_MATRIX=1` only (a subprocess of 14 CPU s): the benchmark pipeline is
# test_benchmarks_smoke's; the events and their gradients it times are
# tests/test_event_search.py's and test_hybrid.py's.
@pytest.mark.slow
@full_matrix_only("test_benchmarks_smoke (the pipeline) and test_event_search.py")
def test_events_benchmark_smoke(tmp_path: pathlib.Path) -> None:
    """`python -m benchmarks.events --quick`: every method's spike times checked
    against the exact ones and timed, the rows written to `--json`."""
    out = tmp_path / "events.json"
    command = [sys.executable, "-m", "benchmarks.events", "--quick", "--json", str(out)]
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["variant"], r["method"]): r for r in data["results"]}
    methods = ("solverkit effect", "diffrax loop", "solverkit loop")
    assert set(rows) == {(v, m) for v in ("forward", "grad") for m in methods}
    for (variant, method), row in rows.items():
        assert row["first_call_s"] > 0 and row["run_median_s"] > 0
        assert row["steps"] > 0 and row["spikes"] > 0
        if variant == "forward" or method != "solverkit effect":
            assert row["note"] == "", (variant, method, row["note"])
    assert rows[("forward", "diffrax loop")]["run_ratio"] == 1.0
    assert "| forward | solverkit effect |" in proc.stdout


@pytest.mark.slow
@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("name", ["bruss2d-8", "rober-blocks-34", "burgers-100"])
def test_stiff_large_problem_fields(name: str) -> None:
    """The quick problems of `benchmarks.stiff_large` (the smoke run below solves
    one of them): the JAX field equals the NumPy one SciPy solves, and its Jacobian
    lies inside the declared sparsity pattern and bandwidths."""
    problem = build_problem(name)
    field = problem.field(jax.tree_util.tree_map(jnp.asarray, problem.params))

    def flat(y):
        shaped = y.reshape(problem.y0.shape)
        return jnp.ravel(field(jnp.asarray(0.5), shaped, None))

    y = np.ravel(problem.y0) + 0.1 * np.cos(np.arange(problem.size))
    # Both are the same float64 expressions, evaluated in a different order.
    scale = np.max(np.abs(problem.np_field(0.5, y))) + 1.0
    np.testing.assert_allclose(
        np.asarray(jax.jit(flat)(y)), problem.np_field(0.5, y), atol=1e-12 * scale
    )
    jacobian = np.asarray(jax.jit(jax.jacfwd(flat))(jnp.asarray(y)))
    rows, cols = np.nonzero(jacobian)
    pattern = problem.sparsity().toarray()
    assert pattern[rows, cols].all(), name
    lower, upper = problem.bandwidths
    assert np.all(rows - cols <= lower) and np.all(cols - rows <= upper), name


# `SOLVERKIT_FULL_MATRIX=1` only (subprocesses of 13 CPU s): the benchmark pipeline is
# test_benchmarks_smoke's, the problems' fields test_stiff_large_problem_fields, and
# the large stiff solves' linear solvers tests/test_linear_solver.py's.
@pytest.mark.slow
@full_matrix_only("test_benchmarks_smoke and test_stiff_large_problem_fields")
def test_stiff_large_benchmark_smoke(tmp_path: pathlib.Path) -> None:
    """`python -m benchmarks.stiff_large --quick`: a small version of a large
    problem, every configuration run or skipped with its reason, SciPy BDF's rows
    and the matched-error ratios written. One problem: each configuration is a
    process of its own (a JAX start-up and a compile), and the pipeline is the same
    for every problem; the others' fields and patterns are
    test_stiff_large_problem_fields's."""
    out = tmp_path / "stiff-large"
    command = [
        sys.executable, "-m", "benchmarks.stiff_large", "--quick",
        "--problems", "burgers-100", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("results.json", "results.md", "burgers-100.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "references" / "burgers-100.npz").exists()
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert {r["problem"] for r in rows} == {"burgers-100"}
    for row in rows:
        assert row["status"] in ("ok", "skipped"), row
        if row["status"] == "skipped":
            assert row["note"], row
            continue
        assert row["run_s"] > 0 and row["steps"] > 0
        assert row["error"] < 1e-1, row
        assert row["peak_rss_mib"] > 0
        if row["config"] != "scipy-BDF" and row["first_call_s"] is not None:
            assert row["first_call_s"] > 0
    # The first call (compile) is timed once per configuration, at its first rtol.
    for config in {(r["problem"], r["config"]) for r in rows if r["status"] == "ok"}:
        if config[1] != "scipy-BDF":
            assert any(
                (r["problem"], r["config"]) == config and r["first_call_s"]
                for r in rows
            ), config
    assert any(r["config"] == "scipy-BDF" and r["status"] == "ok" for r in rows)
    assert any(r["config"] == "BDF+dense" and r["status"] == "ok" for r in rows)
    goals = data["goals"]
    # One goal per SciPy tolerance (the quick run's two).
    assert len(goals) == 2 and all(g["solverkit"] is not None for g in goals)
    assert "| burgers-100 | 100 |" in (out / "results.md").read_text()
