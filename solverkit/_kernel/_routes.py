"""Which path each vmapped solve took, and why: `kernel_routes()` collects a
`KernelRoute` for every decision the `vmap` rule (`_vmap`) makes while a solve is
traced inside it; each decision is also logged to `logging.getLogger("solverkit")`
at DEBUG.
"""

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Literal, NamedTuple


_logger = logging.getLogger("solverkit")
_local = threading.local()


class KernelRoute(NamedTuple):
    """One decision of `jax.vmap(diffeqsolve)`'s kernel route.

    **Attributes:**

    - `stage`: `"forward"` (the solve) or `"backward"` (its reverse mode).
    - `kernel`: whether that stage runs on the whole-solve kernel (for
        `"backward"`: by forward sensitivities in the kernel).
    - `reason`: why not (or, where `kernel` is True, a note on how), else `None`.
    """

    stage: Literal["forward", "backward"]
    kernel: bool
    reason: str | None


def _collectors() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def kernel_routes() -> Iterator[list[KernelRoute]]:
    """Record the path every `jax.vmap(diffeqsolve)` traced inside takes.

    ```python
    with solverkit.kernel_routes() as routes:
        jax.grad(loss)(params)
    for route in routes:
        print(route.stage, route.kernel, route.reason)
    ```

    Only solves traced inside the block record: a `jax.jit` function called again
    with arguments of the same shapes runs its cached program without tracing, and
    records nothing (trace a fresh function, or call `jax.clear_caches()`). A solve
    that the route leaves alone records one `"forward"` decision with
    `kernel=False` and why (with the route off, only a batched solve records);
    one it wraps records, once a `vmap` batches it, where the batch ran
    (`"forward"`) and, when differentiated, how its reverse mode ran
    (`"backward"`). `ensemble_solve(kernel=True)` records its backward choice too.

    **Returns:**

    A list, filled in as solves are traced, of [`solverkit.KernelRoute`][].
    """
    routes: list[KernelRoute] = []
    stack = _collectors()
    stack.append(routes)
    try:
        yield routes
    finally:
        stack.remove(routes)


def listening() -> bool:
    """Whether a decision would go anywhere (an open `kernel_routes()`, or the
    logger at DEBUG): what only a record needs is worked out then."""
    return bool(_collectors()) or _logger.isEnabledFor(logging.DEBUG)


def record(stage: str, kernel: bool, reason: str | None) -> None:
    """Note one decision in every open `kernel_routes()` and in the log."""
    route = KernelRoute(stage, kernel, reason)  # pyright: ignore[reportArgumentType]
    for routes in _collectors():
        routes.append(route)
    _logger.debug(
        "vmap kernel route: %s on the %s%s",
        stage,
        "kernel" if kernel else "loop",
        "" if reason is None else f" ({reason})",
    )
