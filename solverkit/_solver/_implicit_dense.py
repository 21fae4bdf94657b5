"""The implicit and IMEX solvers' `dense_info` as their `step` gives it (diffrax's
form), and the interpolations that read it: cubic Hermite from the first and last
stages (Kvaerno, Sil3) and Kennedy & Carpenter's own dense output (KenCarp)."""

from typing import ClassVar, TYPE_CHECKING

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.lax import Precision
from jaxtyping import Array, PyTree

from .._custom_types import RealScalarLike, Y
from ._implicit_tableau import ImplicitTableau, KENCARP3, KENCARP4, KENCARP5
from ._local_interpolation import (
    AbstractLocalInterpolation,
    dense_weights,
    ThirdOrderHermitePolynomialInterpolation,
)


if TYPE_CHECKING:  # pyright reads `eqx.AbstractClassVar` as an instance field
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


def public_dense_info(y0: Y, y1: Y, h: Array, k_im: PyTree, k_ex: PyTree) -> dict:
    """`dict(y0=, y1=, k=)`: `k` the stage slopes `k_im` (and `k_ex`, for an IMEX
    method), stacked `(stages, *y.shape)` per leaf, times the step `h` (diffrax's
    increments); a pair `(k_explicit, k_implicit)` for an IMEX method."""
    scale = lambda ks: jtu.tree_map(lambda k: k * h.astype(k.dtype), ks)  # noqa: E731
    k = scale(k_im) if k_ex is None else (scale(k_ex), scale(k_im))
    return dict(y0=y0, y1=y1, k=k)


def sil3_interpolation(*, t0, t1, y0: Y, y1: Y, k) -> AbstractLocalInterpolation:
    """Sil3's dense output (diffrax's `Sil3.interpolation_cls`): the cubic Hermite
    with the summed increments `k_explicit + k_implicit` of its first and last
    stages as the slopes at the ends."""
    k_explicit, k_implicit = k
    total = jtu.tree_map(lambda a, b: a + b, k_explicit, k_implicit)
    return ThirdOrderHermitePolynomialInterpolation.from_k(
        t0=t0, t1=t1, y0=y0, y1=y1, k=total
    )


class AbstractKenCarpInterpolation(AbstractLocalInterpolation):
    """A KenCarp method's own dense output (Kennedy & Carpenter 2003, the `b*_ij` of
    each method): `y(t0 + θh) = y0 + Σ_i b_i(θ) (k_explicit_i + k_implicit_i)`,
    `b_i(θ) = Σ_j dense[i, j] θ^(j+1)`. Each solver's subclass fixes `dense`.

    **Arguments:**

    - `t0`, `t1`: the step.
    - `y0`, `y1`: the solution at its ends (`y1` is accepted, as diffrax's, and not
        used: the polynomials reach it at `θ = 1`).
    - `k`: the pair `(k_explicit, k_implicit)` of stage increments, each stacked on
        a leading axis of each leaf (shape `(stages, *y.shape)`), as the solver's
        `step` gives them in `dense_info`.
    """

    dense: AbstractClassVar[np.ndarray]
    y0: PyTree
    k: tuple[PyTree, PyTree]

    def __init__(self, *, t0, t1, y0: Y, y1: Y, k) -> None:
        del y1
        self.t0, self.t1, self.y0, self.k = t0, t1, y0, k

    def at(self, t: RealScalarLike) -> PyTree:
        theta = self._theta(t)

        def leaf(y0, k_explicit, k_implicit):
            y0, k = jnp.asarray(y0), jnp.asarray(k_explicit) + jnp.asarray(k_implicit)
            w = dense_weights(type(self).dense, theta, k.dtype)
            return y0 + jnp.tensordot(w, k, axes=1, precision=Precision.HIGHEST)

        return jtu.tree_map(leaf, self.y0, *self.k)


def _dense(tableau: ImplicitTableau, rows) -> np.ndarray:
    """`rows` as a read-only table, checked: at `θ = 1` the weights are the method's
    `b` (the dense output ends at `y1`)."""
    dense = np.array(rows, dtype=np.float64)
    if dense.shape[0] != tableau.num_stages or not np.allclose(
        dense.sum(axis=1), tableau.b_im, rtol=0, atol=1e-14
    ):
        raise ValueError("a KenCarp dense output must sum to b at theta = 1")
    dense.setflags(write=False)
    return dense


# The `b*_ij` of Kennedy & Carpenter (2003), Appl. Numer. Math. 44, 139-181 (its
# appendix), for ARK3(2)4L[2]SA, ARK4(3)6L[2]SA and ARK5(4)8L[2]SA: row `i` a stage,
# column `j` the coefficient of `θ^(j+1)`.
_KENCARP3_DENSE = _dense(
    KENCARP3,
    [
        [4655552711362 / 22874653954995, -215264564351 / 13552729205753],
        [-18682724506714 / 9892148508045, 17870216137069 / 13817060693119],
        [34259539580243 / 13192909600954, -28141676662227 / 17317692491321],
        [584795268549 / 6622622206610, 2508943948391 / 7218656332882],
    ],
)
_KENCARP4_DENSE = _dense(
    KENCARP4,
    [
        [6943876665148 / 7220017795957, -54480133 / 30881146,
         6818779379841 / 7100303317025],
        [0.0, 0.0, 0.0],
        [7640104374378 / 9702883013639, -11436875 / 14766696,
         2173542590792 / 12501825683035],
        [-20649996744609 / 7521556579894, 174696575 / 18121608,
         -31592104683404 / 5083833661969],
        [8854892464581 / 2390941311638, -12120380 / 966161,
         61146701046299 / 7138195549469],
        [-11397109935349 / 6675773540249, 3843 / 706,
         -17219254887155 / 4939391667607],
    ],
)  # fmt: skip
_KENCARP5_DENSE = _dense(
    KENCARP5,
    [
        [-17674230611817 / 10670229744614, 43486358583215 / 12773830924787,
         -9257016797708 / 5021505065439],
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
        [65168852399939 / 7868540260826, -91478233927265 / 11067650958493,
         26096422576131 / 11239449250142],
        [15494834004392 / 5936557850923, -79368583304911 / 10890268929626,
         92396832856987 / 20362823103730],
        [-99329723586156 / 26959484932159, -12239297817655 / 9152339842473,
         30029262896817 / 10175596800299],
        [-19024464361622 / 5461577185407, 115839755401235 / 10719374521269,
         -26136350496073 / 3983972220547],
        [-6511271360970 / 6095937251113, 5843115559534 / 2180450260947,
         -5289405421727 / 3760307252460],
    ],
)  # fmt: skip


class KenCarp3Interpolation(AbstractKenCarpInterpolation):
    """`KenCarp3`'s dense output (second order), from its `dense_info`."""

    dense: ClassVar[np.ndarray] = _KENCARP3_DENSE


class KenCarp4Interpolation(AbstractKenCarpInterpolation):
    """`KenCarp4`'s dense output (third order), from its `dense_info`."""

    dense: ClassVar[np.ndarray] = _KENCARP4_DENSE


class KenCarp5Interpolation(AbstractKenCarpInterpolation):
    """`KenCarp5`'s dense output (third order), from its `dense_info`."""

    dense: ClassVar[np.ndarray] = _KENCARP5_DENSE
