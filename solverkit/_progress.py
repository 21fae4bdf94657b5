"""Progress meters, driven from inside the compiled loop by host callbacks."""

import itertools
import sys
import threading

import equinox as eqx
import jax
import numpy as np

from ._unvmap import unvmap_max


_ids = itertools.count()
_lock = threading.Lock()
_open: dict = {}


class AbstractProgressMeter(eqx.Module):
    """Base class: `update(fraction)` runs on the host; one meter per solve, also
    under `vmap` (the slowest batch element is shown)."""

    def start(self):
        return None

    def callback(self, token, fraction) -> None:
        """Emit the host callback for a fraction in [0, 1] (batched: the minimum)."""

    def _host(self, token, fraction):
        raise NotImplementedError


class NoProgressMeter(AbstractProgressMeter):
    """Shows nothing (the default)."""


class _HostMeter(AbstractProgressMeter):
    refresh_steps: int = eqx.field(default=10, static=True)

    def start(self):
        return next(_ids)

    def callback(self, token, fraction) -> None:
        # The slowest batch element, unbatched: one callback (one bar) under vmap.
        fraction = -unvmap_max(-fraction)
        jax.debug.callback(lambda f: self._update(token, f), fraction)

    def _update(self, token, fraction):
        value = float(np.min(np.asarray(fraction)))
        with _lock:
            bar = _open.get(token)
            if bar is None and value >= 1.0:
                return  # this bar was already completed by the last step
            if bar is None:
                bar = self._open()
                _open[token] = bar
            self._show(bar, value)
            if value >= 1.0:
                self._close(bar)
                del _open[token]


class TextProgressMeter(_HostMeter):
    """Prints the progress as a percentage, every 10%.

    **Arguments:**

    - `refresh_steps`: update every this many steps.
    """

    def _open(self):
        return [-1]

    def _show(self, bar, value):
        tenth = int(value * 10)
        if tenth > bar[0]:
            bar[0] = tenth
            print(f"{100 * value:.2f}%", file=sys.stdout, flush=True)

    def _close(self, bar):
        pass


class TqdmProgressMeter(_HostMeter):
    """A tqdm progress bar (needs `tqdm`).

    **Arguments:**

    - `refresh_steps`: update every this many steps.
    """

    def _open(self):
        import tqdm  # optional dependency, imported when a bar is shown

        return tqdm.tqdm(total=100, unit="%", bar_format="{l_bar}{bar}| {n:.2f}/100%")

    def _show(self, bar, value):
        bar.n = 100 * value
        bar.refresh()

    def _close(self, bar):
        bar.close()
