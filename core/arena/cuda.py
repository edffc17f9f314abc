"""CUDA arenas: VMM allocations that cross processes as POSIX file descriptors.

The creator allocates pinned device memory with ``cuMemCreate`` (exportable as
a POSIX fd), maps it at an address of its own (``cuMemAddressReserve``,
``cuMemMap``, ``cuMemSetAccess``) and hands out fds made by
``cuMemExportToShareableHandle``.  An importer turns an fd into a handle of its
own with ``cuMemImportFromShareableHandle`` and maps that.  The driver frees the
memory once no process holds an fd, a handle or a mapping of it, so the memory
outlives any one process, the creator included.

Views from :meth:`CudaArena.bytes_view` point into the mapping without owning
it: drop every view before :meth:`CudaArena.close`, which unmaps at once.
torch, numpy (through ``__cuda_array_interface__``) and cuda-bindings are
imported on first use, never at import time.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import typing

from weightcache.core import device as devices
from weightcache.core.arena.base import Arena, ArenaBackend, ArenaSpec, round_up
from weightcache.core.cuda_driver import check, driver
from weightcache.core.errors import ArenaClosed, ArenaError, BackendUnavailable, CudaError

if typing.TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_contexts: dict[int, tuple[typing.Any, typing.Any]] = {}  # torch index -> (primary CUcontext, CUdevice)
_granularities: dict[int, int] = {}


def unavailable_reason() -> str | None:
    """Why the cuda backend cannot run in this process, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        import numpy  # noqa: F401  (torch reads __cuda_array_interface__ through numpy)
    except ImportError:
        return "numpy is not installed (torch needs it to wrap device pointers)"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError as exc:
        return f"cuda-bindings is not importable ({exc})"
    return None


class CudaArena(Arena):
    """One VMM allocation mapped in this process, created here or imported from an fd.

    ``writable`` is False only where the driver granted a read-only mapping;
    ``sealed`` is set by :meth:`CudaArenaBackend.seal`.
    """

    def __init__(self, spec: ArenaSpec, index: int, handle, ptr, *, writable: bool, fd: int | None = None):
        self.spec = spec
        self.device_index = index
        self.writable = writable
        self.sealed = False
        self._handle = handle
        self._ptr = ptr
        self._fd = fd  # an imported arena keeps its own dup of the fd it came from
        self._pointer = _DevicePointer(int(ptr), spec.size)
        self._view: torch.Tensor | None = None
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("rw" if self.writable else "ro")
        return f"<CudaArena {self.spec.size} B on {self.spec.device} (cuda:{self.device_index}) {state}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def address(self) -> int:
        """The device address of the mapping in this process."""
        self._check_open()
        return int(self._ptr)

    def bytes_view(self) -> torch.Tensor:
        """A uint8 CUDA tensor over the whole mapping (no copy; does not keep the mapping alive)."""
        self._check_open()
        if self._view is None:
            import torch

            view = torch.as_tensor(self._pointer, device=torch.device("cuda", self.device_index))
            if view.data_ptr() != int(self._ptr) or view.numel() != self.spec.size:
                raise ArenaError(
                    f"torch copied {self!r} instead of viewing it (pointer seen on {view.device}); "
                    "report this with the torch and driver versions"
                )
            self._view = view
        return self._view

    def export_fd(self) -> int:
        """A new fd for this arena (close-on-exec); the caller owns it and must close it."""
        self._check_open()
        if self._fd is not None:
            return os.dup(self._fd)
        posix_fd = driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with _on_device(self.device_index) as (cu, _):
            fd = int(check(cu.cuMemExportToShareableHandle(self._handle, posix_fd, 0), "cuMemExportToShareableHandle"))
        os.set_inheritable(fd, False)
        return fd

    def take_memory_of(self, other: Arena) -> None:
        """Map ``other``'s allocation (a CUDA arena of the same size on the same GPU) under this arena's reserved range.

        ``cuMemUnmap`` of this arena's range, ``cuMemMap`` of a handle of ``other``'s memory there, ``cuMemSetAccess``
        as before: pointers, CUDA graphs and compiled kernels keep their addresses and read ``other``'s bytes. The GPU
        is synchronised first. Where the new mapping fails, the old memory is mapped back and CudaError raised.
        """
        other = _own(other)
        self._check_open()
        if other.spec.size != self.spec.size or other.device_index != self.device_index:
            raise ArenaError(f"{other!r} cannot replace {self!r}: the two differ in size or device")
        size, ptr = self.spec.size, self._ptr
        posix_fd = driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        own = other.export_fd()
        try:
            with _on_device(self.device_index) as (cu, dev):
                handle = check(cu.cuMemImportFromShareableHandle(own, posix_fd), "cuMemImportFromShareableHandle")
                try:
                    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
                    check(cu.cuMemUnmap(ptr, size), "cuMemUnmap")
                    try:
                        check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
                        _set_access(cu, dev, ptr, size, writable=self.writable)
                    except BaseException:
                        cu.cuMemUnmap(ptr, size)
                        cu.cuMemMap(ptr, size, 0, self._handle, 0)  # the old memory back under the same addresses
                        _set_access(cu, dev, ptr, size, writable=self.writable)
                        raise
                except BaseException:
                    cu.cuMemRelease(handle)
                    raise
                check(cu.cuMemRelease(self._handle), "cuMemRelease")
        except BaseException:
            os.close(own)
            raise
        self._handle = handle
        if self._fd is not None:
            os.close(self._fd)
        self._fd = own
        self.spec = other.spec

    def close(self) -> None:
        """Wait for the GPU, unmap, free the address range and release this process's handle and fd.

        Idempotent.  Every tensor viewing the arena must be dropped first: a
        kernel that touches one afterwards faults and poisons the CUDA context.
        """
        if self._closed:
            return
        self._closed = True
        self._view = None
        self._warn_if_viewed()
        errors: list[CudaError] = []
        try:
            with _on_device(self.device_index) as (cu, _):
                size = self.spec.size
                for call, args in (
                    ("cuCtxSynchronize", ()),
                    ("cuMemUnmap", (self._ptr, size)),
                    ("cuMemAddressFree", (self._ptr, size)),
                    ("cuMemRelease", (self._handle,)),
                ):
                    try:
                        check(getattr(cu, call)(*args), call)
                    except CudaError as exc:
                        errors.append(exc)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if errors:
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaClosed(f"{self!r} is closed in this process; map it again from an fd")

    def _warn_if_viewed(self) -> None:
        # Each torch storage made from the pointer object holds one reference to it.
        if sys.getrefcount(self._pointer) > 2:
            gc.collect()
        views = sys.getrefcount(self._pointer) - 2
        if views > 0:
            log.warning(
                "closing %r while %d tensor storage(s) still view it; using them now faults the CUDA context",
                self,
                views,
            )


