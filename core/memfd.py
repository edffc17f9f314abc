"""Sealed memfds holding a blob: a compile artifact, an entry's tensor table.

A blob travels between processes as one memfd sealed against writes,
shrinking and growing: whoever holds it reads the same bytes forever, and its
size is fixed, so a receiver checks it once (``sealed_size``) and trusts it after.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
"""What a blob's creator adds (``F_SEAL_SEAL`` last: nobody may change the seals after)."""
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""What a receiver requires: the bytes and the size can no longer change."""


def sealed_memfd(data: bytes, name: str = "weightcache-blob") -> int:
    """A memfd holding ``data``, sealed against writes, shrinking and growing; the caller closes it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_memfd(fd: int, size: int) -> bytes:
    """The first ``size`` bytes of the memfd ``fd`` (mapped read-only, copied once)."""
    if size == 0:
        return b""
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
        return bytes(mapped)


def sealed_size(fd: int, what: str) -> int:
    """The size of ``fd``, a memfd sealed against writes, shrinking and growing (ValueError naming ``what`` otherwise).

    The seals make the bytes immutable for every process that maps them, and fix the size counted.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} fd is not a memfd (file type {stat.S_IFMT(info.st_mode):#o})")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError(f"{what} fd is not a memfd (it cannot be sealed)") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ValueError(f"{what} memfd is not sealed against writes, shrinking and growing; seal it before publishing")
    return os.fstat(fd).st_size  # again: the size may have changed until the seals were added
