"""Runge-Kutta steps on diffrax's term protocol: `MultiButcherTableau` (one tableau a
term, their stages interleaved: IMEX and other additive methods) and a built-in
tableau's `step` called on terms that are not one rate of the state (a `MultiTerm`,
a term whose `vf` is expensive).

Each term `j` is stepped through its own `vf`, `contr` and `prod`: the stage
increments are `k^j_i = prod_j(vf_j(t0 + c^j_i h, Y_i), contr_j(t0, t1))`, the stage
values `Y_i = y0 + Σ_j Σ_{l<i} a^j[i, l] k^j_l (+ d_i k^m_i)`, where `d_i` is the
diagonal of the (at most one) diagonally implicit tableau `m`, whose stage is then
solved for with the solver's `root_finder` (an optimistix root finder). The built-in
solvers' loop never comes here: it steps converted terms by the faster path of
`_runge_kutta.py` or `_implicit.py`.
"""

import dataclasses
import enum
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optimistix as optx
from jaxtyping import PyTree

from .._custom_types import Args, Y
from .._solution import Result, RESULTS
from ._base import axpy, successful
from ._implicit_tableau import ImplicitTableau
from ._tableau import ButcherTableau as SolverkitTableau


@dataclasses.dataclass(frozen=True)
class Rows:
    """One tableau in the common form of a diagonally implicit method: nodes `c`,
    the strictly lower `a`, the diagonal `d` (zeros for an explicit tableau), the
    weights `b` and error weights `b_err` (or `None`), and whether its last stage
    is the next step's first (`fsal`)."""

    c: np.ndarray
    a: np.ndarray
    d: np.ndarray
    b: np.ndarray
    b_err: np.ndarray | None
    fsal: bool

    @property
    def implicit(self) -> bool:
        return bool(np.any(self.d != 0))


def rows_of(tableau: Any) -> Rows:
    """A solverkit tableau (`ButcherTableau`, or an `ImplicitTableau` of an ESDIRK
    method) in the common form."""
    if isinstance(tableau, ButcherTableau):
        return tableau.rows
    if isinstance(tableau, SolverkitTableau):
        zeros = np.zeros_like(tableau.c)
        return Rows(tableau.c, tableau.a, zeros, tableau.b, tableau.b_err, tableau.fsal)
    if isinstance(tableau, ImplicitTableau) and tableau.a_ex is None:
        a = np.tril(tableau.a_im, -1)
        d = np.diagonal(tableau.a_im).copy()
        return Rows(tableau.c, a, d, tableau.b_im, tableau.b_err_im, False)
    raise ValueError(
        "MultiButcherTableau takes explicit tableaux (e.g. `Dopri5.tableau`) and "
        "tableaux of diagonally implicit methods (e.g. `Kvaerno5.tableau`), got "
        f"{type(tableau).__name__}"
        + (" of an IMEX pair" if tableau is not None else "")
    )


