"""No single peer can exhaust the server, and no bad entry can exhaust or crash a client.

Real server processes with small limits (through ServerConfig and the CLI's
flags), real sockets and real fds: bursts of connects, idle connections held
open, peers flooding fds or bytes on frames they never finish, a server out of
file descriptors. The server must stay up, serve a good client (or answer
``busy``, on which client modes fall back to disk), and end with the fds it
started with.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

from tests.core.support import (
    fd_count,
    host_manifest,
    make_fingerprint,
    pattern,
    publish_host_entry,
    publish_raw,
    raw_connect,
    raw_wire,
    read_replies,
    resting_fd_count,
    sealed_memfd,
    settle_fd_count,
)
from tests.helpers import ServerProcess, wait_until
from weightcache.core import PROTOCOL_VERSION
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection, wait_for_server
from weightcache.core.errors import EntryNotFound, EntryUnusable, ServerError, ServerUnavailable
from weightcache.core.flow.loader import prepare
from weightcache.core.flow.modes import load_model
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.request import LoadRequest
from weightcache.core.socket_dir import SOCKET_NAME
from weightcache.core.wire.protocol import FDS_PER_MESSAGE, HEADER, MAGIC, MAX_FDS, close_fds, encode

_SERVE = """
import json, logging, resource, sys
from weightcache.core.server.server import ServerConfig, serve
options = json.loads(sys.argv[2])
open_files = options.pop("open_files", None)
if open_files:
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
serve(ServerConfig(socket_dir=sys.argv[1], **options))
"""


@contextlib.contextmanager
def configured_server(socket_dir: Path, **options):
    """A server process with ``ServerConfig(**options)`` (``open_files``: its RLIMIT_NOFILE, soft and hard)."""
    log_path = Path(str(socket_dir) + ".server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(socket_dir), json.dumps(options)], stdout=log, stderr=log, start_new_session=True
        )
    server = ServerProcess(socket_dir, proc, log_path)
    try:
        wait_for_server(socket_dir, timeout=30)
        yield server
    finally:
        try:
            server.stop()
        except subprocess.TimeoutExpired:
            server.kill()
        log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def flag_server(socket_dir: Path, *flags: str):
    """``weightcache serve --socket-dir DIR FLAGS...``."""
    server = ServerProcess.start(socket_dir, *flags)
    try:
        yield server
    finally:
        try:
            server.stop()
        except subprocess.TimeoutExpired:
            server.kill()
        server.log_path.unlink(missing_ok=True)


@pytest.fixture
def fd_room():
    """Room for thousands of sockets and fds in flight in this process (the soft limit is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 16384
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard limit on open files ({hard}) is below 4096")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def sendmsg(sock: socket.socket, data: bytes, fds=()) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", list(fds)))] if fds else []
    sock.sendmsg([data], ancillary)


