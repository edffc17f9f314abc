"""Mapping a file over an address range this process already maps (``mmap`` with ``MAP_FIXED``).

Python's ``mmap`` cannot choose an address, so a host arena that may later show other bytes at the same addresses
reserves its range with an anonymous Python mapping (which owns the range and frees it on close) and maps the memfd
over it here. Mapping another memfd over the same range later swaps the bytes every tensor viewing it reads, in one
system call, without changing an address.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_MAP_FIXED = 0x10  # Linux's value on every architecture weightcache runs on
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # a reservation commits no memory (Python 3.11 lacks the name)
_FAILED = ctypes.c_void_p(-1).value


def reserve(size: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of ``size`` bytes (no memory is committed until it is touched) and its address."""
    owner = mmap.mmap(
        -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    anchor = ctypes.c_char.from_buffer(owner)
    address = ctypes.addressof(anchor)
    del anchor  # the buffer export would keep the mapping from ever closing
    return owner, address


def map_over(address: int, size: int, fd: int) -> None:
    """Map ``fd``'s first ``size`` bytes read-only and shared at ``address``, replacing whatever this process mapped there.

    OSError (and the range left as it was) when the kernel refuses.
    """
    result = _libc.mmap(address, size, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if result == _FAILED or result != address:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap(MAP_FIXED) of {size} bytes at {address:#x}: {os.strerror(errno)}")