def _vector(x: Any, name: str, size: int) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.shape != (size,) or not np.all(np.isfinite(arr)):
        raise ValueError(
            f"ButcherTableau.{name} must be a finite array of shape ({size},), got "
            f"shape {arr.shape}."
        )
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class ButcherTableau:
    """A Runge-Kutta tableau in diffrax's form, for a user's explicit or diagonally
    implicit (DIRK, SDIRK, ESDIRK) method: a subclass of `AbstractRungeKutta` with
    `tableau = ButcherTableau(...)` and its own `order` and `interpolation_cls`
    (which receives `k`, the stacked stage increments); with a diagonal, fields
    `root_finder` and `root_find_max_steps`. The built-in solvers keep their
    tableaux in solverkit's own form (`Tsit5.tableau`); both forms go into a
    `MultiButcherTableau`.

    **Arguments** (diffrax's), for `s` stages:

    - `c`: `(s - 1,)` nodes of stages 1 ... s-1 (stage 0 is at `c1`).
    - `b_sol`: `(s,)` weights of the solution.
    - `b_error`: `(s,)` weights of the error estimate itself (not of an embedded
        solution), summing to 0.
    - `a_lower`: the rows 1 ... s-1 of the strictly lower part, row `i` of
        shape `(i,)`.
    - `a_diagonal`: `(s,)` diagonal, or `None` for an explicit method.
    - `a_predictor`: accepted, as diffrax's (the stage solves here start from the
        explicit part of the stage).
    - `c1`: the node of stage 0 (0).

    **Raises:**

    `ValueError` naming the first inconsistency (shapes, row sums `c`, `b_sol`
    summing to 1, `b_error` to 0).
    """

    c: Any
    b_sol: Any
    b_error: Any
    a_lower: tuple
    a_diagonal: Any = None
    a_predictor: Any = None
    c1: float = 0.0

    def __post_init__(self) -> None:
        s = len(self.a_lower) + 1
        c = np.concatenate([[float(self.c1)], _vector(self.c, "c", s - 1)])
        a = np.zeros((s, s))
        for i, row in enumerate(self.a_lower, start=1):
            a[i, :i] = _vector(row, f"a_lower[{i - 1}]", i)
        d = np.zeros(s)
        if self.a_diagonal is not None:
            d = _vector(self.a_diagonal, "a_diagonal", s)
        b = _vector(self.b_sol, "b_sol", s)
        b_err = _vector(self.b_error, "b_error", s)
        tol = 1e-10  # the printed digits of a published tableau
        if np.max(np.abs(a.sum(axis=1) + d - c)) > tol:
            raise ValueError(
                "ButcherTableau: rows of a (and the diagonal) must sum to c."
            )
        if abs(b.sum() - 1) > tol or abs(b_err.sum()) > tol:
            raise ValueError("ButcherTableau: b_sol must sum to 1 and b_error to 0.")
        # First same as last: the last stage is at (t1, y1), explicitly.
        fsal = bool(
            np.array_equal(a[-1, :-1], b[:-1]) and b[-1] == d[-1] == 0 and d[0] == 0
        )
        object.__setattr__(self, "rows", Rows(c, a, d, b, b_err, fsal))

    rows: Rows = dataclasses.field(init=False, repr=False)

    @property
    def num_stages(self) -> int:
        return self.rows.c.shape[0]

    @property
    def implicit(self) -> bool:
        return self.a_diagonal is not None


class MultiButcherTableau(eqx.Module):
    """Several Runge-Kutta tableaux with the same number of stages, one for each term
    of a `MultiTerm`, their stages interleaved (diffrax's; an additive method such
    as an IMEX one). At most one may be implicit. A solver built on it is a
    subclass of `AbstractRungeKutta` with `tableau = MultiButcherTableau(...)`,
    its own `order` and `interpolation_cls` (which receives `k`, a tuple of each
    term's stacked stage increments), and, with an implicit tableau, fields
    `root_finder` and `root_find_max_steps`.

    **Arguments:**

    - `*tableaus`: the tableaux (e.g. `Dopri5.tableau, Kvaerno5.tableau`).

    **Raises:**

    `ValueError` when their numbers of stages differ or more than one is implicit.
    """

    tableaus: tuple[Any, ...] = eqx.field(static=True)

    def __init__(self, *tableaus: Any):
        rows = [rows_of(t) for t in tableaus]
        if len(rows) < 1:
            raise ValueError("MultiButcherTableau needs at least one tableau.")
        if len({r.c.shape[0] for r in rows}) > 1:
            stages = [r.c.shape[0] for r in rows]
            raise ValueError(
                "MultiButcherTableau: tableaus must all have the same number of "
                f"stages, got {stages}."
            )
        if sum(r.implicit for r in rows) > 1:
            raise ValueError(
                "MultiButcherTableau: may have at most one implicit tableau."
            )
        self.tableaus = tuple(tableaus)

    @property
    def rows(self) -> tuple[Rows, ...]:
        return tuple(rows_of(t) for t in self.tableaus)


class CalculateJacobian(enum.IntEnum):
    """diffrax's names for when an implicit Runge-Kutta method recomputes its
    Jacobian. Accepted as a solver's `calculate_jacobian` class attribute, for
    diffrax code; solverkit's solvers decide themselves (a `VeryChord` root finder
    computes one Jacobian per root find, the built-in implicit solvers one per step
    or as `reuse_jacobian` says)."""

    never = 0
    every_step = 1
    every_stage = 2
    first_stage = 3
    second_stage = 4


