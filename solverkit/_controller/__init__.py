"""Step-size controllers: the bases and the fixed controllers (`_base.py`), the adaptive
ones (`_adaptive.py`) and the default error norm (`_norm.py`)."""
