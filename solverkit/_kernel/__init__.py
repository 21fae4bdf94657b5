"""Whole-solve ensemble kernels (Pallas): every trajectory of an ensemble solved
inside one kernel, a block of them per program, each with its own adaptive steps.
`ensemble_solve(..., kernel=...)` dispatches here (`kernel_solve`), after
`supported` says the solve is one the kernel can do."""

from ._field import by_default as by_default
from ._scalarize import KernelUnsupported as KernelUnsupported
from ._solve import kernel_solve as kernel_solve, supported as supported
