"""A real ``weightcache serve`` process: requests, malformed frames, signals, locks, directory checks, peer uids, evict."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.core.support import (
    SOME_CHECKSUM,
    frame,
    host_manifest,
    inode,
    make_fingerprint,
    pattern,
    publish_host_entry,
    raw_connect,
    read_replies,
    resting_fd_count,
    sealed_memfd,
    send_raw,
    settle_fd_count,
)
from tests.helpers import ServerProcess, run_cli, wait_until
from weightcache.core import PROTOCOL_VERSION
from weightcache.core.arena import ArenaSpec
from weightcache.core.client.client import Connection
from weightcache.core.errors import (
    AccessDenied,
    FingerprintMismatch,
    ServerError,
    ServerUnavailable,
)
from weightcache.core.socket_dir import LOCK_NAME, SOCKET_NAME
from weightcache.core.wire.paths import ensure_private_dir, user_label
from weightcache.core.wire.protocol import (
    MAX_FRAME_BYTES,
    FrameReader,
    close_fds,
    send_frame,
)

TEST_USER = "wctest"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the ``weightcache`` command in a fresh process (its exit status is the test's to check)."""
    return run_cli(*args, timeout=timeout, check=False)


def status(socket_dir) -> dict:
    with Connection(socket_dir, timeout=10) as conn:
        return conn.status()


def read_arena(fd: int, size: int) -> bytes:
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
        return bytes(mapped)


# --- requests ---------------------------------------------------------------------------------------


def test_hello_and_status(server):
    with Connection(server.socket_dir) as conn:
        hello = conn.hello()
        assert hello["ok"] is True
        assert hello["protocol"] == PROTOCOL_VERSION and hello["pid"] == server.pid and hello["uid"] == os.geteuid()
        state = conn.status()
    assert state["entries"] == [] and state["held_bytes"] == 0 and state["pid"] == server.pid
    assert stat.S_IMODE(os.stat(server.socket_dir).st_mode) == 0o700
    sock_info = os.lstat(server.socket_dir / SOCKET_NAME)
    assert stat.S_ISSOCK(sock_info.st_mode) and stat.S_IMODE(sock_info.st_mode) == 0o600


