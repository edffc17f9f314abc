"""A client trusts only its own server: the socket directory and the server process are checked before anything is sent.

The impostor tests need root (CI runs as root) to play another user; the
directory and peer-credential rules are also exercised without root, on real
directories and real sockets whose peer is this process.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until
from weightcache.core.client.client import Connection
from weightcache.core.errors import AccessDenied
from weightcache.core.flow.modes import load_model
from weightcache.core.socket_dir import ENV_SOCKET_DIR, SOCKET_NAME
from weightcache.core.wire.paths import check_client_dir, peer_credentials, trusted_uid, user_label

NOBODY = "nobody"


def serve_cli(socket_dir: Path) -> subprocess.CompletedProcess:
    """``weightcache serve`` on ``socket_dir`` in a fresh process (it exits at once when it refuses the directory)."""
    return subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "serve", "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def listener_in(directory: Path) -> socket.socket:
    """A real listening socket at ``directory``/weightcache.sock, owned by this process."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(directory / SOCKET_NAME))
    sock.listen(8)
    sock.setblocking(False)
    return sock


def nobody_connected(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


# --- without root: the directory rule on real directories, the peer rule on real sockets ------------------------------


@pytest.mark.parametrize(
    ("mode", "kind"), [(0o770, "group-writable"), (0o707, "world-writable"), (0o777, "both"), (None, "symlink")]
)
def test_a_client_refuses_an_unsafe_directory_before_it_connects(tmp_path, mode, kind):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    listener = listener_in(real)
    try:
        if kind == "symlink":
            target = tmp_path / "link"
            target.symlink_to(real)
            expected = "is a symlink"
        else:
            real.chmod(mode)
            target, expected = real, f"has mode {mode:04o}; others could replace the socket"
        with pytest.raises(AccessDenied, match=re.escape(expected)) as caught:
            Connection(target, timeout=2)
        assert "--socket-dir" in str(caught.value) and ENV_SOCKET_DIR in str(caught.value), "the message says what to do"
        assert nobody_connected(listener), "the client must refuse before it connects"
    finally:
        listener.close()


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o711])
def test_a_client_accepts_its_own_directory_that_others_may_read_but_not_write(tmp_path, mode):
    directory = tmp_path / "own"
    directory.mkdir(mode=0o700)
    directory.chmod(mode)
    assert check_client_dir(directory) == directory


def test_the_peer_rule_on_real_peer_credentials(tmp_path):
    """SO_PEERCRED on a real connection to a listener of this process: our own uid is trusted; another is not."""
    directory = tmp_path / "own"
    directory.mkdir(mode=0o700)
    listener = listener_in(directory)
    try:
        with Connection(directory, timeout=2) as connection:  # the directory and peer checks pass: the peer is us
            pid, uid, gid = peer_credentials(connection._sock)
            served, _ = listener.accept()
            try:
                assert peer_credentials(served)[:2] == (os.getpid(), os.geteuid())
            finally:
                served.close()
    finally:
        listener.close()
    assert (pid, uid, gid) == (os.getpid(), os.geteuid(), os.getegid())
    other = next((user.pw_uid for user in pwd.getpwall() if user.pw_uid not in (uid, 0)), uid + 1)  # a real other uid
    assert trusted_uid(uid, os.geteuid()), "a server of one's own uid is trusted"
    assert trusted_uid(uid, other) is (uid == 0), "another user trusts this process only if it runs as root"
    assert not trusted_uid(other, uid) or uid == other, "a server of another non-root uid is never trusted"


