"""How a solve is differentiated: the adjoints' base and what they share (`_base.py`),
`RecursiveCheckpointAdjoint` (`_checkpoint.py`, with its schedule `_schedule.py` and
stored carries `_stack.py`) and `BacksolveAdjoint` (`_backsolve.py`)."""
