"""Where a read places the bytes it staged: host arenas (``HostTarget``) or a GPU's (``GpuTarget``), behind one
interface (``ReadTarget``) every read strategy of ``reader`` calls."""

from __future__ import annotations

import logging
import threading
import types
import typing

from weightcache.core.fileio import DIRECT_ALIGN as ALIGN
from weightcache.core.fileio import DirectBuffer, huge_staging_wanted
from weightcache.core.identity.digests import PIECE_BYTES
from weightcache.core.load.export import ArenaBuilder
from weightcache.core.load.read_pieces import CHUNK_BYTES, Copy

if typing.TYPE_CHECKING:
    import numpy
    import torch

log = logging.getLogger(__name__)


class ReadTarget(typing.Protocol):
    """The arenas a read fills: a staging buffer per thread (``staging``, ``place``), whole-piece buffers
    (``piece_buffer``, ``place_from``, ``wait``), page-locking the reader process's slots (``pin``, ``unpin``), and
    ``finish`` once every copy is queued."""

    huge_staging: bool

    def staging(self) -> "numpy.ndarray": ...

    def place(self, staging: "numpy.ndarray", copies: list[Copy]) -> None: ...

    def piece_buffer(self) -> "torch.Tensor": ...

    def place_from(self, buffer: "torch.Tensor", copies: list[Copy]) -> "torch.cuda.Event | None": ...

    def pin(self, buffers: list) -> list[int]: ...

    def unpin(self, pinned: list[int]) -> None: ...

    def wait(self, done: "torch.cuda.Event | None") -> None: ...

    def finish(self) -> None: ...


def target_for(builder: ArenaBuilder) -> ReadTarget:
    """The target that fills ``builder``'s arenas: a GPU's or the host's."""
    return GpuTarget(builder) if builder.device.is_cuda else HostTarget(builder)


class HostTarget:
    """Each thread reads into its own staging buffer and copies the tensor bytes into host arenas."""

    def __init__(self, builder: ArenaBuilder):
        import numpy

        self.builder = builder
        self.local = threading.local()
        self.numpy = numpy
        self.huge_staging = huge_staging_wanted()  # decided once per read, for every buffer it makes

    def staging(self) -> "numpy.ndarray":
        """This thread's ``CHUNK_BYTES`` staging buffer, ``ALIGN``-aligned (O_DIRECT reads into it)."""
        buffer = getattr(self.local, "buffer", None)
        if buffer is None:
            buffer = self.local.buffer = host_buffer(CHUNK_BYTES, self.huge_staging).numpy()
        return buffer

    def place(self, staging: "numpy.ndarray", copies: list[Copy]) -> None:
        for copy in copies:
            target = self.builder.view(copy.slot)[copy.offset : copy.offset + copy.nbytes].numpy()
            target[:] = staging[copy.source : copy.source + copy.nbytes]

    def piece_buffer(self) -> "torch.Tensor":
        """A tensor of ``PIECE_BYTES`` at an ``ALIGN``-aligned address (O_DIRECT reads into it)."""
        return host_buffer(PIECE_BYTES, self.huge_staging)

    def place_from(self, buffer: "torch.Tensor", copies: list[Copy]) -> None:
        self.place(buffer.numpy(), copies)

    def pin(self, buffers: list) -> list[int]:
        return []  # host copies need no page-locked source

    def unpin(self, pinned: list[int]) -> None:
        pass

    def wait(self, done: "torch.cuda.Event | None") -> None:
        pass

    def finish(self) -> None:
        pass


def host_buffer(nbytes: int, huge: bool) -> "torch.Tensor":
    """A uint8 tensor of ``nbytes`` for O_DIRECT reads: in huge pages where ``huge`` (a virtio disk takes reads into
    them at twice the speed; ``fileio.DirectBuffer``), else malloc's memory at an ``ALIGN``-aligned address. The tensor
    keeps its memory alive."""
    import torch

    if huge:
        return torch.frombuffer(DirectBuffer(nbytes).view, dtype=torch.uint8)
    return aligned(torch.empty(nbytes + ALIGN, dtype=torch.uint8), nbytes)


def aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of the 1-D uint8 tensor ``raw`` that start at an ``ALIGN``-aligned address."""
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


class GpuTarget:
    """Each thread turns between its own two pinned buffers: one is read and hashed while the other's DMA runs."""

    def __init__(self, builder: ArenaBuilder):
        import torch

        self.builder = builder
        self.device = builder.device.torch()  # no arena made here: the read makes them beside its first reads
        self.local = threading.local()
        self.streams: list = []
        self.lock = threading.Lock()
        self.torch = torch
        self.huge_staging = False  # its buffers are cudaHostAlloc's page-locked memory, contiguous already

    def _stream(self):
        """This thread's own copy stream."""
        stream = getattr(self.local, "stream", None)
        if stream is None:
            stream = self.local.stream = self.torch.cuda.Stream(device=self.device)
            with self.lock:
                self.streams.append(stream)
        return stream

    def _state(self):
        state = getattr(self.local, "state", None)
        if state is None:
            torch = self.torch
            state = self.local.state = types.SimpleNamespace(
                buffers=[
                    aligned(torch.empty(CHUNK_BYTES + ALIGN, dtype=torch.uint8, pin_memory=True), CHUNK_BYTES) for _ in range(2)
                ],
                stream=self._stream(),
                events=[None, None],
                turn=0,
            )
        return state

    def staging(self) -> "numpy.ndarray":
        """The next of this thread's two pinned ``CHUNK_BYTES`` buffers (``ALIGN``-aligned), once its copies are done."""
        state = self._state()
        state.turn = 1 - state.turn
        if state.events[state.turn] is not None:
            state.events[state.turn].synchronize()  # the copies out of this buffer have finished
        return state.buffers[state.turn].numpy()

    def place(self, staging: "numpy.ndarray", copies: list[Copy]) -> None:
        torch = self.torch
        state = self._state()
        source = state.buffers[state.turn]
        # A worker thread's current device is cuda:0: without the guard, a copy to another GPU makes a context there.
        with torch.cuda.device(self.device), torch.cuda.stream(state.stream):
            for copy in copies:
                target = self.builder.view(copy.slot)[copy.offset : copy.offset + copy.nbytes]
                target.copy_(source[copy.source : copy.source + copy.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(state.stream)
        state.events[state.turn] = event  # hashing reads the buffer while the DMA does: neither writes it

    def piece_buffer(self) -> "torch.Tensor":
        """A pinned tensor of ``PIECE_BYTES`` at an ``ALIGN``-aligned address (O_DIRECT reads into it)."""
        return aligned(self.torch.empty(PIECE_BYTES + ALIGN, dtype=self.torch.uint8, pin_memory=True), PIECE_BYTES)

    def place_from(self, buffer: "torch.Tensor", copies: list[Copy]) -> "torch.cuda.Event":
        """Queue the copies out of ``buffer`` on this thread's stream; the event that marks them done."""
        torch = self.torch
        stream = self._stream()
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for copy in copies:
                target = self.builder.view(copy.slot)[copy.offset : copy.offset + copy.nbytes]
                target.copy_(buffer[copy.source : copy.source + copy.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def pin(self, buffers: list) -> list[int]:
        """Page-lock ``buffers`` (the reader process's shared slots) for full-speed DMA; the addresses locked. A buffer
        the driver will not lock stays pageable: its copies are correct, only slower."""
        cudart = self.torch.cuda.cudart()
        pinned = []
        for buffer in buffers:
            if int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) == 0:
                pinned.append(buffer.data_ptr())
            else:
                log.info("could not page-lock a staging slot of the reader process; its copies run pageable")
        return pinned

    def unpin(self, pinned: list[int]) -> None:
        if not pinned:
            return
        self.finish()  # no copy may still read a slot
        cudart = self.torch.cuda.cudart()
        for address in pinned:
            cudart.cudaHostUnregister(address)

    def wait(self, done: "torch.cuda.Event | None") -> None:
        if done is not None:
            done.synchronize()  # the buffer may be read into again

    def finish(self) -> None:
        for stream in self.streams:
            stream.synchronize()
