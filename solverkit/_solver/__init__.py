from ._base import (
    AbstractAdaptiveSolver as AbstractAdaptiveSolver,
    AbstractSolver as AbstractSolver,
)
from ._runge_kutta import (
    AbstractERK as AbstractERK,
    AbstractRungeKutta as AbstractRungeKutta,
    Bosh3 as Bosh3,
    Dopri5 as Dopri5,
    Dopri8 as Dopri8,
    Euler as Euler,
    Heun as Heun,
    Midpoint as Midpoint,
    Ralston as Ralston,
    Tsit5 as Tsit5,
)
