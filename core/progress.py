"""How weightcache shows amounts and long work to a person: byte sizes, speed ratios, progress bars.

Bars come from tqdm, when it is installed (the ``hf`` and ``test`` extras bring it)
and the stream is a terminal; otherwise long work is silent (``NoProgress``). Library
code takes any object with ``update(nbytes)`` and ``close()``
(``weightcache.core.identity.digests.ProgressLike``) and never draws anything itself.
"""

from __future__ import annotations

import sys
import typing

MIB = 1 << 20
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: float) -> str:
    """``86.7 MiB``: one decimal in the largest binary unit that keeps the number at least 1 (``512 B`` below 1 KiB)."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(round(value, 1)) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def counted(count: int, one: str, many: str | None = None) -> str:
    """``1 entry``, ``2 entries``, ``0 parcels``: ``count`` and the noun in the number it takes (``many``: an irregular
    plural; else ``one`` + s, or + es after s, x, ch and sh, or y to ies after a consonant)."""
    if count == 1:
        return f"{count} {one}"
    if many is None:
        if one.endswith(("s", "x", "ch", "sh")):
            many = one + "es"
        elif one.endswith("y") and one[-2:-1] not in "aeiou":
            many = one[:-1] + "ies"
        else:
            many = one + "s"
    return f"{count} {many}"


def format_speedup(baseline_s: float, measured_s: float) -> str:
    """How ``measured_s`` compares with ``baseline_s``: ``12.5x faster`` or ``1.3x slower`` (never ``0.8x faster``)."""
    if measured_s <= 0 or baseline_s <= 0:
        return "n/a"
    ratio = baseline_s / measured_s
    return f"{ratio:,.1f}x faster" if ratio >= 1 else f"{1 / ratio:,.1f}x slower"


def is_terminal(stream: typing.TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal a person watches."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def note(text: str, stream: typing.TextIO | None = None) -> None:
    """Say what is happening now (``checking /models/llama ...``) on a terminal; nothing when output goes elsewhere."""
    stream = sys.stderr if stream is None else stream
    if is_terminal(stream):
        print(text, file=stream, flush=True)


class NoProgress:
    """Progress that shows nothing (the library default, and everywhere no terminal watches)."""

    def update(self, nbytes: int) -> None:
        pass

    def close(self) -> None:
        pass


class ByteProgress:
    """A tqdm bar of MiB done, percent (when ``total`` is known) and rate; drawn from the first ``update`` on.

    Nothing appears for work that never reports a byte (a checkpoint whose digests are all remembered).
    """

    def __init__(self, description: str, total: int | None = None, stream: typing.TextIO | None = None):
        self.description = description
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self._bar: typing.Any = None  # a tqdm bar once a byte is reported (tqdm ships no type information)

    def update(self, nbytes: int) -> None:
        if self._bar is None:
            self._bar = self._open()
        bar = self._bar
        if bar.total is not None and bar.n + nbytes / MIB > bar.total:
            bar.total = bar.n + nbytes / MIB  # an estimate fell short: the bar ends at 100 %, never past it
        bar.update(nbytes / MIB)

    def _open(self):
        from tqdm import tqdm

        if self.total:
            shape = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} MiB [{elapsed}<{remaining}, {rate_noinv_fmt}]"
        else:
            shape = "{desc}: {n:.1f} MiB [{elapsed}, {rate_noinv_fmt}]"
        return tqdm(
            desc=self.description,
            total=self.total / MIB if self.total else None,
            unit="MiB",
            bar_format=shape,
            file=self.stream,
            dynamic_ncols=True,
            mininterval=0.2,
            leave=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def byte_progress(description: str, total: int | None = None, stream: typing.TextIO | None = None) -> ByteProgress | NoProgress:
    """A bar on ``stream`` (default: stderr) when tqdm is installed and the stream is a terminal, else ``NoProgress``."""
    if not is_terminal(stream):
        return NoProgress()
    try:
        import tqdm  # noqa: F401  optional: the hf and test extras install it
    except ImportError:
        return NoProgress()
    return ByteProgress(description, total, stream)
