"""Where a block read's blocks are read (``reader``'s block strategies): on threads of this process from one queue
(``ThreadFeed``), or in the reader process into its shared slots (``ProcessFeed``); both behind ``Feed``."""

from __future__ import annotations

import queue
import threading
import typing

from weightcache.core.errors import CheckpointChanged, ReaderFailed
from weightcache.core.fileio import read_block
from weightcache.core.load import read_process
from weightcache.core.load.read_pieces import Changed, Piece
from weightcache.core.load.read_worker import DONE, STATUS_EOF

if typing.TYPE_CHECKING:
    from weightcache.core.identity.safetensors_io import Header
    from weightcache.core.load.read_process import ReadProcess
    from weightcache.core.load.reader import ReadMode


class PieceInFlight:
    """A piece whose blocks are being read into ``buffer`` (slot ``slot`` of the pool); ``left`` blocks are still to
    come."""

    def __init__(self, piece: Piece, slot: int, buffer: typing.Any, blocks: int, direct_fd: int):
        self.piece = piece
        self.slot = slot
        self.buffer = buffer
        self.left = blocks
        self.direct_fd = direct_fd


class Feed(typing.Protocol):
    """Where a dispatched piece's blocks are read: ``start`` the readers, ``submit`` a piece, ``stop`` them all."""

    def start(self, complete: queue.SimpleQueue, finished: queue.SimpleQueue, failed: threading.Event) -> None: ...

    def submit(self, state: PieceInFlight, direct: bool) -> None: ...

    def stop(self) -> None: ...


def changed_error(header: Header) -> CheckpointChanged:
    return CheckpointChanged(str(header.file.parent), str(header.file))


def fail(failed: threading.Event, finished: queue.SimpleQueue, error: BaseException) -> None:
    """Stop the read (every thread skips what is left) and hand ``error`` to the dispatcher, which raises it."""
    failed.set()
    finished.put((None, error))


class ThreadFeed:
    """Blocks read by ``mode.threads`` threads of this process from one queue."""

    def __init__(self, fds: list[int], mode: ReadMode, headers: list[Header]):
        self.fds, self.mode, self.headers = fds, mode, headers
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self, complete: queue.SimpleQueue, finished: queue.SimpleQueue, failed: threading.Event) -> None:
        def work_loop() -> None:
            while (item := self.work.get()) is not None:
                state, offset, nbytes = item
                if failed.is_set():
                    continue
                piece = state.piece
                try:
                    read_block(self.fds[piece.file], state.direct_fd, state.buffer.numpy(), piece.start, offset, nbytes)
                    with self.lock:
                        state.left -= 1
                        last = state.left == 0
                    if last:
                        complete.put(state)
                except (EOFError, Changed):
                    fail(failed, finished, changed_error(self.headers[piece.file]))
                except BaseException as exc:  # handed to the dispatcher, which raises it
                    fail(failed, finished, exc)

        self.threads = [
            threading.Thread(target=work_loop, name=f"weightcache-read-{n}", daemon=True) for n in range(self.mode.threads)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, state: PieceInFlight, direct: bool) -> None:
        block, nbytes = self.mode.block, state.piece.nbytes
        for offset in range(0, nbytes, block):
            self.work.put((state, offset, min(block, nbytes - offset)))

    def stop(self) -> None:
        for _ in self.threads:
            self.work.put(None)
        for thread in self.threads:
            thread.join()


class ProcessFeed:
    """Blocks read by the reader process into its shared slots; a collector thread takes its answers."""

    def __init__(self, process: "ReadProcess", headers: list[Header]):
        self.process, self.headers = process, headers
        self.in_flight: dict[int, PieceInFlight] = {}
        self.collector: threading.Thread | None = None

    def start(self, complete: queue.SimpleQueue, finished: queue.SimpleQueue, failed: threading.Event) -> None:
        def collect() -> None:
            while True:
                try:
                    slot, status = self.process.result()
                except ReaderFailed as exc:
                    if not failed.is_set():  # not the end the dispatcher asked for
                        fail(failed, finished, exc)
                    return
                if slot == DONE:
                    return
                state = self.in_flight.pop(slot, None)
                if state is None:
                    fail(failed, finished, ReaderFailed(f"it answered for slot {slot}, which holds no job"))
                    return
                if status == 0:
                    complete.put(state)
                elif not failed.is_set():
                    error = changed_error(self.headers[state.piece.file])
                    fail(failed, finished, error if status == STATUS_EOF else read_process.status_error(status))

        self.collector = threading.Thread(target=collect, name="weightcache-read-collector", daemon=True)
        self.collector.start()

    def submit(self, state: PieceInFlight, direct: bool) -> None:
        self.in_flight[state.slot] = state
        piece = state.piece
        self.process.submit(state.slot, piece.file, piece.start, piece.nbytes, direct)

    def stop(self) -> None:
        self.process.end_jobs()  # the worker finishes the reads in flight and exits: the collector sees its end
        if self.collector is not None:
            self.collector.join()
