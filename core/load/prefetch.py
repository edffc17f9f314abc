"""Start the disk while Python imports: read a checkpoint's files into the page cache ahead of the load.

A fresh ``weightcache load`` spends seconds importing torch and the model's module
and making a CUDA context before its reader can run; the disk sits idle meanwhile.
``Prefetch`` reads the weight files in file order from background threads into a
throwaway buffer, so the reader later finds them in the page cache. Storage is still
read once, and nothing here is trusted: the digests come from the bytes the reader
places. It reads at most ``limit`` bytes (by default half the memory
the kernel calls available), so a checkpoint larger than memory does not push its
own first pages out before the reader gets to them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from weightcache.core.fileio import READ_FLAGS

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
THREADS = 8

_running: set["Prefetch"] = set()
_running_lock = threading.Lock()


def stop_prefetches() -> int:
    """Stop every prefetch of this process (the reader takes over from here); the bytes they had read."""
    with _running_lock:
        running = list(_running)
    for prefetch in running:
        prefetch.stop()
    return sum(prefetch.done for prefetch in running)


def available_memory() -> int | None:
    """What /proc/meminfo calls MemAvailable, in bytes; None where it cannot be read (not Linux 3.14 or later)."""
    return meminfo_bytes("MemAvailable")


def meminfo_bytes(field: str) -> int | None:
    """The line ``field`` of /proc/meminfo (``MemTotal``, ``MemAvailable``...) in bytes; None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Prefetch:
    """Background reads of ``files`` into the page cache, in order, up to ``limit`` bytes; ``stop()`` ends them.

    Use it as a context manager around the work it overlaps with. A file that cannot be
    opened or read is skipped (the load itself reports it).
    """

    def __init__(self, files: Sequence[str | os.PathLike], limit: int | None = None, threads: int = THREADS):
        self.files = [Path(file) for file in files]
        self.limit = (available_memory() or 0) // 2 if limit is None else limit
        self.done = 0
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._chunks = self._plan()
        self._threads = [
            threading.Thread(target=self._work, name=f"weightcache-prefetch-{n}", daemon=True) for n in range(threads)
        ]

    def _plan(self):
        """(path, offset, length) of every chunk to read, in file order, within ``limit``."""
        budget = self.limit
        for file in self.files:
            try:
                size = file.stat().st_size
            except OSError:
                continue
            for offset in range(0, size, CHUNK_BYTES):
                length = min(CHUNK_BYTES, size - offset)
                if budget < length:
                    return
                budget -= length
                yield file, offset, length

    def __enter__(self) -> Prefetch:
        if self.limit > 0:
            log.debug("reading up to %d bytes of %d weight files ahead of the load", self.limit, len(self.files))
            with _running_lock:
                _running.add(self)
            for thread in self._threads:
                thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """End the reads (each thread finishes its chunk) and wait for the threads."""
        self._stopped.set()
        with _running_lock:
            _running.discard(self)
        for thread in self._threads:
            if thread.is_alive():
                thread.join()

    def _next(self):
        with self._lock:
            return next(self._chunks, None)

    def _work(self) -> None:
        buffer = memoryview(bytearray(CHUNK_BYTES))
        fds: dict[Path, int] = {}
        try:
            for chunk in iter(self._next, None):
                if self._stopped.is_set():
                    return
                file, offset, length = chunk
                fd = fds.get(file)
                if fd is None:
                    fd = fds[file] = os.open(file, READ_FLAGS)
                got = os.preadv(fd, [buffer[:length]], offset)
                with self._lock:
                    self.done += got
        except OSError as exc:
            log.debug("prefetch stopped: %s", exc)
        finally:
            for fd in fds.values():
                os.close(fd)
