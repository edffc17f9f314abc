"""Positioned reads and writes that finish: ``preadv``/``pwritev`` until every byte has moved (the GIL released)."""

from __future__ import annotations

import ctypes
import mmap
import os
import typing

DIRECT_ALIGN = 4096
"""O_DIRECT's alignment of offsets, lengths and buffers (the largest logical block size in use)."""

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


def read_block(fd: int, direct_fd: int, buffer: Buffer, start: int, offset: int, nbytes: int) -> None:
    """Read ``nbytes`` at ``start + offset`` into ``buffer[offset:]``: whole aligned blocks through ``direct_fd`` where
    there is one (the buffer has room up to the next block), the rest (a short read that left it unaligned) buffered.

    EOFError if the file ends first.
    """
    view = memoryview(buffer)
    done = 0
    if direct_fd >= 0:
        want = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
        while done < nbytes:
            got = os.preadv(direct_fd, [view[offset + done : offset + want]], start + offset + done)
            if got == 0:
                raise EOFError
            done += got
            if done % DIRECT_ALIGN:
                break
    while done < nbytes:
        got = os.preadv(fd, [view[offset + done : offset + nbytes]], start + offset + done)
        if got == 0:
            raise EOFError
        done += got


def resident_pages(fd: int, size: int) -> bytes:
    """One byte per page of the open file's first ``size`` bytes, non-zero where the page is in the page cache (``mincore``).

    OSError where the file cannot be mapped (e.g. a pipe) or the kernel refuses ``mincore``.
    """
    if size <= 0:
        return b""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap for mincore")
    try:
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        if libc.mincore(address, size, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return vector.raw[:pages]
    finally:
        libc.munmap(address, size)


def resident_share(fd: int, size: int) -> float:
    """The share of the open file's first ``size`` bytes whose pages are in the page cache, from 0 to 1 (OSError as above)."""
    pages = resident_pages(fd, size)
    return (len(pages) - pages.count(0)) / len(pages) if pages else 0.0
