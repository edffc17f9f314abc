"""Reading safetensors checkpoints straight into arenas in one pass that also computes their content digests.

Each file is read in the digest scheme's own pieces (``digests.PIECE_BYTES`` from
offset 0, header included) into a staging buffer; the buffer is hashed and the
tensor bytes in it are copied to their slots, so the digest and the arenas come
from the very same bytes: no second read can disagree with the first. The file
digests land in ``builder.read_digests``; the loader derives the checkpoint's
identity from them (``safetensors_io.identity_of``). Pieces that are not in the page
cache are read with O_DIRECT (the disk's fastest way on the H200 machine, and no
second copy in memory); those that are, through it.

A file that is replaced, rewritten, cut off or grown while it is read, or whose
header no longer says what the plan was made from, raises ``CheckpointChanged``.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import hashlib
import logging
import mmap
import os
import queue
import threading
import time
import types
import typing
from pathlib import Path

if typing.TYPE_CHECKING:
    import numpy
    import torch

    from weightcache.core.load.read_process import ReadProcess

import attrs

from weightcache.core import envvars
from weightcache.core.errors import CheckpointChanged, ReaderFailed
from weightcache.core.fileio import DIRECT_ALIGN as ALIGN
from weightcache.core.fileio import READ_FLAGS, DirectBuffer, huge_staging_wanted, open_regular, read_block, resident_pages
from weightcache.core.identity.digests import PIECE_BYTES, FileDigest, FileKey, combine, piece_offsets
from weightcache.core.identity.safetensors_io import Header, TensorInfo, checkpoint_files, read_header
from weightcache.core.load import importing, read_process
from weightcache.core.load.export import ArenaBuilder, Slot
from weightcache.core.load.prefetch import stop_prefetches
from weightcache.core.load.read_worker import DONE, STATUS_EOF

log = logging.getLogger(__name__)

THREADS_ENV = "WEIGHTCACHE_READ_THREADS"
BLOCK_ENV = "WEIGHTCACHE_READ_BLOCK_KIB"
DIRECT_ENV = "WEIGHTCACHE_READ_DIRECT"


def default_threads() -> int:
    """``$WEIGHTCACHE_READ_THREADS``, else min(16, 2 x CPUs): 16 read 16 GB 14 % faster than 8 on the H200 machine."""
    return _configured_threads() or min(16, (os.cpu_count() or 2) * 2)


def _configured_threads() -> int | None:
    return envvars.integer(THREADS_ENV, 1, 256)


WARM_SHARE = 0.5
"""A piece with at least this share of its pages in the page cache is read through it (buffered), not O_DIRECT."""


def _configured_block() -> int | None:
    """``$WEIGHTCACHE_READ_BLOCK_KIB`` in bytes (a multiple of 4 KiB up to a piece; 0: whole pieces per thread), else
    None: ``choose_mode`` decides per read."""
    configured = envvars.integer(BLOCK_ENV, ALIGN >> 10, PIECE_BYTES >> 10, step=ALIGN >> 10, also=(0,))
    return None if configured is None else configured << 10


BLOCK_BYTES = 512 << 10
BLOCK_THREADS = 16
"""The block mode's geometry, in this process or the reader process: fastsafetensors' (16 reads of 512 KiB in flight
from one queue, one sequential front of 8 MiB), which keeps a datacentre NVMe's queue full without a copy between the
read and the pinned pieces; docs/benchmarks.md has the cold-path figures."""
HASH_THREADS = 4
"""The block mode's threads that check, place and hash the pieces read, apart from the readers: enough that hashing
(sha256 takes longer per piece than a fast disk needs to read it) never holds the reads back."""


@attrs.frozen
class ReadMode:
    """How one read runs: ``block`` bytes per read from one queue (0: whole pieces per thread) on ``threads`` threads."""

    block: int
    threads: int
    why: str
    process: bool = False
    """Whether the blocks are read in a reader process (``read_process``) rather than on threads of this one."""

    huge_staging: bool = False
    """Whether O_DIRECT reads land in huge pages (``fileio.DirectBuffer``): the reader process's, which it copies into
    its slots, or a host read's staging here."""

    def describe(self) -> str:
        how = f"{self.block >> 10} KiB blocks from one queue" if self.block else "whole pieces per thread"
        where = " in a reader process" if self.process else ""
        staging = ", O_DIRECT into huge pages" if self.huge_staging else ""
        return f"{how} on {self.threads} threads{where}{staging} ({self.why})"


