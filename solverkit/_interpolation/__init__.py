"""Dense output of a whole solve (`_dense.py`: `DenseInterpolation`) and the
interpolations a vector field closes over (`_global_interpolation.py`)."""
