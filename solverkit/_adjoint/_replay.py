"""What a checkpointed forward pass records of each step, so that a recomputation
takes the same steps.

`RecursiveCheckpointAdjoint`'s backward pass recomputes chunks of steps from
checkpoints. That recomputation is another compiled program, which may round
differently from the forward pass:

- an error estimate within round-off of the tolerance can land on the other side
  (or a proposed step end on the other side of the window that lands on `t1`): the
  chunk then takes other steps from there (float32 Lorenz: gradients 13-21% off);
- the next step's end can differ, step after step. By a few floats where the error
  estimate is well above round-off (`t` near 200 in float32: the recomputed times
  drifted 20 spacings over 20 steps, and the gradient was 1e-2 off for a 1e-4 solve:
  tests/kernel/test_float32_steps.py); by much more where the estimate is round-off
  itself
  (a first step `dt0` far below the tolerance's: float32 oscillator at `t = 199`,
  next step 0.00911 in the forward pass, 0.01009 recomputed, 66 spacings; the
  recomputed chunk left the forward pass's steps and a vmapped gradient was 0.25 off
  against 0.001: tests/kernel/test_replayed_decisions.py).

So each step records a byte, whether it was accepted and whether the next step's
end landed on `t1` (both replayed as decisions: `_loop.Replay`), and that end itself,
in `t`'s dtype, which the recomputation takes in place of its own: the forward
pass's steps whatever either program rounds. (The low 6 bits of the end, with the
recomputed end moved to the nearest float with them, recovered it only within 32
spacings.)

`max_steps` times `1 + t.itemsize` bytes per trajectory (20 KiB for float32 at the
default 4096), with adaptive steps and a bounded `max_steps` only: fixed steps decide
nothing and round their ends the same way in any program (one addition), and
unbounded steps can't be recorded.
"""

from typing import NamedTuple

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array

from .. import _loop
from .._problem import Carry, Problem, StepOut
from .._save import row_of, with_row


_ACCEPTED, _LANDS = 1, 2  # bits of a step's byte


class Record(NamedTuple):
    """Per step: its decisions (a byte) and the next step's end, as taken."""

    decisions: Array  # uint8, (max_steps,)
    ends: Array  # `t`'s dtype, (max_steps,)


def empty(problem: Problem) -> Record | None:
    """The record of a solve before its first step (`None`: nothing to record)."""
    if not _loop.adaptive(problem) or problem.max_steps is None:
        return None
    return Record(
        jnp.zeros(problem.max_steps, jnp.uint8),
        jnp.zeros(problem.max_steps, jnp.result_type(problem.t0)),
    )


def write(record: Record, k, after: Carry, out: StepOut) -> Record:
    """`record` with step `k`'s decisions (`out`) and its carry's next step end
    (`after.tnext`)."""
    byte = out.accepted.astype(jnp.uint8)
    if out.lands is not None:
        byte = byte | lax.shift_left(out.lands.astype(jnp.uint8), jnp.uint8(1))
    ends = with_row(record.ends, k, after.tnext.astype(record.ends.dtype))
    return Record(with_row(record.decisions, k, byte), ends)


def decisions(record: Record | None, k) -> _loop.Replay | None:
    """Step `k`'s decisions as the forward pass took them."""
    if record is None:
        return None
    byte = row_of(record.decisions, k)
    return _loop.Replay((byte & _ACCEPTED) != 0, (byte & _LANDS) != 0)


def step_end(record: Record | None, k, tnext: Array) -> Array:
    """The forward pass's next step end after step `k` (`tnext`, the
    recomputation's own, where nothing is recorded)."""
    if record is None:
        return tnext
    return row_of(record.ends, k).astype(tnext.dtype)
