from ._base import (
    AbstractAdaptiveSolver as AbstractAdaptiveSolver,
    AbstractSolver as AbstractSolver,
)
from ._leapfrog_midpoint import LeapfrogMidpoint as LeapfrogMidpoint
from ._reversible_heun import ReversibleHeun as ReversibleHeun
from ._rosenbrock import (
    AbstractRosenbrock as AbstractRosenbrock,
    Rodas4 as Rodas4,
    Rodas5P as Rodas5P,
    Ros3P as Ros3P,
    Rosenbrock23 as Rosenbrock23,
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
