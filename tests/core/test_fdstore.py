"""systemd's fd store, with a datagram socket standing in for systemd (it speaks sd_notify's documented protocol)."""

from __future__ import annotations

import array
import os
import signal
import socket
import subprocess
import threading

from tests.core.support import make_fingerprint, publish_host_entry
from tests.helpers import wait_until
from weightcache.core.attach import Attachment
from weightcache.core.client import Connection
from weightcache.core.errors import ServerUnavailable
from weightcache.core.protocol import close_fds
from weightcache.core.server_process import serve_command


class StandInManager:
    """Records FDSTORE/FDSTOREREMOVE datagrams as systemd would: one fd per name here (the server sends one per name)."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.store: dict[str, int] = {}
        self.messages: list[dict] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        space = socket.CMSG_SPACE(253 * 4)
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, space)
            except TimeoutError:
                continue
            fds = array.array("i")
            for level, kind, blob in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(blob[: len(blob) - len(blob) % fds.itemsize])
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self.lock:
                self.messages.append(fields)
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1":
                    close_fds([self.store.pop(name)] if name in self.store else [])
                    self.store[name] = fds[0]
                    close_fds(fds[1:])
                elif fields.get("FDSTOREREMOVE") == "1":
                    close_fds([self.store.pop(name)] if name in self.store else [])
                else:
                    close_fds(fds)

    def digests(self) -> set[str]:
        with self.lock:
            return {name.split(".")[1] for name in self.store}

    def start_server(self, socket_dir, log) -> subprocess.Popen:
        """Start a server as systemd restarts a unit: the stored fds from fd 3 on, named in LISTEN_FDNAMES."""
        with self.lock:
            names, fds = list(self.store), list(self.store.values())
        high = [os.dup(fd) for fd in fds]  # out of the way of fds 3..n

        def arrange() -> None:
            for offset, fd in enumerate(high):
                os.dup2(fd, 3 + offset)

        env = {
            **os.environ,
            "NOTIFY_SOCKET": self.sock.getsockname(),
            "LISTEN_FDS": str(len(fds)),
            "LISTEN_FDNAMES": ":".join(names),
        }
        command = ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", *serve_command(socket_dir)]
        try:
            with open(log, "ab") as out:
                return subprocess.Popen(command, env=env, stdout=out, stderr=out, close_fds=False, preexec_fn=arrange)
        finally:
            close_fds(high)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        close_fds(self.store.values())


def _digests(socket_dir) -> set[str]:
    with Connection(socket_dir, timeout=10) as conn:
        return {row["digest"] for row in conn.status()["entries"]}


def _serving(socket_dir, pid: int) -> bool:
    try:
        with Connection(socket_dir, timeout=10) as conn:
            return conn.status()["pid"] == pid
    except (ServerUnavailable, OSError):
        return False


def _plain_server(socket_dir, manager: StandInManager, log) -> subprocess.Popen:
    env = {**os.environ, "NOTIFY_SOCKET": manager.sock.getsockname()}
    with open(log, "ab") as out:
        return subprocess.Popen(serve_command(socket_dir), env=env, stdout=out, stderr=out)


def test_a_sigkilled_server_under_systemd_gets_every_entry_back_from_the_fd_store(socket_dir, tmp_path):
    manager = StandInManager(str(tmp_path / "notify"))
    log = tmp_path / "server.log"
    first = second = None
    try:
        first = _plain_server(socket_dir, manager, log)
        assert wait_until(lambda: _serving(socket_dir, first.pid), timeout=20), log.read_text()
        assert wait_until(lambda: {"READY": "1"} in manager.messages, timeout=10), "no READY=1"
        entries = [publish_host_entry(socket_dir, make_fingerprint(architecture=f"Kept{n}"), label=f"k{n}") for n in range(5)]
        published = {entry.digest for entry in entries}
        assert wait_until(lambda: manager.digests() == published, timeout=10), manager.messages[-5:]
        with Connection(socket_dir, timeout=10) as conn:
            conn.evict(entries[0].digest)
        assert wait_until(lambda: manager.digests() == published - {entries[0].digest}, timeout=10), "FDSTOREREMOVE missing"

        first.send_signal(signal.SIGKILL)  # nothing is kept by any engine: only the store holds the fds
        first.wait(timeout=10)
        second = manager.start_server(socket_dir, log)
        assert wait_until(lambda: _serving(socket_dir, second.pid), timeout=20), log.read_text()[-3000:]
        assert _digests(socket_dir) == published - {entries[0].digest}
        attachment = Attachment.open(entries[1].fingerprint, socket_dir)
        try:
            assert attachment.reattach() is False  # its bytes check against their checksum, and the entry is there
        finally:
            attachment.close()
        assert "Traceback" not in log.read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        manager.close()


def test_fds_systemd_passed_that_do_not_make_an_entry_are_closed_and_the_rest_served(socket_dir, tmp_path):
    manager = StandInManager(str(tmp_path / "notify"))
    log = tmp_path / "server.log"
    first = second = None
    try:
        first = _plain_server(socket_dir, manager, log)
        assert wait_until(lambda: _serving(socket_dir, first.pid), timeout=20)
        good = publish_host_entry(socket_dir, make_fingerprint(architecture="Good"))
        bad = publish_host_entry(socket_dir, make_fingerprint(architecture="Bad"))
        assert wait_until(lambda: manager.digests() == {good.digest, bad.digest}, timeout=10)
        first.kill()
        first.wait(timeout=10)
        with manager.lock:  # the bad entry loses its table: incomplete
            close_fds([manager.store.pop(f"wc.{bad.digest}.1")])
        second = manager.start_server(socket_dir, log)
        assert wait_until(lambda: _serving(socket_dir, second.pid), timeout=20), log.read_text()[-3000:]
        assert _digests(socket_dir) == {good.digest}
        assert "not re-serving entry" in log.read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        manager.close()