def _combine(y0: Y, pairs: list) -> Y:
    """`y0 + Σ c k` over `(c, k)` pairs (leafwise, unscaled: `k` are increments)."""
    return axpy(y0, None, pairs)


def _solve_stage(root, term, control, t, base: Y, d: float, args: Args):
    """The stage value `Y = base + d prod(vf(t, Y), control)`, by the solver's root
    finder `root = (root_finder, max_steps)`, and whether it converged."""
    finder, max_steps = root

    def residual(y, _):
        k = term.prod(term.vf(t, y, args), control)
        return jtu.tree_map(lambda a, b, kk: a - b - d * kk, y, base, k)

    sol = optx.root_find(residual, finder, base, max_steps=max_steps, throw=False)
    ok = sol.result == optx.RESULTS.successful
    failed = RESULTS.where(ok, successful, RESULTS.implicit_nonconvergence)
    return sol.value, failed


def _stage_increments(terms, controls, tabs, i, t0, h, y, args, fs):
    """Every term's increment at stage `i`, from its `vf` values `fs` where given
    (the first stage of an FSAL step), else evaluated at `y`; and those `vf` values
    (`None` when computed with `vf_prod`, an expensive `vf`)."""
    if fs is None:
        fs = [
            term.vf(t0 + float(tab.c[i]) * h, y, args) for term, tab in zip(terms, tabs)
        ]
    return [term.prod(f, u) for term, f, u in zip(terms, fs, controls)], fs


def _error(y0: Y, tabs, ks) -> Y | None:
    if any(tab.b_err is None for tab in tabs):
        return None
    zero = jtu.tree_map(jnp.zeros_like, y0)
    return _combine(
        zero, [(tab.b_err[i], k) for tab, kj in zip(tabs, ks) for i, k in enumerate(kj)]
    )


def general_step(
    tabs: tuple[Rows, ...],
    terms: tuple,
    t0,
    t1,
    y0: Y,
    args: Args,
    f0: PyTree,
    root: Any = None,
    want_f1: bool = True,
):
    """One step of the interleaved tableaux `tabs`, term `j` by `tabs[j]`.

    **Arguments:**

    - `tabs`, `terms`: the tableaux and their terms (diffrax's protocol).
    - `t0`, `t1`, `y0`, `args`: the step.
    - `f0`: each term's `vf` at `(t0, y0)` (a list), or `None` to evaluate it.
    - `root`: `(root_finder, max_steps)` for an implicit tableau.
    - `want_f1`: whether to return `f1` (else `None`; no evaluation for it).

    **Returns:**

    `(y1, y_error, ks, f1, result)`: `ks[j]` the list of term `j`'s stage
    increments, `f1` each term's `vf` at `(t1, y1)`.
    """
    t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
    h = t1 - t0
    controls = [term.contr(t0, t1) for term in terms]
    ks: list[list] = [[] for _ in terms]
    result: Result = successful
    fs = f0
    for i in range(tabs[0].c.shape[0]):
        pairs = [(tab.a[i, l], kj[l]) for tab, kj in zip(tabs, ks) for l in range(i)]
        y_i = _combine(y0, pairs)
        implicit = [j for j, tab in enumerate(tabs) if tab.d[i] != 0]
        if implicit:
            j = implicit[0]
            t_i = t0 + float(tabs[j].c[i]) * h
            y_i, failed = _solve_stage(
                root, terms[j], controls[j], t_i, y_i, float(tabs[j].d[i]), args
            )
            result = RESULTS.where(result == successful, failed, result)
        incs, fs = _stage_increments(
            terms, controls, tabs, i, t0, h, y_i, args, fs if i == 0 else None
        )
        for kj, inc in zip(ks, incs):
            kj.append(inc)
    pairs = [(tab.b[i], k) for tab, kj in zip(tabs, ks) for i, k in enumerate(kj)]
    y1 = _combine(y0, pairs)
    if not want_f1:
        f1 = None
    elif all(tab.fsal for tab in tabs):
        f1 = fs  # the last stage is at (t1, y1)
    else:
        f1 = [term.vf(t1, y1, args) for term in terms]
    return y1, _error(y0, tabs, ks), ks, f1, result