def test_serve_refuses_a_parent_others_may_write_without_the_sticky_bit(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    result = serve_cli(parent / "wc")
    assert result.returncode != 0 and "may write it without the sticky bit" in result.stderr, result.stderr
    assert not (parent / "wc").exists(), "nothing is created in an unsafe parent"
    parent.chmod(0o1777)  # like /tmp: others may write, but only the owner may rename or remove what is ours
    from weightcache.core.wire.paths import ensure_private_dir

    assert stat.S_IMODE(os.stat(ensure_private_dir(parent / "wc")).st_mode) == 0o700


# --- as root: an impostor of another user -----------------------------------------------------------------------------

_SQUATTER = r"""
import os, socket, struct, json, sys
path, captured = sys.argv[1], sys.argv[2]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o777)
server.listen(64)
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(5)
    try:
        data = conn.recv(1 << 16)
    except OSError:
        data = b""
    with open(captured, "ab") as log:
        log.write(data)
    if data:  # answer like a weightcache server would, so a client that trusted it would go on
        payload = json.dumps({"ok": True, "version": "0", "protocol": 1, "pid": os.getpid(), "uid": os.geteuid()}).encode()
        conn.sendall(struct.pack("!4sHHI", b"WCF1", 1, 0, len(payload)) + payload)
    conn.close()
"""


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture
def squatter():
    """Another user (``nobody``) made a 0777 socket directory before us and listens in it: ``(directory, captured bytes file)``."""
    if os.geteuid() != 0:
        pytest.skip("needs root to play another user (CI runs as root)")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed; cannot run a process as another user")
    if not _has_user(NOBODY):
        pytest.skip(f"no user {NOBODY!r} on this machine")
    nobody = pwd.getpwnam(NOBODY)
    directory = Path(tempfile.mkdtemp(prefix="weightcache-squat-"))
    os.chown(directory, nobody.pw_uid, nobody.pw_gid)
    directory.chmod(0o777)
    captured = directory / "captured"
    proc = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={nobody.pw_uid}",
            f"--regid={nobody.pw_gid}",
            "--clear-groups",
            sys.executable,
            "-I",
            "-c",
            _SQUATTER,
            str(directory / SOCKET_NAME),
            str(captured),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert proc.stdout.readline().strip() == "listening", proc.stderr.read()
        assert os.lstat(directory / SOCKET_NAME).st_uid == nobody.pw_uid
        yield directory, captured
    finally:
        proc.kill()
        proc.communicate(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def _nothing_captured(captured: Path) -> bool:
    time.sleep(0.2)  # the squatter writes what it read once the client hangs up
    return not captured.exists() or captured.read_bytes() == b""


def test_a_client_refuses_a_squatted_default_directory(squatter, monkeypatch):
    directory, captured = squatter
    monkeypatch.setenv(ENV_SOCKET_DIR, str(directory))  # the default path: what an engine uses with no --socket-dir
    with pytest.raises(AccessDenied) as caught:
        Connection(timeout=5)
    message = str(caught.value)
    assert f"belongs to {user_label(pwd.getpwnam(NOBODY).pw_uid)}" in message and f"({NOBODY})" in message, message
    assert "remove it" in message and "--socket-dir" in message and ENV_SOCKET_DIR in message, message
    assert _nothing_captured(captured), "nothing (above all no fingerprint) may reach the impostor"


def test_client_modes_fall_back_to_disk_from_an_impostor_and_strict_raises(squatter, monkeypatch, model_dir):
    directory, captured = squatter
    monkeypatch.setenv(ENV_SOCKET_DIR, str(directory))
    path = str(model_dir("llama"))
    cached = load_model(path, mode="client")
    assert cached.source == "disk" and f"({NOBODY})" in cached.fallback_reason and "belongs to" in cached.fallback_reason, (
        cached.fallback_reason
    )
    with pytest.raises(AccessDenied):
        load_model(path, mode="client", strict=True)
    assert _nothing_captured(captured)


def test_a_client_refuses_a_server_process_of_another_user(squatter, tmp_path):
    """The directory passes (root's own, 0700) but the process behind the socket runs as nobody: SO_PEERCRED catches it."""
    directory, captured = squatter
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    os.rename(directory / SOCKET_NAME, own / SOCKET_NAME)  # a socket keeps working when its file moves
    assert check_client_dir(own) == own
    with pytest.raises(AccessDenied) as caught:
        Connection(own, timeout=5)
    message = str(caught.value)
    assert f"runs as {user_label(pwd.getpwnam(NOBODY).pw_uid)}" in message and "nothing was sent" in message, message
    assert _nothing_captured(captured)


def test_serve_refuses_a_parent_owned_by_another_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the parent to another user (CI runs as root)")
    if not _has_user(NOBODY):
        pytest.skip(f"no user {NOBODY!r} on this machine")
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    nobody = pwd.getpwnam(NOBODY)
    os.chown(parent, nobody.pw_uid, nobody.pw_gid)
    result = serve_cli(parent / "wc")
    assert result.returncode != 0, result.stderr
    assert f"belongs to {user_label(nobody.pw_uid)}: that user could replace the socket directory" in result.stderr, result.stderr
    assert wait_until(lambda: not (parent / "wc").exists(), timeout=1)
