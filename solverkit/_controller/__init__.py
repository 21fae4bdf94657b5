"""Step-size controllers: the bases and the fixed controllers (`_base.py`), the adaptive
ones (`_adaptive.py`: PID; `_clip.py`: clipping to given times) and the default error
norm (`_norm.py`)."""
