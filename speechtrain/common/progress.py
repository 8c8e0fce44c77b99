"""Progress lines for long work whose output may not be a terminal (a log file, a batch job): one line every
``every_s`` seconds with what is done of the total, the rate and the time left, and one when the work ends.

A terminal's progress bar redraws one line in place; written to a file it is either nothing until the end or a
stream of carriage returns. These lines read the same in both.
"""

import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("speechtrain.progress")

DEFAULT_EVERY_S = 30.0


def progress_interval() -> float:
    """Seconds between progress lines: ``SPEECHTRAIN_PROGRESS_S`` (default 30)."""
    return float(os.environ.get("SPEECHTRAIN_PROGRESS_S", DEFAULT_EVERY_S))


def format_duration(seconds: float) -> str:
    """``75`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    """Counts done items of ``total`` and reports every ``every_s`` seconds (and at :meth:`close`).

    Args:
        what: what is being done, e.g. ``"synthesising builtin:speech"``.
        total: items to do.
        unit: what an item is, e.g. ``"utterances"``.
        every_s: seconds between lines (default: :func:`progress_interval`).
        emit: where a line goes (default: this module's logger at INFO).
        clock: a monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        what: str,
        total: int,
        unit: str = "items",
        every_s: float | None = None,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.every_s = progress_interval() if every_s is None else every_s
        self.emit = emit or logger.info
        self.clock = clock
        self.start = self.last = clock()
        self.done = 0
        self.emit(f"{what}: {total:,} {unit}")

    def line(self) -> str:
        elapsed = self.clock() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        share = 100.0 * self.done / self.total if self.total else 100.0
        eta = format_duration(left) if left == left else "?"
        return (f"{self.what}: {self.done:,}/{self.total:,} {self.unit} ({share:.0f}%), {rate:,.1f}/s, "
                f"{format_duration(elapsed)} elapsed, {eta} left")  # fmt: skip

    def update(self, count: int = 1) -> None:
        self.done += count
        now = self.clock()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            self.emit(self.line())

    def close(self) -> None:
        self.emit(f"{self.what}: done, {self.done:,} {self.unit} in {format_duration(self.clock() - self.start)}")
