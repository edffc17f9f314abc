"""Reading safetensors bytes straight into arenas: parallel preads, pinned staging for GPUs."""

from __future__ import annotations

import concurrent.futures
import os
import threading

import attrs

from weightcache.core.export import ArenaBuilder, Slot
from weightcache.core.fileio import read_fully
from weightcache.core.safetensors_io import TensorInfo, checkpoint_tensors

PIECE_BYTES = 64 << 20
DEFAULT_THREADS = min(8, (os.cpu_count() or 2) * 2)


@attrs.frozen
class Piece:
    """One read: ``nbytes`` from ``file`` at ``start`` into ``slot`` at ``offset``."""

    file: str
    start: int
    slot: Slot
    offset: int
    nbytes: int


def read_checkpoint(
    path: str | os.PathLike, builder: ArenaBuilder, threads: int = DEFAULT_THREADS
) -> dict[str, tuple[TensorInfo, Slot]]:
    """Plan a slot for every tensor of the checkpoint at ``path`` and read its bytes into it.

    Returns ``name -> (info, slot)``; the bytes are the file's, unconverted.
    """
    infos = checkpoint_tensors(path)
    placed = {info.name: (info, builder.plan(info.nbytes)) for info in infos}
    pieces = [
        Piece(str(info.file), info.start + done, slot, done, min(PIECE_BYTES, info.nbytes - done))
        for info, slot in placed.values()
        for done in range(0, info.nbytes, PIECE_BYTES)
    ]
    for _, slot in placed.values():
        builder.view(slot)  # create every arena up front, on this thread
    files = {name: os.open(name, os.O_RDONLY | os.O_CLOEXEC) for name in {p.file for p in pieces}}
    try:
        reader = _GpuReader(builder) if builder.device.is_cuda else _HostReader(builder)
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightcache-read") as pool:
            for done in pool.map(lambda piece: reader.read(piece, files[piece.file]), pieces):
                builder.progress.update(done)
        reader.finish()
    finally:
        for fd in files.values():
            os.close(fd)
    return placed


class _HostReader:
    def __init__(self, builder: ArenaBuilder):
        self.builder = builder

    def read(self, piece: Piece, fd: int) -> int:
        target = self.builder.view(piece.slot)[piece.offset : piece.offset + piece.nbytes]
        read_fully(fd, target.numpy(), piece.start, "checkpoint file")
        return piece.nbytes

    def finish(self) -> None:
        pass


class _GpuReader:
    """Each thread reads into its own pinned buffers and copies them to the GPU on its own stream."""

    def __init__(self, builder: ArenaBuilder):
        import torch

        self.builder = builder
        self.device = builder.view(Slot(0, 0, 0)).device
        self.local = threading.local()
        self.streams: list = []
        self.torch = torch

    def _state(self):
        state = getattr(self.local, "state", None)
        if state is None:
            torch = self.torch
            buffers = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            stream = torch.cuda.Stream(device=self.device)
            events = [None, None]
            state = self.local.state = [buffers, stream, events, 0]
            self.streams.append(stream)
        return state

    def read(self, piece: Piece, fd: int) -> int:
        torch = self.torch
        buffers, stream, events, turn = state = self._state()
        if events[turn] is not None:
            events[turn].synchronize()  # the copy out of this buffer has finished
        staging = buffers[turn][: piece.nbytes]
        read_fully(fd, staging.numpy(), piece.start, "checkpoint file")
        target = self.builder.view(piece.slot)[piece.offset : piece.offset + piece.nbytes]
        # A worker thread's current device is cuda:0: without the guard, a copy to another GPU makes a context there.
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            target.copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        events[turn] = event
        state[3] = 1 - turn
        return piece.nbytes

    def finish(self) -> None:
        for stream in self.streams:
            stream.synchronize()
