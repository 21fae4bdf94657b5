"""The implicit (ESDIRK) and IMEX Runge--Kutta solvers: each a tableau, a dense
output and its documentation on `AbstractImplicitRK`'s step (`_implicit.py`)."""

from typing import Any, ClassVar

from .._term import AbstractTerm, MultiTerm
from ._implicit import AbstractImplicitRK
from ._implicit_dense import (
    KenCarp3Interpolation,
    KenCarp4Interpolation,
    KenCarp5Interpolation,
    sil3_interpolation,
)
from ._implicit_tableau import (
    IMPLICIT_EULER,
    ImplicitTableau,
    KENCARP3,
    KENCARP4,
    KENCARP5,
    KVAERNO3,
    KVAERNO4,
    KVAERNO5,
    SIL3,
)
from ._local_interpolation import LocalLinearInterpolation


def _arguments_doc(stages: str) -> str:
    """The **Arguments:** section shared by the implicit Runge-Kutta solvers;
    `stages` is "stage" or "stages"."""
    return f"""

    **Arguments:**

    - `root_finder`: solves the implicit {stages}. By default a `VeryChord` with the
        step-size controller's tolerances; any optimistix root finder is accepted.
    - `root_find_max_steps`: iterations before the step is rejected (and retried
        with a smaller step by an adaptive controller).
    - `linear_solver`: solves of the chord iteration with `I - γhJ`, a
        `solverkit.AbstractLinearSolver` (default: `DenseLinearSolver()`).
    - `reuse_jacobian`: keep the Jacobian and the factorisations across steps by
        CVODE's rules (refactorise after a 30% change in `γh` or 20 steps; a new
        Jacobian after 50 steps, or at once after a convergence failure; a
        rejected step keeps them). Off by
        default: on small dense problems it is slower (Kvaerno5 on ROBER, 73
        steps, CPU: 1.7x single, about 2x with 16 lanes vmapped, where all lanes
        make a new one when one lane needs it; `python -m benchmarks.jacobian_reuse
        --time`). Gradients are exact either way (each stage's derivative uses
        the Jacobian at its root).
    """


class ImplicitEuler(AbstractImplicitRK):
    __doc__ = (
        "Implicit Euler: first order, L-stable, with an error estimate from the "
        "trapezoidal rule; linear dense output." + _arguments_doc("stage")
    )

    tableau: ClassVar[ImplicitTableau] = IMPLICIT_EULER
    interpolation_cls: ClassVar[Any] = LocalLinearInterpolation

    def error_order(self, terms) -> float | None:
        return 2


_KVAERNO_DOC = """

    ??? cite "Reference"

        Kværnø, A. (2004). Singly diagonally implicit Runge-Kutta methods with an
        explicit first stage. BIT Numerical Mathematics, 44(3), 489-502.
""" + _arguments_doc("stages")


class Kvaerno3(AbstractImplicitRK):
    __doc__ = (
        "Kværnø's 3(2) method: L-stable, stiffly accurate ESDIRK with 4 stages; "
        "cubic Hermite dense output." + _KVAERNO_DOC
    )
    tableau: ClassVar[ImplicitTableau] = KVAERNO3


class Kvaerno4(AbstractImplicitRK):
    __doc__ = (
        "Kværnø's 4(3) method: L-stable, stiffly accurate ESDIRK with 5 stages; "
        "cubic Hermite dense output." + _KVAERNO_DOC
    )
    tableau: ClassVar[ImplicitTableau] = KVAERNO4


class Kvaerno5(AbstractImplicitRK):
    __doc__ = (
        "Kværnø's 5(4) method: L-stable, stiffly accurate ESDIRK with 7 stages; "
        "cubic Hermite dense output. A good default for stiff problems at tight "
        "tolerances." + _KVAERNO_DOC
    )
    tableau: ClassVar[ImplicitTableau] = KVAERNO5


