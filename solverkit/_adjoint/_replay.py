"""What a checkpointed forward pass records of each step, so that a recomputation
takes the same steps.

`RecursiveCheckpointAdjoint`'s backward pass recomputes chunks of steps from
checkpoints. That recomputation is another compiled program, which may round
differently from the forward pass:

- an error estimate within round-off of the tolerance can land on the other side
  (or a proposed step end on the other side of the window that lands on `t1`): the
  chunk then takes other steps from there (float32 Lorenz: gradients 13-21% off);
- the next step's end can round to a neighbouring float, step after step. Where
  float times are coarse beside the steps (`t` near 200 in float32: 1.5e-5 apart,
  steps of 2e-3) the recomputed times drifted 20 spacings from the forward pass's
  over 20 steps, and where the chunk met the next checkpoint the gradient was 1e-2
  off for a 1e-4 solve (tests/test_float32_steps.py).

So each step records one byte: whether it was accepted, whether the next step's end
landed on `t1` (both replayed as decisions: `_loop.Replay`), and the low 6 bits of
that end's float, in an order-preserving integer form. The recomputation's end
(within a few spacings of the forward pass's, its decisions and earlier ends being
the same) is moved to the nearest float with those bits: the forward pass's exactly,
while they are within 32 spacings of each other. Further apart, it moves at most
32 spacings; that happens only where the ends' round-off is large beside a spacing,
which is where a spacing is small beside the step (near `t = 0`), and harmless.

`max_steps` bytes per trajectory (4 KiB at the default 4096), with adaptive steps
and a bounded `max_steps` only: fixed steps decide nothing and round their ends the
same way in any program (one addition), and unbounded steps can't be recorded.
"""

import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .. import _loop
from .._problem import Carry, Problem, StepOut
from .._save import row_of, with_row
from .._select import where


_ACCEPTED, _LANDS, _SHIFT = 1, 2, 2  # bits of a step's byte; the time's from `_SHIFT`
_TIME_BITS = 8 - _SHIFT


def empty(problem: Problem) -> Array | None:
    """The record of a solve before its first step (`None`: nothing to record)."""
    if not _loop.adaptive(problem) or problem.max_steps is None:
        return None
    return jnp.zeros(problem.max_steps, jnp.uint8)


def _ordered(t: Array) -> Array:
    """`t`'s bits as a signed integer that orders as the floats do (-0 as +0)."""
    bits = lax.bitcast_convert_type(t, _int_of(t))
    magnitude = lax.bitwise_and(bits, jnp.asarray(np.iinfo(bits.dtype).max, bits.dtype))
    return where(bits < 0, -magnitude, bits)


def _float(key: Array, dtype) -> Array:
    """The float that `_ordered` maps to `key`."""
    sign = jnp.asarray(np.iinfo(key.dtype).min, key.dtype)
    bits = where(key < 0, lax.bitwise_or(-key, sign), key)
    return lax.bitcast_convert_type(bits, dtype)


def _int_of(t: Array):
    return {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(t.dtype).itemsize]


def write(record: Array, k, after: Carry, out: StepOut) -> Array:
    """`record` with step `k`'s byte: its decisions (`out`) and its carry's next
    step end (`after.tnext`)."""
    key = _ordered(after.tnext)
    low = lax.bitwise_and(key, jnp.asarray((1 << _TIME_BITS) - 1, key.dtype))
    byte = lax.shift_left(low.astype(jnp.uint8), jnp.uint8(_SHIFT))
    byte = byte | out.accepted.astype(jnp.uint8)
    if out.lands is not None:
        byte = byte | lax.shift_left(out.lands.astype(jnp.uint8), jnp.uint8(1))
    return with_row(record, k, byte)


def _byte(record: Array, k) -> Array:
    return row_of(record, k)


def decisions(record: Array | None, k) -> _loop.Replay | None:
    """Step `k`'s decisions as the forward pass took them."""
    if record is None:
        return None
    byte = _byte(record, k)
    return _loop.Replay((byte & _ACCEPTED) != 0, (byte & _LANDS) != 0)


def step_end(record: Array | None, k, tnext: Array) -> Array:
    """The forward pass's next step end after step `k`, from the recomputation's
    `tnext` and the recorded low bits (see the module's docstring)."""
    if record is None:
        return tnext
    key = _ordered(tnext)
    low = lax.shift_right_logical(_byte(record, k), jnp.uint8(_SHIFT))
    size = 1 << _TIME_BITS
    # The step from `key` to the nearest key with the recorded low bits.
    diff = lax.bitwise_and(
        low.astype(key.dtype) - key, jnp.asarray(size - 1, key.dtype)
    )
    diff = where(diff >= size // 2, diff - size, diff)
    return _float(key + diff, tnext.dtype)
