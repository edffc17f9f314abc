"""``weightcache probe``: its exit status for each state a server can be in, each made for real."""

from __future__ import annotations

import fcntl
import json
import os
import socket

import pytest

from tests.core.test_cli import cli
from weightcache.core.socket_dir import LOCK_NAME, SOCKET_NAME


def probe(socket_dir, *extra: str):
    return cli("probe", "--socket-dir", str(socket_dir), *extra)


def test_a_running_server_is_ready(server):
    run = probe(server.socket_dir)
    assert run.code == 0 and run.stdout.startswith(f"ready: server pid {server.pid} (weightcache "), run
    assert json.loads(probe(server.socket_dir, "--json").stdout)["health"] == "ready"
    assert not run.imported, "a probe imports no torch"


def test_no_server_is_3(socket_dir):
    run = probe(socket_dir)
    assert run.code == 3 and run.stdout.strip() == (
        f"no server: no weightcache server at {socket_dir}/{SOCKET_NAME} (no socket); "
        f"start one with `weightcache serve --socket-dir {socket_dir}`"
    ), run


def test_a_dead_servers_socket_is_no_server(socket_dir):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(socket_dir / SOCKET_NAME))  # left behind, nobody listens
    run = probe(socket_dir, "--json")
    assert run.code == 3 and json.loads(run.stdout)["health"] == "no_server", run


@pytest.fixture
def lock_held(socket_dir):
    """The directory's lock held as a starting server holds it."""
    fd = os.open(socket_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield socket_dir
    finally:
        os.close(fd)


def test_a_server_that_holds_its_lock_but_does_not_listen_yet_is_not_ready(lock_held):
    run = probe(lock_held)
    assert run.code == 4 and run.stdout.startswith("not ready: a server holds"), run


def test_a_server_that_accepts_but_never_answers_is_unhealthy(lock_held):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(lock_held / SOCKET_NAME))
        listener.listen(8)
        run = probe(lock_held, "--timeout", "0.5")
    assert run.code == 5 and run.stdout.startswith("unhealthy: the server at"), run
