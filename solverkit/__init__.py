"""solverkit: ODE solvers in JAX whose vector fields may close over anything."""

from ._adjoint._backsolve import (
    adjoint_rms_seminorm as adjoint_rms_seminorm,
    BacksolveAdjoint as BacksolveAdjoint,
)
from ._adjoint._base import (
    AbstractAdjoint as AbstractAdjoint,
    DirectAdjoint as DirectAdjoint,
    ForwardMode as ForwardMode,
    ImplicitAdjoint as ImplicitAdjoint,
)
from ._adjoint._checkpoint import (
    RecursiveCheckpointAdjoint as RecursiveCheckpointAdjoint,
)
from ._closure._convert import (
    Closure as Closure,
    closure_convert as closure_convert,
    is_closure_converted as is_closure_converted,
)
from ._controller._adaptive import PIDController as PIDController
from ._controller._base import (
    AbstractAdaptiveStepSizeController as AbstractAdaptiveStepSizeController,
    AbstractStepSizeController as AbstractStepSizeController,
    ConstantStepSize as ConstantStepSize,
    StepTo as StepTo,
)
from ._controller._clip import ClipStepSizeController as ClipStepSizeController
from ._ensemble import (
    default_lanes as default_lanes,
    ensemble_solve as ensemble_solve,
)
from ._event import (
    AbstractDiscreteTerminatingEvent as AbstractDiscreteTerminatingEvent,
    DiscreteTerminatingEvent as DiscreteTerminatingEvent,
    Event as Event,
    steady_state_event as steady_state_event,
    SteadyStateEvent as SteadyStateEvent,
    TimedEvent as TimedEvent,
)
from ._integrate import diffeqsolve as diffeqsolve
from ._interpolation._dense import DenseInterpolation as DenseInterpolation
from ._interpolation._global_interpolation import (
    AbstractGlobalInterpolation as AbstractGlobalInterpolation,
    backward_hermite_coefficients as backward_hermite_coefficients,
    CubicInterpolation as CubicInterpolation,
    linear_interpolation as linear_interpolation,
    LinearInterpolation as LinearInterpolation,
    rectilinear_interpolation as rectilinear_interpolation,
)
from ._kernel._routes import (
    kernel_routes as kernel_routes,
    KernelRoute as KernelRoute,
)
from ._linear._band_solver import BandedLinearSolver as BandedLinearSolver
from ._linear._krylov import KrylovLinearSolver as KrylovLinearSolver
from ._linear._linear_solver import (
    AbstractLinearSolver as AbstractLinearSolver,
    DenseLinearSolver as DenseLinearSolver,
)
from ._linear._sparse import SparseLinearSolver as SparseLinearSolver
from ._progress import (
    AbstractProgressMeter as AbstractProgressMeter,
    NoProgressMeter as NoProgressMeter,
    TextProgressMeter as TextProgressMeter,
    TqdmProgressMeter as TqdmProgressMeter,
)
from ._saveat import save_y as save_y, SaveAt as SaveAt, SubSaveAt as SubSaveAt
from ._solution import (
    EventRecord as EventRecord,
    is_event as is_event,
    is_okay as is_okay,
    is_successful as is_successful,
    RESULTS as RESULTS,
    Solution as Solution,
)
from ._solver import (
    AbstractAdaptiveSolver as AbstractAdaptiveSolver,
    AbstractERK as AbstractERK,
    AbstractImplicitSolver as AbstractImplicitSolver,
    AbstractRungeKutta as AbstractRungeKutta,
    AbstractSolver as AbstractSolver,
    AbstractWrappedSolver as AbstractWrappedSolver,
    BDF as BDF,
    Bosh3 as Bosh3,
    ButcherTableau as ButcherTableau,
    CalculateJacobian as CalculateJacobian,
    Dopri5 as Dopri5,
    Dopri8 as Dopri8,
    Euler as Euler,
    HalfSolver as HalfSolver,
    Heun as Heun,
    ImplicitEuler as ImplicitEuler,
    KenCarp3 as KenCarp3,
    KenCarp4 as KenCarp4,
    KenCarp5 as KenCarp5,
    Kvaerno3 as Kvaerno3,
    Kvaerno4 as Kvaerno4,
    Kvaerno5 as Kvaerno5,
    LeapfrogMidpoint as LeapfrogMidpoint,
    Midpoint as Midpoint,
    MultiButcherTableau as MultiButcherTableau,
    Ralston as Ralston,
    ReversibleHeun as ReversibleHeun,
    Rodas4 as Rodas4,
    Rodas5P as Rodas5P,
    Ros3P as Ros3P,
    Rosenbrock23 as Rosenbrock23,
    SemiImplicitEuler as SemiImplicitEuler,
    Sil3 as Sil3,
    Tsit5 as Tsit5,
    VeryChord as VeryChord,
    with_stepsize_controller_tols as with_stepsize_controller_tols,
)
from ._solver._local_interpolation import (
    AbstractLocalInterpolation as AbstractLocalInterpolation,
    FourthOrderPolynomialInterpolation as FourthOrderPolynomialInterpolation,
    LocalLinearInterpolation as LocalLinearInterpolation,
    ThirdOrderHermitePolynomialInterpolation as ThirdOrderHermitePolynomialInterpolation,  # noqa: E501
)
from ._term import (
    AbstractTerm as AbstractTerm,
    MultiTerm as MultiTerm,
    ODETerm as ODETerm,
)
from ._tolerances import IControl as IControl, Tolerances as Tolerances


__version__ = "0.1.0"
