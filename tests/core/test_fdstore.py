"""systemd's fd store, with a datagram socket standing in for systemd (it speaks sd_notify's documented protocol)."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess

import pytest

from tests.core.support import ALL_SEALS, make_fingerprint, publish_host_entry
from tests.fdstore_standin import StandInManager
from tests.helpers import run_cli, wait_until
from weightcache.core.arena.checksum import SCHEME
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import EntryCorrupt, EntryNotFound, ServerError, ServerUnavailable
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.request import LoadRequest
from weightcache.core.server.rewarm import SCRUB_PAUSE_ENV
from weightcache.core.server.server_process import serve_command
from weightcache.core.wire.protocol import close_fds


def _digests(socket_dir) -> set[str]:
    with Connection(socket_dir, timeout=10) as conn:
        return {row["digest"] for row in conn.status()["entries"]}


def _serving(socket_dir, pid: int) -> bool:
    try:
        with Connection(socket_dir, timeout=10) as conn:
            return conn.status()["pid"] == pid
    except (ServerUnavailable, OSError):
        return False


def _started(socket_dir, managed, from_store: bool = False) -> subprocess.Popen:
    """A server under the stand-in (``from_store``: started with the stored fds, as systemd restarts a unit), serving."""
    manager, log, procs = managed
    if from_store:
        proc = manager.start_server(socket_dir, log)
    else:
        with open(log, "ab") as out:
            env = {**os.environ, "NOTIFY_SOCKET": manager.sock.getsockname()}
            proc = subprocess.Popen(serve_command(socket_dir), env=env, stdout=out, stderr=out)
    procs.append(proc)
    assert wait_until(lambda: _serving(socket_dir, proc.pid), timeout=20), log.read_text()[-3000:]
    return proc


@pytest.fixture
def managed(tmp_path):
    """A stand-in for systemd, the servers' log, and a list of the servers started (killed afterwards)."""
    manager = StandInManager(str(tmp_path / "notify"))
    procs: list[subprocess.Popen] = []
    try:
        yield manager, tmp_path / "server.log", procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        manager.close()


def test_a_sigkilled_server_under_systemd_gets_every_entry_back_from_the_fd_store(socket_dir, managed):
    manager, log, _ = managed
    first = _started(socket_dir, managed)
    assert wait_until(lambda: any(m.get("READY") == "1" for m in manager.messages), timeout=10), "no READY=1"
    entries = [publish_host_entry(socket_dir, make_fingerprint(architecture=f"Kept{n}"), label=f"k{n}") for n in range(5)]
    published = {entry.digest for entry in entries}
    assert wait_until(lambda: manager.digests() == published, timeout=10), manager.messages[-5:]
    with Connection(socket_dir, timeout=10) as conn:
        conn.evict(entries[0].digest)
    assert wait_until(lambda: manager.digests() == published - {entries[0].digest}, timeout=10), "FDSTOREREMOVE missing"
    metrics = _metrics(socket_dir)
    assert metrics["fdstore"] is True and metrics["fdstore_fds"] == 4 * 3 and metrics["fdstore_failures"] == 0, metrics

    first.send_signal(signal.SIGKILL)  # nothing is kept by any engine: only the store holds the fds
    first.wait(timeout=10)
    _started(socket_dir, managed, from_store=True)
    assert _digests(socket_dir) == published - {entries[0].digest}
    attachment = Attachment.open(entries[1].fingerprint, socket_dir)
    try:
        assert attachment.reattach() is False  # its bytes check against their checksum, and the entry is there
    finally:
        attachment.close()
    assert "Traceback" not in log.read_text()


