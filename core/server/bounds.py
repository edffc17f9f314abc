"""The accepted range of every numeric server option, declared once (docs/operations.md, "Limits").

``weightcache serve`` parses its flags with them (``Bound.parse`` is an argparse
``type=``) and ``ServerConfig`` validates its fields with them
(``Bound.validator``), so neither the command line nor the Python API can start a
server that resets every connection (a NaN, zero or negative deadline) or
holds a budget nothing could reach. Every bound is finite: a number that is
not (NaN, infinity) is refused, and so is a bool where a number is expected.
"""

from __future__ import annotations

import math
import re
import typing

import attrs

DAY_S: typing.Final = 86400.0


@attrs.frozen
class Bound:
    """A finite number from ``least`` to ``most``; ``unit`` names it in messages, ``integer`` allows whole numbers only.

    ``none`` says what None stands for where an option may be left unset (``no limit``,
    ``never``); without it None is refused.
    """

    least: float
    most: float
    unit: str
    integer: bool = False
    none: str | None = None

    @property
    def accepted(self) -> str:
        """``a number of seconds from 0.01 to 86400 (1 day)``: what a message says is accepted."""
        kind = f"a whole number of {self.unit}" if self.integer else f"a number of {self.unit}"
        return f"{kind} from {self.shown(self.least)} to {self.shown(self.most)}"

    def shown(self, value: float) -> str:
        """``86400 (1 day)``, ``1 EiB``, ``0.01``: a bound as messages and docs write it."""
        return _number(value, self.unit)

    def contains(self, value: object) -> bool:
        """Whether ``value`` is a number (not a bool) of the right kind, finite, from ``least`` to ``most``."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        return math.isfinite(value) and self.least <= value <= self.most

    def check(self, name: str, value: typing.Any) -> typing.Any:
        """``value`` when it is in range (or None where ``none`` allows it); else ValueError naming ``name`` and the range."""
        if value is None and self.none is not None:
            return value
        if not self.contains(value):
            unset = f", or None for {self.none}" if self.none is not None else ""
            raise ValueError(f"{name} is {value!r}; give {self.accepted}{unset}")
        return value

    def validator(self, instance: object, attribute: attrs.Attribute, value: typing.Any) -> None:
        """An attrs validator: ``check`` under the field's name."""
        self.check(attribute.name, value)

    def parse(self, text: str, zero: str | None = None) -> float | int:
        """The value of a command-line flag; ``zero``: what ``0`` stands for where the flag accepts it (``never``).

        Raises ValueError with a message that says the accepted range (argparse shows it as the flag's error).
        """
        convert = int if self.integer else float
        accepted = f"{self.accepted}{f', or 0 for {zero}' if zero else ''}"
        try:
            value = convert(text)
        except ValueError:
            raise ValueError(f"{text!r} is not {accepted}") from None
        if zero and value == 0:
            return value
        if not self.contains(value):
            raise ValueError(f"{text!r} is not {accepted}")
        return value


def _number(value: float, unit: str) -> str:
    """``86400 (1 day)``, ``1 EiB``, ``0.01`` or ``1048576``: a bound as a message shows it."""
    if value == DAY_S:
        return "86400 (1 day)"
    for power, name in reversed(list(enumerate(_BINARY_UNITS, start=1))):
        if unit == "bytes" and value >= 1 << 10 * power and value % (1 << 10 * power) == 0:
            return f"{int(value) >> 10 * power} {name}"
    return f"{value:g}" if not float(value).is_integer() else str(int(value))


_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


SECONDS: typing.Final = Bound(0.01, DAY_S, "seconds")
"""A deadline or a wait: from 10 ms (anything shorter resets connections under ordinary load) to a day."""
IDLE_SECONDS: typing.Final = Bound(0.01, DAY_S, "seconds", none="never")
BYTES: typing.Final = Bound(1, 1 << 60, "bytes", integer=True)
"""A byte count: at least one byte, at most 1 EiB (no machine holds more)."""
BUDGET: typing.Final = Bound(1, 1 << 60, "bytes", integer=True, none="no limit")
FRAME_BYTES: typing.Final = Bound(4096, 1 << 30, "bytes", integer=True)
"""One frame's payload: room for any reply's envelope (4 KiB), at most 1 GiB (a frame is decoded in memory)."""
CONNECTIONS: typing.Final = Bound(1, 1 << 20, "connections", integer=True)
IN_FLIGHT_FDS: typing.Final = Bound(1, 1 << 20, "fds", integer=True, none="a quarter of the open-file limit")
ARTIFACTS: typing.Final = Bound(1, 4096, "artifacts", integer=True)
PORT: typing.Final = Bound(0, 65535, "port", integer=True, none="off")
"""A TCP port (0: any free one)."""


SIZE_POWERS: typing.Final = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
SIZE_EXAMPLE: typing.Final = (
    "bytes, or a number with K, M, G or T: 64G, 64Gi and 64GiB are powers of 1024, 64GB of 1000; e.g. 512M, 1.5TiB, 80GB"
)


def parse_size(text: str | int) -> int:
    """A byte count (or an int), more than 0: ``64G``, ``64Gi`` and ``64GiB`` are 64 × 2^30, ``64GB`` 64 × 10^9 (as
    ``df -H`` and disk vendors count), ``1048576`` bytes; K, M, G, T alike, in either case. ValueError says what to write."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a size; write {SIZE_EXAMPLE}")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?)|b?)\s*", text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not a size; write {SIZE_EXAMPLE}")
    number, letter, binary, byte = match.groups()
    base = 1000 if letter and byte and not binary else 1024
    nbytes = int(float(number) * base ** SIZE_POWERS[letter or ""])
    if nbytes <= 0:
        raise ValueError(f"{text!r} is no room at all; give a size above 0 (or leave the option out for no limit)")
    if not BUDGET.contains(nbytes):
        raise ValueError(f"{text!r} is more than any machine holds; give a size up to {BUDGET.shown(BUDGET.most)}")
    return nbytes
