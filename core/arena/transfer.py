"""Copies between host arenas and GPU memory at DMA speed: page-lock in chunks, copy each chunk as soon as it is locked.

Copying from pageable memory runs at a fraction of the link's speed; registering
(page-locking) the whole range first costs about as long as the copy itself. So a
few registrar threads lock chunk after chunk (``cudaHostRegister``; read-only for a
sealed source) while the caller's thread queues each locked chunk's copy on a
stream of its own: locking and copying overlap. After the last copy the chunks
are unlocked (``unlock``): a sealed memfd cannot be sealed, and should not be
unmapped, while pages are locked.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
import typing

import attrs

from weightcache.core.arena.cuda import _on_device
from weightcache.core.errors import ArenaError

if typing.TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20
"""Bytes locked and copied at a time: small enough to overlap well, large enough for full-speed copies."""
LOCKERS = 8
"""Threads page-locking chunks at once: locking one thread's worth runs at ~13 GB/s on an H200 host, the copy at ~55."""
_REGISTER_DEFAULT = 0
_REGISTER_READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY: a sealed memfd is mapped read-only


@attrs.frozen
class Pair:
    """One copy: ``host`` (a uint8 CPU tensor over a host arena) and ``device`` (a uint8 CUDA tensor), same length."""

    host: typing.Any = attrs.field(repr=False)
    device: typing.Any = attrs.field(repr=False)


@attrs.define
class Transfer:
    """What a transfer did: bytes, seconds of lock + copy (overlapped), whether every page was locked."""

    nbytes: int = 0
    copy_s: float = 0.0
    locked: bool = True
    _registered: list = attrs.field(factory=list, repr=False)  # host addresses to unlock
    _device_index: int = 0

    def unlock(self) -> float:
        """Unlock every chunk this transfer locked; returns the seconds it took (idempotent)."""
        start = time.perf_counter()
        if self._registered:
            with _on_device(self._device_index) as (cu, _):
                for address in self._registered:
                    result = cu.cuMemHostUnregister(address)[0]
                    if int(result):
                        log.warning("cuMemHostUnregister(%#x) failed: %s", address, getattr(result, "name", result))
        self._registered = []
        return time.perf_counter() - start


def host_to_device(pairs: typing.Sequence[Pair], chunk_bytes: int = CHUNK_BYTES) -> Transfer:
    """Copy each pair's host bytes (read-only is fine) into its device bytes; returns after the copies finished.

    Call ``unlock()`` on the result before the host memory is unmapped.
    """
    return _copy(pairs, to_device=True, chunk_bytes=chunk_bytes)


def device_to_host(pairs: typing.Sequence[Pair], chunk_bytes: int = CHUNK_BYTES) -> Transfer:
    """Copy each pair's device bytes into its (writable) host bytes; returns after the copies finished.

    Call ``unlock()`` on the result before the host arena is sealed.
    """
    return _copy(pairs, to_device=False, chunk_bytes=chunk_bytes)


def _copy(pairs: typing.Sequence[Pair], to_device: bool, chunk_bytes: int) -> Transfer:
    import torch

    if not pairs:
        return Transfer()
    device = pairs[0].device.device
    for pair in pairs:
        if pair.host.numel() != pair.device.numel() or pair.device.device != device or pair.host.device.type != "cpu":
            raise ArenaError("every pair must be a CPU and a CUDA byte tensor of one length, all on one GPU")
    chunks = [
        (pair.host[start : start + chunk_bytes], pair.device[start : start + chunk_bytes])
        for pair in pairs
        for start in range(0, pair.host.numel(), chunk_bytes)
    ]
    index = device.index if device.index is not None else torch.cuda.current_device()
    flags = _REGISTER_READ_ONLY if to_device else _REGISTER_DEFAULT
    transfer = Transfer(nbytes=sum(host.numel() for host, _ in chunks), device_index=index)
    start = time.perf_counter()
    stream = torch.cuda.Stream(device)
    with concurrent.futures.ThreadPoolExecutor(LOCKERS, thread_name_prefix="weightcache-lock") as registrar:
        locks = [registrar.submit(_lock, host, flags, index) for host, _ in chunks]
        try:
            with torch.cuda.stream(stream):
                for (host, target), lock in zip(chunks, locks, strict=True):
                    locked = lock.result()
                    transfer.locked &= locked
                    if to_device:
                        target.copy_(host, non_blocking=locked)
                    else:
                        host.copy_(target, non_blocking=locked)
            stream.synchronize()
        finally:
            for lock in locks:
                lock.cancel()
            concurrent.futures.wait(locks)
            transfer._registered = [host.data_ptr() for (host, _), lock in zip(chunks, locks, strict=True) if _locked(lock)]
            if sys.exc_info()[0] is not None:
                stream.synchronize()
                transfer.unlock()
    transfer.copy_s = time.perf_counter() - start
    if not transfer.locked:
        log.warning("could not page-lock host memory for a copy; copied from pageable memory (slower)")
    return transfer


def _lock(host: "torch.Tensor", flags: int, index: int) -> bool:
    """Page-lock ``host``'s bytes for DMA (the driver API: no error state is left behind); False where refused."""
    with _on_device(index) as (cu, _):
        result = cu.cuMemHostRegister(host.data_ptr(), host.numel(), flags)[0]
    if int(result):
        log.debug("cuMemHostRegister of %d bytes failed: %s", host.numel(), getattr(result, "name", result))
        return False
    return True


def _locked(lock: concurrent.futures.Future) -> bool:
    return lock.done() and not lock.cancelled() and lock.exception() is None and bool(lock.result())
