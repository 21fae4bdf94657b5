"""How many lanes `ensemble_solve` uses and how many of them it refills at once:
the defaults in one place, easy to change from measurements.

A lane loop iteration steps every lane; once `wait` lanes have finished, a refill
writes the outputs of up to `refill` finished lanes and starts them on the next
trajectories of the queue. With as many
lanes as trajectories nothing is refilled: the loop is the lockstep one of
`jax.vmap(diffeqsolve)`, and `ensemble_solve` runs it without the refill.
"""

from typing import NamedTuple

from .. import _backend


# On a CPU each lane's step costs about the same whatever the number of lanes, so
# fewer lanes (more trajectories per lane) waste less: N // 16, at least 64.
_CPU_LANE_FRACTION = 16
_CPU_MIN_LANES = 64
# On an accelerator a loop iteration costs a fixed launch overhead (tens of
# microseconds) plus little per lane until the chip is full, so the refill loop,
# whose iterations are more and each dearer, does not pay. Measured on a TPU v5e
# (float32, Lorenz rho <= 100, t <= 10, `python -m benchmarks.ensemble --dtype
# float32 --cases lorenz100 --sizes 16384,65536 --lanes n/4,n/2`): refill took
# 7.6-8.9x the lockstep loop's time at every lane count tried (N = 16,384: 0.127 s
# vs 0.0167 s). So on an accelerator the lockstep loop runs by itself (`None`:
# never refill); a number here would refill from that many trajectories on, with
# N // `_ACCELERATOR_LANE_FRACTION` lanes.
_ACCELERATOR_REFILL_FROM: int | None = None
_ACCELERATOR_LANE_FRACTION = 2
# A refill finishes and starts a buffer of this fraction of the lanes (those of the
# finished lanes it takes; the rest of the buffer is masked) ...
_REFILL_FRACTION = 8
# ... once this fraction of the lanes (at most the buffer), or every running lane,
# has finished.
_WAIT_FRACTION = 32


class Policy(NamedTuple):
    """The lanes of one ensemble: `lanes` trajectories solved side by side, up to
    `refill` of them refilled at once (`0`: the lockstep loop, no refill), once
    `wait` of them have finished."""

    lanes: int
    refill: int
    wait: int = 1


def default_lanes(batch: int, platform: str | None = None) -> int:
    """The number of lanes `ensemble_solve` uses for `batch` trajectories when not
    told.

    **Arguments:**

    - `batch`: the number of trajectories, `N`.
    - `platform`: `"cpu"`, `"gpu"`, `"tpu"`; default: JAX's default backend.

    **Returns:**

    On a CPU, `N // 16`, at least 64 (enough trajectories per lane that the last
    ones to finish leave few lanes idle). On an accelerator, where an iteration's
    fixed cost dominates, `N`: the lockstep loop, no refill (refill measured
    7.6-8.9x slower on a TPU). At most `N`.
    """
    platform = _backend.platform() if platform is None else platform
    if platform == "cpu":
        lanes = max(batch // _CPU_LANE_FRACTION, _CPU_MIN_LANES)
    elif _ACCELERATOR_REFILL_FROM is None or batch < _ACCELERATOR_REFILL_FROM:
        lanes = batch
    else:
        lanes = -(-batch // _ACCELERATOR_LANE_FRACTION)
    return max(1, min(batch, lanes))


def default_refill(lanes: int) -> int:
    """How many finished lanes a refill takes at most: `lanes // 8`, at least 1."""
    return max(1, lanes // _REFILL_FRACTION)


def _wait(lanes: int, refill: int) -> int:
    """How many finished lanes make a refill: `lanes // 32`, at least 1, at most
    `refill`."""
    return max(1, min(refill, lanes // _WAIT_FRACTION))


def policy(batch: int, lanes: int | None, refill: int | None) -> Policy:
    """The lanes and refill size for `batch` trajectories, the defaults where
    `None`; lockstep (`refill == 0`) when there are as many lanes as
    trajectories."""
    lanes = default_lanes(batch) if lanes is None else min(lanes, batch)
    if lanes >= batch:
        return Policy(batch, 0)
    refill = default_refill(lanes) if refill is None else min(refill, lanes)
    return Policy(lanes, refill, _wait(lanes, refill))
