"""The architecture as documented: the import order of docs/architecture.md is the
order of the code, and equinox's abstract/final pattern holds (equinox no longer
enforces it)."""

import ast
import inspect
import pathlib
import re

import equinox as eqx
import pytest

import solverkit as sk


_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _ROOT / "solverkit"


def _documented_layers() -> list[list[str]]:
    """The modules of the sentence "Imports run one way: ..." in architecture.md,
    layer by layer (a layer is one name or a parenthesised group)."""
    text = (_ROOT / "docs" / "architecture.md").read_text()
    match = re.search(r"Imports run one way:(.*?[`)])\.", text, re.S)
    assert match, "architecture.md states no import order"
    return [
        [name.rstrip("/") for name in re.findall(r"`([^`]+)`", part)]
        for part in match.group(1).split("→")
    ]


def _module_of(path: pathlib.Path) -> str:
    """The top-level module (or subpackage) a file belongs to: `_solver` for every
    file of `_solver/`."""
    rel = path.relative_to(_PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: pathlib.Path) -> set[str]:
    """The top-level solverkit modules a file imports when it runs (not those under
    `if TYPE_CHECKING:`, which only annotations use)."""
    depth = len(path.relative_to(_PACKAGE).parts) - 1
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        if node.level - 1 < depth:  # within a subpackage
            continue
        if node.module:
            found.add(node.module.split(".")[0])
        else:
            found.update(alias.name for alias in node.names)
    return found


def test_documented_import_order_is_the_code():
    layers = _documented_layers()
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    files = sorted(_PACKAGE.rglob("*.py"))
    modules = {_module_of(f) for f in files}
    assert modules == set(rank), (
        "architecture.md's import order and the package differ: "
        f"undocumented {sorted(modules - set(rank))}, "
        f"gone {sorted(set(rank) - modules)}"
    )
    wrong = [
        f"{f.relative_to(_ROOT)} imports {dep}"
        for f in files
        for dep in _imports(f)
        if dep != _module_of(f) and rank[dep] <= rank[_module_of(f)]
    ]
    assert not wrong, "imports against the documented order: " + "; ".join(wrong)


