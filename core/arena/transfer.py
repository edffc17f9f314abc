"""Copies between host arenas and GPU memory at DMA speed, through small page-locked bounce buffers.

Copying from pageable memory runs at a fraction of the link's speed, and
page-locking a host arena in place (``cuMemHostRegister``) runs at ~10 GB/s on an
H200 host whatever the number of threads: 16 GiB took 1.6 s. So the bytes go
through a few page-locked buffers instead: ``WORKERS`` threads each take every
``WORKERS``-th chunk, copy it with the CPU between the host arena and their own
buffer (``memmove``, the GIL released) and let the DMA engine move it between
that buffer and the GPU on their own stream. CPU copies of many chunks and DMA
copies overlap; nothing but the buffers is ever locked, and the host arena
itself (sealed, read-only) is only read or, for a new host-tier copy, written.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import time
import typing

import attrs

from weightcache.core.errors import ArenaError

if typing.TYPE_CHECKING:
    import torch

CHUNK_BYTES = 64 << 20
"""Bytes per bounce buffer and per copy: large enough for full-speed DMA, small enough to overlap."""
WORKERS = 16
"""Threads, each with its own page-locked buffer and stream (``WORKERS * CHUNK_BYTES`` locked in all: 1 GiB)."""


@attrs.frozen
class Pair:
    """One copy: ``host`` (a uint8 CPU tensor over a host arena) and ``device`` (a uint8 CUDA tensor), same length."""

    host: typing.Any = attrs.field(repr=False)
    device: typing.Any = attrs.field(repr=False)


@attrs.frozen
class Transfer:
    """What a transfer did: bytes moved and seconds taken."""

    nbytes: int = 0
    copy_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0


def host_to_device(pairs: typing.Sequence[Pair], chunk_bytes: int = CHUNK_BYTES, workers: int = WORKERS) -> Transfer:
    """Copy each pair's host bytes (read-only is fine) into its device bytes; returns after the copies finished."""
    return _copy(pairs, to_device=True, chunk_bytes=chunk_bytes, workers=workers)


def device_to_host(pairs: typing.Sequence[Pair], chunk_bytes: int = CHUNK_BYTES, workers: int = WORKERS) -> Transfer:
    """Copy each pair's device bytes into its (writable) host bytes; returns after the copies finished."""
    return _copy(pairs, to_device=False, chunk_bytes=chunk_bytes, workers=workers)


def _copy(pairs: typing.Sequence[Pair], to_device: bool, chunk_bytes: int, workers: int) -> Transfer:
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
    workers = max(1, min(workers, len(chunks)))
    start = time.perf_counter()
    with torch.cuda.device(device):
        lanes = [
            _Lane(torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True), torch.cuda.Stream(device)) for _ in range(workers)
        ]
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="weightcache-copy") as pool:
            done = [pool.submit(lane.run, chunks[index::workers], to_device, device) for index, lane in enumerate(lanes)]
            for future in done:
                future.result()
    return Transfer(sum(host.numel() for host, _ in chunks), time.perf_counter() - start)


@attrs.define
class _Lane:
    """One worker's page-locked buffer and stream."""

    buffer: typing.Any
    stream: typing.Any

    def run(self, chunks: list, to_device: bool, device: "torch.device") -> None:
        import torch

        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            for host, target in chunks:
                size = host.numel()
                staged = self.buffer[:size]
                if to_device:
                    self.stream.synchronize()  # the buffer's previous chunk has left it
                    ctypes.memmove(staged.data_ptr(), host.data_ptr(), size)
                    target.copy_(staged, non_blocking=True)
                else:
                    staged.copy_(target, non_blocking=True)
                    self.stream.synchronize()
                    ctypes.memmove(host.data_ptr(), staged.data_ptr(), size)
            self.stream.synchronize()