def test_publish_and_attach_a_host_entry(server):
    fingerprint = make_fingerprint()
    data = pattern(16384)
    fd, spec = sealed_memfd(data)
    manifest = host_manifest(spec, len(data))
    try:
        with Connection(server.socket_dir) as conn:
            first = conn.publish(fingerprint, manifest, [fd], label="wire-test")
            again = conn.publish(fingerprint, manifest, [fd], label="wire-test")
        assert first["created"] is True and first["digest"] == fingerprint.digest
        assert again["created"] is False, "publishing the same fingerprint twice keeps the first entry"
        [entry] = status(server.socket_dir)["entries"]
        assert entry["digest"] == fingerprint.digest and entry["label"] == "wire-test"
        assert entry["bytes"] == spec.size and entry["tensors"] == 1 and entry["arenas"] == 1
        assert entry["rank"] == "tp1/2 pp0/1 ep0/1" and entry["attached_pids"] == []

        holder = Connection(server.socket_dir)
        try:
            reply = holder.attach(fingerprint)
            try:
                assert reply.digest == fingerprint.digest and reply.label == "wire-test"
                assert reply.manifest() == manifest
                assert len(reply.fds) == 1 and inode(reply.fds[0]) == inode(fd), "the engine must get the published memfd itself"
                assert read_arena(reply.fds[0], spec.size)[: len(data)] == data
                seals = fcntl.fcntl(reply.fds[0], fcntl.F_GET_SEALS)
                assert seals & fcntl.F_SEAL_WRITE, "a published host arena is sealed against writes"
                with pytest.raises(PermissionError):
                    mmap.mmap(reply.fds[0], spec.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                assert status(server.socket_dir)["entries"][0]["attached_pids"] == [os.getpid()]
                holder.detach(reply.digest)
                assert status(server.socket_dir)["entries"][0]["attached_pids"] == []
                close_fds(holder.attach(fingerprint).fds)  # attached again; closing the connection detaches
            finally:
                close_fds(reply.fds)
        finally:
            holder.close()
        assert wait_until(lambda: status(server.socket_dir)["entries"][0]["attached_pids"] == []), (
            "closing the connection detaches"
        )
    finally:
        os.close(fd)


def test_attach_names_the_mismatched_fields(server):
    published = publish_host_entry(server.socket_dir)
    with Connection(server.socket_dir) as conn, pytest.raises(FingerprintMismatch) as info:
        conn.attach(make_fingerprint(dtype="bfloat16", engine_version="1"))
    assert set(info.value.fields) == {"dtype", "engine_version"} and info.value.closest == published.digest


def test_several_entries_at_once(server):
    digests = {publish_host_entry(server.socket_dir, make_fingerprint(tp_rank=rank)).digest for rank in (0, 1)}
    digests.add(publish_host_entry(server.socket_dir, make_fingerprint(architecture="Other", tp_size=1, tp_rank=0)).digest)
    entries = status(server.socket_dir)["entries"]
    assert {e["digest"] for e in entries} == digests and len(digests) == 3


# --- malformed frames -------------------------------------------------------------------------------


def _publish_message(fingerprint, manifest) -> bytes:
    return json.dumps({"op": "publish", "fingerprint": fingerprint.to_json(), "manifest": manifest.to_json()}).encode()


def _make_case(name: str, published, tmp_path: Path):
    """``(bytes, fds, expected error code, whether the connection stays open)`` for malformed case ``name``."""
    fp_json = published.fingerprint.to_json()
    other_fp = make_fingerprint(tp_rank=0)
    fd, spec = sealed_memfd(pattern(4096))
    manifest = host_manifest(spec, 4096)
    read_end, write_end = os.pipe()
    regular = os.open(tmp_path / "plain-file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(regular, 4096)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    small_fd, _ = sealed_memfd(b"x")
    big_manifest = host_manifest(ArenaSpec(backend="host", size=1 << 20, checksum=SOME_CHECKSUM), 4096)
    odd_manifest = host_manifest(ArenaSpec(backend="tape", size=4096, checksum=SOME_CHECKSUM), 4096)
    owned = [fd, read_end, write_end, regular, unsealed, small_fd]

    def request(message: dict, fds=(), stays_open=True, code="bad_request"):
        return frame(json.dumps(message).encode(), nfds=len(fds)), list(fds), code, stays_open

    def publish(fds, manifest_=manifest):
        data = _publish_message(other_fp, manifest_)
        return frame(data, nfds=len(fds)), list(fds), "bad_request", True

    cases = {
        "garbage-bytes": (b"GET / HTTP/1.1\r\nHost: weightcache\r\n\r\n", [], "protocol_error", False),
        "wrong-version": (frame(b'{"op":"hello"}', version=PROTOCOL_VERSION + 1), [], "protocol_error", False),
        "too-large": (frame(b"{}", length=MAX_FRAME_BYTES + 1), [], "protocol_error", False),
        "non-json": (frame(b"\x00\xffnot json"), [], "protocol_error", False),
        "non-object-json": (frame(b'["hello"]'), [], "protocol_error", False),
        "deeply-nested-json": (frame(b'{"op":' + b"[" * 50_000 + b"]" * 50_000 + b"}"), [], "protocol_error", False),
        "declared-fds-mismatch": (frame(b'{"op":"hello"}', nfds=2), [read_end], "protocol_error", False),
        "truncated": (frame(b'{"op":"hello"}')[:9], [fd], "protocol_error", False),
        "unknown-op": request({"op": "launch_missiles"}),
        "missing-op": request({"fingerprint": fp_json}),
        "op-not-a-string-with-fds": request({"op": ["hello"]}, [fd, read_end]),
        "fds-with-hello": request({"op": "hello"}, [fd, read_end, write_end]),
        "fds-with-attach": request({"op": "attach", "fingerprint": fp_json}, [fd]),
        "publish-no-fds": publish([]),
        "publish-two-fds-for-one-arena": publish([fd, small_fd]),
        "publish-a-pipe": publish([read_end]),
        "publish-a-regular-file": publish([regular]),
        "publish-an-unsealed-memfd": publish([unsealed]),
        "publish-a-memfd-smaller-than-its-manifest": publish([fd], big_manifest),
        "publish-an-unknown-backend": publish([fd], odd_manifest),
        "publish-malformed-manifest": request({"op": "publish", "fingerprint": fp_json, "manifest": {"tensors": 3}}, [fd]),
        "publish-malformed-fingerprint": request({"op": "publish", "fingerprint": [1], "manifest": manifest.to_json()}, [fd]),
        "attach-fingerprint-missing-fields": request({"op": "attach", "fingerprint": {"checkpoint": "x"}}),
        "attach-fingerprint-not-an-object": request({"op": "attach", "fingerprint": "abc"}),
        "attach-fingerprint-extra-is-a-list": request({"op": "attach", "fingerprint": {**fp_json, "extra": ["kernel"]}}),
        "attach-fingerprint-unhashable-extra": request({"op": "attach", "fingerprint": {**fp_json, "extra": [[1]]}}),
        "detach-without-digest": request({"op": "detach"}),
        "evict-short-prefix": request({"op": "evict", "digest": "ab"}),
    }
    return cases[name], owned


MALFORMED = [
    "garbage-bytes",
    "wrong-version",
    "too-large",
    "non-json",
    "non-object-json",
    "deeply-nested-json",
    "declared-fds-mismatch",
    "truncated",
    "unknown-op",
    "missing-op",
    "op-not-a-string-with-fds",
    "fds-with-hello",
    "fds-with-attach",
    "publish-no-fds",
    "publish-two-fds-for-one-arena",
    "publish-a-pipe",
    "publish-a-regular-file",
    "publish-an-unsealed-memfd",
    "publish-a-memfd-smaller-than-its-manifest",
    "publish-an-unknown-backend",
    "publish-malformed-manifest",
    "publish-malformed-fingerprint",
    "attach-fingerprint-missing-fields",
    "attach-fingerprint-not-an-object",
    "attach-fingerprint-extra-is-a-list",
    "attach-fingerprint-unhashable-extra",
    "detach-without-digest",
    "evict-short-prefix",
]


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_frame_gets_an_error_and_the_server_goes_on(server, tmp_path, case):
    published = publish_host_entry(server.socket_dir)
    baseline = resting_fd_count(server.pid)
    (data, fds, code, stays_open), owned = _make_case(case, published, tmp_path)
    try:
        sock = raw_connect(server.socket_dir)
        try:
            send_raw(sock, data, fds)
            if stays_open:
                reply, reply_fds = FrameReader(sock, deadline_s=10).read(idle_timeout=10)
                assert reply_fds == []
                assert reply["ok"] is False and reply["error"]["code"] == code, reply
                send_frame(sock, {"op": "hello"})
                assert FrameReader(sock).read(idle_timeout=10)[0]["ok"] is True, "the connection must stay usable"
            else:
                sock.shutdown(socket.SHUT_WR)
                replies = read_replies(sock)
                assert len(replies) <= 1, replies
                for reply in replies:
                    assert reply["ok"] is False and reply["error"]["code"] == code, reply
        finally:
            sock.close()
    finally:
        close_fds(owned)
    with Connection(server.socket_dir) as conn:
        assert conn.hello()["pid"] == server.pid, "a fresh client must still be served"
        assert [e["digest"] for e in conn.status()["entries"]] == [published.digest], "a refused publish leaves no entry"
    count = settle_fd_count(server.pid, baseline)
    assert count == baseline, f"server holds {count} fds after the bad frame, {baseline} before"
    assert server.proc.poll() is None
    assert "unexpected error" not in server.log(), server.log()


_SERVE_WITH_LOW_FD_LIMIT = """
import resource, sys
from weightcache.core.cli.cli import main
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.exit(main(["serve", "--socket-dir", sys.argv[1]]))
"""


def test_a_frame_with_more_fds_than_the_default_soft_limit_arrives_whole(socket_dir):
    """A server started with a low soft fd limit lifts it: a frame may carry up to 4,096 fds."""
    log_path = Path(str(socket_dir) + ".server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE_WITH_LOW_FD_LIMIT, str(socket_dir)], stdout=log, stderr=log, start_new_session=True
        )
    server = ServerProcess(socket_dir, proc, log_path)
    try:
        wait_until(lambda: "serving on" in server.log() or proc.poll() is not None, timeout=20)
        baseline = resting_fd_count(server.pid)
        fd, _ = sealed_memfd(b"many")
        try:
            sock = raw_connect(socket_dir)
            try:
                send_frame(sock, {"op": "hello"}, [fd] * 1500)
                reply, _ = FrameReader(sock).read(idle_timeout=10)
            finally:
                sock.close()
        finally:
            os.close(fd)
        assert reply["ok"] is False and reply["error"]["message"].endswith("takes no fds; 1500 were closed"), reply
        assert settle_fd_count(server.pid, baseline) == baseline
    finally:
        assert server.stop() == 0
        log_path.unlink(missing_ok=True)


# --- lifecycle --------------------------------------------------------------------------------------


def test_sigterm_exits_cleanly_and_removes_the_socket(server):
    published = publish_host_entry(server.socket_dir)
    idle = raw_connect(server.socket_dir)
    holder = Connection(server.socket_dir)
    try:
        reply = holder.attach(published.fingerprint)
        try:
            assert server.stop() == 0
            assert not (server.socket_dir / SOCKET_NAME).exists(), "a stopped server removes its socket"
            assert "server stopping" in server.log()
            assert read_arena(reply.fds[0], published.manifest.arenas[0].size)[:64] == published.data[:64], (
                "an engine's mapping outlives the server"
            )
        finally:
            close_fds(reply.fds)
    finally:
        holder.close()
        idle.close()


def test_a_second_server_on_the_same_directory_refuses_to_start(server):
    second = cli("serve", "--socket-dir", str(server.socket_dir))
    assert second.returncode != 0
    assert f"a weightcache server (pid {server.pid}) already serves" in second.stderr, second.stderr
    with Connection(server.socket_dir) as conn:
        assert conn.hello()["pid"] == server.pid, "the first server still owns the socket"


def test_stale_socket_of_a_killed_server_is_removed_by_the_next(socket_dir):
    first = ServerProcess.start(socket_dir)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=20)
    assert stat.S_ISSOCK(os.lstat(socket_dir / SOCKET_NAME).st_mode), "SIGKILL leaves the socket file behind"
    with pytest.raises(ServerUnavailable, match="nobody listens"):
        Connection(socket_dir)
    second = ServerProcess.start(socket_dir)
    try:
        with Connection(socket_dir) as conn:
            assert conn.hello()["pid"] == second.pid
        assert "removing the stale socket" in second.log()
    finally:
        assert second.stop() == 0


def test_a_non_socket_in_the_sockets_place_is_left_alone(socket_dir):
    (socket_dir / SOCKET_NAME).write_text("not a socket")
    result = cli("serve", "--socket-dir", str(socket_dir))
    assert result.returncode != 0 and "is not a socket; remove it by hand" in result.stderr, result.stderr
    assert (socket_dir / SOCKET_NAME).read_text() == "not a socket"


# --- the socket directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "0770", "0777", "other-uid", "not-a-directory"])
def test_unsafe_socket_directory_is_refused(tmp_path, kind):
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o700)
    target, expected = real, ""
    if kind == "symlink":
        target, expected = tmp_path / "link", "is a symlink"
        target.symlink_to(real)
    elif kind in ("0770", "0777"):
        real.chmod(int(kind, 8))
        expected = f"has mode {kind}; others could replace the socket"
    elif kind == "other-uid":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another uid")
        os.chown(real, 65534, 65534)
        expected = f"belongs to {user_label(65534)}, not to you"
    else:
        target, expected = tmp_path / "file", "is not a directory"
        target.write_text("")
    with pytest.raises(AccessDenied, match=re.escape(expected)):
        ensure_private_dir(target)
    result = cli("serve", "--socket-dir", str(target))
    assert result.returncode != 0, "the server must refuse the directory"
    assert "weightcache: error:" in result.stderr and expected in result.stderr, result.stderr
    assert not (real / SOCKET_NAME).exists() and not (real / LOCK_NAME).exists()


