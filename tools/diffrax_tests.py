"""Run diffrax's own ODE tests against solverkit, and count what passes per file.

Give it the `test/` folder of a diffrax checkout (the tag of the installed diffrax);
`.dfx-test/` in the repository root is ignored by git, for a copy of it:

```bash
python -m tools.diffrax_tests .dfx-test                       # every ODE file
python -m tools.diffrax_tests .dfx-test --files test_solver.py -k vmap
python -m tools.diffrax_tests .dfx-test --reference          # the real diffrax
python -m tools.diffrax_tests .dfx-test -n 12 --timeout 500 --out DIR
python -m tools.diffrax_tests --summarize DIR                # rebuild DIR's tables
```

How: the test folder is copied into a temporary directory, next to an import shim,
a package `diffrax` whose namespace is solverkit's (`from solverkit import *`), with
the few private submodules the tests import (`diffrax._misc`, `_custom_types`,
`_typing`, `_step_size_controller.clip`, `_solver.dopri5`, `_integrate`, `_term`).
A name solverkit lacks (SDE terms, Brownian paths, ...) resolves to a placeholder
class whose instances raise `NotImplementedError` when used, so a file imports
and only the tests that use it fail. The files run in one pytest session (or one
per file, `--per-file`), with diffrax's `conftest.py` (x64, strict dtype and rank
promotion), without diffrax's `pyproject.toml` options (its beartype hook),
`-p no:cacheprovider`, on `JAX_PLATFORMS=cpu` unless set, and with `-n WORKERS`
through pytest-xdist (tests handed out one or two at a time; `--first` names the
long tests that start first, one per worker). Each test's outcome is written to
`DIR/diffrax_tests.jsonl` as it finishes (`diffrax_tests_plugin.py`), and the
tables (`diffrax_tests.json`, `.md`) are rebuilt from it after each session: a
session past `--timeout` is killed, and a crash or a kill of the whole run keeps
every finished test (`--summarize DIR` rebuilds the tables), the rest counted as
`not_run`. `--reference` runs the same files against the installed diffrax.

ODE files are `ODE_FILES` below; SDE, Brownian, Langevin, citation and typing
files are not ODE tests, nor are the SDE tests inside ODE files (`NOT_ODE`, not
run). Other tests that need a name solverkit lacks fail through the placeholder
and count as failures. diffrax's tests import optax (test_adjoint) and scipy
(test_integrate, test_detest) when the file is collected.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time


ODE_FILES = (
    "test_adaptive_stepsize_controller.py",
    "test_adjoint.py",
    "test_detest.py",
    "test_event.py",
    "test_global_interpolation.py",
    "test_integrate.py",
    "test_interpolation.py",
    "test_local_interpolation.py",
    "test_progress_meter.py",
    "test_saveat_solution.py",
    "test_solver.py",
    "test_step_to.py",
    "test_very_chord.py",
    "test_vmap.py",
)

# Tests in the ODE files that are about SDEs (Brownian paths, Milstein, SDE adjoints).
NOT_ODE = (
    "test_integrate.py::test_sde_strong_order",
    "test_adjoint.py::test_sde_against",
    "test_adjoint.py::test_forward_mode_runge_kutta",  # a ControlTerm, Brownian path
    "test_solver.py::test_adaptive_dt0_milstein",
    "test_adaptive_stepsize_controller.py::test_revisit_steps",  # a ControlTerm
)

_ROOT = pathlib.Path(__file__).resolve().parent.parent

_INIT = '''"""Import shim: diffrax's names resolved to solverkit's."""
import solverkit as _sk
from solverkit import *  # noqa: F401,F403

for _name in dir(_sk):
    if not _name.startswith("_"):  # the private submodules are the shim's own
        globals()[_name] = getattr(_sk, _name)

from . import _custom_types, _integrate, _misc, _solver, _term, _typing  # noqa: E402
from . import _step_size_controller  # noqa: E402


class _Missing(type):
    # A placeholder class: it and its attributes can be made (a test module builds
    # its parameters and class attributes on import), but using them raises.
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__name__}.{attr}")()


def _placeholder(name):
    def missing(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotImplementedError(f"solverkit has no diffrax.{name} (.{attr})")

    init = lambda self, *args, **kwargs: None
    return _Missing(name, (), {"__init__": init, "__getattr__": missing})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    cls = _placeholder(name)
    globals()[name] = cls
    return cls
'''

_SUBMODULES = {
    "_misc.py": """import jax.numpy as jnp
import numpy as np