class CudaArenaBackend(ArenaBackend):
    """Arenas in GPU memory, shared as POSIX fds through the CUDA VMM API."""

    name = "cuda"

    def granularity(self, device: str) -> int:
        """The driver's recommended VMM granularity on ``device`` (a UUID, ``cuda`` or ``cuda:N``)."""
        return _granularity(devices.cuda_index(device))

    def create(self, size: int, device: str = "cuda") -> CudaArena:
        """A new writable arena of ``size`` bytes rounded up to the granularity.

        ``device`` is a GPU UUID, ``cuda`` or ``cuda:N``; the spec names the GPU by UUID.
        """
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        index = devices.cuda_index(device)
        size = round_up(size, _granularity(index))
        spec = ArenaSpec(backend=self.name, size=size, device=devices.gpu_uuid(index))
        with _on_device(index) as (cu, dev):
            handle = check(cu.cuMemCreate(size, _allocation_prop(cu, dev), 0), "cuMemCreate")
            try:
                ptr, _ = _map_handle(cu, dev, handle, size, writable=True)
            except BaseException:
                cu.cuMemRelease(handle)
                raise
        log.debug("created CUDA arena of %d bytes on %s (cuda:%d)", size, spec.device, index)
        return CudaArena(spec, index, handle, ptr, writable=True)

    def seal(self, arena: Arena) -> None:
        """Wait until every write to ``arena`` on its GPU has finished.

        CUDA cannot make the creator's mapping read-only for other processes;
        importers ask for a read-only mapping in :meth:`map` instead.
        """
        arena = _own(arena)
        with _on_device(arena.device_index) as (cu, _):
            check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        arena.sealed = True

    def map(self, fd: int, spec: ArenaSpec, *, writable: bool = False, on_device: int | None = None) -> CudaArena:
        """Import and map the arena behind ``fd`` on the GPU ``spec.device`` names.

        ``fd`` is duplicated; the caller keeps and closes its own.  Unless
        ``writable``, the mapping is asked to be read-only; where the driver
        refuses that, it is read-write (``arena.writable`` says which).
        With ``on_device``, another GPU's index, the memory stays where it is
        and is mapped for ``on_device`` over peer access (its views are
        ``cuda:on_device`` tensors, reading the owner's memory): what a peer
        fill copies from. ArenaError when the two GPUs have no peer access.
        """
        if spec.backend != self.name:
            raise ArenaError(f"{spec} belongs to the {spec.backend!r} backend; map it with that backend")
        owner = devices.cuda_index(spec.device)
        index = owner if on_device is None else on_device
        if index != owner:
            _check_peer_access(index, owner)
        granularity = _granularity(owner, via=index)
        if spec.size % granularity:
            raise ArenaError(f"{spec}: size is not a multiple of {granularity} bytes on this GPU; the spec is corrupt")
        posix_fd = driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        own = os.dup(fd)
        try:
            with _on_device(index) as (cu, dev):
                handle = check(cu.cuMemImportFromShareableHandle(own, posix_fd), "cuMemImportFromShareableHandle")
                try:
                    _check_location(cu, handle, check(cu.cuDeviceGet(owner), "cuDeviceGet"), spec)
                    ptr, granted = _map_handle(cu, dev, handle, spec.size, writable=writable)
                except BaseException:
                    cu.cuMemRelease(handle)
                    raise
        except BaseException:
            os.close(own)
            raise
        log.debug(
            "mapped CUDA arena of %d bytes on %s (cuda:%d, %s)",
            spec.size,
            spec.device,
            index,
            "rw" if granted else "ro",
        )
        return CudaArena(spec, index, handle, ptr, writable=granted, fd=own)


