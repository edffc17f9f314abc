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
import typing
from pathlib import Path

if typing.TYPE_CHECKING:
    from weightcache.core.load.read_process import ReadProcess

import attrs

from weightcache.core import envvars
from weightcache.core.errors import CheckpointChanged
from weightcache.core.fileio import DIRECT_ALIGN as ALIGN
from weightcache.core.fileio import READ_FLAGS, open_regular, read_block, resident_pages
from weightcache.core.identity.digests import PIECE_BYTES, FileDigest, FileKey, combine, piece_offsets
from weightcache.core.identity.safetensors_io import Header, TensorInfo, checkpoint_files, read_header
from weightcache.core.load import importing, read_process
from weightcache.core.load.export import ArenaBuilder, Slot
from weightcache.core.load.prefetch import stop_prefetches
from weightcache.core.load.read_feeds import Feed, PieceInFlight, ProcessFeed, ThreadFeed, changed_error, fail
from weightcache.core.load.read_pieces import CHUNK_BYTES as CHUNK_BYTES
from weightcache.core.load.read_pieces import Changed, Copy, Piece, check_header_bytes, overlaps, within
from weightcache.core.load.read_targets import ReadTarget, target_for

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
        reader = target_for(builder)
        try:
            stop_prefetches()  # what they read is in the page cache now; from here on, this reads
            cached = [cached_pieces(fd, key.st_size) for fd, key in zip(fds, keys, strict=True)]
            direct_for = _direct_for(files, keys, pieces, cached, direct_fds)
            mode, process = _mode_and_process(fds, direct_for, pieces, cached, threads, reader)
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


def _direct_for(
    files: list[Path], keys: list[FileKey], pieces: list[Piece], cached: list[set[int]], direct_fds: list[int]
) -> list[int]:
    """Per piece, the O_DIRECT descriptor it is read through, or -1 (buffered: in the page cache, or O_DIRECT off).
    The descriptors opened go to ``direct_fds`` (the caller closes them)."""
    if not default_direct():
        return [-1] * len(pieces)
    direct_fds.extend(_direct_fd(file, keys[number]) for number, file in enumerate(files))
    return [-1 if piece.index in cached[piece.file] else direct_fds[piece.file] for piece in pieces]


def _mode_and_process(
    fds: list[int], direct_for: list[int], pieces: list[Piece], cached: list[set[int]], threads: int | None, reader: ReadTarget
) -> "tuple[ReadMode, ReadProcess | None]":
    """The read's mode (``choose_mode``, from the share of bytes in the page cache) and its reader process, started
    where the mode asks for one (None where it did not start: the mode says so, and the read runs here)."""
    total = sum(piece.nbytes for piece in pieces)
    warm = sum(piece.nbytes for piece in pieces if piece.index in cached[piece.file])
    mode = choose_mode(threads, warm / total if total else 1.0)
    process = _start_process(fds, direct_for, pieces, mode) if mode.process else None
    if mode.process and process is None:
        return attrs.evolve(mode, process=False, why=f"{mode.why}; the reader process did not start"), None
    huge = process.huge_staging if process is not None else reader.huge_staging
    return attrs.evolve(mode, huge_staging=huge and any(fd >= 0 for fd in direct_for)), process