def _dotted(path: pathlib.Path) -> str:
    """`solverkit._solver._bdf` for `solverkit/_solver/_bdf.py` (a package's
    `__init__.py` is the package)."""
    parts = path.relative_to(_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _every_import(path: pathlib.Path, known: set[str]) -> set[str]:
    """The solverkit modules (dotted names in `known`) a file imports anywhere: at
    the top, under `if TYPE_CHECKING:`, inside functions."""
    package = _dotted(path) if path.name == "__init__.py" else _dotted(path.parent)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            bases, names = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            # `from . import _x` names a module; `from ._x import f` a module's name.
            subs = {f"{base}.{n}" for n in names} & known
            found.update(subs or {m for m in [base] if m in known})
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (a list of nodes, the first repeated at the end), or
    `None`."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _import_graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """`(files, units)`: who imports whom among the package's files, and among its
    top-level modules and subpackages (`_solver`, `_controller`, ...)."""
    files = sorted(_PACKAGE.rglob("*.py"))
    known = {_dotted(f) for f in files}
    by_file = {_dotted(f): _every_import(f, known) for f in files}
    unit = lambda name: name.split(".")[1] if "." in name else name  # noqa: E731
    by_unit: dict[str, set[str]] = {}
    for name, deps in by_file.items():
        if name == "solverkit":  # `__init__` imports everything
            continue
        by_unit.setdefault(unit(name), set()).update(
            unit(d) for d in deps if unit(d) != unit(name) and d != "solverkit"
        )
    return by_file, by_unit


def test_no_import_circle():
    # Any import counts, also those only type annotations read (under
    # `TYPE_CHECKING`) and deferred ones inside functions: a circle of either kind
    # means two layers that know each other.
    by_file, by_unit = _import_graphs()
    circle = _cycle(by_unit)
    assert circle is None, "import circle between modules: " + " → ".join(circle)
    circle = _cycle(by_file)
    assert circle is None, "import circle between files: " + " → ".join(circle)


def test_the_circle_finder_finds_circles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# The house rules (STYLE.md): no module over 500 lines, no function over 60 lines of
# code (docstrings, comments and blank lines not counted).
_MODULE_LINES, _FUNCTION_LINES = 500, 60
# Exempt, each for its reason: coefficient tables, which read best whole.
_TABLES = {
    "_solver/_tableau.py": "Butcher tableaux of the explicit Runge-Kutta methods",
    "_solver/_implicit_tableau.py": "tableaux of the implicit and IMEX methods",
    "_solver/_implicit_tableau.py::_kencarp5": "KenCarp5's coefficients, one table",
}
# Over the limits and being split elsewhere; remove when merged.
_PENDING = {}


def _code_lines(lines: list[str], node: ast.AST) -> int:
    """Lines of code of a function: its lines less its docstring, comments and
    blank lines (nested functions count as its lines)."""
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    doc: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        assert first.end_lineno is not None
        doc = set(range(first.lineno, first.end_lineno + 1))
    assert node.end_lineno is not None
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in doc and lines[i - 1].strip() and not lines[i - 1].strip()[0] == "#"
    )


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """`(modules, functions)`: lines per module, code lines per function
    (`path::name`), paths relative to the package."""
    modules, functions = {}, {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        rel = path.relative_to(_PACKAGE).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        modules[rel] = len(lines)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(lines, node)
                functions[f"{rel}::{node.name}"] = max(
                    n, functions.get(f"{rel}::{node.name}", 0)
                )
    return modules, functions


def test_modules_and_functions_are_short():
    modules, functions = _sizes()
    exempt = set(_TABLES) | set(_PENDING)
    long_modules = {
        k: n for k, n in modules.items() if n > _MODULE_LINES and k not in exempt
    }
    long_functions = {
        k: n
        for k, n in functions.items()
        if n > _FUNCTION_LINES and k not in exempt and k.split("::")[0] not in exempt
    }
    assert not long_modules, f"modules over {_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, (
        f"functions over {_FUNCTION_LINES} code lines: {long_functions}"
    )


def test_the_line_counter_counts_code():
    text = '''def f(x):
    """A docstring
    of three lines.
    """
    # a comment

    y = x + 1
    return y
'''
    node = ast.parse(text).body[0]
    assert _code_lines(text.splitlines(), node) == 3  # def, y = ..., return


def _solverkit_modules() -> list[type]:
    classes = {
        cls
        for module in list(vars(sk).values())
        for cls in [module]
        if inspect.isclass(cls) and issubclass(cls, eqx.Module)
    }
    # The private classes too: every equinox Module defined in the package.
    seen, todo = set(), list(classes)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(c for c in cls.__mro__ if issubclass(c, eqx.Module))
        todo.extend(cls.__subclasses__())
    return [c for c in seen if c.__module__.startswith("solverkit")]


def _is_abstract_name(cls: type) -> bool:
    return cls.__name__.lstrip("_").startswith("Abstract")


def test_only_abstract_classes_are_subclassed():
    # Abstract/final: behaviour is inherited from `Abstract*` bases only; a concrete
    # class is never subclassed (wrap it instead).
    wrong = [
        f"{cls.__name__} subclasses the concrete {base.__name__}"
        for cls in _solverkit_modules()
        for base in cls.__mro__[1:]
        if base.__module__.startswith("solverkit") and not _is_abstract_name(base)
    ]
    assert not wrong, "; ".join(sorted(wrong))


@pytest.mark.parametrize(
    "cls",
    [
        sk.AbstractRungeKutta,
        sk.AbstractERK,
        sk.AbstractSolver,
        sk.AbstractAdjoint,
        sk.AbstractStepSizeController,
        sk.AbstractAdaptiveStepSizeController,
        sk.AbstractProgressMeter,
        sk.AbstractTerm,
    ],
)
def test_abstract_bases_do_not_instantiate(cls):
    with pytest.raises(TypeError, match="abstract"):
        cls()


def test_a_user_progress_meter_must_say_when_to_refresh():
    class Meter(sk.AbstractProgressMeter):
        def start(self):
            return 0

        def callback(self, token, fraction):
            pass

    with pytest.raises(TypeError, match="wants"):
        Meter()


# Development history belongs in commit messages: no round names ("stop" and two
# digits, with or without a letter or folder suffix) and no issue numbers ("issue
# #N", "#N" in prose) in any tracked text file. Stricter than the commit hook's
# `stop ?[0-9]{2}([_ ]?[a-e])?\b|issue #[0-9]+`.
_HISTORY = r"\bstop ?[0-9]{2}|stop[0-9]{2}|\bissues? #[0-9]+|(^|[ (`])#[0-9]{1,3}\b"


def test_no_development_history_in_tracked_files():
    import shutil
    import subprocess

    if shutil.which("git") is None or not (_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    found = subprocess.run(
        ["git", "grep", "--untracked", "-I", "-n", "-i", "-E", _HISTORY],
        cwd=_ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode in (0, 1), found.stderr
    assert found.stdout == "", "development history in the repository:\n" + found.stdout
