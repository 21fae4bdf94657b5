"""Linear algebra of the stiff solvers: the linear-solver protocol and the dense
solver (`_linear_solver.py`), one module per other linear solver (`_band_solver.py`,
`_sparse.py`, `_krylov.py` with `_bicgstab.py`), Jacobians and factors
(`_linalg.py`), banded matrices (`_banded.py`) and sparsity patterns
(`_sparsity.py`)."""
