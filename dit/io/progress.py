"""Progress for people: tqdm's bar on a terminal; elsewhere (a log, a CI transcript) plain lines, at most one per
``PlainProgress.SECONDS`` unless a tenth of the work was done, and one at the end."""

from __future__ import annotations

import sys
import time
import weakref

from tqdm import tqdm

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the bars drawn now, for end_bars


def write(message: str) -> None:
    """A line on stderr, above any bar drawn there."""
    tqdm.write(message, file=sys.stderr)


def progress(total: int | None, desc: str, *, initial: int = 0, unit: str = "it", enabled: bool = True):
    """A bar with ``update(n)`` and ``close()`` (also a context manager); disabled, it does nothing."""
    if not enabled or sys.stderr.isatty():
        bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, leave=False,
                   dynamic_ncols=True)  # fmt: skip
        _LIVE.add(bar)
        return bar
    return PlainProgress(total, desc, initial, unit)


def end_bars() -> None:
    """Close every bar an error left drawn, so that the next line starts a line of its own."""
    for bar in list(_LIVE):
        bar.close()


class PlainProgress:
    """``desc: n/total unit (p%), rate, elapsed, ETA`` lines, for logs and pipes."""

    SECONDS = 30.0  # the longest quiet spell; a tenth of the work done (and 5 s) also prints a line

    def __init__(self, total: int | None, desc: str, initial: int = 0, unit: str = "it"):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self._shown = self._start_n = initial
        self._start = self._last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        tenth = self.total and self.n - self._shown >= self.total / 10 and now - self._last >= 5
        if tenth or now - self._last >= self.SECONDS or (self.total and self.n >= self.total):
            self._print(now)

    def _print(self, now: float) -> None:
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        line = f"{self.desc}: {self.n:,}"
        if self.total:
            line += f"/{self.total:,} {self.unit} ({self.n / self.total:.0%})"
            if rate > 0 and self.n < self.total:
                line += f", ETA {duration((self.total - self.n) / rate)}"
        else:
            line += f" {self.unit}"
        print(f"{line}, {rate:.3g} {self.unit}/s, elapsed {duration(elapsed)}", file=sys.stderr, flush=True)
        self._shown, self._last = self.n, now

    def close(self) -> None:
        if self.n != self._shown:
            self._print(time.perf_counter())

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def duration(seconds: float) -> str:
    """Seconds in the unit a person reads: "42.1 s", "3.5 min", "26.5 h"."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.4g} h"
