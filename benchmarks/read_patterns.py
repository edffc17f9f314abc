"""How this machine's disk takes a checkpoint's reads into each kind of memory, side by side (issue 20).

    python benchmarks/read_patterns.py --model /root/cold-ckpt                       # every row, 16 threads
    python benchmarks/read_patterns.py --model DIR --rows anon4k:512,anonthp:512 --json OUT.json

A cold load is a disk read into staging memory, and on a virtual machine *which* memory can matter: a request
to a virtio disk carries one descriptor per physically contiguous run of the buffer, so 512 KiB into scattered
4 KiB pages is 128 segments (or, where the device offers few segments, 128 requests), where the same read into
a huge page is one. Every row reads all of the checkpoint's ``*.safetensors`` files, in file order, as blocks of
one size taken from one queue by ``--threads`` threads (fastsafetensors' pattern), into buffers of one kind, with
the page cache dropped first. The table gives seconds, GB/s, and what the block device itself saw in that time
(``/sys/block/DEV/stat``): requests completed and their average size, which tells whether the memory's layout
reached the disk. The machine's facts (the queue's ``max_segments`` and ``max_sectors_kb``, the huge-page
settings, NUMA nodes) come first.

Memory kinds: ``anon4k`` (private anonymous, huge pages refused), ``anonthp`` (private anonymous, ``MADV_HUGEPAGE``),
``memfd`` (a shared memfd, as the reader process's staging slots), ``memfdthp`` (the same with ``MADV_HUGEPAGE``,
which takes only where ``shmem_enabled`` allows), ``pinned`` (``torch.empty(pin_memory=True)``: ``cudaHostAlloc``),
``memfdreg`` (a memfd registered with ``cudaHostRegister``, as the loader pins the slots), ``buffered`` (anon4k
through the page cache, no O_DIRECT); ``KIND+memfd`` reads into KIND and copies each block into a memfd (what the
reader process does since decision 60). A row is ``KIND:BLOCK_KIB[:THREADS]``. Needs root for the drops (else
``posix_fadvise(DONTNEED)`` per file, said in the table). Nothing is verified: these rows only read.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import sys
import threading
import time
from pathlib import Path

import restart  # benchmarks/restart.py: its page-cache helpers (standard library only)

ALIGN = 4096
HUGE = 2 << 20
DEFAULT_ROWS = (
    "anon4k:512,anonthp:512,memfd:512,memfdthp:512,pinned:512,memfdreg:512,"
    "anon4k:65536,anonthp:65536,buffered:512,anonthp:2048:4,memfd:2048:4"
)


def block_device(path: Path) -> Path | None:
    """The sysfs directory of the whole disk holding ``path`` (a partition's parent), or None."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        return None
    node = node.resolve()
    return node.parent if (node / "partition").exists() else node


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        return f"? ({exc.strerror})"


def machine_facts(model: Path) -> dict:
    """What decides how reads reach the disk: its queue's limits, the huge-page settings, NUMA, CPUs, kernel."""
    disk = block_device(model)
    facts: dict = {"kernel": os.uname().release, "cpus": os.cpu_count(), "disk": str(disk) if disk else None}
    if disk is not None:
        queue_dir = disk / "queue"
        names = ("max_segments", "max_sectors_kb", "max_hw_sectors_kb", "max_segment_size", "nr_requests", "scheduler")
        facts["queue"] = {name: _read(queue_dir / name) for name in names}
        facts["hw_queues"] = len(list((disk / "mq").glob("*"))) if (disk / "mq").exists() else None
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    facts["thp"] = {name: _read(thp / name) for name in ("enabled", "shmem_enabled", "defrag")}
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    facts["numa"] = {node.name: _read(node / "cpulist") for node in nodes}
    return facts


def disk_counters(disk: Path | None) -> tuple[int, int]:
    """(reads completed, sectors read) of the whole disk, from its ``stat`` file; (0, 0) where there is none."""
    if disk is None:
        return 0, 0
    fields = _read(disk / "stat").split()
    return (int(fields[0]), int(fields[2])) if len(fields) > 2 and fields[0].isdigit() else (0, 0)


def drop_cache(files: list[Path]) -> str:
    """The whole page cache dropped (root), else the files evicted one by one; which of the two it was."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped"
    except OSError:
        restart.drop_from_page_cache(files)
        return "fadvise"


class Memory:
    """``nbytes`` of one kind of memory, page-aligned, touched, as a writable memoryview."""

    def __init__(self, kind: str, nbytes: int):
        self.kind, self.nbytes = kind, nbytes
        self.keep: list = []
        self.view = self._make(kind, nbytes)
        for offset in range(0, nbytes, ALIGN):
            self.view[offset] = 0  # every page present before the clock

    def _make(self, kind: str, nbytes: int) -> memoryview:
        if kind in ("anon4k", "anonthp", "buffered"):
            area = mmap.mmap(-1, nbytes + HUGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.keep.append(area)
            view = memoryview(area)
            address = _address(view)
            skip = (-address) % HUGE
            advice = mmap.MADV_HUGEPAGE if kind == "anonthp" else mmap.MADV_NOHUGEPAGE
            area.madvise(advice, skip, nbytes)
            return view[skip : skip + nbytes]
        if kind in ("memfd", "memfdthp", "memfdreg"):
            fd = os.memfd_create(f"read-patterns-{kind}", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
            area = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            self.keep.append(area)
            if kind == "memfdthp":
                area.madvise(mmap.MADV_HUGEPAGE, 0, nbytes)
            view = memoryview(area)
            if kind == "memfdreg":
                import torch

                for offset in range(0, nbytes, ALIGN):
                    view[offset] = 0
                err = torch.cuda.cudart().cudaHostRegister(_address(view), nbytes, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister failed: {err}")
                self.keep.append(("registered", _address(view)))
            return view
        if kind == "pinned":
            import torch

            raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
            self.keep.append(raw)
            skip = (-raw.data_ptr()) % ALIGN
            return memoryview(raw.numpy())[skip : skip + nbytes]
        raise ValueError(f"unknown memory kind {kind!r}")

    def huge_share(self) -> float | None:
        """The share of this memory the kernel backs with huge pages (``/proc/self/smaps``), or None if unknown."""
        start = _address(self.view)
        end = start + self.nbytes
        huge = 0
        try:
            lines = Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return None
        inside = False
        for line in lines:
            head = line.split()[0] if line else ""
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < end and high > start
            elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                huge += int(line.split()[1]) << 10
        return min(1.0, huge / self.nbytes)

    def close(self) -> None:
        for item in self.keep:
            if isinstance(item, tuple):
                import torch

                torch.cuda.cudart().cudaHostUnregister(item[1])
        self.view.release()
        for item in self.keep:
            if isinstance(item, mmap.mmap):
                try:
                    item.close()
                except BufferError:
                    pass


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_row(files: list[Path], kind: str, block: int, threads: int, disk: Path | None) -> dict:
    """Read every file in order as ``block``-byte reads from one queue on ``threads`` threads into ``kind`` memory."""
    copy_to = None
    if kind.endswith("+memfd"):  # read into the first kind, then copy each block into a shared memfd
        kind = kind.removesuffix("+memfd")
        copy_to = Memory("memfd", block * threads)
    memory = Memory(kind, block * threads)
    huge = memory.huge_share()
    direct = kind != "buffered"
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fds = [os.open(file, flags) for file in files]
    sizes = [os.fstat(fd).st_size for fd in fds]
    work: queue.SimpleQueue = queue.SimpleQueue()
    for number, size in enumerate(sizes):
        for offset in range(0, size, block):
            work.put((number, offset, min(block, size - offset)))
    for _ in range(threads):
        work.put(None)
    errors: list[BaseException] = []

    def reader(index: int) -> None:
        mine = memory.view[index * block : (index + 1) * block]
        source = _address(mine)
        target = _address(copy_to.view[index * block : (index + 1) * block]) if copy_to else 0
        try:
            while (item := work.get()) is not None:
                number, offset, nbytes = item
                want = -(-nbytes // ALIGN) * ALIGN if direct else nbytes
                done = 0
                while done < nbytes:
                    got = os.preadv(fds[number], [mine[done:want]], offset + done)
                    if got <= 0:
                        raise EOFError(f"{files[number]} ended at {offset + done}")
                    done += got
                if target:
                    ctypes.memmove(target, source, nbytes)  # a foreign call: the GIL is released
        except BaseException as exc:
            errors.append(exc)

    cache = drop_cache(files)
    before = disk_counters(disk)
    start = time.monotonic()
    workers = [threading.Thread(target=reader, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.monotonic() - start
    after = disk_counters(disk)
    for fd in fds:
        os.close(fd)
    memory.close()
    if copy_to is not None:
        copy_to.close()
        kind += "+memfd"
    if errors:
        raise errors[0]
    requests, sectors = after[0] - before[0], after[1] - before[1]
    total = sum(sizes)
    return {
        "row": f"{kind}:{block >> 10}:{threads}",
        "seconds": round(seconds, 3),
        "gb_s": round(total / seconds / 1e9, 3),
        "requests": requests,
        "avg_request_kib": round(sectors * 512 / requests / 1024, 1) if requests else None,
        "huge_share": None if huge is None else round(huge, 3),
        "cache": cache,
    }


def parse_row(text: str, threads: int) -> tuple[str, int, int]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts[1:]):
        raise ValueError(f"a row is KIND:BLOCK_KIB[:THREADS], not {text!r}")
    block = int(parts[1]) << 10
    if block <= 0 or block % ALIGN:
        raise ValueError(f"{text!r}: the block must be a positive multiple of 4 KiB")
    return parts[0], block, int(parts[2]) if len(parts) == 3 else threads


def table(facts: dict, rows: list[dict]) -> str:
    lines = [f"machine: {json.dumps(facts)}", ""]
    lines.append("| memory:block KiB:threads | seconds | GB/s | disk requests | avg request KiB | huge pages | cache |")
    lines.append("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['row']} | error: {row['error']} | | | | | |")
            continue
        huge = "?" if row["huge_share"] is None else f"{row['huge_share']:.0%}"
        lines.append(
            f"| {row['row']} | {row['seconds']:.2f} | {row['gb_s']:.2f} | {row['requests']} | {row['avg_request_kib']} "
            f"| {huge} | {row['cache']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a directory of *.safetensors files (on a disk, not tmpfs)")
    parser.add_argument(
        "--rows", default=DEFAULT_ROWS, help=f"KIND:BLOCK_KIB[:THREADS], comma-separated (default {DEFAULT_ROWS})"
    )
    parser.add_argument("--threads", type=int, default=16, help="threads of a row that names none (default 16)")
    parser.add_argument("--json", metavar="PATH", help="also write the facts and rows as JSON")
    args = parser.parse_args(argv)
    files = sorted(Path(args.model).glob("*.safetensors"))
    if not files:
        parser.error(f"no *.safetensors in {args.model}")
    try:
        specs = [parse_row(text, args.threads) for text in args.rows.split(",") if text]
    except ValueError as exc:
        parser.error(str(exc))
    facts = machine_facts(files[0])
    disk = Path(facts["disk"]) if facts["disk"] else None
    print(f"machine: {json.dumps(facts)}", flush=True)
    rows = []
    for kind, block, threads in specs:
        try:
            row = read_row(files, kind, block, threads, disk)
        except Exception as exc:  # one refused kind (memfdreg without CUDA, say) must not lose the others
            row = {"row": f"{kind}:{block >> 10}:{threads}", "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"facts": facts, "rows": rows}, indent=2) + "\n")
    print("\n" + table(facts, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