def is_tuple_of_ints(obj):
    return isinstance(obj, tuple) and all(isinstance(x, int) for x in obj)


def fill_forward(ys, replace_nans_at_start=None):
    raise NotImplementedError("solverkit has no diffrax._misc.fill_forward")
""",
    "_custom_types.py": """from solverkit._custom_types import *  # noqa: F401,F403
from jaxtyping import ArrayLike, Bool, Float, Int

RealScalarLike = float | int | ArrayLike
""",
    "_typing.py": """def get_args_of(*args, **kwargs):
    raise NotImplementedError("solverkit has no diffrax._typing")


get_origin_no_specials = get_args_of
""",
    "_integrate.py": """from solverkit._integrate import *  # noqa: F401,F403

_PRINT_STATIC = False
""",
    "_term.py": """from solverkit._term import *  # noqa: F401,F403


def AdjointTerm(*args, **kwargs):
    raise NotImplementedError("solverkit has no diffrax._term.AdjointTerm")
""",
    "_solver/__init__.py": "from . import dopri5  # noqa: F401\n",
    "_solver/dopri5.py": """import solverkit

# diffrax's private name for Dopri5's dense output (`interpolation_cls`), which its
# tests build from `k`, Dopri5's stacked stage increments, as solverkit's takes them.
_Dopri5Interpolation = solverkit.Dopri5.interpolation_cls
""",
    "_step_size_controller/__init__.py": "from . import clip  # noqa: F401\n",
    "_step_size_controller/clip.py": """def _find_idx_with_hint(*args, **kwargs):
    raise NotImplementedError("solverkit has no diffrax's private _find_idx_with_hint")
""",
}


def _write_shim(where: pathlib.Path) -> None:
    pkg = where / "diffrax"
    (pkg / "_solver").mkdir(parents=True)
    (pkg / "_step_size_controller").mkdir()
    (pkg / "__init__.py").write_text(_INIT)
    for name, text in _SUBMODULES.items():
        (pkg / name).write_text(text)


_STREAM = "diffrax_tests.jsonl"


def _read_stream(path: pathlib.Path) -> tuple[list, dict, dict]:
    """`(collected ids, final outcome per test id, collection errors per file)` from
    the plugin's records; a line cut by a kill is skipped."""
    collected, outcomes, broken = [], {}, {}
    if not path.exists():
        return collected, outcomes, broken
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "collected" in rec:
            collected += [i for i in rec["collected"] if i not in set(collected)]
            continue
        node, outcome = rec["nodeid"], rec["outcome"]
        if rec["when"] == "collect":
            broken[_file_of(node)] = rec.get("message", "")
            continue
        old = outcomes.get(node, ("", ""))
        if old[0] == "failed":
            continue  # a failure in any phase is the test's outcome
        if outcome == "failed":
            outcomes[node] = ("failed", rec.get("message", ""))
        elif outcome == "skipped" or (rec["when"] == "call" and outcome == "passed"):
            outcomes[node] = (outcome, "")
    return collected, outcomes, broken


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0].rsplit("/", 1)[-1]


def summarize(out: pathlib.Path, files: list | None = None) -> dict:
    """Per-file counts (`passed`, `failed`, `skipped`, `not_run`: collected, not
    finished) and failure messages from `out`'s stream; written to
    `out/diffrax_tests.json` and `.md`."""
    collected, outcomes, broken = _read_stream(out / _STREAM)
    names = list(files or [])
    names += [f for f in map(_file_of, collected + list(broken)) if f not in names]
    results = {}
    for name in names:
        r = {"passed": 0, "failed": 0, "skipped": 0, "not_run": 0, "failures": {}}
        ids = [i for i in collected if _file_of(i) == name]
        ids += [i for i in outcomes if _file_of(i) == name and i not in set(ids)]
        for node in ids:
            outcome, message = outcomes.get(node, ("not_run", ""))
            r[outcome] += 1
            if outcome == "failed":
                r["failures"][node.split("::", 1)[-1]] = message
        if name in broken:
            r["failed"] += 1
            r["failures"]["(collection)"] = broken[name]
        results[name] = r
    _write(out, results)
    return results


def _one_line(message: str) -> str:
    return re.sub(r"[|\s]+", " ", message)[:200]


def _totals(results: dict) -> dict:
    keys = ("passed", "failed", "skipped", "not_run")
    return {k: sum(r[k] for r in results.values()) for k in keys}