def test_a_missing_socket_directory_is_created_private(tmp_path):
    created = ensure_private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(os.stat(created).st_mode) == 0o700 and os.stat(created).st_uid == os.geteuid()


# --- other users ------------------------------------------------------------------------------------

# Another user cannot exec this interpreter (it lives under /root, mode 0700), so the child
# starts as root, imports everything it needs and only then switches to the test user.
_SERVER_AS_USER = """
import logging, os, sys
import weightcache.core.arena.host, weightcache.core.layout.manifest
from weightcache.core.server.server import ServerConfig, serve
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
serve(ServerConfig(socket_dir=sys.argv[3]))
"""

_HELLO_AS_USER = """
import json, os, sys
from weightcache.core.arena import ArenaSpec
from weightcache.core.client.client import Connection
from weightcache.core.errors import WeightCacheError
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
try:
    with Connection(sys.argv[3], timeout=10) as conn:
        print(json.dumps({"ok": True, "uid": conn.hello()["uid"]}))
except WeightCacheError as exc:
    print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}))
"""


@pytest.fixture(scope="module")
def test_user() -> tuple[int, int]:
    """``(uid, gid)`` of a system user other than us, created if missing (needs root; CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create the test user and switch to it (CI runs as root)")
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("useradd is not installed; cannot create a second user")
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
            capture_output=True,
            timeout=60,
            check=False,
        )  # may race another session creating it: look it up again
        entry = pwd.getpwnam(TEST_USER)
    return entry.pw_uid, entry.pw_gid


def hello_as(user: tuple[int, int], socket_dir: Path) -> dict:
    uid, gid = user
    result = subprocess.run(
        [sys.executable, "-c", _HELLO_AS_USER, str(uid), str(gid), str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def foreign_server(test_user):
    """A server running as the test user, on a 0700 directory that user owns."""
    uid, gid = test_user
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
    os.chown(socket_dir, uid, gid)
    socket_dir.chmod(0o700)
    log_path = Path(str(socket_dir) + ".server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER_AS_USER, str(uid), str(gid), str(socket_dir)],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    server = ServerProcess(socket_dir, proc, log_path)
    try:
        # No hello to wait with (it would be refused): the log line comes once the socket listens.
        assert wait_until(lambda: "serving on" in server.log() or proc.poll() is not None, timeout=20)
        assert proc.poll() is None, f"the test user's server did not start:\n{server.log()}"
        yield server
    finally:
        try:
            server.stop()
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
        log_path.unlink(missing_ok=True)


def test_a_client_of_another_uid_is_refused_by_its_peer_credentials(foreign_server, test_user):
    uid, _ = test_user
    info = os.lstat(foreign_server.socket_dir / SOCKET_NAME)
    assert info.st_uid == uid and stat.S_IMODE(info.st_mode) == 0o600
    # Our own client refuses another user's directory before it connects (tests/core/test_trust.py)...
    with pytest.raises(AccessDenied, match=re.escape(f"belongs to {user_label(uid)}")):
        Connection(foreign_server.socket_dir, timeout=10)
    # ...so speak to the server directly: root may enter the user's 0700 directory, and only SO_PEERCRED stands between.
    sock = raw_connect(foreign_server.socket_dir)
    try:
        try:
            send_frame(sock, {"op": "hello"})
        except BrokenPipeError:  # the refusal can come first, on connect: its reply is still there to read
            pass
        replies = read_replies(sock)
    finally:
        sock.close()
    assert [r["error"]["code"] for r in replies] == ["access_denied"], replies
    assert f"uid {os.geteuid()} may not use a server of uid {uid}" in replies[0]["error"]["message"]
    assert wait_until(lambda: f"refused pid {os.getpid()} of uid {os.geteuid()}" in foreign_server.log()), foreign_server.log()
    # The refusal is about the uid: the server's own user is served.
    assert hello_as(test_user, foreign_server.socket_dir) == {"ok": True, "uid": uid}
    assert foreign_server.proc.poll() is None


def test_a_client_of_another_uid_cannot_reach_a_root_server(server, test_user):
    result = hello_as(test_user, server.socket_dir)
    assert result["ok"] is False and result["error"] == "AccessDenied", result
    assert f"permission denied on {server.socket_dir / SOCKET_NAME}" in result["message"]
    with Connection(server.socket_dir) as conn:
        assert conn.hello()["pid"] == server.pid


# --- evict and the status table ---------------------------------------------------------------------


def test_evict_refuses_an_attached_entry_until_it_is_detached(server):
    published = publish_host_entry(server.socket_dir, label="evict-me")
    prefix = published.digest[:12]
    holder = Connection(server.socket_dir)
    try:
        reply = holder.attach(published.fingerprint)
        close_fds(reply.fds)
        with Connection(server.socket_dir) as conn, pytest.raises(ServerError) as info:
            conn.evict(prefix)
        assert info.value.code == "attached" and f"attached by pids [{os.getpid()}]" in str(info.value)

        table = cli("status", "--socket-dir", str(server.socket_dir))
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert f"server pid {server.pid}" in lines[0] and "1 entry," in lines[0]
        assert lines[1].startswith("  since its start "), "the second line says what the server counted"
        header, row = lines[2].split(), lines[3]
        assert header[0] == "ID" and "ATTACHED" in header
        assert row.startswith(prefix) and "evict-me" in row and row.rstrip().endswith(str(os.getpid())), table.stdout

        refused = cli("evict", "--socket-dir", str(server.socket_dir), prefix)
        assert refused.returncode != 0 and "--force" in refused.stderr, refused.stderr

        holder.detach(published.digest)
        evicted = cli("evict", "--socket-dir", str(server.socket_dir), prefix)
        assert evicted.returncode == 0 and evicted.stdout.strip() == f"evicted {prefix}", evicted.stderr
        assert status(server.socket_dir)["entries"] == []
        empty = cli("status", "--socket-dir", str(server.socket_dir))
        assert "0 entries" in empty.stdout
    finally:
        holder.close()


def test_force_evict_frees_the_servers_fds_and_keeps_engine_mappings(server):
    baseline = resting_fd_count(server.pid)
    published = publish_host_entry(server.socket_dir)
    holder = Connection(server.socket_dir)
    try:
        reply = holder.attach(published.fingerprint)
        try:
            forced = cli("evict", "--force", "--socket-dir", str(server.socket_dir), published.digest[:8])
            assert forced.returncode == 0, forced.stderr
            assert status(server.socket_dir)["entries"] == []
            assert read_arena(reply.fds[0], published.manifest.arenas[0].size)[: len(published.data)] == published.data
        finally:
            close_fds(reply.fds)
    finally:
        holder.close()
    assert settle_fd_count(server.pid, baseline) == baseline
    unknown = cli("evict", "--socket-dir", str(server.socket_dir), "ffffffff")
    assert unknown.returncode != 0 and "no entry matches" in unknown.stderr


def test_a_server_starts_on_a_socket_directory_whose_parent_nobody_made(tmp_path):
    socket_dir = tmp_path / "not" / "made" / "sock"
    server = ServerProcess.start(socket_dir)
    try:
        with Connection(socket_dir) as conn:
            assert conn.hello()["pid"] == server.pid
        assert (socket_dir.stat().st_mode & 0o777) == 0o700
    finally:
        server.close()
