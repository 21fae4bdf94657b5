"""The `while` loops of an optimized HLO module's text and the operations in each
loop's body (tests/adjoint/test_fixed_step_pullback.py).

Reads `compiled.as_text()` (the optimized HLO, after fusion): a row of a stack
that `vmap` reads is a gather in the lowered program, which XLA may turn into a
dynamic slice; counting both kinds, per loop, is what says how often a loop's
iteration touches memory by index, across JAX versions.
"""

import collections
import re
from typing import Any


ROW_OPS = ("gather", "scatter", "dynamic-slice", "dynamic-update-slice")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLEE = re.compile(
    r"(?:calls|body|condition|to_apply|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)
_CALLEES = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, list[str]]]], str]:
    """Each computation of an HLO module's text as `(op, called computations)` per
    instruction, and the name of the entry computation."""
    comps: dict[str, list[tuple[str, list[str]]]] = {}
    current, entry = None, ""
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif current is not None and line.startswith(" ") and "=" in line:
            rhs = line.split("=", 1)[1]
            op = _OP.search(rhs)
            callees = _CALLEE.findall(rhs)
            for group in _CALLEES.findall(rhs):
                callees += [c.strip().lstrip("%") for c in group.split(",")]
            comps[current].append((op.group(1) if op else "?", callees))
    return comps, entry


def _ops(comps, name: str) -> collections.Counter:
    """The ops of computation `name` and of those it calls, nested loops' bodies
    (and conditions) excluded."""
    counts: collections.Counter = collections.Counter()
    for op, callees in comps[name]:
        counts[op] += 1
        if op != "while":
            for callee in callees:
                counts += _ops(comps, callee)
    return counts


def loops(hlo: str) -> list[dict[str, Any]]:
    """The `while` loops of an optimized HLO module's text, outer before inner, each
    as `{"depth", "ops"}`: its nesting depth and the count of each op in its body
    (its own, not its nested loops'): the row operations (`ROW_OPS`), `while` and
    `fusion` (a kernel each: an accelerator's per-iteration cost), and `size`, all
    its instructions.

    **Arguments:**

    - `hlo`: `compiled.as_text()`.

    **Returns:**

    One dict per loop, in the order of the text's nesting walk.
    """
    comps, entry = _computations(hlo)
    found: list[dict[str, Any]] = []

    def walk(name: str, depth: int) -> None:
        for op, callees in comps[name]:
            if op == "while":
                body = _body_of(comps, callees)
                ops = _ops(comps, body)
                keep = {k: ops.get(k, 0) for k in (*ROW_OPS, "while", "fusion")}
                found.append({"depth": depth, "ops": keep, "size": sum(ops.values())})
                walk(body, depth + 1)
            else:
                for callee in callees:
                    walk(callee, depth)

    walk(entry, 0)
    return found


def _body_of(comps, callees: list[str]) -> str:
    """A while instruction's body among its callees (its condition and body, in
    either order): the larger."""
    return max(callees, key=lambda c: len(comps.get(c, ())))
