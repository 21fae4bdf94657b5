"""Linear algebra of the stiff solvers: the linear solvers (`_linear_solver.py`),
Jacobians and factors (`_linalg.py`), banded matrices (`_banded.py`) and sparsity
patterns (`_sparsity.py`)."""
