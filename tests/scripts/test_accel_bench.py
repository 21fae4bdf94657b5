"""The benchmark suite's accelerator options, without running a benchmark: out of
memory recorded alike for every library, `--dtype float32`, `--append`, and the
tables written without matplotlib."""

import json
import pathlib

import pytest
from helpers import skip_unless_full_matrix

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


@pytest.mark.parametrize(
    "script", ["benchmarks/accel.sh", "benchmarks/gpu.sh", "tools/tpu_tests.sh"]
)
def test_shell_scripts_parse(script):
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / script
    subprocess.run(["bash", "-n", str(script)], check=True)


def _callbacks(job) -> int:
    """Host callbacks in a job's program (a jitted `throw=True` check is one)."""
    import jax

    return str(jax.make_jaxpr(job.fn)(*job.args)).count("pure_callback")


@pytest.mark.parametrize("case", ["lorenz", "lotka_volterra"])
# Quick loop: solve/test_errors.py::test_throw_false_sets_result[dt_min].
@pytest.mark.slow
def test_throw_false_applies_to_every_peer(case):
    # `--throw false` reaches every solverkit and diffrax solve, the ensemble peer's
    # too: no host callback left in their programs; `true` keeps each one's check.
    if case == "lotka_volterra":
        # `SOLVERKIT_FULL_MATRIX=1` only: the option's path to every peer is
        # [lorenz]'s (the same peers, another problem).
        skip_unless_full_matrix("[lorenz] (the same peers)")
    from benchmarks.cases import load_peers

    libs, _ = load_peers(["solverkit", "solverkit-ensemble", "diffrax"])
    variant = {"lorenz": "adaptive-forward", "lotka_volterra": "forward"}[case]
    for throw in (False, True):
        tasks = [
            t
            for t in CASES[case].tasks(4, libs, "float32", throw)
            if t.variant == variant
        ]
        assert {t.library for t in tasks} == set(libs)
        for task in tasks:
            assert task.throw is throw
            assert (_callbacks(task.make()) > 0) is throw, (task.library, throw)


def test_throw_option_is_recorded():
    args = suite.parse_args(["--throw", "false", "--cases", "lorenz"])
    assert args.throw is False
    assert suite.parse_args(["--cases", "lorenz"]).throw is True  # both libraries'
    with pytest.raises(SystemExit):
        suite.parse_args(["--throw", "maybe"])
    meta = suite.metadata([], args, "cpu", {})
    assert meta["throw"] is False


def _timed(library, throw, run_s, variant="adaptive-forward"):
    r = Record("lorenz", variant, 4096, library, "float32", throw=throw)
    r.run_median_s = r.run_min_s = r.run_max_s = run_s
    r.first_call_s = 10 * run_s
    return r


def test_ratios_for_both_solverkit_rows_of_one_throw_setting():
    rows = [
        _timed("solverkit", False, 1e-3),
        _timed("solverkit-ensemble", False, 5e-4),
        _timed("diffrax", False, 1e-2),
        _timed("gradsolve", None, 2e-3),
        # another run's diffrax row with the check: no ratio across settings
        _timed("solverkit", False, 1e-3, "fixed-forward"),
        _timed("diffrax", True, 1e-2, "fixed-forward"),
    ]
    rat = report.ratios(rows)
    assert set(rat) == {0, 1}
    assert rat[0][0] == pytest.approx(0.1) and rat[1][0] == pytest.approx(0.05)
    text = report.markdown(
        {"device_kind": "cpu", "platform": "cpu", "command": "x", "versions": {},
         "date": "d"},
        rows,
        {"lorenz": "Lorenz"},
    )  # fmt: skip
    assert "| 0.05 |" in text  # the ensemble row's own ratio
    assert "throw=True" in text and "throw=False" in text  # mixed: per row


def test_variants_run_in_the_order_given():
    args = suite.parse_args(
        ["--cases", "lorenz", "--variants", "adaptive-grad,fixed-forward"]
    )
    todo = suite.plan(CASES["lorenz"], [16], {"solverkit": None}, args)
    assert [t.variant for _, t in todo] == ["adaptive-grad", "fixed-forward"]