def test_fds_systemd_passed_that_do_not_make_an_entry_are_closed_and_the_rest_served(socket_dir, managed):
    manager, log, _ = managed
    first = _started(socket_dir, managed)
    good = publish_host_entry(socket_dir, make_fingerprint(architecture="Good"))
    bad = publish_host_entry(socket_dir, make_fingerprint(architecture="Bad"))
    assert wait_until(lambda: manager.digests() == {good.digest, bad.digest}, timeout=10)
    first.kill()
    first.wait(timeout=10)
    with manager.lock:  # the bad entry loses its table: incomplete
        close_fds([manager.store.pop(f"wc.{bad.digest}.1")])
    _started(socket_dir, managed, from_store=True)
    assert _digests(socket_dir) == {good.digest}
    assert "not re-serving entry" in log.read_text()


def test_entries_back_from_the_fd_store_are_scrubbed_and_a_lying_one_is_dropped(socket_dir, managed):
    manager, log, _ = managed
    first = _started(socket_dir, managed)
    good = publish_host_entry(socket_dir, make_fingerprint(architecture="Honest"))
    liar = publish_host_entry(socket_dir, make_fingerprint(architecture="Liar"), checksum=f"{SCHEME}:{'c3' * 16}")
    assert wait_until(lambda: manager.digests() == {good.digest, liar.digest}, timeout=10)
    first.kill()
    first.wait(timeout=10)
    _started(socket_dir, managed, from_store=True)
    assert wait_until(lambda: _digests(socket_dir) == {good.digest}, timeout=120), "the scrub did not drop the lying entry"
    assert wait_until(lambda: "weightcache verify on the entries from systemd's fd store: exit 2" in log.read_text(), timeout=30)


def test_sigusr2_restarts_the_server_in_place_and_names_its_successor_the_main_process(socket_dir, managed):
    """The successor is the server's own child (under systemd: in the unit's cgroup), takes every entry over, and
    the old server tells the service manager ``MAINPID=<successor>`` instead of ``STOPPING=1``."""
    manager, log, _ = managed
    first = _started(socket_dir, managed)
    published = {publish_host_entry(socket_dir, make_fingerprint(architecture=f"InPlace{n}")).digest for n in range(3)}
    assert wait_until(lambda: manager.digests() == published, timeout=10)
    first.send_signal(signal.SIGUSR2)
    assert first.wait(timeout=30) == 0, log.read_text()[-3000:]
    with Connection(socket_dir, timeout=10) as conn:
        status = conn.status()
    successor = status["pid"]
    try:
        assert successor != first.pid
        assert {row["digest"] for row in status["entries"]} == published
        assert {"MAINPID": str(successor)} in manager.messages
        assert not any(m.get("STOPPING") == "1" for m in manager.messages), "the unit must not be told it stops"
        assert manager.digests() == published, "the fd store lost entries"
    finally:
        os.kill(successor, signal.SIGTERM)


def test_a_successor_command_takes_over_and_never_detaches():
    from weightcache.core.server.reexec import successor_command

    tail = successor_command(["--log-format", "json", "serve", "--socket-dir", "/run/wc", "--detach", "--log-file", "x"])
    assert tail[-6:] == ["--log-format", "json", "serve", "--socket-dir", "/run/wc", "--take-over"]
    assert successor_command(["serve", "--log-file=x", "--take-over", "--detach"])[-2:] == ["serve", "--take-over"]
    with pytest.raises(ValueError, match="not a `weightcache serve` command line"):
        successor_command(["load", "--model", "m"])


# --- entries back from the fd store are verified before they are served (issue 24, criterion 2) ----------------------


def _metrics(socket_dir) -> dict:
    with Connection(socket_dir, timeout=10) as conn:
        return conn.status()["metrics"]


def _rows(socket_dir) -> dict[str, dict]:
    with Connection(socket_dir, timeout=10) as conn:
        return {row["digest"]: row for row in conn.status()["entries"]}


def _stored(socket_dir, managed, *architectures: str):
    """A server under the stand-in store, one host entry published per architecture and kept in the store: (server, entries)."""
    manager = managed[0]
    first = _started(socket_dir, managed)
    entries = [publish_host_entry(socket_dir, make_fingerprint(architecture=name), label=name.lower()) for name in architectures]
    assert wait_until(lambda: manager.digests() == {entry.digest for entry in entries}, timeout=10)
    return first, entries


