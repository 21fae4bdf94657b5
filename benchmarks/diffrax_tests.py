"""Run diffrax's own ODE tests against solverkit, and count what passes per file.

Give it the `test/` folder of a diffrax checkout (the tag of the installed diffrax):

```bash
python -m benchmarks.diffrax_tests /tmp/diffrax-src/test            # every ODE file
python -m benchmarks.diffrax_tests /tmp/diffrax-src/test --files test_solver.py -k vmap
python -m benchmarks.diffrax_tests /tmp/diffrax-src/test --reference  # the real diffrax
python -m benchmarks.diffrax_tests /tmp/diffrax-src/test --out DIR    # + JSON, failures
```

How: the test folder is copied into a temporary directory, next to an import shim,
a package `diffrax` whose namespace is solverkit's (`from solverkit import *`), with
the few private submodules the tests import (`diffrax._misc`, `_custom_types`,
`_typing`, `_step_size_controller.clip`, `_solver.dopri5`, `_integrate`, `_term`).
A name solverkit lacks (SDE terms, Brownian paths, ...) resolves to a placeholder
class whose instances raise `NotImplementedError` when used, so a file imports
and only the tests that use it fail. Each file runs in its own pytest process, with
diffrax's `conftest.py` (x64, strict dtype and rank promotion), without diffrax's
`pyproject.toml` options (its beartype hook), and `-p no:cacheprovider`.
`--reference` runs the same files against the installed diffrax, for a baseline.

ODE files are `ODE_FILES` below; SDE, Brownian, Langevin, citation and typing
files are not ODE tests, nor are the SDE tests inside ODE files (`NOT_ODE`, not
run). Other tests that need a name solverkit lacks fail through the placeholder
and count as failures.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET


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
    "test_solver.py::test_adaptive_dt0_milstein",
    "test_adaptive_stepsize_controller.py::test_revisit_steps",  # a ControlTerm
)

_ROOT = pathlib.Path(__file__).resolve().parent.parent

_INIT = '''"""Import shim: diffrax's names resolved to solverkit's."""
import solverkit as _sk
from solverkit import *  # noqa: F401,F403

for _name in dir(_sk):
    if not _name.startswith("__"):
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
    "_solver/dopri5.py": """def _Dopri5Interpolation(*args, **kwargs):
    raise NotImplementedError("solverkit has no diffrax's private _Dopri5Interpolation")
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


def _counts(xml_path: pathlib.Path) -> dict:
    """Passed/failed/skipped and the failing test ids of one junit-xml report."""
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": {}}
    if not xml_path.exists():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = case.get("name", "")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            out["failed"] += 1
            message = (bad.get("message") or "").strip().splitlines()
            out["failures"][name] = message[0][:300] if message else ""
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def _run_file(work: pathlib.Path, name: str, args, env) -> dict:
    xml_path = work / f"{name}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        f"test/{name}",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    cmd += ["-c", str(work / "pytest.ini"), f"--junitxml={xml_path}"]
    cmd += [f"--deselect=test/{t}" for t in NOT_ODE if t.startswith(name + "::")]
    if args.k:
        cmd += ["-k", args.k]
    try:
        proc = subprocess.run(
            cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout else []
    except subprocess.TimeoutExpired:
        tail = [f"timed out after {args.timeout} s"]
    result = _counts(xml_path)
    result["summary"] = tail[0] if tail else ""
    return result


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=pathlib.Path, help="diffrax's test/ folder")
    parser.add_argument("--files", default=None, help="comma-separated file names")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--reference", action="store_true", help="the real diffrax")
    parser.add_argument("--timeout", type=float, default=3600.0, help="s per file")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON here")
    args = parser.parse_args(argv)
    if not (args.tests / "helpers.py").exists():
        parser.error(f"tests={args.tests}: expected diffrax's test/ folder")
    return args


def _totals(results: dict) -> dict:
    return {
        k: sum(r[k] for r in results.values()) for k in ("passed", "failed", "skipped")
    }


def _write(out, results: dict) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"total": _totals(results), "files": results}, indent=1)
        (out / "diffrax_tests.json").write_text(text)


def main(argv=None) -> int:
    args = _parse(argv)
    files = args.files.split(",") if args.files else list(ODE_FILES)
    results = {}
    with tempfile.TemporaryDirectory(prefix="diffrax-tests-") as tmp:
        work = pathlib.Path(tmp)
        shutil.copytree(args.tests, work / "test")
        (work / "pytest.ini").write_text("[pytest]\n")
        path = [str(_ROOT)]
        if not args.reference:
            _write_shim(work / "shim")
            path.insert(0, str(work / "shim"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        for name in files:
            results[name] = _run_file(work, name, args, env)
            _write(args.out, results)  # after each file: a killed run keeps its counts
            r = results[name]
            print(
                f"{name:42s} passed {r['passed']:4d}  failed {r['failed']:4d}"
                f"  skipped {r['skipped']:3d}   {r['summary']}",
                flush=True,
            )
    total = _totals(results)
    print(
        f"{'total':42s} passed {total['passed']:4d}  failed {total['failed']:4d}"
        f"  skipped {total['skipped']:3d}"
    )
    for name, r in results.items():
        for test, message in r["failures"].items():
            short = re.sub(r"\s+", " ", message)[:200]
            print(f"FAILED {name}::{test}: {short}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