def choose_mode(threads: int | None, cached_share: float) -> ReadMode:
    """The read's mode: ``$WEIGHTCACHE_READ_BLOCK_KIB`` where set; else whole pieces where ``cached_share`` (of the
    bytes, in the page cache) is ``WARM_SHARE`` or more (memory speed: 16 threads hash in parallel); else blocks from
    one queue (the disk sees one sequential front), ``BLOCK_BYTES`` on ``BLOCK_THREADS`` threads: in a reader process
    where another thread of this one imports (its lock would hold every read up) or ``$WEIGHTCACHE_READ_PROCESS=1``,
    else here, straight into the pieces the hash threads place from (no copy). Beside an import with the process
    off (``=0``): whole pieces. ``threads`` (or ``$WEIGHTCACHE_READ_THREADS``) overrides the thread count."""
    configured = _configured_block()
    threads = threads or _configured_threads()
    setting = read_process.setting()
    beside_import = importing.under_way()
    process = beside_import if setting is None else setting
    if configured is not None:
        return ReadMode(configured, threads or default_threads(), f"${BLOCK_ENV}", process=bool(configured) and process)
    if cached_share >= WARM_SHARE:
        return ReadMode(0, threads or default_threads(), f"{cached_share:.0%} in the page cache")
    if beside_import and not process:
        return ReadMode(0, threads or default_threads(), "another thread imports")
    why = "from the disk, another thread imports" if beside_import else "from the disk"
    return ReadMode(BLOCK_BYTES, threads or BLOCK_THREADS, why, process=process)


def default_direct() -> bool:
    """Pieces not in the page cache are read with O_DIRECT (bypassing it) unless ``$WEIGHTCACHE_READ_DIRECT=0``."""
    return envvars.switch(DIRECT_ENV) is not False


def cached_pieces(fd: int, size: int) -> set[int]:
    """The indexes of the file's digest pieces of which ``WARM_SHARE`` or more is in the page cache: those are read
    through it (from memory, far faster than the disk), the others with O_DIRECT. All of them where that cannot be told."""
    offsets = piece_offsets(size)
    try:
        pages = resident_pages(fd, size)
    except OSError:
        return set(range(len(offsets)))
    per_piece = PIECE_BYTES // mmap.PAGESIZE
    cached = set()
    for index in range(len(offsets)):
        window = pages[index * per_piece : (index + 1) * per_piece]
        if window and (len(window) - window.count(0)) >= WARM_SHARE * len(window):
            cached.add(index)
    return cached


CHUNK_BYTES = 16 << 20
"""One read: a piece is read, placed and hashed in chunks, so each thread's two staging buffers stay small."""


@attrs.frozen
class Copy:
    """Bytes of one tensor inside a piece: ``nbytes`` at ``source`` in the piece go to ``slot`` at ``offset``."""

    slot: Slot
    offset: int
    source: int
    nbytes: int


@attrs.frozen
class Piece:
    """One read: ``nbytes`` of file number ``file`` at ``start``, the tensor bytes it holds, and its index in the file."""

    file: int
    index: int
    start: int
    nbytes: int
    copies: tuple[Copy, ...]


