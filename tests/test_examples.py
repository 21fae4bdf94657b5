"""Smoke tests of `examples/` and of the code in the docs.

Each example runs with `--quick` and must write its PNG; every ```python block of the
narrative docs pages (`docs/*.md`) must run. They spend most of their time compiling,
which is mostly single-threaded, so every selected job is started at once in its own
process, and each test waits for its own.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest


# Subprocesses that take a minute or more together: the full suite only.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = [
    "quickstart",
    "fit_lotka_volterra",
    "neural_ode",
    "ensemble",
    "forced_system",
    "multi_process",  # launches two JAX processes (jax.distributed, gloo on CPU)
    "heat_pde",
    "stiff_chemistry",
    "dae",
    "steady_state",
    "bouncing_ball",
    "spiking_neurons",
    "pharmacokinetics",
    "brusselator",
]
DOCS = "docs"
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


def _command(job: str, out: pathlib.Path) -> list[str]:
    if job == DOCS:
        pages = sorted(str(p) for p in (ROOT / "docs").glob("*.md"))
        return [sys.executable, "-c", RUN_DOC_BLOCKS, *pages]
    script = ROOT / "examples" / f"{job}.py"
    return [sys.executable, str(script), "--quick", "--out", str(out)]


class _Job:
    def __init__(self, job: str, out: pathlib.Path):
        self.out = out
        self.log = out / "output.log"
        env = dict(os.environ, MPLBACKEND="Agg")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [str(ROOT), env.get("PYTHONPATH")] if p
        )
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                _command(job, out),
                cwd=out,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait(self) -> tuple[int | None, str]:
        """The exit code (`None` after a timeout) and the end of the output."""
        try:
            code = self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = None
        return code, self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Start every selected job at once; yield `{job: _Job}`."""
    selected = {
        item.callspec.params["job"]
        for item in request.session.items
        if getattr(item, "callspec", None) and "job" in item.callspec.params
    }
    started = {
        job: _Job(job, tmp_path_factory.mktemp(job))
        for job in [*EXAMPLES, DOCS]
        if job in selected
    }
    yield started
    for job in started.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()


@pytest.mark.parametrize("job", EXAMPLES)
def test_example(job: str, jobs) -> None:
    code, output = jobs[job].wait()
    assert code == 0, f"examples/{job}.py --quick exited with {code}:\n{output}"
    png = jobs[job].out / f"{job}.png"
    assert png.is_file() and png.stat().st_size > 0, f"no {png.name}:\n{output}"


@pytest.mark.parametrize("job", ["multi_process"])
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
