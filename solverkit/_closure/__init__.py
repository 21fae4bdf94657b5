"""Closure conversion (`_convert.py`: `closure_convert`, `Closure`), the rewrites of a
converted jaxpr (`_jaxpr_rewrite.py`), its evaluation under `shard_map`
(`_vma_eval.py`), batch-aware primitives, loops and
error raising (`_unvmap.py`, `_loops.py`, `_raising.py`) and a function traced once
and evaluated from its jaxpr after (`_traced.py`). Imports nothing else of
solverkit."""
