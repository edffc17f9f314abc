"""Positioned reads and writes that finish: ``preadv``/``pwritev`` until every byte has moved (the GIL released)."""

from __future__ import annotations

import os
import typing

Buffer = typing.Any
"""Anything ``memoryview`` takes: bytes, bytearray, a numpy array, an mmap (``collections.abc.Buffer`` from Python 3.12)."""


def read_fully(fd: int, into: Buffer, offset: int, what: str = "the file") -> None:
    """Fill the writable buffer ``into`` with ``fd``'s bytes from ``offset``; EOFError naming ``what`` if it ends early."""
    view = memoryview(into).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"{what} ended {len(view) - done} bytes early, at byte {offset + done}; the file is truncated")
        done += got


def write_fully(fd: int, data: Buffer, offset: int) -> None:
    """Write all of the buffer ``data`` to ``fd`` at ``offset``."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)
