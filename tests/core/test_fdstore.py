"""systemd's fd store, with a datagram socket standing in for systemd (it speaks sd_notify's documented protocol)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.core.support import make_fingerprint, publish_host_entry
from tests.fdstore_standin import StandInManager
from tests.helpers import wait_until
from weightcache.core.arena.checksum import SCHEME
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import ServerUnavailable
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