def _crash_and_restart_from_store(socket_dir, managed, server: subprocess.Popen) -> subprocess.Popen:
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=10)
    return _started(socket_dir, managed, from_store=True)


def _other_bytes_in_store(manager: StandInManager, digest: str, arena: int = 0) -> None:
    """Hand back a different sealed memfd under the arena's name: same size, one byte changed (what a bug, or memory
    that changed while no server held it, would leave; the server's own sealed memfd cannot be written)."""
    name = f"wc.{digest}.{2 + arena}"
    with manager.lock:
        old = manager.store[name]
        data = bytearray(os.pread(old, os.fstat(old).st_size, 0))
        data[len(data) // 2] ^= 0x40
        fd = os.memfd_create("weightcache-test-corrupt", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.pwrite(fd, bytes(data), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ALL_SEALS)
        manager.store[name] = fd
        os.close(old)


def test_an_entry_whose_bytes_changed_in_the_fd_store_is_never_served_and_is_dropped(
    socket_dir, managed, model_dir, monkeypatch, caplog
):
    manager, log, _ = managed
    monkeypatch.setenv(SCRUB_PAUSE_ENV, "600")  # the clients below find the corruption, not the scrub
    first = _started(socket_dir, managed)
    paths = [model_dir("llama"), model_dir("llama", "bfloat16")]
    published = [publish(prepare(LoadRequest(model=str(path))), socket_dir) for path in paths]
    assert wait_until(lambda: manager.digests() == {p.digest for p in published}, timeout=10)
    for entry in published:
        _other_bytes_in_store(manager, entry.digest)
    _crash_and_restart_from_store(socket_dir, managed, first)
    with Connection(socket_dir, timeout=10) as conn, pytest.raises(EntryNotFound) as missed:
        close_fds(conn.attach(published[0].fingerprint).fds)  # a client that does not verify: a miss, never these bytes
    assert missed.value.unverified and "not verified yet" in str(missed.value)
    rows = _rows(socket_dir)
    assert [rows[p.digest]["verified"] for p in published] == [False, False]  # admitted (sizes, seals), not checked

    with caplog.at_level(logging.WARNING, logger="weightcache.core.flow.modes"):
        loaded = load_model(str(paths[0]), mode="client", socket_dir=socket_dir)
    try:
        assert loaded.source == "disk", "a client used an entry whose bytes changed"
        assert "came back after a server crash with other bytes" in loaded.fallback_reason, loaded.fallback_reason
        assert "it was dropped from the server" in loaded.fallback_reason
    finally:
        loaded.close()
    fallbacks = [r for r in caplog.records if r.name == "weightcache.core.flow.modes" and "from disk" in r.getMessage()]
    assert len(fallbacks) == 1, [r.getMessage() for r in caplog.records]
    with pytest.raises(EntryCorrupt) as strict:
        load_model(str(paths[1]), mode="client", socket_dir=socket_dir, strict=True)
    assert strict.value.dropped and strict.value.arena == 0
    assert _rows(socket_dir) == {}, "a corrupt entry nobody else attached must be dropped"
    with Connection(socket_dir, timeout=10) as conn:
        metrics = conn.status()["metrics"]
    assert metrics["fallbacks"]["corrupt"] == 1 and metrics["evictions"]["request"] == 2, metrics
    # The store forgets an entry when its manager has read the server's FDSTOREREMOVE datagram: asynchronous.
    assert wait_until(lambda: not manager.digests(), timeout=10), "the fd store keeps a dropped entry"
    assert "Traceback" not in log.read_text()


def test_an_intact_entry_from_the_fd_store_is_served_to_a_verifying_client_and_then_to_every_client(
    socket_dir, managed, monkeypatch
):
    monkeypatch.setenv(SCRUB_PAUSE_ENV, "600")
    first, [entry] = _stored(socket_dir, managed, "Intact")
    _crash_and_restart_from_store(socket_dir, managed, first)
    with Connection(socket_dir, timeout=10) as plain:
        with pytest.raises(EntryNotFound):
            close_fds(plain.attach(entry.fingerprint).fds)
        with pytest.raises(ServerError, match="not attached over this connection"):
            plain.verified(entry.digest, [spec.checksum for spec in entry.manifest.arenas])  # only after checking it
        reply = plain.attach(entry.fingerprint, verifies=True)
        close_fds(reply.fds)
        assert reply.verify
        with pytest.raises(ServerError, match="not entry"):
            plain.verified(entry.digest, [f"{SCHEME}:{'0' * 32}"])
    assert _rows(socket_dir)[entry.digest]["verified"] is False
    assert _metrics(socket_dir)["unverified_entries"] == 1
    shown = run_cli("status", "--socket-dir", str(socket_dir)).stdout
    assert "intact (unverified)" in shown, shown

    attachment = Attachment.open(entry.fingerprint, socket_dir)  # checksums the mapped arenas, then says so
    try:
        assert bytes(attachment.arenas[0].bytes_view()[: len(entry.data)].numpy()) == entry.data
        assert "verify_s" in attachment.timings and not attachment.unverified
    finally:
        attachment.close()
    assert _rows(socket_dir)[entry.digest]["verified"] is True
    with Connection(socket_dir, timeout=10) as plain:
        close_fds(plain.attach(entry.fingerprint).fds)  # served to every client now
    assert "(unverified)" not in run_cli("status", "--socket-dir", str(socket_dir)).stdout


def test_the_scrub_verifies_the_entries_from_the_fd_store(socket_dir, managed):
    _, log, _ = managed
    first, entries = _stored(socket_dir, managed, "Scrubbed0", "Scrubbed1")
    _crash_and_restart_from_store(socket_dir, managed, first)
    assert wait_until(lambda: all(row["verified"] for row in _rows(socket_dir).values()), timeout=120), log.read_text()[-3000:]
    assert set(_rows(socket_dir)) == {entry.digest for entry in entries}
    with Connection(socket_dir, timeout=10) as plain:
        close_fds(plain.attach(entries[0].fingerprint).fds)


def test_an_engine_that_republishes_after_the_crash_verifies_the_entry_from_the_store(socket_dir, managed, monkeypatch):
    manager, _, _ = managed
    monkeypatch.setenv(SCRUB_PAUSE_ENV, "600")
    first, [entry] = _stored(socket_dir, managed, "Republished")
    attachment = Attachment.open(entry.fingerprint, socket_dir)
    try:
        _crash_and_restart_from_store(socket_dir, managed, first)
        assert _rows(socket_dir)[entry.digest]["verified"] is False
        assert attachment.reattach() is False  # it checked its own mapping first: the server now holds those bytes
        assert _rows(socket_dir)[entry.digest]["verified"] is True
        assert manager.digests() == {entry.digest}
    finally:
        attachment.close()


def test_an_unverified_entry_stays_unverified_through_a_restart_in_place(socket_dir, managed, monkeypatch):
    _, log, _ = managed
    monkeypatch.setenv(SCRUB_PAUSE_ENV, "600")
    first, [entry] = _stored(socket_dir, managed, "HandedOn")
    second = _crash_and_restart_from_store(socket_dir, managed, first)
    second.send_signal(signal.SIGUSR2)
    assert second.wait(timeout=30) == 0, log.read_text()[-3000:]
    with Connection(socket_dir, timeout=10) as conn:
        successor = conn.status()["pid"]
    try:
        assert successor != second.pid
        assert _rows(socket_dir)[entry.digest]["verified"] is False
    finally:
        os.kill(successor, signal.SIGTERM)
