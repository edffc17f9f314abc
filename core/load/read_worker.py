"""The reader process: reads blocks of a checkpoint's files into shared staging slots, apart from the loading process.

Run as ``python -m weightcache.core.load.read_worker`` by ``read_process.ReadProcess``, which passes the files'
descriptors (the same open files the loader planned from and checks afterwards), a memfd of staging slots, a pipe of
jobs as its standard input and a pipe of results as its standard output. It imports nothing but the standard library
and ``core.fileio``, and never sees a tensor or a digest: the loading process checks, hashes and places the bytes of
each slot it was told is full, so identity and bytes still come from one read.

Why a process: each block read returns to an interpreter lock, and in the loading process that lock is busy (the
skeleton's Python, an adapter's imports, the hashing and copy threads' bookkeeping). Here the only Python is this
loop's, so ``threads`` reads stay in flight however busy the loader is.

The wire (native byte order, one host): first ``CONFIG`` (the JSON's length) and the JSON ``{"files": [[fd,
direct_fd], ...], "staging": fd, "slot_bytes": n, "slots": n, "threads": n, "block": n, "huge_staging": bool}``;
then ``JOB`` records
(slot, file index, start, nbytes, direct), each asking for ``nbytes`` of that file from ``start`` into the slot
(through its O_DIRECT descriptor where ``direct``). The answers are ``RESULT`` records (slot, status): first one for
slot ``READY`` (the config read, the slots mapped), then one per job once its last block is in, with status 0,
``STATUS_EOF`` (the file ended first) or an errno, and last one for slot ``DONE``: the jobs' end (EOF on standard
input) let the reads in flight finish, and the process exits 0.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import queue
import struct
import sys
import threading

from weightcache.core.fileio import DirectBuffer, read_block

CONFIG = struct.Struct("=I")
JOB = struct.Struct("=iiqqi")
RESULT = struct.Struct("=ii")
STATUS_EOF = -1
READY = -1
"""The slot of the first result: the config was read and the slots mapped."""
DONE = -2
"""The slot of the last result: the jobs ended and every read finished; the process exits next."""
MAX_CONFIG_BYTES = 1 << 20


def read_exactly(fd: int, nbytes: int) -> bytes | None:
    """``nbytes`` from the pipe ``fd``, or None at its end (EOFError if it ends inside a record)."""
    data = b""
    while len(data) < nbytes:
        got = os.read(fd, nbytes - len(data))
        if not got:
            if data:
                raise EOFError("the job pipe ended inside a record")
            return None
        data += got
    return data


def serve(jobs: int, results: int) -> None:
    """Read the config and then jobs from ``jobs``; answer each on ``results`` once its last block is in."""
    size = read_exactly(jobs, CONFIG.size)
    if size is None:
        return
    (length,) = CONFIG.unpack(size)
    if length > MAX_CONFIG_BYTES:
        raise ValueError(f"a config of {length} bytes")
    config = json.loads(read_exactly(jobs, length) or b"")
    files = [(int(fd), int(direct)) for fd, direct in config["files"]]
    slot_bytes, slots, block = int(config["slot_bytes"]), int(config["slots"]), int(config["block"])
    area = mmap.mmap(int(config["staging"]), slot_bytes * slots, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(area)
    anchor = ctypes.c_char.from_buffer(area)  # the slots' address, for the copies out of the huge-page staging
    threads = int(config["threads"])
    huge = DirectBuffer(threads * block) if config.get("huge_staging") else None
    os.write(results, RESULT.pack(READY, 0))
    blocks: queue.SimpleQueue = queue.SimpleQueue()
    lock = threading.Lock()
    left: dict[int, int] = {}
    status: dict[int, int] = {}

    def read_loop(index: int) -> None:
        staging = huge.view[index * block : (index + 1) * block] if huge is not None else None
        while (item := blocks.get()) is not None:
            slot, file, start, offset, nbytes, direct = item
            outcome = 0
            if status[slot] == 0:
                fd, direct_fd = files[file]
                try:
                    if direct and huge is not None:  # into a huge page, then copied (ctypes releases the GIL)
                        read_block(fd, direct_fd, staging, start + offset, 0, nbytes)
                        target = ctypes.addressof(anchor) + slot * slot_bytes + offset
                        ctypes.memmove(target, huge.address + index * block, nbytes)
                    else:
                        slot_view = view[slot * slot_bytes : (slot + 1) * slot_bytes]
                        read_block(fd, direct_fd if direct else -1, slot_view, start, offset, nbytes)
                except EOFError:
                    outcome = STATUS_EOF
                except OSError as exc:
                    outcome = exc.errno or 5  # EIO
            with lock:
                if outcome and status[slot] == 0:
                    status[slot] = outcome
                left[slot] -= 1
                last, final = left[slot] == 0, status[slot]
            if last:
                os.write(results, RESULT.pack(slot, final))  # 8 bytes: one atomic pipe write

    readers = [threading.Thread(target=read_loop, args=(n,), daemon=True) for n in range(threads)]
    for thread in readers:
        thread.start()
    try:
        while (record := read_exactly(jobs, JOB.size)) is not None:
            slot, file, start, nbytes, direct = JOB.unpack(record)
            if not (0 <= slot < slots and 0 <= file < len(files) and 0 < nbytes <= slot_bytes and start >= 0):
                raise ValueError(f"a job out of bounds: slot {slot}, file {file}, {nbytes} bytes at {start}")
            with lock:
                if left.get(slot):
                    raise ValueError(f"slot {slot} was given a job before its last one finished")
                left[slot], status[slot] = -(-nbytes // block), 0
            for offset in range(0, nbytes, block):
                blocks.put((slot, file, start, offset, min(block, nbytes - offset), direct))
    finally:
        for _ in readers:
            blocks.put(None)
        for thread in readers:
            thread.join()
    os.write(results, RESULT.pack(DONE, 0))


def main() -> int:
    try:
        serve(sys.stdin.fileno(), sys.stdout.fileno())
    except (ValueError, EOFError, KeyError, OSError) as exc:
        print(f"weightcache read worker: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.stderr.flush()
    os._exit(main())  # nothing to tear down: every result is written, and the loader waits for this exit