def test_append_keeps_other_sizes_of_a_case(tmp_path: pathlib.Path):
    rows = [
        Record("lorenz", "fixed-forward", 4096, "solverkit", "float32").__dict__,
        Record("lorenz", "fixed-forward", 1048576, "solverkit", "float32").__dict__,
        Record("lorenz", "fixed-grad", 1048576, "solverkit", "float32").__dict__,
    ]
    (tmp_path / "results.json").write_text(json.dumps({"meta": {}, "results": rows}))
    args = suite.parse_args(
        ["--cases", "lorenz", "--sizes", "1048576", "--variants", "fixed-grad"]
    )
    kept = suite._kept_records(tmp_path, args)
    assert [(r.size, r.variant) for r in kept] == [
        (4096, "fixed-forward"),
        (1048576, "fixed-forward"),
    ]


def test_ensemble_peer_failure_is_an_error():
    other = RuntimeError("UnsupportedError: can't")
    assert suite.failure_status(other, "solverkit-ensemble") == "error"


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [None, True])
def test_ensemble_peer_matches_the_reference(kernel, monkeypatch):
    # The ensemble peer's rows, through the lane loop (a CPU's default) and the
    # whole-solve kernel (Pallas' interpreter), against the float64 reference.
    # State: 34 steps of local error <= rtol |y| = 1e-5 * 20 add up to <= 7e-3.
    # Gradient: the discretisation error of d/drho sum(y^2) that vmap(diffeqsolve)
    # and diffrax reach here (0.014, same tolerance, same steps), with a factor 3.
    from benchmarks import ensemble_peer
    from benchmarks.cases import load_peers

    if kernel is None:
        # `SOLVERKIT_FULL_MATRIX=1` only: the peer's pipeline is [True]'s; the lane
        # loop's values and gradients are tests/ensemble/test_ensemble.py's.
        skip_unless_full_matrix("[True] and tests/ensemble/test_ensemble.py")
    monkeypatch.setattr(ensemble_peer, "KERNEL", kernel)
    libs, _ = load_peers(["solverkit-ensemble"])
    reference = CASES["lorenz"].reference(16)
    for task in CASES["lorenz"].tasks(16, libs, "float32", False):
        if task.variant not in ("adaptive-forward", "adaptive-grad"):
            continue
        record = Record("lorenz", task.variant, 16, task.library, task.dtype)
        suite.run_task(task, record, reference, 1, 1.0)
        assert record.status == "ok", record.note
        bound = 7e-3 if task.compare == "y" else 0.05
        assert record.max_abs_error < bound, (task.variant, record.max_abs_error)
        path = "kernel" if kernel else "lane loop"
        assert record.note.startswith(f"path: {path}"), record.note


def test_rows_are_written_as_they_finish():
    # A step cut by its time limit keeps the rows it finished: `done` follows each.
    args = suite.parse_args(["--cases", "stiff", "--dtype", "float32", "--sizes", "4"])
    records: list[Record] = []
    seen: list[int] = []
    case = CASES["stiff"]
    case = type(case)(**{**case.__dict__, "reference": lambda n: None})
    suite.run_case(
        case, [4], {"solverkit": None}, args, records, lambda _: None,
        lambda: seen.append(len(records)),
    )  # fmt: skip
    assert seen == list(range(1, len(records) + 1))


def test_jobs_are_made_in_their_own_precision():
    # A task's arrays are made when its job is, in the task's precision (a float64
    # row must not be computed from float32 inputs made at planning time).
    import jax

    from benchmarks.cases import load_peers
    from benchmarks.harness import precision

    libs, _ = load_peers(["solverkit", "solverkit-ensemble", "diffrax"])
    tasks = CASES["lorenz"].tasks(4, libs, None, True)
    assert {t.dtype for t in tasks} == {"float32", "float64"}
    for task in tasks:
        with precision(task.dtype):
            job = task.make()
        dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(job.args)}
        assert dtypes == {task.dtype}, (task.variant, task.library, dtypes)