def _read_pieces(
    reader: "ReadTarget",
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


def _read_piece(reader: "ReadTarget", piece: Piece, fd: int, direct_fd: int, header: Header) -> bytes:
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
            check_header_bytes(raw, piece.start + start, staging)
            reader.place(staging, [within(copy, start, stop) for copy in piece.copies if overlaps(copy, start, stop)])
            digest.update(staging)  # type: ignore[arg-type]  # numpy's stubs omit __buffer__ before Python 3.12; hashlib reads the array's buffer
    except (EOFError, Changed):
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


def _read_in_blocks(
    reader: "ReadTarget",
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
    feed: Feed
    if process is not None:
        buffers = process.buffers()
        pinned = reader.pin(buffers)
        feed = ProcessFeed(process, headers)
    else:
        buffers, pinned = [], []  # made as first needed, pinned as they are made
        feed = ThreadFeed(fds, mode, headers)
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


def _dispatch(
    reader: ReadTarget,
    pieces: list[Piece],
    direct_for: list[int],
    headers: list[Header],
    slots: int,
    buffers: list,
    feed: Feed,
    block: int,
    make_arenas: "typing.Callable[[], None]",
) -> typing.Generator[tuple[Piece, bytes], None, None]:
    """Hand each piece a free buffer and the feed its blocks; hash threads finish the pieces whose blocks are in.

    ``buffers`` are the pool (made here as first needed, up to ``slots``, where empty). ``make_arenas`` runs here
    when every buffer holds a piece being read (or every piece was handed out), so the arenas are made while the disk
    works; the hash threads place nothing before it returned."""
    dispatch = _Dispatch(reader, headers, slots, buffers, feed, make_arenas)
    yield from dispatch.run(pieces, direct_for, block)


class _Dispatch:
    """One block read's state between the dispatcher (``run``), the feed's readers and ``HASH_THREADS`` hash threads."""

    def __init__(self, reader: ReadTarget, headers: list[Header], slots: int, buffers: list, feed: Feed, make_arenas):
        self.reader, self.headers, self.slots, self.feed, self.make_arenas = reader, headers, slots, feed, make_arenas
        self.free: queue.Queue = queue.Queue()
        for slot, buffer in enumerate(buffers):
            self.free.put((slot, buffer))
        self.made = len(buffers)
        self.complete: queue.SimpleQueue = queue.SimpleQueue()  # pieces whose blocks are all in
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.failed = threading.Event()
        self.busy = [0.0] * HASH_THREADS  # seconds each hash thread spent checking, placing and hashing
        self.arenas_made = threading.Event()  # set once make_arenas returned (or the read ends): placing may begin
        self.arenas_s = 0.0
        self.waited = 0.0
        self.received = 0  # pieces handed back to the caller

    def finish(self, state: PieceInFlight) -> None:
        piece, header = state.piece, self.headers[state.piece.file]
        view = state.buffer.numpy()[: piece.nbytes]
        check_header_bytes(header.raw, piece.start, view)
        done = self.reader.place_from(state.buffer, list(piece.copies))
        digest = hashlib.sha256(view).digest()
        self.reader.wait(done)
        self.free.put((state.slot, state.buffer))
        self.finished.put((piece, digest))

    def arenas_beside_the_reads(self) -> None:  # an error here leaves through run's finally, which sets the event
        start = time.monotonic()
        self.make_arenas()
        self.arenas_made.set()
        self.arenas_s = time.monotonic() - start

    def hash_loop(self, number: int) -> None:
        while (state := self.complete.get()) is not None:
            self.arenas_made.wait()
            if self.failed.is_set():
                continue
            try:
                start = time.monotonic()
                self.finish(state)
                self.busy[number] += time.monotonic() - start
            except (EOFError, Changed):
                fail(self.failed, self.finished, changed_error(self.headers[state.piece.file]))
            except BaseException as exc:  # handed to the dispatcher, which raises it
                fail(self.failed, self.finished, exc)

    def take(self) -> typing.Generator[tuple[Piece, bytes], None, tuple | None]:
        """A free buffer (made where the pool may grow), yielding the pieces that finish meanwhile; None once failed."""
        taken = None
        while taken is None and not self.failed.is_set():
            try:
                taken = self.free.get_nowait()
            except queue.Empty:
                if self.made < self.slots:
                    taken, self.made = (self.made, self.reader.piece_buffer()), self.made + 1
                elif not self.arenas_made.is_set():  # every buffer is being read: the arenas now, beside the disk
                    self.arenas_beside_the_reads()
                else:
                    start = time.monotonic()
                    with contextlib.suppress(queue.Empty):
                        taken = self.free.get(timeout=0.05)
                    self.waited += time.monotonic() - start
            while not self.finished.empty():
                self.received += 1
                yield _result(self.finished.get())
        return taken

    def run(self, pieces: list[Piece], direct_for: list[int], block: int) -> typing.Generator[tuple[Piece, bytes], None, None]:
        hashers = [
            threading.Thread(target=self.hash_loop, args=(n,), name=f"weightcache-hash-{n}", daemon=True)
            for n in range(HASH_THREADS)
        ]
        self.feed.start(self.complete, self.finished, self.failed)
        for thread in hashers:
            thread.start()
        dispatched = 0
        began = time.monotonic()
        try:
            for piece, direct_fd in zip(pieces, direct_for, strict=True):
                taken = yield from self.take()
                if taken is None:
                    break
                slot, buffer = taken
                self.feed.submit(PieceInFlight(piece, slot, buffer, -(-piece.nbytes // block), direct_fd), direct_fd >= 0)
                dispatched += 1
            if not self.arenas_made.is_set() and not self.failed.is_set():  # fewer pieces than buffers (or none read)
                self.arenas_beside_the_reads()
            while self.received < dispatched:  # every failure puts its error here: the loop ends by raising it
                self.received += 1
                yield _result(self.finished.get())
            log.debug(
                "read %d pieces in %.2f s through %d staging slots; %.2f s of it waiting for a free slot; the %d hash "
                "threads busy %.2f s in all; the arenas made in %.2f s beside the first reads",
                dispatched,
                time.monotonic() - began,
                self.slots,
                self.waited,
                HASH_THREADS,
                sum(self.busy),
                self.arenas_s,
            )
        finally:
            self.failed.set()  # the readers skip what is left
            self.arenas_made.set()  # a hash thread waiting to place sees ``failed`` and stops
            self.feed.stop()
            for _ in hashers:
                self.complete.put(None)
            for hasher in hashers:
                hasher.join()


def _result(item: tuple) -> tuple[Piece, bytes]:
    """A finished piece, or the error a worker met, raised."""
    piece, outcome = item
    if piece is None:
        raise outcome
    return piece, outcome


def _check_unchanged(checkpoint: str | os.PathLike, file: Path, fd: int, key: FileKey) -> None:
    """CheckpointChanged if the file read (``fd``) was written meanwhile, or ``file`` now names another file."""
    try:
        named = FileKey.of(file)
    except OSError:
        named = None
    if FileKey.of_fd(fd) != key or named != key:
        raise CheckpointChanged(str(checkpoint), str(file))
