"""Progress meters, driven from inside the compiled loop by host callbacks."""

import abc
import itertools
import sys
import threading
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._closure._unvmap import unvmap_max


_ids = itertools.count()
_lock = threading.Lock()
_bars: dict = {}  # token -> the open bar of a solve in progress


class AbstractProgressMeter(eqx.Module):
    """Base class of the progress meters: one meter per solve, also under `vmap` (the
    slowest batch element is shown). The loop calls exactly these three methods."""

    @abc.abstractmethod
    def start(self):
        """Called once per solve, when it is traced: a token that identifies this
        solve's meter in `callback`, or `None` to show nothing (then neither of the
        other methods is called)."""

    @abc.abstractmethod
    def callback(self, token, fraction) -> None:
        """Emit the host callback that shows `fraction` (of the interval, in [0, 1];
        batched: the minimum is shown), from inside the compiled loop."""

    @abc.abstractmethod
    def wants(self, num_steps, shown, now) -> Any:
        """Whether to refresh after a step (a boolean array; unbatched: `num_steps`
        of the slowest element, `shown` the fraction last shown, `now` the slowest
        element's fraction after the step)."""


class NoProgressMeter(AbstractProgressMeter):
    """Shows nothing (the default)."""

    def start(self):
        return None

    def callback(self, token, fraction) -> None:
        pass

    def wants(self, num_steps, shown, now) -> Any:
        return False


class _AbstractHostMeter(AbstractProgressMeter):
    def start(self):
        return next(_ids)

    def callback(self, token, fraction) -> None:
        # The slowest batch element, unbatched: one callback (one bar) under vmap.
        fraction = -unvmap_max(-fraction)
        jax.debug.callback(lambda f: self._update(token, f), fraction)

    def _update(self, token, fraction):
        value = float(np.min(np.asarray(fraction)))
        with _lock:
            bar = _bars.get(token)
            if bar is None:
                bar = self._new_bar()
                _bars[token] = bar
                if value <= 0.0:
                    return  # opening the bar shows the start
            if value >= 1.0:
                self._close(bar)
                del _bars[token]
            else:
                self._show(bar, value)

    @abc.abstractmethod
    def _new_bar(self) -> Any:
        """Open a bar (shown at 0)."""

    @abc.abstractmethod
    def _show(self, bar, value) -> None:
        """Show `value` (in [0, 1)) on `bar`."""

    @abc.abstractmethod
    def _close(self, bar) -> None:
        """Show 1 on `bar` and close it."""


class TextProgressMeter(_AbstractHostMeter):
    """Prints the progress as a percentage: `0.00%` at the start, a line each time
    it has grown by more than `minimum_increase` since the last line, and `100.00%`
    at the end (the same lines as diffrax's).

    **Arguments:**

    - `minimum_increase`: the least increase (a fraction of the interval) worth a
        new line (default 0.02, every 2%).
    """

    minimum_increase: float = eqx.field(default=0.02, static=True)

    def __check_init__(self):
        if not 0 < self.minimum_increase <= 1:
            raise ValueError(
                "TextProgressMeter(minimum_increase=...) must be in (0, 1], got "
                f"{self.minimum_increase!r}."
            )

    def wants(self, num_steps, shown, now):
        return now - shown > self.minimum_increase

    def _new_bar(self):
        print("0.00%", file=sys.stdout, flush=True)
        return [0.0]

    def _show(self, bar, value):
        if value > bar[0]:
            bar[0] = value
            print(f"{100 * value:.2f}%", file=sys.stdout, flush=True)

    def _close(self, bar):
        print("100.00%", file=sys.stdout, flush=True)


class TqdmProgressMeter(_AbstractHostMeter):
    """A tqdm progress bar (needs `tqdm`).

    **Arguments:**

    - `refresh_steps`: refresh the bar every this many steps (default 20).
    """

    refresh_steps: int = eqx.field(default=20, static=True)

    def __check_init__(self):
        if self.refresh_steps < 1:
            raise ValueError(
                "TqdmProgressMeter(refresh_steps=...) must be >= 1, got "
                f"{self.refresh_steps!r}."
            )

    def wants(self, num_steps, shown, now):
        return num_steps % self.refresh_steps == 0

    def _new_bar(self):
        import tqdm  # optional dependency, imported when a bar is shown

        return tqdm.tqdm(total=100, unit="%", bar_format="{l_bar}{bar}| {n:.2f}/100%")

    def _show(self, bar, value):
        bar.n = round(100 * value, 2)
        bar.refresh()

    def _close(self, bar):
        bar.n = 100.0
        bar.refresh()
        bar.close()
