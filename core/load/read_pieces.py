"""What every read strategy shares (``reader``): a read's unit (``Piece``, each with the tensor bytes it holds as
``Copy`` objects), the chunk a piece is staged in, and the checks that the bytes read are the file's the plan was made
from (``Changed``)."""

from __future__ import annotations

import typing

import attrs

from weightcache.core.load.export import Slot

if typing.TYPE_CHECKING:
    import numpy

CHUNK_BYTES = 16 << 20
"""One read: a piece is read, placed and hashed in chunks, so each thread's two staging buffers stay small."""


@attrs.frozen
class Copy:
    """Bytes of one tensor inside a piece: ``nbytes`` at ``source`` in the piece go to ``slot`` at ``offset``."""

    slot: Slot
    offset: int
    source: int
    nbytes: int


@attrs.frozen
class Piece:
    """One read: ``nbytes`` of file number ``file`` at ``start``, the tensor bytes it holds, and its index in the file."""

    file: int
    index: int
    start: int
    nbytes: int
    copies: tuple[Copy, ...]


class Changed(Exception):
    """The bytes read are not those of the file the plan was made from."""


def check_header_bytes(raw: bytes, at: int, data: "numpy.ndarray") -> None:
    """``Changed`` if ``data``, read from file offset ``at``, disagrees with the header bytes ``raw`` it overlaps."""
    if at < len(raw):
        stop = min(len(raw), at + len(data))
        if bytes(data[: stop - at]) != raw[at:stop]:
            raise Changed


def overlaps(copy: Copy, start: int, stop: int) -> bool:
    return copy.source < stop and start < copy.source + copy.nbytes


def within(copy: Copy, start: int, stop: int) -> Copy:
    """The part of ``copy`` that lies in the piece's bytes ``start``..``stop``, its source relative to ``start``."""
    low, high = max(start, copy.source), min(stop, copy.source + copy.nbytes)
    return Copy(copy.slot, copy.offset + low - copy.source, low - start, high - low)
