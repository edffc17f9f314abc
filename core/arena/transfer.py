"""Copies between host arenas and GPU memory at DMA speed, through small page-locked bounce buffers.

Copying from pageable memory runs at a fraction of the link's speed, and
page-locking a host arena in place (``cuMemHostRegister``) is slow and does not scale
with threads. So the bytes go
through a few page-locked buffers instead: ``WORKERS`` threads each take every
``WORKERS``-th chunk, move it between the host arena's memfd and their own
buffer with ``preadv``/``pwritev`` (the GIL released) and let the DMA engine move
it between that buffer and the GPU on their own stream. CPU copies of many
chunks and DMA copies overlap; nothing but the buffers is ever locked.

The memfd is read and written as a file, never mapped: mapping 16 GiB and copying
through the mapping faults in four million pages, and unmapping them costs as much
again; a new host copy's pages are allocated by the writes themselves.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import typing

import attrs

from weightcache.core.errors import ArenaError
from weightcache.core.fileio import read_fully, write_fully

if typing.TYPE_CHECKING:
    import torch

CHUNK_BYTES = 64 << 20
"""Bytes per bounce buffer and per copy: large enough for full-speed DMA, small enough to overlap."""
WORKERS = 16
"""Threads, each with its own page-locked buffer and stream (``WORKERS * CHUNK_BYTES`` locked in all: 1 GiB)."""


@attrs.frozen
class Pair:
    """One copy: ``host_fd`` (a host arena's memfd, from offset 0) and ``device`` (a uint8 CUDA tensor) of its length."""

    host_fd: int
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
    """Copy each pair's host bytes (a sealed memfd is fine) into its device bytes; returns after the copies finished."""
    return _copy(pairs, to_device=True, chunk_bytes=chunk_bytes, workers=workers)


def device_to_host(pairs: typing.Sequence[Pair], chunk_bytes: int = CHUNK_BYTES, workers: int = WORKERS) -> Transfer:
    """Copy each pair's device bytes into its host memfd (not yet sealed); returns after the copies finished."""
    return _copy(pairs, to_device=False, chunk_bytes=chunk_bytes, workers=workers)


def _copy(pairs: typing.Sequence[Pair], to_device: bool, chunk_bytes: int, workers: int) -> Transfer:
    import torch

    if not pairs:
        return Transfer()
    device = pairs[0].device.device
    for pair in pairs:
        flat_bytes = pair.device.is_cuda and pair.device.dtype == torch.uint8 and pair.device.dim() == 1
        if not flat_bytes or pair.device.device != device:
            raise ArenaError("every pair's device bytes must be one flat uint8 CUDA tensor, all on one GPU")
        if os.fstat(pair.host_fd).st_size < pair.device.numel():  # a write past its end would grow the memfd
            raise ArenaError(f"a host arena holds fewer bytes than the {pair.device.numel()} to copy")
    chunks = [
        _Chunk(pair.host_fd, start, pair.device[start : start + chunk_bytes])
        for pair in pairs
        for start in range(0, pair.device.numel(), chunk_bytes)
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
                try:
                    future.result()
                except EOFError as exc:
                    raise ArenaError(f"{exc}; publish the host copy again") from None
    return Transfer(sum(chunk.device.numel() for chunk in chunks), time.perf_counter() - start)


@attrs.frozen
class _Chunk:
    """At most one bounce buffer's bytes: ``device`` and the same bytes at ``offset`` in the memfd ``fd``."""

    fd: int
    offset: int
    device: typing.Any = attrs.field(repr=False)


@attrs.define
class _Lane:
    """One worker's page-locked buffer and stream."""

    buffer: typing.Any
    stream: typing.Any

    def run(self, chunks: list[_Chunk], to_device: bool, device: "torch.device") -> None:
        import torch

        memory = memoryview(self.buffer.numpy())
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            for chunk in chunks:
                size = chunk.device.numel()
                staged = self.buffer[:size]
                if to_device:
                    self.stream.synchronize()  # the buffer's previous chunk has left it
                    read_fully(chunk.fd, memory[:size], chunk.offset, "a host arena")
                    chunk.device.copy_(staged, non_blocking=True)
                else:
                    staged.copy_(chunk.device, non_blocking=True)
                    self.stream.synchronize()
                    write_fully(chunk.fd, memory[:size], chunk.offset)
            self.stream.synchronize()