class _DevicePointer:
    """A device byte range as ``__cuda_array_interface__``, for ``torch.as_tensor``."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def _own(arena: Arena) -> CudaArena:
    if not isinstance(arena, CudaArena):
        raise ArenaError(f"{arena!r} is not a CUDA arena; seal it with its own backend")
    arena._check_open()
    return arena


@contextlib.contextmanager
def _on_device(index: int):
    """Make device ``index``'s primary context current on this thread; yields (driver module, CUdevice)."""
    context, device = _primary_context(index)
    cu = driver()
    check(cu.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        yield cu, device
    finally:
        err, _ = cu.cuCtxPopCurrent()
        if int(err) != 0:
            log.error("cuCtxPopCurrent failed with %s", getattr(err, "name", err))


def _primary_context(index: int):
    """The (context, device) pair of device ``index``, after torch has initialised CUDA on it."""
    with _lock:
        found = _contexts.get(index)
        if found is None:
            import torch

            if not torch.cuda.is_available():
                raise BackendUnavailable("cuda", f"torch {torch.__version__} sees no CUDA device")
            cu = driver()
            torch.empty(1, device=torch.device("cuda", index))  # torch creates the primary context here
            check(cu.cuInit(0), "cuInit")
            device = check(cu.cuDeviceGet(index), "cuDeviceGet")
            context = check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")  # kept for the process
            found = _contexts[index] = (context, device)
        return found


def can_access_peer(index: int, peer: int) -> bool:
    """Whether GPU ``index`` can read GPU ``peer``'s memory directly (NVLink or PCIe peer-to-peer)."""
    import torch

    return index == peer or torch.cuda.can_device_access_peer(index, peer)


def _check_peer_access(index: int, owner: int) -> None:
    if not can_access_peer(index, owner):
        raise ArenaError(f"cuda:{index} has no peer access to cuda:{owner}, whose memory the arena holds")


def _granularity(index: int, *, via: int | None = None) -> int:
    """Device ``index``'s VMM granularity, asked in ``via``'s context (default its own).

    A peer mapping asks in the mapping GPU's context, so that it creates no
    context (hundreds of MiB) on the GPU that owns the memory.
    """
    found = _granularities.get(index)
    if found is None:
        with _on_device(index if via is None else via) as (cu, _):
            device = check(cu.cuDeviceGet(index), "cuDeviceGet")
            recommended = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            found = int(
                check(
                    cu.cuMemGetAllocationGranularity(_allocation_prop(cu, device), recommended),
                    "cuMemGetAllocationGranularity",
                )
            )
        _granularities[index] = found
    return found


def _allocation_prop(cu, device):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device)
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _check_location(cu, handle, device, spec: ArenaSpec) -> None:
    prop = check(cu.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
    if int(prop.location.id) != int(device):
        raise ArenaError(
            f"the fd holds memory of CUDA device {int(prop.location.id)}, but {spec} names device {int(device)} "
            "here; the fd and the spec do not belong together"
        )


def _map_handle(cu, device, handle, size: int, *, writable: bool) -> tuple[typing.Any, bool]:
    """Reserve an address range, map ``handle`` there and grant access; returns (pointer, writable)."""
    ptr = check(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    try:
        check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
        try:
            granted = _set_access(cu, device, ptr, size, writable=writable)
        except BaseException:
            cu.cuMemUnmap(ptr, size)
            raise
    except BaseException:
        cu.cuMemAddressFree(ptr, size)
        raise
    return ptr, granted


def _set_access(cu, device, ptr, size: int, *, writable: bool) -> bool:
    flags = cu.CUmemAccess_flags
    if not writable:
        try:
            check(
                cu.cuMemSetAccess(ptr, size, [_access(cu, device, flags.CU_MEM_ACCESS_FLAGS_PROT_READ)], 1),
                "cuMemSetAccess(PROT_READ)",
            )
            return False
        except CudaError as exc:
            log.debug("driver refused a read-only mapping (%s); mapping read-write", exc.result)
    check(
        cu.cuMemSetAccess(ptr, size, [_access(cu, device, flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)], 1),
        "cuMemSetAccess",
    )
    return True


def _access(cu, device, flags):
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = int(device)
    desc.flags = flags
    return desc
