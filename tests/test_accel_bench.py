"""The benchmark suite's accelerator options, without running a benchmark: out of
memory recorded alike for every library, `--dtype float32`, `--append`, and the
tables written without matplotlib."""

import json
import pathlib

import pytest

from benchmarks import __main__ as suite, report
from benchmarks.cases import CASES, LORENZ_TOL_32
from benchmarks.harness import Record


def test_out_of_memory_is_oom_for_every_library():
    oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    other = RuntimeError("INVALID_ARGUMENT: Binary op compare with different types")
    assert suite.failure_status(oom, "solverkit") == "oom"
    assert suite.failure_status(oom, "diffrax") == "oom"
    assert suite.failure_status(other, "solverkit") == "error"
    assert suite.failure_status(other, "diffrax") == "unsupported"


def test_dtype_float32_runs_lorenz_adaptive_in_float32():
    tasks = CASES["lorenz"].tasks(16, {"solverkit": None}, "float32")
    assert {t.dtype for t in tasks} == {"float32"}
    default = CASES["lorenz"].tasks(16, {"solverkit": None}, None)
    assert {t.dtype for t in default if "adaptive" in t.variant} == {"float64"}
    assert LORENZ_TOL_32 > 1e-7  # what float32 resolves at |y| ~ 1


def test_dtype_float32_skips_float64_only_tasks():
    # The stiff case exists only in float64: every row is skipped, nothing runs.
    args = suite.parse_args(["--cases", "stiff", "--dtype", "float32", "--sizes", "4"])
    records: list[Record] = []
    case = CASES["stiff"]
    case = type(case)(**{**case.__dict__, "reference": lambda n: None})
    suite.run_case(case, [4], {"solverkit": None}, args, records, lambda _: None)
    assert records and {r.status for r in records} == {"skipped"}
    assert all("float64 only" in r.note for r in records)


def test_append_keeps_other_cases(tmp_path: pathlib.Path):
    rows = [
        Record("lorenz", "fixed-forward", 16, "solverkit", "float32").__dict__,
        Record("neural_ode", "grad-checkpoint", 16, "solverkit", "float32").__dict__,
    ]
    (tmp_path / "results.json").write_text(json.dumps({"meta": {}, "results": rows}))
    args = suite.parse_args(["--cases", "neural_ode", "--append"])
    kept = suite._kept_records(tmp_path, args)
    assert [r.case for r in kept] == ["lorenz"]
    assert suite._kept_records(tmp_path / "absent", args) == []


def test_tables_without_matplotlib(tmp_path: pathlib.Path, monkeypatch):
    monkeypatch.setattr(report, "plt", None)
    record = Record("lorenz", "fixed-forward", 16, "solverkit", "float32")
    record.run_median_s = record.run_min_s = record.run_max_s = 1e-3
    record.first_call_s = 1.0
    oom = Record("lorenz", "fixed-forward", 16, "diffrax", "float32", status="oom")
    oom.note = "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory"
    meta = suite.metadata(["--quick"], suite.parse_args(["--quick"]), "quick", {})
    text = report.write_all(tmp_path, meta, [record, oom], {"lorenz": "Lorenz"})
    assert (tmp_path / "results.json").exists() and (tmp_path / "results.md").exists()
    assert not list(tmp_path.glob("*.png"))
    assert "**oom**" in text


@pytest.mark.parametrize("module", ["accel", "tpu_tests", "gpu"])
def test_shell_scripts_parse(module):
    import subprocess

    script = pathlib.Path(__file__).parent.parent / "benchmarks" / f"{module}.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
