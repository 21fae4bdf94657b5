"""`BandedLinearSolver`: Jacobians with `lower` sub- and `upper` super-diagonals,
compressed into `lower + upper + 1` Jacobian-vector products and factorised by band
LU (`_banded.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._closure._raising import error_if
from ._banded import (
    band_lu,
    band_lu_solve,
    band_matvec,
    BandLU,
    BlockedBandLU,
    dense_to_bands,
)
from ._linear_solver import (
    AbstractLinearSolver,
    check_mass,
    check_point,
    FlatFn,
    probe_failed,
)


class BandedLinearSolver(AbstractLinearSolver):
    """Banded Jacobians: `lower` sub-diagonals and `upper` super-diagonals.

    The Jacobian costs `lower + upper + 1` Jacobian-vector products (columns `c` with
    the same `c mod (lower + upper + 1)` share one: no row has two of them in its
    band), is stored as bands (`O(n·bw)` memory), and `M - γh J` is factorised by
    band Gaussian elimination with partial pivoting (`O(n·bw²)` work). For 1-D
    discretised PDEs and chains of reactions, and for any field whose unknowns can be
    ordered so that each couples only to near neighbours.

    **Arguments:**

    - `lower`, `upper`: the numbers of sub- and super-diagonals of `∂f/∂y` (of the
      ravelled state).
    - `check`: each `linearise` also compares one more Jacobian-vector product,
      with a random vector, against the banded product, and raises an error (at run
      time, also under `jit`) if the Jacobian has entries outside the bands.

    A mass matrix may be `None`, a vector, or a dense matrix with no entries outside
    the bands (checked at run time). An exactly singular `M - γh J` gives a NaN
    solution (a stiff solver rejects the step); no error is raised.
    """

    lower: int = eqx.field(static=True)
    upper: int = eqx.field(static=True)
    check: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        for name in ("lower", "upper"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"BandedLinearSolver: `{name}` must be an int >= 0, got {value!r}"
                )

    def linearise(self, fn: FlatFn, x: Array) -> tuple[Array, Array]:
        check_point(fn, x, "BandedLinearSolver")
        n = x.shape[0]
        lower, width = self.lower, self.lower + self.upper + 1
        colours = min(width, n)
        seeds = jnp.arange(n)[None, :] % width == jnp.arange(colours)[:, None]
        value, jvp = jax.linearize(fn, x)
        compressed = jax.vmap(jvp)(seeds.astype(x.dtype))  # (colours, n)
        col = jnp.arange(n)[:, None] - lower + jnp.arange(width)[None, :]
        inside = (col >= 0) & (col < n)
        rows = jnp.broadcast_to(jnp.arange(n)[:, None], col.shape)
        bands = jnp.where(
            inside, compressed[jnp.where(inside, col, 0) % width, rows], 0
        )
        if self.check:
            failed = probe_failed(
                jvp,
                lambda v: (
                    band_matvec(bands, lower, v),
                    band_matvec(jnp.abs(bands), lower, v),
                ),
                n,
                x.dtype,
            )
            bands = error_if(
                bands,
                failed,
                0,
                [
                    f"BandedLinearSolver(lower={self.lower}, upper={self.upper}): "
                    "the Jacobian has entries outside these bands; pass the right "
                    "bandwidths (or use SparseLinearSolver / DenseLinearSolver)"
                ],
            )
        return value, bands

    def factorise(
        self, jac: Array, gamma_h: Array, mass: Array | None
    ) -> BandLU | BlockedBandLU:
        n = jac.shape[0]
        check_mass(mass, n, "BandedLinearSolver")
        matrix = -jnp.asarray(gamma_h, jac.dtype) * jac
        if mass is None:
            matrix = matrix.at[:, self.lower].add(1)
        elif mass.ndim == 1:
            matrix = matrix.at[:, self.lower].add(mass.astype(jac.dtype))
        else:
            banded = dense_to_bands(mass.astype(jac.dtype), self.lower, self.upper)
            offset = jnp.arange(n)[None, :] - jnp.arange(n)[:, None]
            outside_band = (offset > self.upper) | (-offset > self.lower)
            outside = jnp.any(jnp.where(outside_band, mass, 0) != 0)
            banded = error_if(
                banded,
                outside,
                0,
                [
                    f"BandedLinearSolver(lower={self.lower}, upper={self.upper}): "
                    "the mass matrix has entries outside the bands"
                ],
            )
            matrix = matrix + banded
        return band_lu(matrix, self.lower)

    def solve(self, factor: BandLU | BlockedBandLU, rhs: Array, fn: FlatFn) -> Array:
        del fn
        return band_lu_solve(factor, rhs).astype(rhs.dtype)
