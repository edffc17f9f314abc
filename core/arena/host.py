"""Host arenas: a sealed memfd, mapped with mmap.

Works on any Linux machine (CI, CPU engines). Sealing (``F_SEAL_WRITE``) makes
the memory immutable for every process: receivers map it read-only, and a
faulty engine that writes to its weights gets a fault instead of corrupting
another engine's copy.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import typing
import warnings

from weightcache.core.arena import fixed_map
from weightcache.core.arena.base import Arena, ArenaBackend, ArenaSpec, round_up
from weightcache.core.errors import ArenaError

if typing.TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class HostArena(Arena):
    """A memfd, mapped into this process on first use (read-write while building, read-only once sealed).

    Copies to and from a GPU read or write the memfd itself (:meth:`fileno`) and never map it:
    faulting 16 GiB of pages in and unmapping them again costs more than the copy.

    A read-only mapping lies over an address range this arena reserved (``fixed_map``), so that
    :meth:`take_memory_of` can show another memfd's bytes at the same addresses.
    """

    def __init__(self, fd: int, spec: ArenaSpec, writable: bool):
        self.spec = spec
        self.writable = writable
        self._fd = fd
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None
        self._fixed_at: int | None = None  # where a read-only mapping lies over this arena's reserved range

    def fileno(self) -> int:
        """The memfd: ``os.preadv`` reads the arena's bytes; a new arena's are written with ``os.pwritev`` before sealing."""
        if self._fd < 0:
            raise ValueError("arena is closed")
        return self._fd

    def bytes_view(self) -> "torch.Tensor":
        import torch

        if self._view is None:
            with warnings.catch_warnings():
                # A sealed arena is read-only on purpose; torch warns that it cannot write to it.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._view = torch.frombuffer(self._mapping(), dtype=torch.uint8)
        return self._view

    def buffer(self) -> memoryview:
        """The mapping as a memoryview (writable while the arena is being filled)."""
        return memoryview(self._mapping())

    def export_fd(self) -> int:
        return os.dup(self.fileno())

    @property
    def address(self) -> int:
        return self.bytes_view().data_ptr()

    def _mapping(self) -> mmap.mmap:
        if self._map is None and not self.writable:
            owner, address = fixed_map.reserve(self.spec.size)
            try:
                fixed_map.map_over(address, self.spec.size, self.fileno())
            except BaseException:
                owner.close()
                raise
            self._map, self._fixed_at = owner, address
        if self._map is None:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            # A new arena mapped here is filled at once: populate its pages up front instead of faulting one by one.
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self.writable else 0)
            self._map = mmap.mmap(self.fileno(), self.spec.size, flags=flags, prot=prot)
        return self._map

    def take_memory_of(self, other: Arena) -> None:
        """Show ``other``'s bytes (a host arena of the same size) at this arena's addresses from now on, and hold its memfd.

        Every tensor viewing this arena reads ``other``'s bytes afterwards; this arena's old memfd is closed here (its
        memory is freed once no process holds it). ``other`` stays usable and is closed by its owner.
        """
        if not isinstance(other, HostArena):
            raise ArenaError(f"a host arena takes the memory of another host arena, not of a {type(other).__name__}")
        if other.spec.size != self.spec.size:
            raise ArenaError(f"arena of {other.spec.size} bytes cannot replace one of {self.spec.size}; the layouts differ")
        if self.writable:
            raise ArenaError("a writable arena keeps its own memory; seal it first")
        if self._fixed_at is not None:
            fixed_map.map_over(self._fixed_at, self.spec.size, other.fileno())
        new = os.dup(other.fileno())
        old, self._fd = self._fd, new
        if old >= 0:
            os.close(old)
        self.spec = other.spec

    def unmap(self) -> None:
        self._drop_map()

    def make_read_only(self) -> None:
        """Drop the writable mapping (all views must be dropped first); later views map read-only."""
        self._drop_map()
        self.writable = False

    def _drop_map(self):
        self._view = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                log.warning("host arena still has live tensor views; its mapping stays until they are freed")
            self._map = None
            self._fixed_at = None

    def close(self) -> None:
        self._drop_map()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class HostArenaBackend(ArenaBackend):
    """memfd + mmap arenas in host memory."""

    name = "host"

    def granularity(self, device: str) -> int:
        return mmap.PAGESIZE

    def create(self, size: int, device: str = "cpu") -> HostArena:
        size = round_up(max(size, 1), self.granularity(device))
        fd = os.memfd_create("weightcache-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            return HostArena(fd, ArenaSpec(backend=self.name, size=size, device="cpu"), writable=True)
        except BaseException:
            os.close(fd)
            raise

    def seal(self, arena: Arena) -> None:
        """Drop the writable mapping and seal the memfd; views made later map it read-only.

        Tensors that viewed the writable mapping must be dropped before sealing.
        """
        if not isinstance(arena, HostArena):
            raise TypeError(f"the host backend seals host arenas, not a {type(arena).__name__}")
        arena.make_read_only()
        fcntl.fcntl(arena.fileno(), fcntl.F_ADD_SEALS, _SEALS)

    def map(self, fd: int, spec: ArenaSpec, *, writable: bool = False, on_device: int | None = None) -> HostArena:
        if spec.backend != self.name:
            raise ValueError(f"arena of backend {spec.backend!r} cannot be mapped by the host backend")
        size = os.fstat(fd).st_size
        if size < spec.size:
            raise ValueError(f"arena fd holds {size} bytes, manifest says {spec.size}")
        if writable or on_device is not None:
            raise ValueError("host arenas map read-only in host memory: drop writable= and on_device=")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_WRITE:
            log.warning("host arena is not sealed; mapping it read-only anyway")
        return HostArena(os.dup(fd), spec, writable=False)
