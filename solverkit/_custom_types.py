"""Type aliases for annotations (jaxtyping), shared by the modules."""

from typing import Any

from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree


RealScalarLike = float | int | Float[ArrayLike, ""]
"""A real scalar: a Python number or a 0-d array (a time, a step, a tolerance)."""
BoolScalarLike = bool | Bool[ArrayLike, ""]
IntScalarLike = int | Int[ArrayLike, ""]
Y = PyTree[Array]
"""A state: a pytree of floating (or complex) arrays."""
VF = PyTree[Array]
"""A vector field's value: a pytree of the state's structure."""
Args = PyTree[Any]
"""The `args` passed to a vector field."""
DenseInfo = dict[str, PyTree[Array]]
"""What one step hands to its local interpolation."""