def is_open(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock``'s other end (nothing to read, no end of stream)."""
    sock.setblocking(False)
    try:
        sock.recv(1)  # data or the end of the stream: either way not an open, idle connection
    except BlockingIOError:
        return True
    except OSError:
        pass
    finally:
        sock.settimeout(10)
    return False


def hangs_up_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (fails after ``seconds``)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        assert sock.recv(1) == b"", "the server sent something to an idle connection"
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {seconds} s")
    return time.monotonic() - started


# --- the acceptance test ----------------------------------------------------------------------------------------------


def _flood_before_the_header(socket_dir: Path, memfd: int, results: dict) -> None:
    """Batches of fds on the header's first bytes: at most one batch may come before the header."""
    sock = raw_connect(socket_dir)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for index in range(HEADER.size - 1):
                sendmsg(sock, MAGIC[:1] if index == 0 else b"\0", [memfd] * FDS_PER_MESSAGE)
        results["before_header"] = read_replies(sock)
    finally:
        sock.close()


def _flood_an_unfinished_frame(socket_dir: Path, memfd: int, results: dict, name: str) -> None:
    """A header declaring MAX_FDS fds, all of them sent, and a payload that never ends."""
    sock = raw_connect(socket_dir)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sendmsg(sock, HEADER.pack(MAGIC, PROTOCOL_VERSION, MAX_FDS, 1 << 20), [memfd] * FDS_PER_MESSAGE)
            for start in range(FDS_PER_MESSAGE, MAX_FDS, FDS_PER_MESSAGE):
                sendmsg(sock, b"{", [memfd] * min(FDS_PER_MESSAGE, MAX_FDS - start))
        results[name] = read_replies(sock, timeout=30)  # dropped at the frame deadline, or refused as busy
    finally:
        sock.close()


def test_a_burst_idle_connections_and_an_fd_flood_cannot_take_the_server_down(socket_dir, fd_room):
    with flag_server(socket_dir, "--frame-deadline", "2") as server:
        entry = publish_host_entry(socket_dir, nbytes=4096)
        for _ in range(20):
            with Connection(socket_dir) as conn:
                conn.hello()
        baseline = resting_fd_count(server.pid)
        memfd, _ = sealed_memfd(b"flood")
        idle: list[socket.socket] = []
        burst: list[socket.socket] = []
        results: dict = {}
        try:
            idle += [raw_connect(socket_dir) for _ in range(1024)]
            assert wait_until(lambda: fd_count(server.pid) >= baseline + 1024, timeout=30), (
                "the server did not take 1,024 connections"
            )
            _flood_before_the_header(socket_dir, memfd, results)
            floods = [
                threading.Thread(target=_flood_an_unfinished_frame, args=(socket_dir, memfd, results, f"unfinished-{i}"))
                for i in range(2)
            ]
            for thread in floods:
                thread.start()

            # 300 connects at once: none may find the listen queue full.
            refused = 0
            for _ in range(300):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect(str(socket_dir / SOCKET_NAME))
                except BlockingIOError:
                    refused += 1
                burst.append(sock)
            assert refused == 0, f"{refused} of 300 connects found the listen queue full"

            # 300 clients at once, each a hello: every one is served (idle connections make room).
            failures: list[str] = []
            barrier = threading.Barrier(300)

            def hello() -> None:
                barrier.wait(30)
                try:
                    with Connection(socket_dir, timeout=30) as conn:
                        conn.hello()
                except Exception as exc:  # reported by the test thread
                    failures.append(repr(exc))

            clients = [threading.Thread(target=hello) for _ in range(300)]
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join(60)
            assert not failures, f"{len(failures)} of 300 clients failed, e.g. {failures[:3]}"

            # A good client attaches and reads the published bytes.
            attachment = Attachment.open(entry.fingerprint, socket_dir, timeout=30)
            try:
                assert bytes(attachment.arenas[0].bytes_view()[:64].tolist()) == entry.data[:64]
            finally:
                attachment.close()
            for thread in floods:
                thread.join(60)
                assert not thread.is_alive()
        finally:
            for sock in idle + burst:
                sock.close()
            os.close(memfd)
        assert [r["error"]["code"] for r in results["before_header"]] == ["protocol_error"], results
        assert "arrived before the frame's header was complete" in results["before_header"][0]["error"]["message"]
        for name in ("unfinished-0", "unfinished-1"):
            assert all(r["error"]["code"] == "busy" for r in results[name]), results[name]
        assert server.proc.poll() is None, server.log()[-3000:]
        count = settle_fd_count(server.pid, baseline, timeout=30)
        assert count == baseline, f"the server holds {count} fds afterwards, {baseline} before"
        assert "unexpected error" not in server.log()
        assert "to make room for a new connection" in server.log()


# --- idle connections -------------------------------------------------------------------------------------------------


def test_an_idle_connection_is_closed_but_an_attached_one_stays(socket_dir):
    with flag_server(socket_dir, "--idle-timeout", "0.5") as server:
        entry = publish_host_entry(socket_dir)
        idle = raw_connect(socket_dir)
        try:
            assert 0.4 <= hangs_up_within(idle, 10) < 5
        finally:
            idle.close()
        holder = Connection(socket_dir, timeout=10)
        try:
            close_fds(holder.attach(entry.fingerprint).fds)
            time.sleep(1.5)  # three idle times: an attach session may idle forever
            holder.detach(entry.digest)  # still served
            time.sleep(1.5)  # nothing attached any more: it is an idle connection now
            with pytest.raises(ServerUnavailable):
                holder.hello()
        finally:
            holder.close()
        assert "idle for 0.5 s with nothing attached" in server.log()


# --- a full table -----------------------------------------------------------------------------------------------------


def test_a_full_table_sheds_the_longest_idle_connection_and_answers_busy_only_when_none_is_idle(socket_dir, model_dir):
    with flag_server(socket_dir, "--max-connections", "4", "--idle-timeout", "0") as server:
        entry = publish_host_entry(socket_dir)
        holders = [Connection(socket_dir, timeout=10)]
        close_fds(holders[0].attach(entry.fingerprint).fds)
        idle = []
        try:
            for _ in range(3):
                idle.append(raw_connect(socket_dir))
                time.sleep(0.1)  # accepted in this order: the first is the longest idle
            for index in range(3):  # each newcomer displaces the longest-idle connection, never an attached one
                holders.append(Connection(socket_dir, timeout=10))
                close_fds(holders[-1].attach(entry.fingerprint).fds)
                assert hangs_up_within(idle[index], 10) < 5
                assert all(is_open(sock) for sock in idle[index + 1 :])
            with pytest.raises(ServerError) as caught, Connection(socket_dir, timeout=10) as conn:
                conn.hello()
            assert caught.value.code == "busy"
            # Client mode (the one mode runner every adapter goes through): a busy server costs a disk load, not a
            # crash; strict raises.
            path = str(model_dir("llama"))
            cached = load_model(path, mode="client", socket_dir=socket_dir)
            assert cached.source == "disk" and "(busy)" in cached.fallback_reason, cached.fallback_reason
            with pytest.raises(ServerError):
                load_model(path, mode="client", socket_dir=socket_dir, strict=True)
            for holder in holders:
                assert holder.status()["entries"][0]["digest"] == entry.digest, "attached connections are never shed"
        finally:
            for sock in idle:
                sock.close()
            for holder in holders:
                holder.close()
        assert "to make room for a new connection" in server.log()


# --- fds on one frame -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["two-batches-before-the-header", "more-than-declared"])
def test_fds_beyond_what_a_frame_may_carry_are_refused_at_once(server, case):
    baseline = resting_fd_count(server.pid)
    memfd, _ = sealed_memfd(b"fds")
    sock = raw_connect(server.socket_dir)
    started = time.monotonic()
    try:
        if case == "two-batches-before-the-header":
            sendmsg(sock, MAGIC[:1], [memfd] * FDS_PER_MESSAGE)
            sendmsg(sock, MAGIC[1:2], [memfd] * FDS_PER_MESSAGE)
            expected = f"{2 * FDS_PER_MESSAGE} fds arrived before the frame's header was complete"
        else:
            sendmsg(sock, HEADER.pack(MAGIC, PROTOCOL_VERSION, 1, 100), [memfd])
            sendmsg(sock, b"{", [memfd] * FDS_PER_MESSAGE)
            expected = f"frame declared 1 fds but carried {FDS_PER_MESSAGE + 1}"
        replies = read_replies(sock)  # the frame is never finished: only an early refusal answers
    finally:
        sock.close()
        os.close(memfd)
    assert time.monotonic() - started < 5, "refused at once, not at the 10 s frame deadline"
    assert [r["error"]["code"] for r in replies] == ["protocol_error"] and expected in replies[0]["error"]["message"], replies
    assert settle_fd_count(server.pid, baseline) == baseline
    assert server.proc.poll() is None


# --- what all unfinished frames hold together -------------------------------------------------------------------------


def test_fds_held_by_unfinished_frames_are_capped_server_wide(socket_dir):
    with configured_server(socket_dir, max_inflight_fds=300, frame_deadline_s=3.0) as server:
        baseline = resting_fd_count(server.pid)
        memfd, _ = sealed_memfd(b"fds")
        first, second = raw_connect(socket_dir), raw_connect(socket_dir)
        try:
            header = HEADER.pack(MAGIC, PROTOCOL_VERSION, FDS_PER_MESSAGE, 100)
            sendmsg(first, header, [memfd] * FDS_PER_MESSAGE)  # 250 fds, and a payload that never comes
            assert wait_until(lambda: fd_count(server.pid) >= baseline + 1 + FDS_PER_MESSAGE)
            sendmsg(second, header, [memfd] * FDS_PER_MESSAGE)  # 250 more would pass 300
            replies = read_replies(second)
            assert [r["error"]["code"] for r in replies] == ["busy"], replies
            assert "unfinished frames already hold 250 fds" in replies[0]["error"]["message"]
            publish_host_entry(socket_dir)  # a two-fd publish (an arena and its table) still fits beside the first frame
            assert hangs_up_within(first, 10) < 5, "the unfinished frame is dropped at its deadline"
        finally:
            first.close()
            second.close()
            os.close(memfd)
        assert settle_fd_count(server.pid, baseline + 2) == baseline + 2  # plus the published arena and its table


def test_payload_bytes_in_flight_wait_briefly_then_get_busy(socket_dir):
    with configured_server(socket_dir, max_inflight_bytes=1 << 20, inflight_wait_s=0.3, frame_deadline_s=20.0) as server:
        big = encode({"op": "hello", "pad": "x" * 800_000})
        holder = raw_connect(socket_dir, timeout=20)
        try:
            holder.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(big)) + big[:1000])  # reserves 800 KB, sends 1 KB
            time.sleep(0.3)
            started = time.monotonic()
            with pytest.raises(ServerError) as caught, Connection(socket_dir, timeout=20) as conn:
                conn.request({"op": "hello", "pad": "y" * 400_000})
            waited = time.monotonic() - started
            assert caught.value.code == "busy" and "did not fit within 0.3 s" in str(caught.value)
            assert 0.25 <= waited < 5, f"refused after {waited:.2f} s"
            with (
                pytest.raises(ServerError, match="exceeds the 1048576 bytes the server reads at once"),
                Connection(socket_dir, timeout=20) as conn,
            ):
                conn.request({"op": "hello", "pad": "z" * 1_100_000})
            holder.sendall(big[1000:])  # the first frame completes and frees its bytes
            assert [r["ok"] for r in _replies_until_closed(holder, 1)] == [True]
        finally:
            holder.close()
        with Connection(socket_dir, timeout=20) as conn:
            assert conn.request({"op": "hello", "pad": "y" * 400_000})[0]["ok"] is True
        assert server.proc.poll() is None


