"""Readiness under systemd (``Type=notify``): a real datagram socket stands in for systemd's ``$NOTIFY_SOCKET``."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from weightcache.core.client.client import Connection
from weightcache.core.server.server_process import serve_command


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request):
    """A bound datagram socket and the ``$NOTIFY_SOCKET`` value that names it (a path, or ``@name``)."""
    directory = Path(tempfile.mkdtemp(prefix="wc-notify-"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        sock.bind(str(directory / "notify"))
        name = str(directory / "notify")
    else:
        abstract = f"weightcache-test-{os.getpid()}-{id(sock)}"
        sock.bind("\0" + abstract)
        name = "@" + abstract
    sock.settimeout(60)
    try:
        yield sock, name
    finally:
        sock.close()
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()


def test_the_server_tells_systemd_it_is_ready_once_it_answers_and_when_it_stops(notify_socket, socket_dir, tmp_path):
    sock, name = notify_socket
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(serve_command(socket_dir), env={**os.environ, "NOTIFY_SOCKET": name}, stdout=log, stderr=log)
    try:
        states = sock.recv(4096).decode().splitlines()
        assert "READY=1" in states and f"MAINPID={proc.pid}" in states, states
        with Connection(socket_dir, timeout=5) as connection:  # ready means an engine can attach now
            assert connection.hello()["pid"] == proc.pid
        proc.terminate()
        assert sock.recv(4096).decode() == "STOPPING=1"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    from weightcache.core.server import readiness

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert readiness.notify("READY=1") is False
