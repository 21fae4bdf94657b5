"""Where the step-size controllers and the solvers meet: `Tolerances`, the one value
a controller hands a solver (`controller.tolerances()`, bound by
`solver.bind_controller_tols`). Neither side imports the other: a solver never asks
which controller it runs with, and a controller sees a solver only through its
error order (`controller.check(error_order, ...)`)."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import Array, PyTree


class IControl(eqx.Module):
    """How an I-controller turns a step's scaled error `e` into the next step's
    factor: `safety * e ** (-icoeff / order)`, `order` the controller's
    `error_order`, or the solver's where that is `None`. A solver that chooses its
    own step sizes (`BDF`) passes its choice through the error with this rule."""

    safety: Any
    icoeff: Any
    error_order: float | None = None


class Tolerances(eqx.Module):
    """An adaptive controller's tolerances, for the parts of a solve that measure
    errors as it does (an implicit solver's root finder, `BDF`'s Newton solve).

    **Arguments:**

    - `rtol`, `atol`: relative and absolute tolerance.
    - `norm`: the norm of a scaled error.
    - `i_control`: the controller's step-size rule when it is an I-controller
        (`IControl`), else `None`.
    """

    rtol: Any
    atol: Any
    norm: Callable[[PyTree], Array]
    i_control: IControl | None = None
