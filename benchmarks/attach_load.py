"""Attach latency under load: many client processes attach and detach one host entry at once.

    python benchmarks/attach_load.py                      # 32 clients x 200 cycles, own server
    python benchmarks/attach_load.py --clients 8 --cycles 1000 --mib 64
    python benchmarks/attach_load.py --socket-dir DIR     # against a server that already runs

Each cycle is what an engine does on restart: ``Attachment.open`` (connect,
attach, receive the fds, map the arenas, build the tensor views) and then
``close``. The latency is that of ``open``; the table also shows the server's
open fds and RSS before and after the run, which must come back flat.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path


def publish_entry(socket_dir: Path, nbytes: int, tensors: int):
    """A sealed host arena of ``nbytes`` in ``tensors`` float32 tensors, published; returns its fingerprint."""
    import attrs

    from weightcache.core.arena import backend
    from weightcache.core.arena.checksum import checksum
    from weightcache.core.client.client import Connection
    from weightcache.core.fingerprint import Fingerprint, sha256_json
    from weightcache.core.layout.manifest import Manifest, TensorRecord

    host = backend("host")
    arena = host.create(nbytes)
    fd = arena.export_fd()
    try:
        chunk = os.urandom(1 << 20)
        for offset in range(0, nbytes, len(chunk)):
            os.pwrite(fd, chunk[: nbytes - offset], offset)
        host.seal(arena)
        per = nbytes // tensors // 4
        records = [
            TensorRecord(
                name=f"layer{i}.weight",
                kind="parameter",
                dtype="float32",
                shape=(per,),
                stride=(1,),
                storage_offset=0,
                arena=0,
                offset=i * per * 4,
                nbytes=per * 4,
            )
            for i in range(tensors)
        ]
        spec = attrs.evolve(arena.spec, checksum=checksum(arena.bytes_view()))  # every published arena carries one
        manifest = Manifest(tensors=records, arenas=[spec])
        fingerprint = Fingerprint(
            checkpoint=sha256_json({"benchmark": "attach_load", "bytes": nbytes, "tensors": tensors}),
            architecture="AttachLoadBenchmark",
            config=sha256_json({}),
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            dp_size=1,
            ep_size=1,
            ep_rank=0,
            dtype="float32",
            quantization="none",
            quantization_config=sha256_json({}),
            adapter="benchmark",
            adapter_version="1",
            engine="none",
            engine_version="0",
            torch_version="",
            cuda_version="",
            compute_capability="",
            gpu_uuid="",
        )
        with Connection(socket_dir) as conn:
            conn.publish(fingerprint, manifest, [fd], label=f"attach_load ({tensors} tensors)")
        return fingerprint
    finally:
        os.close(fd)
        arena.close()


def attach_cycles(socket_dir: str, fingerprint: dict, cycles: int, barrier, results) -> None:
    """One client process: ``cycles`` x (Attachment.open, close); puts its latencies and failures on ``results``."""
    from weightcache.core.client.attach import Attachment
    from weightcache.core.fingerprint import Fingerprint

    fp = Fingerprint.from_json(fingerprint)
    opens, closes, failures = [], [], []
    barrier.wait(300)
    for cycle in range(cycles):
        try:
            started = time.perf_counter()
            attachment = Attachment.open(fp, socket_dir)
            opened = time.perf_counter()
            attachment.close()
            opens.append(opened - started)
            closes.append(time.perf_counter() - opened)
        except Exception as exc:  # counted and shown in the table
            failures.append(f"cycle {cycle}: {exc!r}")
    results.put({"opens": opens, "closes": closes, "failures": failures})


def server_facts(pid: int) -> tuple[int, float]:
    """The server's open fds and RSS in MiB, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return fds, rss / 1024


def resting_facts(pid: int) -> tuple[int, float]:
    """``server_facts`` once the fd count stops changing (connection threads close theirs asynchronously)."""
    facts = server_facts(pid)
    for _ in range(100):
        time.sleep(0.1)
        again = server_facts(pid)
        if again[0] == facts[0]:
            return again
        facts = again
    return facts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def run(args) -> int:
    from weightcache.core.client.client import Connection
    from weightcache.core.server.server_process import ServerProcess

    own_dir = None
    server = None
    socket_dir = Path(args.socket_dir) if args.socket_dir else None
    if socket_dir is None:
        own_dir = Path(tempfile.mkdtemp(prefix="wc-bench-"))
        socket_dir = own_dir
        server = ServerProcess.start(socket_dir)
    try:
        fingerprint = publish_entry(socket_dir, args.mib << 20, args.tensors)
        with Connection(socket_dir) as conn:
            pid = conn.hello()["pid"]
        before = resting_facts(pid)

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "weightcache.core.client.attach"])
        barrier = ctx.Barrier(args.clients + 1)
        results = ctx.Queue()
        procs = [
            ctx.Process(target=attach_cycles, args=(str(socket_dir), fingerprint.to_json(), args.cycles, barrier, results))
            for _ in range(args.clients)
        ]
        for proc in procs:
            proc.start()
        barrier.wait(300)
        started = time.perf_counter()
        reports = [results.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - started
        for proc in procs:
            proc.join()
        after = resting_facts(pid)
    finally:
        if server is not None:
            server.close()
        if own_dir is not None:
            for _ in range(100):  # the server removes its socket on the way out
                if not (own_dir / "weightcache.sock").exists():
                    break
                time.sleep(0.05)

    opens = [t * 1000 for r in reports for t in r["opens"]]
    closes = [t * 1000 for r in reports for t in r["closes"]]
    failures = [f for r in reports for f in r["failures"]]
    rows = [
        ("clients x cycles", f"{args.clients} x {args.cycles}"),
        ("entry", f"{args.mib} MiB in {args.tensors} tensors, 1 host arena"),
        ("cycles completed", f"{len(opens)} of {args.clients * args.cycles}"),
        ("failures", str(len(failures))),
        ("wall time", f"{wall:.2f} s"),
        ("throughput", f"{len(opens) / wall:.0f} attach/detach cycles/s"),
        ("attach p50", f"{statistics.median(opens):.2f} ms" if opens else "-"),
        ("attach p99", f"{percentile(opens, 99):.2f} ms" if opens else "-"),
        ("attach max", f"{max(opens):.2f} ms" if opens else "-"),
        ("detach p50", f"{statistics.median(closes):.2f} ms" if closes else "-"),
        ("server fds before / after", f"{before[0]} / {after[0]}"),
        ("server RSS before / after", f"{before[1]:.1f} / {after[1]:.1f} MiB"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'metric'.ljust(width)}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    for failure in failures[:5]:
        print(f"failure: {failure}")
    return 1 if failures or after[0] != before[0] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32, help="concurrent client processes (default 32)")
    parser.add_argument("--cycles", type=int, default=200, help="attach/detach cycles per client (default 200)")
    parser.add_argument("--mib", type=int, default=16, help="size of the published entry in MiB (default 16)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors in the entry (default 64)")
    parser.add_argument("--socket-dir", help="use the server on this directory instead of starting one")
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