def _replies_until_closed(sock: socket.socket, count: int) -> list[dict]:
    sock.shutdown(socket.SHUT_WR)
    replies = read_replies(sock)
    assert len(replies) == count, replies
    return replies


# --- out of file descriptors ------------------------------------------------------------------------------------------


def _publish_arenas(socket_dir: Path, count: int, tp_rank: int) -> None:
    """An entry of ``count`` one-page arenas: it holds ``count`` of the server's fds."""
    fds, specs = [], []
    try:
        for _ in range(count):
            fd, spec = sealed_memfd(pattern(4096))
            fds.append(fd)
            specs.append(spec)
        record = TensorRecord(
            name="w",
            kind="parameter",
            dtype="float32",
            shape=(1024,),
            stride=(1,),
            storage_offset=0,
            arena=0,
            offset=0,
            nbytes=4096,
        )
        manifest = Manifest(tensors=[record], arenas=specs)
        with Connection(socket_dir, timeout=10) as conn:
            conn.publish(make_fingerprint(tp_rank=tp_rank, tp_size=8), manifest, fds)
    finally:
        close_fds(fds)


def test_running_out_of_fds_at_accept_sheds_idle_connections_instead_of_exiting(socket_dir):
    with configured_server(socket_dir, open_files=128) as server:  # 64 connections, 32 fds in flight
        entry = publish_host_entry(socket_dir)
        _publish_arenas(socket_dir, 30, tp_rank=2)
        _publish_arenas(socket_dir, 30, tp_rank=3)  # the registry now holds 61 of the 128 fds
        baseline = resting_fd_count(server.pid)
        idle = []
        try:
            for _ in range(100):  # more than fit: accept() fails with EMFILE long before 64 connections
                idle.append(raw_connect(socket_dir))
            assert wait_until(lambda: "accept() failed: Too many open files" in server.log(), timeout=20), server.log()[-2000:]
            attachment = Attachment.open(entry.fingerprint, socket_dir, timeout=30)
            try:
                assert attachment.tensors["w"].numel() == 4096
            finally:
                attachment.close()
            assert server.proc.poll() is None
        finally:
            for sock in idle:
                sock.close()
        assert settle_fd_count(server.pid, baseline, timeout=20) == baseline
        assert server.log().count("accept() failed") == 1, "one log line per burst"
        assert "unexpected error" not in server.log()


