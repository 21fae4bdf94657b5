"""Which public names of solverkit the quick test loop references, and which only the
full suite does.

    python -m tools.quick_coverage [--out FILE.json] [--baseline FILE.json]

Collects the suite (`pytest --collect-only`, nothing is run), and for each test item
takes its text: the test function's source and those of the functions, classes and
values of its own module that it uses (two levels down), its parametrization's id, and
the names of the classes and instances among its parameter values (solver lists from
`tests/helpers.py` appear there, not in the source). A public name (a name that
`solverkit` exports without a leading underscore) counts as referenced by a test when it
appears in that text as a whole word. A test marked `slow` (directly, by `pytestmark`,
or by `quick_cases` leaving it out) is in the full suite only.

Prints a Markdown table: per public name, how many quick tests and how many tests in
all reference it. `--baseline` (an earlier `--out`) names those that lost quick
coverage since, and exits with status 1 if any did. The check is textual: a name used
only inside `tests/helpers.py` or deeper in the module's helpers is not seen.
"""

import argparse
import inspect
import json
import pathlib
import re
import sys
from typing import Any

import pytest


def _value_names(value: Any, depth: int = 0) -> list[str]:
    """Class names found in a parameter value: a class's own name, an instance's
    class name, recursing into tuples, lists and dicts."""
    if depth > 3:
        return []
    if isinstance(value, type):
        return [value.__name__]
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _value_names(v, depth + 1)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _value_names(v, depth + 1)]
    if callable(value) and hasattr(value, "__name__"):
        return [value.__name__]
    return [type(value).__name__]


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError, ValueError):
        return ""


def _with_module_helpers(source: str, module: Any, depth: int = 2) -> str:
    """`source` and the sources of the test module's own functions, classes and
    values that it names, and of those they name, `depth` levels down."""
    seen: set[str] = set()
    texts, frontier = [source], source
    for _ in range(depth):
        found = []
        for word in set(re.findall(r"\b[A-Za-z_]\w*\b", frontier)) - seen:
            seen.add(word)
            obj = getattr(module, word, None)
            if obj is None or inspect.ismodule(obj):
                continue
            if inspect.getmodule(inspect.unwrap(obj)) is module:
                found.append(_source(obj))
            elif not callable(obj):  # a module-level value: a solver list, a term
                found.append(" ".join(_value_names(obj)))
        frontier = "\n".join(found)
        texts.append(frontier)
    return "\n".join(texts)


def _item_text(item: pytest.Item) -> str:
    """The test's source with its module's helpers that it uses, its
    parametrization's id and its parameters' class names."""
    source = _source(getattr(item, "function", None))
    source = _with_module_helpers(source, getattr(item, "module", None))
    callspec = getattr(item, "callspec", None)
    extra = []
    if callspec is not None:
        extra.append(callspec.id)
        extra += _value_names(list(callspec.params.values()))
    return "\n".join([source, *extra])


class _Collector:
    """A pytest plugin that records each collected item's node id, tier and text."""

    def __init__(self):
        self.items: list[tuple[str, bool, str]] = []

    @pytest.hookimpl(trylast=True)  # after conftest marks `quick_cases`' others slow
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            slow = item.get_closest_marker("slow") is not None
            self.items.append((item.nodeid, slow, _item_text(item)))


def public_names() -> list[str]:
    """The names `solverkit` exports: those without a leading underscore that are
    not modules."""
    import types

    import solverkit

    return sorted(
        name
        for name, value in vars(solverkit).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


def coverage(items: list[tuple[str, bool, str]], names: list[str]) -> dict:
    """Per name: the quick and all tests whose text references it."""
    out = {}
    for name in names:
        pattern = re.compile(rf"\b{re.escape(name)}\b")
        hits = [(nodeid, slow) for nodeid, slow, text in items if pattern.search(text)]
        quick = [nodeid for nodeid, slow in hits if not slow]
        out[name] = {"quick": len(quick), "all": len(hits), "quick_ids": quick}
    return out


def table(cover: dict) -> str:
    """Markdown: per name, quick and total references, and one quick test."""
    lines = ["| name | quick tests | all tests | a quick test |", "|---|---|---|---|"]
    for name, row in cover.items():
        first = row["quick_ids"][0] if row["quick_ids"] else "-"
        lines.append(f"| {name} | {row['quick']} | {row['all']} | {first} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="write the counts as JSON")
    parser.add_argument("--baseline", type=pathlib.Path, help="an earlier --out")
    parser.add_argument("tests", nargs="*", default=["tests"])
    args = parser.parse_args()
    collector = _Collector()
    flags = ["--collect-only", "-qq", "-p", "no:cacheprovider", "-p", "no:xdist"]
    code = pytest.main([*flags, *args.tests], plugins=[collector])
    if code not in (0, 5):
        return int(code)
    cover = coverage(collector.items, public_names())
    print(table(cover))
    if args.out:
        args.out.write_text(json.dumps(cover, indent=1))
    if not args.baseline:
        return 0
    before = json.loads(args.baseline.read_text())
    lost = [n for n, row in cover.items() if row["quick"] == 0 and before.get(n, {})]
    lost = [n for n in lost if before[n]["quick"] > 0]
    print("\nlost quick coverage:", ", ".join(lost) if lost else "none")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
