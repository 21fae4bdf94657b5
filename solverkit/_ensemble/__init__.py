"""`ensemble_solve`: a batch of trajectories on a fixed number of lanes, refilled
from a queue (`_solve.py`: the entry point; `_inputs.py`: checks before tracing;
`_policy.py`: the default lanes and refill size; `_lanes.py`: the lane loop;
`_backward.py`: reverse mode)."""

from ._policy import default_lanes as default_lanes
from ._solve import ensemble_solve as ensemble_solve
