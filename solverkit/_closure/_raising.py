"""Raising a solve's failure: one run-time error for a whole batch (`error_if`), or on
the host after an eager call (`eager`, `raise_failed`); and where a call is traced
from (`transformed_in_jit`).
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ._unvmap import unvmap_max
from ._vma_eval import union_of_axes, varying_axes


def error_if(x, failed, index, messages):
    """`equinox.branched_error_if(x, failed, index, messages)` (raise at run time the
    message `index`, under `vmap` if any element fails), which also works inside
    `shard_map(check_vma=True)`: there any device's failure fails all, and the check
    hangs on an invariant token that `x` then depends on (equinox's branches would
    otherwise differ in their varying axes)."""
    if not union_of_axes((x, failed, index)):
        return eqx.branched_error_if(x, failed, index, messages)
    code = jnp.where(failed, jnp.asarray(index, jnp.int32) + 1, 0)
    axes = tuple(sorted(varying_axes(code), key=str))
    if axes:
        code = jax.lax.pmax(code, axes)
    code = unvmap_max(code)
    token = eqx.branched_error_if(
        jnp.zeros((), jnp.int32), code > 0, jnp.maximum(code - 1, 0), messages
    )
    return jax.tree_util.tree_map(
        lambda a: a + token.astype(a.dtype) if eqx.is_inexact_array(a) else a, x
    )


def _at_top_level() -> bool:
    """Whether no JAX transformation is tracing now (False where JAX cannot say)."""
    try:
        from jax._src import core

        return bool(core.trace_state_clean())
    except Exception:  # a JAX without it: keep the check on the device
        return False


def transformed_in_jit() -> bool:
    """Whether a transformation (`vmap`, `grad`, ...) is tracing now inside a `jit` (or
    `scan`, `make_jaxpr`, ...) that stages the program (False where JAX cannot say).

    There a `jit` of our own would be traced to a jaxpr and then traced again by each
    transformation (batched, linearised, transposed), where calling its function
    directly traces it once through all of them.
    """
    try:
        from jax._src import core
        from jax._src.interpreters import partial_eval as pe

        return bool(core.unsafe_am_i_under_a_jit()) and not isinstance(
            core.trace_ctx.trace, pe.DynamicJaxprTrace
        )
    except Exception:  # a JAX without these: as if not
        return False


def eager(tree) -> bool:
    """Whether a call on `tree` runs eagerly: outside every `jit`/`vmap`/`grad` trace,
    with no tracer among its leaves, and with equinox's errors set to raise.

    Then a solve's failure can be checked on the host after it ran (`raise_failed`)
    instead of inside the program: a host callback costs about 2 ms a call on a TPU,
    and XLA's persistent compilation cache refuses programs that hold one.
    """
    if os.environ.get("EQX_ON_ERROR", "raise") != "raise" or not _at_top_level():
        return False
    leaves = jax.tree_util.tree_leaves(tree)
    return not any(isinstance(x, Tracer) for x in leaves)


def raise_failed(result, ok_codes, messages) -> None:
    """Raise, on the host, what `error_if` raises inside a program: the message of the
    largest result code that is not in `ok_codes`, as equinox's error type."""
    codes = np.asarray(result).ravel()
    failed = codes[~np.isin(codes, np.asarray(ok_codes))]
    if failed.size:
        error = getattr(eqx, "EquinoxRuntimeError", RuntimeError)
        raise error(messages[int(failed.max())])
