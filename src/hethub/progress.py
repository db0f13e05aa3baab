"""Progress for long work: a tqdm bar on a terminal, plain log lines everywhere else.

CI logs and redirected output cannot render a bar's carriage returns (they become thousands of
lines), so off a terminal we print one line every ``every_percent`` of the total or every
``every_s`` seconds, whichever comes first, plus a final line::

    search: 40/100 plans (12.3 plans/s, ETA 4.9 s)
    search: 100/100 plans done in 8.1 s (12.3 plans/s)

Use it around an iterable or as a context manager with an explicit total::

    for layer in progress(layers, desc="profile", unit="layers"):
        ...
    with progress(n_plans, desc="search", unit="plans") as bar:
        bar.update(3)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TextIO, TypeVar

T = TypeVar("T")


class Progress(Generic[T]):
    """Counts work done; iterate it (when built from an iterable) or call :meth:`update`."""

    def __init__(self, iterable: Iterable[T] | None, *, total: int | None, desc: str, unit: str, stream: TextIO,
                 tty: bool, every_percent: float, every_s: float, clock: Callable[[], float]) -> None:
        self._iterable = iterable
        self.total = total
        self.desc = desc
        self.unit = unit
        self.count = 0
        self._stream = stream
        self._clock = clock
        self._every_frac = every_percent / 100.0
        self._every_s = every_s
        self._start_s = clock()
        self._last_log_s = self._start_s
        self._last_log_count = 0
        self._closed = False
        self._bar: Any = None
        if tty:
            from tqdm import tqdm  # imported lazily: log-line mode must not pay for it

            # Without tqdm's monitor thread: a live thread keeps the planner's fan-out (hethub.fanout) serial.
            quiet = type("Bar", (tqdm,), {"monitor_interval": 0})
            self._bar = quiet(total=total, desc=desc, unit=f" {unit}", file=stream, dynamic_ncols=True)

    # ---- counting ------------------------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = self._clock()
        due_by_time = now - self._last_log_s >= self._every_s
        due_by_count = bool(self.total) and (self.count - self._last_log_count) >= self._every_frac * self.total
        if (due_by_time or due_by_count) and not (self.total is not None and self.count >= self.total):
            # The final count is left to close(), which prints the "done" line instead.
            self._log(self._line(now))
            self._last_log_s, self._last_log_count = now, self.count

    @property
    def is_bar(self) -> bool:
        return self._bar is not None

    def note(self, text: str) -> None:
        """Show `text` beside the bar (e.g. the current loss); log-line mode leaves that to the caller."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        elapsed_s = self._clock() - self._start_s
        of_total = f"/{self.total}" if self.total is not None else ""
        self._log(f"{self.desc}: {self.count}{of_total} {self.unit} done in {_fmt_s(elapsed_s)} "
                  f"({_fmt_rate(self.count, elapsed_s)} {self.unit}/s)")

    # ---- protocols -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        if self._iterable is None:
            raise TypeError("progress() was given a total, not an iterable: call update() instead of iterating")
        try:
            for item in self._iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- formatting ----------------------------------------------------------------------------------
    def _line(self, now: float) -> str:
        elapsed_s = now - self._start_s
        rate = self.count / elapsed_s if elapsed_s > 0 else 0.0
        if self.total is None:
            return f"{self.desc}: {self.count} {self.unit} ({_fmt_rate(self.count, elapsed_s)} {self.unit}/s)"
        eta = f"ETA {_fmt_s((self.total - self.count) / rate)}" if rate > 0 else "ETA ?"
        return (f"{self.desc}: {self.count}/{self.total} {self.unit} "
                f"({_fmt_rate(self.count, elapsed_s)} {self.unit}/s, {eta})")

    def _log(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()


def progress(iterable_or_total: Iterable[T] | int, *, desc: str, unit: str = "it", stream: TextIO | None = None,
             tty: bool | None = None, every_percent: float = 10.0, every_s: float = 5.0,
             clock: Callable[[], float] = time.monotonic) -> Progress[T]:
    """A progress reporter for ``iterable_or_total`` (an iterable, or the number of units to come).

    ``stream`` defaults to stderr; ``tty`` defaults to ``stream.isatty()``. ``clock`` exists so tests
    can drive time.
    """
    out = stream if stream is not None else sys.stderr
    is_tty = _isatty(out) if tty is None else tty
    if isinstance(iterable_or_total, int):
        return Progress(None, total=iterable_or_total, desc=desc, unit=unit, stream=out, tty=is_tty,
                        every_percent=every_percent, every_s=every_s, clock=clock)
    total = len(iterable_or_total) if hasattr(iterable_or_total, "__len__") else None  # type: ignore[arg-type]
    return Progress(iterable_or_total, total=total, desc=desc, unit=unit, stream=out, tty=is_tty,
                    every_percent=every_percent, every_s=every_s, clock=clock)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or stream-like objects without a terminal
        return False


def _fmt_rate(count: int, elapsed_s: float) -> str:
    if elapsed_s <= 0:
        return "?"
    rate = count / elapsed_s
    return f"{rate:.3g}" if rate < 1000 else f"{rate:,.0f}"


def _fmt_s(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m} min {s} s" if m else f"{s} s"
    h, rem = divmod(round(seconds), 3600)
    return f"{h} h {rem // 60} min"