# --- the client's side --------------------------------------------------------------------------------------------------


def test_a_full_listen_queue_is_retried_until_the_timeout(tmp_path):
    directory = tmp_path / "queue"
    directory.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / SOCKET_NAME))
    listener.listen(0)
    queued = []
    try:
        while True:  # fill the queue: a non-blocking connect then fails with EAGAIN
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(directory / SOCKET_NAME))
            except BlockingIOError:
                sock.close()
                break
            queued.append(sock)
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match="listen queue stayed full"):
            Connection(directory, timeout=0.5)
        assert 0.4 <= time.monotonic() - started < 10  # its 0.5 s timeout, within an order of magnitude
        drain = threading.Timer(0.3, lambda: [listener.accept()[0].close() for _ in range(len(queued) + 1)])
        drain.start()
        with Connection(directory, timeout=10):
            pass  # connected once the queue had room
        drain.join()
    finally:
        for sock in queued:
            sock.close()
        listener.close()


def _unusable(kind: str, data_size: int = 4096) -> tuple[int, dict]:
    """A sealed memfd and a manifest (JSON form) the server accepts but no client can use."""
    fd, spec = sealed_memfd(pattern(data_size))
    if kind == "cuda-arena-on-a-host-memfd":
        spec = attrs.evolve(spec, backend="cuda", device="GPU-00000000-0000-0000-0000-000000000000")
        return fd, host_manifest(spec, data_size).to_json()
    manifest = host_manifest(spec, data_size).to_json()
    manifest["tensors"][0]["shape"] = [-5]  # a negative shape: no view can be made of it
    return fd, manifest


