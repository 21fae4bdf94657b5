"""Smoke tests of `examples/` and of the code in the docs.

Each example runs with `--quick` and must write its PNG; every ```python block of the
narrative docs pages (`docs/*.md`) must run. They spend most of their time compiling,
which is mostly single-threaded, so every selected group of jobs is started at once
in its own process, and each test waits for its own job. Examples that set the same
global JAX state share a process (one start-up of Python, JAX and matplotlib instead
of one each; each example still runs as `__main__` in a fresh namespace, with its own
output directory and log); those that set process-wide state of their own (host
devices, processes) run alone.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from helpers import FULL_MATRIX, full_matrix_only


# Subprocesses that take a minute or more together: the full suite only.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The examples, in groups that share a process: those that turn on float64 at import,
# those that stay in float32, and the two that configure the process themselves.
GROUPS = [
    [
        "heat_pde",
        "stiff_chemistry",
        "dae",
        "steady_state",
        "bouncing_ball",
        "spiking_neurons",
        "pharmacokinetics",
        "brusselator",
    ],
    # float32 examples, then every python block of docs/*.md (which may turn float64
    # on, as dae.md's does, for the blocks after it, as when they ran alone).
    ["quickstart", "fit_lotka_volterra", "neural_ode", "forced_system", "docs"],
    ["ensemble"],  # sets XLA_FLAGS (8 host devices) before JAX starts
    ["multi_process"],  # launches two JAX processes (jax.distributed, gloo on CPU)
]
DOCS = "docs"
# The float64 group, three float32 examples and `multi_process` run with
# `SOLVERKIT_FULL_MATRIX=1` only (about 45, 10 and 8 CPU s): each example's feature
# has its own tests, named here; the full suite keeps the README's main job
# (`fit_lotka_volterra`, in its quick configuration), the docs' code and `ensemble`
# (a batch sharded over 8 host devices).
FULL_MATRIX_ONLY = {
    "quickstart": "closure/test_closure.py (a jaxpr of a closure over a vmapped int) "
    "and closure/test_closure_matrix.py's backsolve cells (vmap of grad)",
    "multi_process": "examples/ensemble.py (the batch sharded over devices) and "
    "kernel/test_sharded_kernel.py",
    "neural_ode": "closure/test_closure_matrix.py (its MLP cells, under grad)",
    "forced_system": "solve/test_global_interpolation.py (cubic data, its gradient)",
    "heat_pde": "test_protocol.py (a user's Crank-Nicolson solver, its gradient)",
    "stiff_chemistry": "test_rosenbrock.py::test_stiff_reference (ROBER)",
    "dae": "test_dae.py (ROBER and index-1 DAEs)",
    "steady_state": "test_adjoint.py::test_implicit_adjoint_steady_state_gradient",
    "bouncing_ball": "test_hybrid.py::test_bouncing_ball_against_analytic",
    "spiking_neurons": "test_continuing_events.py::"
    "test_integrate_and_fire_closures_vmap_grad",
    "pharmacokinetics": "test_timed_event.py (doses as timed events, their gradient)",
    "brusselator": "test_bdf.py's Brusselator, test_bruss_preconditioner.py",
}
EXAMPLES = [job for group in GROUPS for job in group if job != DOCS]
TIMEOUT = 600  # seconds per job; each takes well under a minute on an idle machine

# Runs every ```python block of the Markdown files given as arguments, each in a
# fresh namespace, and names the failing block.
RUN_DOC_BLOCKS = """
import pathlib, re, sys
for path in sys.argv[1:]:
    text = pathlib.Path(path).read_text()
    for i, code in enumerate(re.findall(r"^```python\\n(.*?)^```", text, re.S | re.M)):
        print(f"--- {path}, python block {i}", flush=True)
        exec(compile(code, f"{path} (python block {i})", "exec"), {"__name__": "m"})
"""

# Runs each example given as `script out` argument pairs as `__main__` with `--quick
# --out out`, in `out`, its output in `out/output.log` and its exit code in
# `out/exit_code`; a failing example does not stop the next. A `script` that is a
# directory stands for the docs: `RUN_DOC_BLOCKS` on its Markdown files.
RUN_EXAMPLES = """
import contextlib, os, pathlib, runpy, sys, traceback
import matplotlib.pyplot as plt
for script, out in zip(sys.argv[1::2], sys.argv[2::2]):
    os.chdir(out)
    with open("output.log", "w") as log:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            pages = sorted(str(p) for p in pathlib.Path(script).glob("*.md"))
            sys.argv = [script, *pages] if pages else [script, "--quick", "--out", out]
            try:
                if pages:
                    exec(RUN_DOC_BLOCKS, {"__name__": "docs"})
                else:
                    runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
                code = 1
    pathlib.Path("exit_code").write_text(str(code))
    plt.close("all")
