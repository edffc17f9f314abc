"""The metrics and health listener (``serve --metrics-port``): bounded, deadlined, bound before readiness.

Real sockets throughout: an endpoint in this process with a few connection slots, and a real server whose port
is flooded with half-sent requests by a process of another uid (``nobody``, through ``setpriv``) while its owner
runs ``weightcache status``, attaches and scrapes.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.core.support import publish_host_entry
from tests.core.test_cli import cli
from tests.helpers import ServerProcess, free_port, run_cli, wait_until
from weightcache.core.client.attach import Attachment
from weightcache.core.errors import ListenerUnavailable
from weightcache.core.server.http_endpoint import MAX_REQUEST_BYTES, HttpEndpoint, Response, bind

pytest.importorskip("prometheus_client", reason="the metrics extra is not installed (pip install -e '.[test]')")

STALLERS = 300


def get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def half_sent(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line: the request never ends
    return sock


@pytest.fixture
def endpoint():
    """An endpoint with 4 connection slots and a 1 s deadline on a loopback port, answering ``/ok``."""
    served = HttpEndpoint(bind("127.0.0.1", 0), {"/ok": lambda: Response.text(200, "fine")}, max_connections=4, deadline_s=1)
    served.start()
    try:
        yield served
    finally:
        served.close()
        served.listener.close()


def test_a_request_is_answered_past_more_stalled_connections_than_there_are_slots(endpoint):
    port = endpoint.address[1]
    stalled = [half_sent(port) for _ in range(12)]
    try:
        assert get(port, "/ok") == (200, "fine\n")
        assert endpoint.displaced >= 8, "a newcomer displaces the oldest connection once every slot is taken"
    finally:
        for sock in stalled:
            sock.close()


def test_a_stalled_connection_is_closed_at_its_deadline(endpoint):
    with half_sent(endpoint.address[1]) as sock:
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed by the endpoint, not answered
        assert 0.8 < time.monotonic() - started < 10  # its 1 s deadline, within an order of magnitude
    assert endpoint.expired == 1


def test_bad_requests_get_their_status(endpoint):
    port = endpoint.address[1]
    assert get(port, "/nope")[0] == 404
    for raw, status in [
        (b"POST /ok HTTP/1.0\r\n\r\n", b"405"),
        (b"nonsense\r\n\r\n", b"400"),
        (b"GET /ok HTTP/1.0\r\nX: " + b"y" * MAX_REQUEST_BYTES + b"\r\n\r\n", b"431"),
    ]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(raw)
            assert sock.recv(100).split()[1] == status, raw[:20]


def test_bind_refuses_in_one_error_and_leaves_nothing_bound():
    with pytest.raises(ListenerUnavailable, match="is no address or resolvable host name"):
        bind("256.1.1.1", 0)
    taken = bind("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ListenerUnavailable, match="another process listens there"):
            bind("127.0.0.1", port)
    finally:
        taken.close()


@pytest.fixture
def busy_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("host", ["busy", "256.1.1.1", "no-such-host.invalid"])
@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detach"])
def test_a_listener_that_cannot_bind_is_one_line_and_leaves_no_socket(tmp_path, busy_port, host, detach):
    socket_dir = tmp_path / "wc"
    args = ["serve", "--socket-dir", str(socket_dir), "--metrics-port", str(busy_port)]
    args += ["--metrics-host", "127.0.0.1" if host == "busy" else host] + (["--detach"] if detach else [])
    run = cli(*args, timeout=60)
    errors = [line for line in run.stderr if "error" in line.lower()]
    assert run.code == 1 and len(errors) == 1 and errors[0].startswith("weightcache: error: cannot listen on"), run
    assert "Traceback" not in "\n".join(run.stderr) and "serving on" not in "\n".join(run.stderr), run
    assert not (socket_dir / "weightcache.sock").exists(), os.listdir(socket_dir)
    assert run_cli("probe", "--socket-dir", str(socket_dir), check=False).returncode == 3, "no server may be left"


def _other_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to play another user (CI runs as root)")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed; cannot run a process as another user")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")


_STALLER = """
import socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n")
    held.append(sock)
print("stalled", len(held), flush=True)
sys.stdin.readline()  # hold them until told
closed = 0
for sock in held:
    sock.settimeout(0.01)
    try:
        closed += sock.recv(1) == b""
    except ConnectionResetError:  # closed with the request unread
        closed += 1
    except OSError:
        pass
print("closed", closed, flush=True)
"""


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def test_hundreds_of_stalled_clients_of_another_uid_starve_neither_the_owner_nor_the_probes(tmp_path):
    other = _other_user()
    port = free_port()
    server = ServerProcess.start(tmp_path / "wc", "--metrics-port", str(port))
    entry = publish_host_entry(server.socket_dir)

    def owner_steps() -> float:
        """``weightcache status``, an attach and the three paths of the port, as the owner; their time."""
        started = time.monotonic()
        assert "1 entry" in run_cli("status", "--socket-dir", str(server.socket_dir)).stdout
        Attachment.open(entry.fingerprint, server.socket_dir).close()
        assert get(port, "/healthz")[0] == 200 and get(port, "/readyz")[0] == 200
        code, text = get(port, "/metrics")
        assert code == 200 and "weightcache_hits_total" in text
        return time.monotonic() - started

    unhindered = owner_steps()  # also warms the test's own imports and process starter
    as_other = ["setpriv", f"--reuid={other.pw_uid}", f"--regid={other.pw_gid}", "--clear-groups"]
    staller = subprocess.Popen(
        [*as_other, sys.executable, "-I", "-c", _STALLER, str(port), str(STALLERS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert staller.stdout.readline().split() == ["stalled", str(STALLERS)], staller.stderr.read()
        threads = _threads(server.pid)
        hindered = owner_steps()
        assert hindered < unhindered + 5, (
            f"the owner's steps took {hindered:.1f} s with the stalled clients, {unhindered:.1f} s without"
        )
        assert threads < 20, f"{threads} threads in the server for {STALLERS} HTTP connections: one per connection?"
        time.sleep(6)  # past the deadline: every stalled connection has been displaced or closed
        out, err = staller.communicate("go\n", timeout=60)
        assert out.split()[-2:] == ["closed", str(STALLERS)], (out, err)
    finally:
        if staller.poll() is None:
            staller.kill()
            staller.communicate(timeout=10)
        server.close()
    assert wait_until(lambda: not server.socket_dir.exists() or not (server.socket_dir / "weightcache.sock").exists())
