"""A progress line (bytes and rate) for loads that take more than a moment."""

from __future__ import annotations

import sys
import time


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


class Progress:
    """Counts bytes; once ``delay_s`` has passed, redraws one line on ``stream`` at most 10 times a second."""

    def __init__(self, label: str, total: int | None = None, stream=None, delay_s: float = 1.0):
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.delay_s = delay_s
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def update(self, nbytes: int) -> None:
        now = time.monotonic()
        if not self.done:
            self._start = now  # the rate counts from the first byte
        self.done += nbytes
        if now - self._start >= self.delay_s and now - self._last_draw >= 0.1:
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        total = f" / {_human(self.total)}" if self.total else ""
        percent = f" {100 * self.done / self.total:5.1f}%" if self.total else ""
        self.stream.write(f"\r{self.label}: {_human(self.done)}{total}{percent} at {_human(rate)}/s   ")
        self.stream.flush()
        self._last_draw = now
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


class NoProgress:
    """Progress that shows nothing (library default)."""

    def update(self, nbytes: int) -> None:
        pass

    def close(self) -> None:
        pass