def _write(out: pathlib.Path, results: dict) -> None:
    total = _totals(results)
    text = json.dumps({"total": total, "files": results}, indent=1)
    (out / "diffrax_tests.json").write_text(text)
    rows = [
        "| file | passed | failed | skipped | not run |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in list(results.items()) + [("total", total)]:
        rows.append(
            f"| {name} | {r['passed']} | {r['failed']} | {r['skipped']} "
            f"| {r['not_run']} |"
        )
    fails = [
        f"- {name}::{test}: {_one_line(message)}"
        for name, r in results.items()
        for test, message in r["failures"].items()
    ]
    (out / "diffrax_tests.md").write_text("\n".join(rows + [""] + fails) + "\n")


def _session(work, names: list, args, env, out: pathlib.Path) -> str:
    """One pytest session over `names`; killed (its process group) past
    `args.timeout` s. Returns the last line pytest printed, or why it stopped."""
    cmd = [sys.executable, "-m", "pytest", *[f"test/{n}" for n in names], "-q"]
    cmd += ["-p", "no:cacheprovider", "-p", "tools.diffrax_tests_plugin"]
    cmd += ["-c", str(work / "pytest.ini"), "-o", "console_output_style=classic"]
    cmd += [f"--deselect=test/{t}" for t in NOT_ODE if t.split("::")[0] in names]
    if args.workers:
        cmd += ["-n", str(args.workers), "--dist", "load", "--maxschedchunk", "1"]
    if args.k:
        cmd += ["-k", args.k]
    env = dict(env, DFX_TESTS_STREAM=str(out / _STREAM), DFX_TESTS_FIRST=args.first)
    log = open(out / "pytest.log", "a")
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        proc.wait(timeout=args.timeout)
        tail = ""
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        tail = f"killed after {args.timeout:.0f} s"
    log.close()
    if not tail:
        lines = (out / "pytest.log").read_text().strip().splitlines()
        tail = lines[-1] if lines else f"exit {proc.returncode}"
    return tail


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=pathlib.Path, nargs="?", help="diffrax's test/")
    parser.add_argument("--files", default=None, help="comma-separated file names")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--reference", action="store_true", help="the real diffrax")
    parser.add_argument("-n", dest="workers", type=int, default=0, help="xdist workers")
    parser.add_argument("--per-file", action="store_true", help="a session a file")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="s per session (per file)"
    )
    parser.add_argument(
        "--first", default="test_adjoint.py", help="ids of long tests, comma-separated"
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results here")
    parser.add_argument("--summarize", type=pathlib.Path, default=None, help="DIR")
    args = parser.parse_args(argv)
    if args.summarize is None and (
        args.tests is None or not (args.tests / "helpers.py").exists()
    ):
        parser.error(f"tests={args.tests}: expected diffrax's test/ folder")
    if args.workers and importlib.util.find_spec("xdist") is None:
        parser.error(f"-n {args.workers} needs pytest-xdist (and execnet) installed")
    return args


def _print(results: dict) -> None:
    for name, r in list(results.items()) + [("total", _totals(results))]:
        print(
            f"{name:42s} passed {r['passed']:4d}  failed {r['failed']:4d}"
            f"  skipped {r['skipped']:3d}  not run {r['not_run']:4d}",
            flush=True,
        )


def main(argv=None) -> int:
    args = _parse(argv)
    if args.summarize is not None:
        results = summarize(args.summarize)
        _print(results)
        return 0
    files = args.files.split(",") if args.files else list(ODE_FILES)
    with tempfile.TemporaryDirectory(prefix="diffrax-tests-") as tmp:
        work = pathlib.Path(tmp)
        out = args.out or work / "out"
        out.mkdir(parents=True, exist_ok=True)
        (out / _STREAM).unlink(missing_ok=True)
        shutil.copytree(args.tests, work / "test")
        (work / "pytest.ini").write_text("[pytest]\n")
        path = [str(_ROOT)]
        if not args.reference:
            _write_shim(work / "shim")
            path.insert(0, str(work / "shim"))
        # Keep the caller's path (where the wheels of a bare machine are installed).
        path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        env.setdefault("JAX_PLATFORMS", "cpu")
        sessions = [[f] for f in files] if args.per_file else [files]
        start = time.time()
        for names in sessions:
            tail = _session(work, names, args, env, out)
            results = summarize(out, files)
            print(f"{','.join(names)}: {tail} ({time.time() - start:.0f} s)")
        _print(results)  # pyright: ignore[reportPossiblyUnbound]
        for name, r in results.items():  # pyright: ignore[reportPossiblyUnbound]
            for test, message in r["failures"].items():
                print(f"FAILED {name}::{test}: {_one_line(message)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