_IMEX_DOC = """

    Call with `terms=MultiTerm(ODETerm(explicit_field), ODETerm(implicit_field))`:
    the first term is treated explicitly, the second (stiff) one implicitly."""
_IMEX_DOC += _arguments_doc("stages")

_KENCARP_CITE = """

    ??? cite "Reference"

        Kennedy, C. A., & Carpenter, M. H. (2003). Additive Runge-Kutta schemes for
        convection-diffusion-reaction equations. Applied Numerical Mathematics,
        44(1-2), 139-181.
    """


class AbstractIMEX(AbstractImplicitRK):
    """An additive (IMEX) Runge--Kutta method: `MultiTerm(explicit, implicit)`."""

    # diffrax's value, `MultiTerm[tuple[AbstractTerm, AbstractTerm]]`, so that code
    # which builds the terms a solver asks for builds a `MultiTerm` here too.
    term_structure: ClassVar = MultiTerm[tuple[AbstractTerm, AbstractTerm]]


class KenCarp3(AbstractIMEX):
    __doc__ = (
        "Kennedy & Carpenter's ARK3(2)4L[2]SA: third-order IMEX pair, L-stable "
        "stiffly accurate ESDIRK implicit part, 4 stages; the paper's dense output."
        + _IMEX_DOC
        + _KENCARP_CITE
    )
    tableau: ClassVar[ImplicitTableau] = KENCARP3
    interpolation_cls: ClassVar[Any] = KenCarp3Interpolation


class KenCarp4(AbstractIMEX):
    __doc__ = (
        "Kennedy & Carpenter's ARK4(3)6L[2]SA: fourth-order IMEX pair, 6 stages; "
        "the paper's third-order dense output." + _IMEX_DOC + _KENCARP_CITE
    )
    tableau: ClassVar[ImplicitTableau] = KENCARP4
    interpolation_cls: ClassVar[Any] = KenCarp4Interpolation


_KENCARP5_NOTE = """

    !!! note

        Its steps are long for its tolerance, and values saved between step ends
        (`SaveAt(ts=...)`, `dense=True`) come from a third-order dense output: on a
        stiff linear test their error was 18-350 times `rtol` at `rtol` 1e-6 to
        1e-10, against 0.3-1.7 times at step ends. Its embedded error estimate
        undershoots (the order-5 defects of its fourth-order pair are small): a
        12-step stiff solve at `rtol=1e-8` was 2.4e-7 off, so its step sizes move
        its result more than the tolerance suggests, and finite differences of an
        adaptive solve (which see the steps move) differ from its gradients
        (exact for the steps taken) by about 4e-5 relative there. Where values
        between step ends must meet a tight tolerance, prefer `KenCarp4` or
        `Kvaerno5`."""


class KenCarp5(AbstractIMEX):
    __doc__ = (
        "Kennedy & Carpenter's ARK5(4)8L[2]SA: fifth-order IMEX pair, 8 stages; "
        "the paper's third-order dense output (no continuous extension from its "
        "stages reaches fourth order for the additive pair)."
        + _KENCARP5_NOTE
        + _IMEX_DOC
        + _KENCARP_CITE
    )
    tableau: ClassVar[ImplicitTableau] = KENCARP5
    interpolation_cls: ClassVar[Any] = KenCarp5Interpolation


class Sil3(AbstractIMEX):
    __doc__ = (
        "Whitaker & Kar's IMEX method: second order (as an additive pair), 4 stages, "
        "with a first-order embedded error estimate; three matrix inversions per step "
        "(its diagonal is not constant); cubic Hermite dense output."
        + _IMEX_DOC
        + """

    ??? cite "Reference"

        Whitaker, J. S., & Kar, S. K. (2013). Implicit-explicit Runge-Kutta methods
        for fast-slow wave problems. Monthly Weather Review, 141(10), 3426-3434.
    """
    )
    tableau: ClassVar[ImplicitTableau] = SIL3
    interpolation_cls: ClassVar[Any] = staticmethod(sil3_interpolation)
