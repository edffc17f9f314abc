"""Positioned reads and writes that finish: ``preadv``/``pwritev`` until every byte has moved (the GIL released)."""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import typing

from weightcache.core import envvars
from weightcache.core.errors import NotRegularFile

DIRECT_ALIGN = 4096
"""O_DIRECT's alignment of offsets, lengths and buffers (the largest logical block size in use)."""

Buffer = typing.Any
"""Anything ``memoryview`` takes: bytes, bytearray, a numpy array, an mmap (``collections.abc.Buffer`` from Python 3.12)."""

HUGE_PAGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_STAGING_ENV = "WEIGHTCACHE_READ_HUGE_PAGES"


READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
"""How weight files are opened: O_NONBLOCK, so that a FIFO put in a file's place never waits for a writer (reads of a
regular file ignore the flag)."""

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def check_regular(path: str | os.PathLike, mode: int) -> None:
    """NotRegularFile unless ``mode`` (``st_mode`` of ``path``) is a regular file's."""
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, _KINDS.get(stat.S_IFMT(mode), "no regular file"))


def open_regular(path: str | os.PathLike, flags: int = 0) -> int:
    """A descriptor of the regular file ``path`` (symlinks followed), opened with ``READ_FLAGS | flags``.

    NotRegularFile for a FIFO, a device, a socket or a directory: it is refused from ``os.stat`` before any open (no
    device is opened, no FIFO waited on), and checked again on the open descriptor (the path may be swapped between).
    """
    check_regular(path, os.stat(path).st_mode)
    fd = os.open(path, READ_FLAGS | flags)
    try:
        check_regular(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def huge_pages_offered(setting: str = THP_SETTING) -> bool:
    """Whether the kernel backs memory that asks for it (``MADV_HUGEPAGE``) with transparent huge pages: its setting
    is ``always`` or ``madvise``. False where the setting cannot be read (no THP in this kernel)."""
    try:
        with open(setting) as handle:
            chosen = handle.read()
    except OSError:
        return False
    return "[always]" in chosen or "[madvise]" in chosen


def switch_setting(name: str) -> bool | None:
    """The read setting ``$name`` as a switch: True for 1, False for 0, None where it is unset or anything else (then
    the caller's default decides; anything else is warned about once, ``envvars.switch``)."""
    return envvars.switch(name)


def huge_staging_setting() -> bool | None:
    """``$WEIGHTCACHE_READ_HUGE_PAGES`` as a switch (``switch_setting``)."""
    return switch_setting(HUGE_STAGING_ENV)


def huge_staging_wanted() -> bool:
    """Whether O_DIRECT reads land in huge pages (``DirectBuffer``): ``$WEIGHTCACHE_READ_HUGE_PAGES`` where it is 0 or
    1, else where the kernel offers them."""
    setting = huge_staging_setting()
    return huge_pages_offered() if setting is None else setting


class DirectBuffer:
    """``nbytes`` of private memory for O_DIRECT reads, ``HUGE_PAGE``-aligned and in transparent huge pages where the
    kernel offers them (``huge_pages_offered``), every page present.

    Why: a read's request to a virtio disk carries one descriptor per physically contiguous run of its buffer, and
    the hypervisor handles each on its own. 512 KiB read into scattered 4 KiB pages (a memfd's, or malloc's) is 128 of
    them; into a huge page, one, so the same O_DIRECT reads finish sooner (``benchmarks/read_patterns.py``). ``view`` is the memory, ``address`` where it starts.
    """

    def __init__(self, nbytes: int):
        whole = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        self.area = mmap.mmap(-1, whole + HUGE_PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self.area)
        skip = (-ctypes.addressof(self._anchor)) % HUGE_PAGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.area.madvise(mmap.MADV_HUGEPAGE, skip, whole)
            except OSError:
                pass  # a kernel without THP: 4 KiB pages, correct, only slower
        self.address = ctypes.addressof(self._anchor) + skip
        self.view = memoryview(self.area)[skip : skip + nbytes]
        for offset in range(0, nbytes, mmap.PAGESIZE):
            self.view[offset] = 0  # the pages (huge ones where granted) are made here, not during a read

    def close(self) -> None:
        """Unmap it (every view of it must be released first)."""
        self.view.release()
        del self._anchor
        self.area.close()


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