"""


def _script(job: str) -> pathlib.Path:
    return ROOT / "examples" / f"{job}.py"


class _Group:
    """One process that runs `jobs` (`{job: output directory}`) one after another."""

    def __init__(self, jobs: dict[str, pathlib.Path], log: pathlib.Path):
        self.jobs, self.log = jobs, log
        env = dict(os.environ, MPLBACKEND="Agg")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(ROOT), env.get("PYTHONPATH")] if p
        )
        (job, out), *others = jobs.items()
        if job == DOCS:
            pages = sorted(str(p) for p in (ROOT / "docs").glob("*.md"))
            command = [sys.executable, "-c", RUN_DOC_BLOCKS, *pages]
        elif not others:  # alone: as a user runs it
            command = [sys.executable, str(_script(job)), "--quick", "--out", str(out)]
        else:
            pairs = [
                str(a)
                for job, out in jobs.items()
                for a in (ROOT / DOCS if job == DOCS else _script(job), out)
            ]
            runner = f"RUN_DOC_BLOCKS = {RUN_DOC_BLOCKS!r}\n{RUN_EXAMPLES}"
            command = [sys.executable, "-c", runner, *pairs]
        with open(log, "wb") as f:
            self.process = subprocess.Popen(
                command,
                cwd=out,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    def wait(self) -> int | None:
        """The process's exit code, `None` after a timeout of `TIMEOUT` a job."""
        try:
            return self.process.wait(timeout=TIMEOUT * len(self.jobs))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


class _Job:
    def __init__(self, job: str, out: pathlib.Path, group: _Group):
        self.job, self.out, self.group = job, out, group

    def wait(self) -> tuple[int | None, str]:
        """The job's exit code (`None` after a timeout) and the end of its output
        (with the end of its process's, where the example's own shows no error)."""
        code = self.group.wait()
        if len(self.group.jobs) == 1:  # the process's own output and exit code
            return code, self.group.log.read_text(errors="replace")[-4000:]
        status = self.out / "exit_code"
        own = self.out / "output.log"
        text = own.read_text(errors="replace")[-4000:] if own.exists() else ""
        if status.exists():
            return int(status.read_text()), text
        process = self.group.log.read_text(errors="replace")[-4000:]
        return (code if code else 1) if code is not None else None, text + process


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Start every selected group of jobs at once; yield `{job: _Job}`."""
    selected = {
        item.callspec.params["job"]
        for item in request.session.items
        if getattr(item, "callspec", None) and "job" in item.callspec.params
    }
    if not FULL_MATRIX:  # skipped: their process is not started
        selected -= set(FULL_MATRIX_ONLY)
    started, groups = {}, []
    for group in GROUPS:
        outs = {job: tmp_path_factory.mktemp(job) for job in group if job in selected}
        if not outs:
            continue
        log = (
            next(iter(outs.values()))
            if len(outs) == 1
            else tmp_path_factory.mktemp("group")
        )
        groups.append(_Group(outs, log / "output.log"))
        started |= {job: _Job(job, out, groups[-1]) for job, out in outs.items()}
    yield started
    for group in groups:
        if group.process.poll() is None:
            group.process.kill()
            group.process.wait()


@pytest.mark.parametrize(
    "job",
    [
        pytest.param(job, marks=full_matrix_only(FULL_MATRIX_ONLY[job]))
        if job in FULL_MATRIX_ONLY
        else job
        for job in EXAMPLES
    ],
)
def test_example(job: str, jobs) -> None:
    code, output = jobs[job].wait()
    assert code == 0, f"examples/{job}.py --quick exited with {code}:\n{output}"
    png = jobs[job].out / f"{job}.png"
    assert png.is_file() and png.stat().st_size > 0, f"no {png.name}:\n{output}"


@pytest.mark.parametrize(
    "job",
    [
        pytest.param(
            "multi_process",
            marks=full_matrix_only(FULL_MATRIX_ONLY["multi_process"]),
        )
    ],
)
def test_multi_process_result(job: str, jobs) -> None:
    """The two processes' gathered ensemble equals a single-process solve, and each
    process solved its own half."""
    code, output = jobs[job].wait()
    assert code == 0, f"examples/{job}.py --quick exited with {code}:\n{output}"
    with np.load(jobs[job].out / "multi_process.npz") as result:
        np.testing.assert_allclose(
            result["multi"], result["single"], rtol=1e-5, atol=1e-5
        )
        size = result["rhos"].shape[0]
    assert f"process 0: solved rows from [0] of {size}" in output, output
    assert f"process 1: solved rows from [{size // 2}] of {size}" in output, output


@pytest.mark.parametrize("job", [DOCS])
def test_docs_code_blocks(job: str, jobs) -> None:
    code, output = jobs[job].wait()
    assert code == 0, f"a python block in docs/*.md failed ({code}):\n{output}"