def read_checkpoint(
    path: str | os.PathLike, builder: ArenaBuilder, threads: int | None = None
) -> dict[str, tuple[TensorInfo, Slot]]:
    """Plan a slot for every tensor of the checkpoint at ``path``, read its bytes into it and digest every file.

    Returns ``name -> (info, slot)``; the bytes are the file's, unconverted. The
    file digests are added to ``builder.read_digests``, the mode ``choose_mode`` picked to ``builder.read_mode``:
    threads taking blocks from one queue in file order (``_read_in_blocks``) or each reading whole pieces
    (``_read_pieces``), with O_DIRECT for the pieces not in the page cache (``cached_pieces``). ``threads``
    overrides the mode's thread count.
    """
    began = time.monotonic()
    files = checkpoint_files(path)
    headers = [read_header(file) for file in files]
    placed = {info.name: (info, builder.plan(info.nbytes)) for header in headers for info in header.tensors}

    def make_arenas() -> None:
        """Create every arena, on this thread (a host arena's pages populated, a GPU's memory mapped): a block read
        does it while its first pieces are read, a piece read before it starts."""
        for _, slot in placed.values():
            builder.view(slot)

    fds: list[int] = []
    direct_fds: list[int] = []
    try:
        for file in files:
            fds.append(open_regular(file))
            os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
        keys = [FileKey.of_fd(fd) for fd in fds]
        pieces = [piece for number, header in enumerate(headers) for piece in _pieces(number, header, keys[number], placed)]
        hashes: list[dict[int, bytes]] = [{} for _ in files]
        reader = _GpuReader(builder) if builder.device.is_cuda else _HostReader(builder)
        try:
            stop_prefetches()  # what they read is in the page cache now; from here on, this reads
            cached = [cached_pieces(fd, key.st_size) for fd, key in zip(fds, keys, strict=True)]
            if default_direct():
                direct_fds.extend(_direct_fd(file, keys[number]) for number, file in enumerate(files))
                direct_for = [-1 if piece.index in cached[piece.file] else direct_fds[piece.file] for piece in pieces]
            else:
                direct_for = [-1] * len(pieces)
            total = sum(piece.nbytes for piece in pieces)
            warm = sum(piece.nbytes for piece in pieces if piece.index in cached[piece.file])
            mode = choose_mode(threads, warm / total if total else 1.0)
            process = _start_process(fds, direct_for, pieces, mode) if mode.process else None
            if mode.process and process is None:
                mode = attrs.evolve(mode, process=False, why=f"{mode.why}; the reader process did not start")
            else:
                huge = process.huge_staging if process is not None else reader.huge_staging
                mode = attrs.evolve(mode, huge_staging=huge and any(fd >= 0 for fd in direct_for))
            builder.read_mode = mode
            log.debug("reading %d weight files: %s", len(files), mode.describe())
            first_piece = time.monotonic()
            if mode.block:
                done = _read_in_blocks(reader, pieces, fds, direct_for, headers, mode, process, make_arenas)
            else:
                make_arenas()
                done = _read_pieces(reader, pieces, fds, direct_for, headers, mode.threads)
            try:
                for piece, piece_hash in done:
                    hashes[piece.file][piece.index] = piece_hash
                    builder.progress.update(sum(copy.nbytes for copy in piece.copies))
                last_piece = time.monotonic()
            finally:
                done.close()  # its threads stopped, also where it was never started
                if process is not None:
                    process.close()
        finally:
            reader.finish()
        for number, file in enumerate(files):
            _check_unchanged(path, file, fds[number], keys[number])
            size = keys[number].st_size
            digest = combine(size, [hashes[number][i] for i in range(len(piece_offsets(size)))])
            builder.read_digests[str(file)] = FileDigest(file, keys[number], digest)
        log.debug(
            "the read's own work: %.2f s before its first piece (headers, plan, files, page cache, reader process), "
            "%.2f s after its last (the reader closed, the files checked, the digests)",
            first_piece - began,
            time.monotonic() - last_piece,
        )
    finally:
        for fd in fds + [fd for fd in direct_fds if fd >= 0]:
            os.close(fd)
    return placed


def _read_pieces(
    reader: "_HostReader | _GpuReader",
    pieces: list[Piece],
    fds: list[int],
    direct_for: list[int],
    headers: list[Header],
    threads: int,
) -> typing.Generator[tuple[Piece, bytes], None, None]:
    """Each of ``threads`` threads reads whole pieces in ``CHUNK_BYTES`` chunks (through ``direct_for[i]`` where it is not
    -1); ``(piece, sha256)`` as each finishes."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightcache-read") as pool:
        work = {
            pool.submit(_read_piece, reader, piece, fds[piece.file], direct_fd, headers[piece.file]): piece
            for piece, direct_fd in zip(pieces, direct_for, strict=True)
        }
        try:
            for future in concurrent.futures.as_completed(work):
                yield work[future], future.result()
        except BaseException:
            for future in work:
                future.cancel()
            raise


def _pieces(number: int, header: Header, key: FileKey, placed: dict) -> list[Piece]:
    """The digest scheme's pieces of one file, each with the tensor bytes that fall into it."""
    if key != header.key:
        raise CheckpointChanged(str(header.file.parent), str(header.file))  # not the version whose header was read
    starts = [info.start for info in header.tensors]
    pieces = []
    for index, start in enumerate(piece_offsets(key.st_size)):
        stop = min(start + PIECE_BYTES, key.st_size)
        copies = []
        first = max(bisect.bisect_right(starts, start) - 1, 0)
        for info in header.tensors[first:]:
            if info.start >= stop:
                break
            low, high = max(start, info.start), min(stop, info.start + info.nbytes)
            if low < high:
                copies.append(Copy(placed[info.name][1], low - info.start, low - start, high - low))
        pieces.append(Piece(number, index, start, stop - start, tuple(copies)))
    return pieces


