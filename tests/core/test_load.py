"""Load: 32 client processes attach and detach one entry 200 times each; all succeed and the server stays flat."""

from __future__ import annotations

import multiprocessing
import os
import time

from tests.core.support import fd_count, publish_host_entry, resting_fd_count, rss_kib
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.wire.protocol import close_fds

CLIENTS = int(os.environ.get("WEIGHTCACHE_LOAD_CLIENTS", "32"))
CYCLES = int(os.environ.get("WEIGHTCACHE_LOAD_CYCLES", "200"))
RSS_TOLERANCE_KIB = 20 << 10


def _check_bytes(attachment, expected: bytes) -> bool:
    import torch

    return attachment.tensors["w"].view(torch.uint8)[: len(expected)].tolist() == list(expected)


def attach_cycles(socket_dir: str, fingerprint: dict, expected: bytes, cycles: int, barrier, results) -> None:
    """One client process: ``cycles`` times Attachment.open, check the bytes, close; report to ``results``."""
    from weightcache.core.client.attach import Attachment

    fp = Fingerprint.from_json(fingerprint)
    latencies, failures = [], []
    fds_before = fd_count()
    barrier.wait(120)
    for cycle in range(cycles):
        started = time.perf_counter()
        try:
            attachment = Attachment.open(fp, socket_dir)
            latencies.append(time.perf_counter() - started)
            try:
                if not _check_bytes(attachment, expected):
                    failures.append(f"cycle {cycle}: the mapped bytes differ from the published ones")
            finally:
                attachment.close()
        except Exception as exc:  # reported to the parent, which fails the test with it
            failures.append(f"cycle {cycle}: {exc!r}")
    results.put({"pid": os.getpid(), "latencies": latencies, "failures": failures, "fds_leaked": fd_count() - fds_before})


def run_clients(socket_dir, fingerprint: Fingerprint, expected: bytes, clients: int, cycles: int) -> list[dict]:
    """Start ``clients`` processes (forkserver with torch preloaded, so none pays for ``import torch``)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "weightcache.core.client.attach", __name__])
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=attach_cycles, args=(str(socket_dir), fingerprint.to_json(), expected, cycles, barrier, results))
        for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=300) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        results.join_thread()
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return reports


def test_concurrent_attach_detach_cycles(server):
    entry = publish_host_entry(server.socket_dir, nbytes=1 << 20, label="load")
    # Warm the server up (threads, allocator) before the baseline, then let it rest.
    for _ in range(50):
        with Connection(server.socket_dir) as conn:
            close_fds(conn.attach(entry.fingerprint).fds)
    fds_before = resting_fd_count(server.pid)
    rss_before = rss_kib(server.pid)

    started = time.monotonic()
    reports = run_clients(server.socket_dir, entry.fingerprint, entry.data[:256], CLIENTS, CYCLES)
    elapsed = time.monotonic() - started

    failures = [f"pid {r['pid']}: {f}" for r in reports for f in r["failures"]]
    assert not failures, f"{len(failures)} of {CLIENTS * CYCLES} cycles failed, e.g.:\n" + "\n".join(failures[:10])
    assert sum(len(r["latencies"]) for r in reports) == CLIENTS * CYCLES
    assert all(r["fds_leaked"] == 0 for r in reports), [r["fds_leaked"] for r in reports]

    fds_after = resting_fd_count(server.pid)
    rss_after = rss_kib(server.pid)
    assert fds_after == fds_before, f"server fds went from {fds_before} to {fds_after} after {CLIENTS * CYCLES} cycles"
    assert rss_after <= rss_before + RSS_TOLERANCE_KIB, f"server RSS went from {rss_before} KiB to {rss_after} KiB"
    with Connection(server.socket_dir) as conn:
        [listed] = conn.status()["entries"]
    assert listed["attached_pids"] == [], "every client detached"
    assert server.proc.poll() is None
    assert elapsed < 300
