"""The loading side of the reader process (``read_worker``): start it over shared staging slots, give it jobs, take
its results.

A block read in the loading process returns to its interpreter lock, which the skeleton's Python, an adapter's
imports and the hashing threads keep busy; in a process of its own the reads stay in flight.
The slots are one memfd mapped by both processes; the loader hashes and places each slot's bytes after the worker
said it is full, and gives the slot a new job only after that. The reader uses it where another thread of the loading
process imports while the read runs; ``$WEIGHTCACHE_READ_PROCESS=1`` for every read from the
disk, ``=0`` for none. A worker that cannot start (no usable ``sys.executable``, an import that fails there) leaves
the read to the loading process, with a log line.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import select
import subprocess
import sys
import time
import typing

from weightcache.core.cpus import usable_cpus
from weightcache.core.errors import ReaderFailed
from weightcache.core.fileio import huge_pages_offered, huge_staging_setting, switch_setting
from weightcache.core.load.read_worker import CONFIG, DONE, JOB, READY, RESULT

if typing.TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PROCESS_ENV = "WEIGHTCACHE_READ_PROCESS"
START_TIMEOUT_S = 20.0
"""How long the worker may take to start (an interpreter and the standard library: ~50 ms) before the loader reads
in-process instead."""


BOUNCE_MIN_CPUS = 4
"""The fewest CPUs on which the worker's O_DIRECT reads go through huge pages and a copy: on 2 cores the copy (a
second pass over every byte) took longer than the faster reads saved, because the load's hashing and placing held
both cores (docs/benchmarks.md)."""


def bounced_staging() -> bool:
    """Whether the worker reads O_DIRECT blocks into huge pages and copies them into the slots:
    ``$WEIGHTCACHE_READ_HUGE_PAGES`` where it is 0 or 1, else where the kernel offers huge pages and the process may
    run on ``BOUNCE_MIN_CPUS`` or more."""
    setting = huge_staging_setting()
    return huge_pages_offered() and usable_cpus() >= BOUNCE_MIN_CPUS if setting is None else setting


def setting() -> bool | None:
    """``$WEIGHTCACHE_READ_PROCESS``: True (``1``: every read from the disk goes through a reader process), False
    (``0``: none does), else None (the reader decides: only beside an import)."""
    return switch_setting(PROCESS_ENV)


class ReadProcess:
    """A started reader process and its ``slots`` staging slots of ``slot_bytes`` each (a memfd both processes map).

    ``files`` are (descriptor, O_DIRECT descriptor or -1) per file, as the loader opened them: the worker reads
    through the very same open files. Where ``bounced_staging()``, its O_DIRECT reads land in huge pages of its own and
    are copied into the slots (a memfd's 4 KiB pages took them at half the speed). Use as a context manager;
    ``close`` ends the worker and unmaps the slots.
    """

    def __init__(self, files: list[tuple[int, int]], slots: int, slot_bytes: int, threads: int, block: int):
        self.slots, self.slot_bytes = slots, slot_bytes
        self.huge_staging = bounced_staging()
        self.process: subprocess.Popen | None = None
        self.jobs = self.results = -1
        self.memfd = os.memfd_create("weightcache-staging", os.MFD_CLOEXEC)
        self.area: mmap.mmap | None = None
        try:
            os.ftruncate(self.memfd, slots * slot_bytes)
            self.area = mmap.mmap(self.memfd, slots * slot_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            jobs_read, self.jobs = os.pipe()
            self.results, results_write = os.pipe()
            try:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "weightcache.core.load.read_worker"],
                    stdin=jobs_read,
                    stdout=results_write,
                    stderr=subprocess.PIPE,
                    pass_fds=[fd for pair in files for fd in pair if fd >= 0] + [self.memfd],
                    env=env,
                )
            finally:
                os.close(jobs_read)
                os.close(results_write)
            config = json.dumps(
                {
                    "files": files,
                    "staging": self.memfd,
                    "slot_bytes": slot_bytes,
                    "slots": slots,
                    "threads": threads,
                    "block": block,
                    "huge_staging": self.huge_staging,
                }
            ).encode()
            os.write(self.jobs, CONFIG.pack(len(config)) + config)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ReadProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def buffers(self) -> list[torch.Tensor]:
        """One uint8 tensor over each slot (they share the mapping; page-aligned, as O_DIRECT needs)."""
        import torch

        assert self.area is not None
        whole = torch.frombuffer(self.area, dtype=torch.uint8)
        return [whole[n * self.slot_bytes : (n + 1) * self.slot_bytes] for n in range(self.slots)]

    def ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Whether the worker started (mapped the slots) within ``timeout`` seconds; if not, the caller closes it."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.results], [], [], left)[0]:
                try:
                    slot, _status = self.result()
                except ReaderFailed as exc:
                    log.info("%s; reading in this process", exc)
                    return False
                return slot == READY
        log.info("the reader process did not start in %.0f s; reading in this process", timeout)
        return False

    def submit(self, slot: int, file: int, start: int, nbytes: int, direct: bool) -> None:
        """Ask for ``nbytes`` of file number ``file`` from ``start`` into ``slot`` (which holds no job now), through
        its O_DIRECT descriptor where ``direct``."""
        os.write(self.jobs, JOB.pack(slot, file, start, nbytes, int(direct)))

    def end_jobs(self) -> None:
        """No more jobs: the worker finishes those in flight, answers them, answers ``DONE`` and exits."""
        if self.jobs >= 0:
            os.close(self.jobs)
            self.jobs = -1

    def result(self) -> tuple[int, int]:
        """The next finished job: (slot, status), status 0, ``STATUS_EOF`` or an errno. ReaderFailed if the worker
        ended."""
        data = b""
        while len(data) < RESULT.size:
            got = os.read(self.results, RESULT.size - len(data))
            if not got:
                raise ReaderFailed(self._ended())
            data += got
        slot, status = RESULT.unpack(data)
        if slot not in (READY, DONE) and not 0 <= slot < self.slots:
            raise ReaderFailed(f"it answered for slot {slot} of {self.slots}")
        return slot, status

    def _ended(self) -> str:
        """How the worker ended, with the last line it wrote to its standard error."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        said = self.process.stderr.read().decode(errors="replace").strip().splitlines() if self.process.stderr else []
        return f"it exited with status {code}" + (f" ({said[-1]})" if said else "")

    def close(self) -> None:
        """End the worker (the reads in flight finish first) and unmap the slots; idempotent."""
        self.end_jobs()
        if self.process is not None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if self.process.stderr:
                self.process.stderr.close()
            self.process = None
        if self.results >= 0:
            os.close(self.results)
            self.results = -1
        if self.area is not None:
            try:
                self.area.close()
            except BufferError:  # a tensor over the slots is still alive; the mapping goes with it
                pass
            self.area = None
        if self.memfd >= 0:
            os.close(self.memfd)
            self.memfd = -1


def status_error(status: int) -> OSError:
    """The OSError a job's errno ``status`` stands for (``STATUS_EOF``, the file ending first, is the reader's to
    name: it is the file that changed)."""
    return OSError(status, os.strerror(status))