class _Changed(Exception):
    """The bytes read are not those of the file the plan was made from."""


def _read_piece(reader: "_HostReader | _GpuReader", piece: Piece, fd: int, direct_fd: int, header: Header) -> bytes:
    """Read ``piece`` in chunks through a staging buffer: check the header bytes, place the tensor bytes, hash; its sha256.

    Every chunk is hashed from the buffer its tensor bytes were placed from, after they were placed.
    """
    digest = hashlib.sha256()
    raw = header.raw
    try:
        for start in range(0, piece.nbytes, CHUNK_BYTES):
            stop = min(start + CHUNK_BYTES, piece.nbytes)
            buffer = reader.staging()
            read_block(fd, direct_fd, buffer, piece.start + start, 0, stop - start)
            staging = buffer[: stop - start]
            _check_header_bytes(raw, piece.start + start, staging)
            reader.place(staging, [_within(copy, start, stop) for copy in piece.copies if _overlaps(copy, start, stop)])
            digest.update(staging)  # type: ignore[arg-type]  # numpy's stubs omit __buffer__ before Python 3.12; hashlib reads the array's buffer
    except (EOFError, _Changed):
        raise CheckpointChanged(str(header.file.parent), str(header.file)) from None  # cut off or rewritten meanwhile
    return digest.digest()


def _direct_fd(file: Path, key: FileKey) -> int:
    """``file`` opened again with O_DIRECT, or -1 where its file system refuses that; CheckpointChanged if it is another file now."""
    try:
        fd = os.open(file, READ_FLAGS | os.O_DIRECT)
    except OSError:
        return -1  # e.g. tmpfs: EINVAL; the buffered descriptor reads it
    if FileKey.of_fd(fd) != key:
        os.close(fd)
        raise CheckpointChanged(str(file.parent), str(file))  # replaced between the two opens
    return fd


class _PieceInFlight:
    """A piece whose blocks are being read into ``buffer`` (slot ``slot`` of the pool); ``left`` blocks are still to
    come."""

    def __init__(self, piece: Piece, slot: int, buffer: typing.Any, blocks: int, direct_fd: int):
        self.piece = piece
        self.slot = slot
        self.buffer = buffer
        self.left = blocks
        self.direct_fd = direct_fd


def _read_in_blocks(
    reader: "_HostReader | _GpuReader",
    pieces: list[Piece],
    fds: list[int],
    direct_for: list[int],
    headers: list[Header],
    mode: ReadMode,
    process: "ReadProcess | None",
    make_arenas: "typing.Callable[[], None]",
) -> typing.Generator[tuple[Piece, bytes], None, None]:
    """``mode.threads`` reads of ``mode.block`` bytes from one queue in file order, so the disk sees one sequential
    front: in the reader process ``process`` where there is one (its caller closes it), else on threads of this
    process. ``make_arenas`` runs on this thread once the first pieces are being read (every staging buffer has one),
    and no piece is placed before it returned.

    Each piece is read into a whole-piece buffer from a small pool (in the reader process: its shared slots); once
    its last block is in, one of ``HASH_THREADS`` threads checks its header bytes, places its tensor bytes, hashes it
    and gives the buffer back, so the reads never stop for hashing (a piece takes longer to hash than to
    read). The dispatcher (this generator) waits for a free buffer holding no lock, and stops at
    the first error. ``direct_for[i]`` is the O_DIRECT descriptor to read ``pieces[i]`` through, or -1 (buffered).
    Yields ``(piece, sha256)`` as pieces finish.
    """
    feed: _Feed
    if process is not None:
        buffers = process.buffers()
        pinned = reader.pin(buffers)
        feed = _ProcessFeed(process, headers)
    else:
        buffers, pinned = [], []  # made as first needed, pinned as they are made
        feed = _ThreadFeed(fds, mode, headers)
    try:
        yield from _dispatch(reader, pieces, direct_for, headers, _slots(mode), buffers, feed, mode.block, make_arenas)
    finally:
        reader.unpin(pinned)