def _publish_unusable(socket_dir, fingerprint, kind: str) -> None:
    fd, manifest = _unusable(kind)
    try:
        with Connection(socket_dir, timeout=10) as conn:
            try:
                publish_raw(conn, fingerprint, *raw_wire(manifest), [fd])
            except ServerError as exc:
                if exc.code == "bad_request":
                    pytest.skip(f"the server refuses this manifest at publish ({exc}): no client can receive it")
                raise
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["cuda-arena-on-a-host-memfd", "negative-shape"])
def test_an_attach_that_fails_closes_every_fd_it_received(server, kind):
    fingerprint = make_fingerprint()
    _publish_unusable(server.socket_dir, fingerprint, kind)
    before = fd_count()
    for _ in range(3):
        with pytest.raises(EntryUnusable, match="cannot be used here"):
            Attachment.open(fingerprint, server.socket_dir)
    with pytest.raises(EntryNotFound):
        Attachment.open(make_fingerprint(tp_rank=0), server.socket_dir)
    assert fd_count() == before, f"{fd_count() - before:+d} fds leaked by failed attaches"

    def detached() -> bool:
        with Connection(server.socket_dir) as conn:
            return conn.status()["entries"][0]["attached_pids"] == []

    assert wait_until(detached), "every failed attach closed its connection"


@pytest.mark.parametrize("kind", ["cuda-arena-on-a-host-memfd", "negative-shape"])
def test_client_modes_fall_back_from_an_entry_they_cannot_use(server, model_dir, kind):
    path = str(model_dir("llama"))
    prepared = prepare(LoadRequest(model=path))
    _publish_unusable(server.socket_dir, prepared.fingerprint, kind)
    before = fd_count()
    with pytest.raises(EntryUnusable):
        load_model(path, mode="client", socket_dir=server.socket_dir, strict=True)
    assert fd_count() == before, "the failed attach closed what it received"
    loaded = load_model(path, mode="client", socket_dir=server.socket_dir)
    assert loaded.source == "disk" and "cannot be used here" in loaded.fallback_reason, loaded.fallback_reason
