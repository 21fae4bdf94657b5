"""Which patterns of the whole-solve kernel compile and run on the TPU (Mosaic).

`python -m tools.mosaic_probe [--interpret] [--no-smoke] [--rows 8]`

Compiles and runs one tiny `pallas_call` per pattern that `solverkit/_kernel/` uses,
on `(rows, 128)` float32 tiles, and prints one line per pattern, `ok` (its result
checked against plain JAX) or `FAIL <first line of the error>`; then (unless
`--no-smoke`) the kernel's own stages, `benchmarks.kernel --smoke`. `--interpret`
runs the kernels in Pallas' interpreter (to check the script on a CPU). Each pattern
is caught on its own: one failure does not stop the rest.
"""

import argparse
import sys
import time

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from solverkit._kernel import _tile


LANES = 128


def _vec(rows):
    """A real (non-constant) test tile, values in [0.1, 2.1)."""
    return (
        0.1
        + (jnp.arange(rows * LANES, dtype=jnp.float32) % 200).reshape(rows, LANES) / 100
    )


def _where_const(x, s, z):
    return jnp.where(x > 1.0, 1e-6, x)


def _where_vec(x, s, z):
    return jnp.where(x > 1.0, x * 2, x + 1)


def _where_anchored(x, s, z):
    with _tile.anchored(z):
        return _tile.where(x > 1.0, 1e-6, x) + _tile.where(x == 0, 1, x)


def _scalar_mask(x, s, z):  # a mask from SMEM scalars, anchored
    with _tile.anchored(z):
        mask = _tile.anchor(jnp.full(x.shape, s[0]) > s[1])
        return _tile.where(mask, x, -x)


def _scalar_mask_raw(x, s, z):  # the same, not anchored
    return jnp.where(jnp.full(x.shape, s[0]) > s[1], x, -x)


def _pow(x, s, z):
    return x**0.2 * x ** (-0.35)


def _exp_log(x, s, z):
    return jnp.exp(x) + jnp.log(x) + jnp.sqrt(x)


def _jvp(x, s, z):
    g = lambda u: jnp.sin(u) * u + u * u  # noqa: E731
    value, slope = jax.jvp(g, (x,), (jnp.ones_like(x),))
    return value + slope


def _jvp_where(x, s, z):  # the event search: anchored selects under jax.jvp
    def g(u):
        with _tile.anchored(z):
            return _tile.where(u > 1.0, 1.0, u * u)

    value, slope = jax.jvp(g, (x,), (jnp.ones_like(x),))
    return value + slope


def _smem_fori(x, s, z):
    return lax.fori_loop(0, 4, lambda k, acc: acc + s[k] * x, jnp.zeros_like(x) + z)


def _minmax_bound(x, s, z):  # a tile's min/max as a scalar loop bound
    lo, hi = jnp.min(x), jnp.max(x)
    k = lax.while_loop(
        lambda k: (k < 4) & (s[jnp.minimum(k, 3)] <= hi), lambda k: k + 1, 0
    )
    return x + lo + k.astype(jnp.float32)


def _int_where_anchored(x, s, z):
    with _tile.anchored(z):
        n = (x * 10).astype(jnp.int32)
        return _tile.where(x > 1.0, n, 0).astype(jnp.float32)


def _int_where_raw(x, s, z):
    n = (x * 10).astype(jnp.int32)
    return jnp.where(x > 1.0, n, n + 1).astype(jnp.float32)


def _sign_isinf(x, s, z):  # the event's sign test, the controller's isinf
    inv = 1 / (x - 1.0)
    with _tile.anchored(z):
        flag = (jnp.sign(x - 1.0) == jnp.sign(x - 0.5)) | jnp.isinf(inv)
        return _tile.where(flag, x, -x) + jnp.clip(x, 0.5, 1.5)


def _dynamic_store(x, s, z, o_ref):  # save rows: o_ref[k] at a traced k
    def write(k, carry):
        with _tile.anchored(z):
            o_ref[k] = _tile.where(x > s[k], x * s[k], o_ref[k])
        return carry

    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    lax.fori_loop(0, 4, write, 0)


def _dynamic_store_ref(x, s, z):
    return jnp.stack([jnp.where(x > s[k], x * s[k], 0.0) for k in range(4)])


def _casts(x, s, z):
    return (x * 7).astype(jnp.int32).astype(jnp.float32) + jnp.floor(x)