SLOTS_ENV = "WEIGHTCACHE_READ_SLOTS"


def _slots(mode: ReadMode) -> int:
    """Whole-piece buffers a block read keeps: ``$WEIGHTCACHE_READ_SLOTS`` (2 to 64), else its front's pieces, one per
    hash thread, two to spare."""
    configured = envvars.integer(SLOTS_ENV, 2, 64)
    if configured is not None:
        return configured
    return -(-mode.threads * mode.block // PIECE_BYTES) + HASH_THREADS + 2


def _start_process(fds: list[int], direct_for: list[int], pieces: list[Piece], mode: ReadMode) -> "ReadProcess | None":
    """A started reader process over the files (each with its O_DIRECT descriptor where one of its pieces uses it),
    or None where it did not start (logged: the read runs in this process then)."""
    slots = _slots(mode)
    direct = {piece.file: fd for piece, fd in zip(pieces, direct_for, strict=True) if fd >= 0}
    try:
        process = read_process.ReadProcess(
            [(fd, direct.get(n, -1)) for n, fd in enumerate(fds)], slots, PIECE_BYTES, mode.threads, mode.block
        )
    except OSError as exc:
        log.info("the reader process did not start (%s); reading in this process", exc)
        return None
    if not process.ready():
        process.close()
        return None
    return process


class _Feed(typing.Protocol):
    """Where a dispatched piece's blocks are read: ``start`` the readers, ``submit`` a piece, ``stop`` them all."""

    def start(self, complete: queue.SimpleQueue, finished: queue.SimpleQueue, failed: threading.Event) -> None: ...

    def submit(self, state: _PieceInFlight, direct: bool) -> None: ...

    def stop(self) -> None: ...


def _changed(header: Header) -> CheckpointChanged:
    return CheckpointChanged(str(header.file.parent), str(header.file))


def _fail(failed: threading.Event, finished: queue.SimpleQueue, error: BaseException) -> None:
    """Stop the read (every thread skips what is left) and hand ``error`` to the dispatcher, which raises it."""
    failed.set()
    finished.put((None, error))


class _ThreadFeed:
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
                except (EOFError, _Changed):
                    _fail(failed, finished, _changed(self.headers[piece.file]))
                except BaseException as exc:  # handed to the dispatcher, which raises it
                    _fail(failed, finished, exc)

        self.threads = [
            threading.Thread(target=work_loop, name=f"weightcache-read-{n}", daemon=True) for n in range(self.mode.threads)
        ]
        for thread in self.threads:
            thread.start()

    def submit(self, state: _PieceInFlight, direct: bool) -> None:
        block, nbytes = self.mode.block, state.piece.nbytes
        for offset in range(0, nbytes, block):
            self.work.put((state, offset, min(block, nbytes - offset)))

    def stop(self) -> None:
        for _ in self.threads:
            self.work.put(None)
        for thread in self.threads:
            thread.join()


class _ProcessFeed:
    """Blocks read by the reader process into its shared slots; a collector thread takes its answers."""

    def __init__(self, process: "ReadProcess", headers: list[Header]):
        self.process, self.headers = process, headers
        self.in_flight: dict[int, _PieceInFlight] = {}
        self.collector: threading.Thread | None = None

    def start(self, complete: queue.SimpleQueue, finished: queue.SimpleQueue, failed: threading.Event) -> None:
        def collect() -> None:
            while True:
                try:
                    slot, status = self.process.result()
                except ReaderFailed as exc:
                    if not failed.is_set():  # not the end the dispatcher asked for
                        _fail(failed, finished, exc)
                    return
                if slot == DONE:
                    return
                state = self.in_flight.pop(slot, None)
                if state is None:
                    _fail(failed, finished, ReaderFailed(f"it answered for slot {slot}, which holds no job"))
                    return
                if status == 0:
                    complete.put(state)
                elif not failed.is_set():
                    changed = _changed(self.headers[state.piece.file])
                    _fail(failed, finished, changed if status == STATUS_EOF else read_process.status_error(status))

        self.collector = threading.Thread(target=collect, name="weightcache-read-collector", daemon=True)
        self.collector.start()

    def submit(self, state: _PieceInFlight, direct: bool) -> None:
        self.in_flight[state.slot] = state
        piece = state.piece
        self.process.submit(state.slot, piece.file, piece.start, piece.nbytes, direct)

    def stop(self) -> None:
        self.process.end_jobs()  # the worker finishes the reads in flight and exits: the collector sees its end
        if self.collector is not None:
            self.collector.join()


def _dispatch(
    reader: "_HostReader | _GpuReader",
    pieces: list[Piece],
    direct_for: list[int],
    headers: list[Header],
    slots: int,
    buffers: list,
    feed: _Feed,
    block: int,
    make_arenas: "typing.Callable[[], None]",
) -> typing.Generator[tuple[Piece, bytes], None, None]:
    """Hand each piece a free buffer and the feed its blocks; hash threads finish the pieces whose blocks are in.

    ``buffers`` are the pool (made here as first needed, up to ``slots``, where empty). ``make_arenas`` runs here
    when every buffer holds a piece being read (or every piece was handed out), so the arenas are made while the disk
    works; the hash threads place nothing before it returned."""
    free: queue.Queue = queue.Queue()
    for slot, buffer in enumerate(buffers):
        free.put((slot, buffer))
    made = len(buffers)
    complete: queue.SimpleQueue = queue.SimpleQueue()  # pieces whose blocks are all in
    finished: queue.SimpleQueue = queue.SimpleQueue()
    failed = threading.Event()

    def finish(state: _PieceInFlight) -> None:
        piece, header = state.piece, headers[state.piece.file]
        view = state.buffer.numpy()[: piece.nbytes]
        _check_header_bytes(header.raw, piece.start, view)
        done = reader.place_from(state.buffer, list(piece.copies))
        digest = hashlib.sha256(view).digest()
        reader.wait(done)
        free.put((state.slot, state.buffer))
        finished.put((piece, digest))

    busy = [0.0] * HASH_THREADS  # seconds each hash thread spent checking, placing and hashing
    arenas_made = threading.Event()  # set once make_arenas returned (or the read ends): placing may begin
    arenas_s = 0.0

    def arenas_beside_the_reads() -> None:  # an error here leaves through the dispatcher's finally, which sets the event
        nonlocal arenas_s
        start = time.monotonic()
        make_arenas()
        arenas_made.set()
        arenas_s = time.monotonic() - start

    def hash_loop(number: int) -> None:
        while (state := complete.get()) is not None:
            arenas_made.wait()
            if failed.is_set():
                continue
            try:
                start = time.monotonic()
                finish(state)
                busy[number] += time.monotonic() - start
            except (EOFError, _Changed):
                _fail(failed, finished, _changed(headers[state.piece.file]))
            except BaseException as exc:  # handed to the dispatcher, which raises it
                _fail(failed, finished, exc)

    hashers = [
        threading.Thread(target=hash_loop, args=(n,), name=f"weightcache-hash-{n}", daemon=True) for n in range(HASH_THREADS)
    ]
    feed.start(complete, finished, failed)
    for thread in hashers:
        thread.start()
    dispatched = received = 0
    began, waited = time.monotonic(), 0.0
    try:
        for piece, direct_fd in zip(pieces, direct_for, strict=True):
            taken = None
            while taken is None and not failed.is_set():
                try:
                    taken = free.get_nowait()
                except queue.Empty:
                    if made < slots:
                        taken, made = (made, reader.piece_buffer()), made + 1
                    elif not arenas_made.is_set():  # every buffer is being read: the arenas now, beside the disk
                        arenas_beside_the_reads()
                    else:
                        start = time.monotonic()
                        with contextlib.suppress(queue.Empty):
                            taken = free.get(timeout=0.05)
                        waited += time.monotonic() - start
                while not finished.empty():
                    received += 1
                    yield _result(finished.get())
            if taken is None:
                break
            slot, buffer = taken
            feed.submit(_PieceInFlight(piece, slot, buffer, -(-piece.nbytes // block), direct_fd), direct_fd >= 0)
            dispatched += 1
        if not arenas_made.is_set() and not failed.is_set():  # fewer pieces than buffers (a failed read makes none)
            arenas_beside_the_reads()
        while received < dispatched:  # every failure puts its error here: the loop ends by raising it
            received += 1
            yield _result(finished.get())
        log.debug(
            "read %d pieces in %.2f s through %d staging slots; %.2f s of it waiting for a free slot; the %d hash "
            "threads busy %.2f s in all; the arenas made in %.2f s beside the first reads",
            dispatched,
            time.monotonic() - began,
            slots,
            waited,
            HASH_THREADS,
            sum(busy),
            arenas_s,
        )
    finally:
        failed.set()  # the readers skip what is left
        arenas_made.set()  # a hash thread waiting to place sees ``failed`` and stops
        feed.stop()
        for _ in hashers:
            complete.put(None)
        for hasher in hashers:
            hasher.join()


def _result(item: tuple) -> tuple[Piece, bytes]:
    """A finished piece, or the error a worker met, raised."""
    piece, outcome = item
    if piece is None:
        raise outcome
    return piece, outcome


def _check_header_bytes(raw: bytes, at: int, data: "numpy.ndarray") -> None:
    """``_Changed`` if ``data``, read from file offset ``at``, disagrees with the header bytes ``raw`` it overlaps."""
    if at < len(raw):
        stop = min(len(raw), at + len(data))
        if bytes(data[: stop - at]) != raw[at:stop]:
            raise _Changed


def _overlaps(copy: Copy, start: int, stop: int) -> bool:
    return copy.source < stop and start < copy.source + copy.nbytes


def _within(copy: Copy, start: int, stop: int) -> Copy:
    """The part of ``copy`` that lies in the piece's bytes ``start``..``stop``, its source relative to ``start``."""
    low, high = max(start, copy.source), min(stop, copy.source + copy.nbytes)
    return Copy(copy.slot, copy.offset + low - copy.source, low - start, high - low)


def _check_unchanged(checkpoint: str | os.PathLike, file: Path, fd: int, key: FileKey) -> None:
    """CheckpointChanged if the file read (``fd``) was written meanwhile, or ``file`` now names another file."""
    try:
        named = FileKey.of(file)
    except OSError:
        named = None
    if FileKey.of_fd(fd) != key or named != key:
        raise CheckpointChanged(str(checkpoint), str(file))


class _HostReader:
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
            buffer = self.local.buffer = _host_buffer(CHUNK_BYTES, self.huge_staging).numpy()
        return buffer

    def place(self, staging: "numpy.ndarray", copies: list[Copy]) -> None:
        for copy in copies:
            target = self.builder.view(copy.slot)[copy.offset : copy.offset + copy.nbytes].numpy()
            target[:] = staging[copy.source : copy.source + copy.nbytes]

    def piece_buffer(self) -> "torch.Tensor":
        """A tensor of ``PIECE_BYTES`` at an ``ALIGN``-aligned address (O_DIRECT reads into it)."""
        return _host_buffer(PIECE_BYTES, self.huge_staging)

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


def _host_buffer(nbytes: int, huge: bool) -> "torch.Tensor":
    """A uint8 tensor of ``nbytes`` for O_DIRECT reads: in huge pages where ``huge`` (a virtio disk takes reads into
    them at twice the speed; ``fileio.DirectBuffer``), else malloc's memory at an ``ALIGN``-aligned address. The tensor
    keeps its memory alive."""
    import torch

    if huge:
        return torch.frombuffer(DirectBuffer(nbytes).view, dtype=torch.uint8)
    return _aligned(torch.empty(nbytes + ALIGN, dtype=torch.uint8), nbytes)


def _aligned(raw, nbytes: int):
    """The ``nbytes`` of the 1-D uint8 tensor ``raw`` that start at an ``ALIGN``-aligned address."""
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


class _GpuReader:
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
                    _aligned(torch.empty(CHUNK_BYTES + ALIGN, dtype=torch.uint8, pin_memory=True), CHUNK_BYTES) for _ in range(2)
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
        return _aligned(self.torch.empty(PIECE_BYTES + ALIGN, dtype=self.torch.uint8, pin_memory=True), PIECE_BYTES)

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
