from ._base import (
    AbstractAdaptiveSolver as AbstractAdaptiveSolver,
    AbstractImplicitSolver as AbstractImplicitSolver,
    AbstractSolver as AbstractSolver,
    AbstractWrappedSolver as AbstractWrappedSolver,
)
from ._bdf import BDF as BDF
from ._half import HalfSolver as HalfSolver
from ._implicit import AbstractImplicitRK as AbstractImplicitRK
from ._implicit_solvers import (
    ImplicitEuler as ImplicitEuler,
    KenCarp3 as KenCarp3,
    KenCarp4 as KenCarp4,
    KenCarp5 as KenCarp5,
    Kvaerno3 as Kvaerno3,
    Kvaerno4 as Kvaerno4,
    Kvaerno5 as Kvaerno5,
    Sil3 as Sil3,
)
from ._leapfrog_midpoint import LeapfrogMidpoint as LeapfrogMidpoint
from ._multi_tableau import (
    ButcherTableau as ButcherTableau,
    CalculateJacobian as CalculateJacobian,
    MultiButcherTableau as MultiButcherTableau,
)
from ._reversible_heun import ReversibleHeun as ReversibleHeun
from ._root_finder import (
    VeryChord as VeryChord,
    with_stepsize_controller_tols as with_stepsize_controller_tols,
)
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
from ._semi_implicit_euler import SemiImplicitEuler as SemiImplicitEuler