def _while_mixed(x, s, z):
    def body(c):
        t, n = c
        dt = jnp.minimum(0.3 * x, jnp.maximum(2.0 - t, 1e-6))
        going = t < 2.0
        with _tile.anchored(z):
            return _tile.where(going, t + dt, t), n + going.astype(jnp.int32)

    with _tile.anchored(z):
        start = (
            _tile.anchor(jnp.zeros_like(x)),
            _tile.anchor(jnp.zeros(x.shape, jnp.int32)),
        )
    t, n = lax.while_loop(lambda c: jnp.any(c[0] < 2.0), body, start)
    return t + n.astype(jnp.float32)


def _nextafter(x, s, z):  # Mosaic's own lowering (bitcasts, splat selects)
    return jnp.nextafter(x, jnp.full_like(x, jnp.inf)) - x


PATTERNS = [
    ("where(vec mask, const, vec) [unanchored: the failing form]", _where_const),
    ("where(vec mask, vec, vec)", _where_vec),
    ("where anchored to a zero tile (_tile.where)", _where_anchored),
    ("mask from SMEM scalars, anchored", _scalar_mask),
    ("mask from SMEM scalars, not anchored [the failing form]", _scalar_mask_raw),
    ("x ** p, float p (pow)", _pow),
    ("exp / log / sqrt", _exp_log),
    ("jax.jvp in the kernel", _jvp),
    ("jax.jvp of an anchored where (custom_jvp)", _jvp_where),
    ("SMEM at a dynamic index in a fori_loop", _smem_fori),
    ("jnp.min/max of a tile as a loop bound", _minmax_bound),
    ("int32 where, anchored", _int_where_anchored),
    ("int32 where, not anchored (vec, vec)", _int_where_raw),
    ("sign / isinf / clip", _sign_isinf),
    ("float -> int casts", _casts),
    ("while_loop carrying int32 and f32 tiles", _while_mixed),
    ("nextafter [refused by _scalarize.check until this passes]", _nextafter),
    (
        "store to a ref at a dynamic row (fori_loop)",
        (_dynamic_store, _dynamic_store_ref),
    ),
]


def _run(fn, rows: int, interpret: bool):
    """`fn(x, s, zero)` as a kernel and as plain JAX: (kernel, reference). `fn` may
    be a pair `(kernel body writing its output ref, reference)`, output `(4, rows,
    128)`."""
    x = _vec(rows)
    s = jnp.asarray([0.5, 0.25, 1.5, 2.0], jnp.float32)
    zero = jnp.full((rows, LANES), -0.0, jnp.float32)
    if isinstance(fn, tuple):
        body, reference = fn
        out = (4, rows, LANES)
    else:
        body, reference, out = None, fn, (rows, LANES)

    def kernel(x_ref, s_ref, z_ref, o_ref):
        if body is not None:
            body(x_ref[...], s_ref, z_ref[...], o_ref)
        else:
            o_ref[...] = fn(x_ref[...], s_ref, z_ref[...])

    tile = pl.BlockSpec((rows, LANES), lambda: (0, 0))
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out, jnp.float32),
        in_specs=[tile, pl.BlockSpec(memory_space=pltpu.SMEM), tile],
        out_specs=pl.BlockSpec(out, lambda: (0,) * len(out)),
        interpret=interpret,
    )
    got = jax.block_until_ready(jax.jit(call)(x, s, zero))
    return got, reference(x, s, zero)


def probe(rows: int, interpret: bool) -> int:
    """Print one line per pattern; return the number that failed."""
    failed = 0
    for name, fn in PATTERNS:
        start = time.perf_counter()
        try:
            got, want = _run(fn, rows, interpret)
            # float32 transcendental functions on the chip: to ~1e-5 relative.
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4)
            status = "ok"
        except Exception as e:  # noqa: BLE001 - report and go on
            failed += 1
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            status = f"FAIL {type(e).__name__}: {first[:300]}"
        print(f"{name}: {status} ({time.perf_counter() - start:.1f} s)", flush=True)
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--no-smoke", action="store_true")
    parser.add_argument("--rows", type=int, default=8)
    ns = parser.parse_args(argv)
    print("backend:", jax.default_backend(), "jax", jax.__version__, flush=True)
    failed = probe(ns.rows, ns.interpret)
    print(f"probe: {len(PATTERNS) - failed} ok, {failed} failed", flush=True)
    if not ns.no_smoke:
        from benchmarks import kernel

        failed += kernel.main(["--smoke"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
