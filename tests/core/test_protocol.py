"""The wire format over real socketpairs: round trips with many fds, every malformed frame, and no fd leaks."""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import resource
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.support import fd_count, frame, inode, send_raw
from weightcache.core import PROTOCOL_VERSION
from weightcache.core.errors import ProtocolError
from weightcache.core.wire.protocol import (
    FDS_PER_MESSAGE,
    HEADER,
    MAGIC,
    MAX_FDS,
    MAX_FRAME_BYTES,
    FrameReader,
    close_fds,
    encode,
    send_frame,
)


@pytest.fixture
def pair():
    """``(sender, receiver)``: the two ends of a real Unix stream socketpair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def no_fd_leak():
    """The body leaves this process with exactly as many open fds as it found."""
    before = fd_count()
    yield
    after = fd_count()
    assert after == before, f"{after - before:+d} fds leaked ({before} before, {after} after)"


@contextlib.contextmanager
def memfds(count: int):
    """``count`` distinct memfds (distinct inodes), closed afterwards."""
    fds = [os.memfd_create(f"wire-{i}", os.MFD_CLOEXEC) for i in range(count)]
    try:
        yield fds
    finally:
        close_fds(fds)


class Sender(threading.Thread):
    """Sends from another thread, so a frame larger than the socket buffer cannot block the test."""

    def __init__(self, target, *args):
        super().__init__(daemon=True)
        self._target_fn, self._args, self.error = target, args, None

    def run(self):
        try:
            self._target_fn(*self._args)
        except BaseException as exc:  # handed to the test thread by join()
            self.error = exc

    def join(self, timeout=10.0):
        super().join(timeout)
        assert not self.is_alive(), "sender did not finish"
        if self.error is not None:
            raise self.error


# --- round trips ------------------------------------------------------------------------------------


@pytest.fixture
def fd_headroom():
    """Room for a frame of MAX_FDS fds in this process (the soft limit is often 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * MAX_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"the hard limit on open files ({hard}) is below {wanted}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("nfds", [0, 1, 300, 1000, MAX_FDS])
def test_round_trip_carries_every_fd_in_order(pair, fd_headroom, nfds):
    a, b = pair
    with no_fd_leak(), memfds(7) as files:
        sent = [files[i % len(files)] for i in range(nfds)]  # repeats are allowed: each one arrives as a new fd
        message = {"op": "probe", "n": nfds, "text": "héllo ✓", "nested": {"list": [1, 2.5, None, True]}}
        sender = Sender(send_frame, a, message, sent)
        sender.start()
        got_message, got = FrameReader(b).read(idle_timeout=10)
        sender.join()
        try:
            assert got_message == message
            assert len(got) == nfds, f"{nfds} fds sent, {len(got)} received"
            assert len(set(got)) == nfds, "every received fd must be a distinct descriptor"
            mismatched = [i for i, (s, r) in enumerate(zip(sent, got, strict=True)) if inode(s) != inode(r)]
            assert not mismatched, f"received fds {mismatched[:5]} refer to other files than the ones sent there"
        finally:
            close_fds(got)


def test_fds_split_across_messages_at_the_documented_batch_size(pair):
    a, b = pair
    with no_fd_leak(), memfds(1) as (memfd,):
        sender = Sender(send_frame, a, {"op": "probe"}, [memfd] * (FDS_PER_MESSAGE + 1))
        sender.start()
        sender.join()
        # The first message carries exactly one batch: read it alone.
        data, ancdata, flags, _ = b.recvmsg(1, socket.CMSG_SPACE(MAX_FDS * 4))
        received = array.array("i")
        for _level, _kind, blob in ancdata:
            received.frombytes(blob[: len(blob) - len(blob) % received.itemsize])
        close_fds(received)
        assert data == MAGIC[:1] and not flags & socket.MSG_CTRUNC
        assert len(received) == FDS_PER_MESSAGE


def test_consecutive_frames_keep_their_own_fds(pair):
    a, b = pair
    counts = [300, 0, 1, 0, 251, 2]
    with no_fd_leak(), memfds(3) as files:

        def send_all():
            for index, count in enumerate(counts):
                send_frame(a, {"index": index}, [files[index % 3]] * count)

        sender = Sender(send_all)
        sender.start()
        reader = FrameReader(b)
        for index, count in enumerate(counts):
            message, got = reader.read(idle_timeout=10)
            try:
                assert message == {"index": index}
                assert len(got) == count, f"frame {index}: {count} fds sent, {len(got)} received"
                assert all(inode(fd) == inode(files[index % 3]) for fd in got)
            finally:
                close_fds(got)
        sender.join()
        a.shutdown(socket.SHUT_WR)
        assert reader.read(idle_timeout=5) is None, "a peer that closes between frames reads as None"


def test_large_payload_round_trip(pair):
    a, b = pair
    message = {"op": "probe", "blob": "x" * (8 << 20)}
    with no_fd_leak():
        sender = Sender(send_frame, a, message)
        sender.start()
        got, fds = FrameReader(b).read(idle_timeout=10)
        sender.join()
        assert got == message and fds == []


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None)
@given(message=st.dictionaries(st.text(max_size=12), json_values, max_size=6), nfds=st.integers(0, 3))
def test_any_json_object_round_trips(pair, message, nfds):
    a, b = pair
    with memfds(1) as (memfd,):
        send_frame(a, message, [memfd] * nfds)
        got, fds = FrameReader(b).read(idle_timeout=5)
        close_fds(fds)
    assert got == message
    assert len(fds) == nfds


# --- malformed frames -------------------------------------------------------------------------------


def expect_protocol_error(b: socket.socket, match: str, **reader_args) -> None:
    with pytest.raises(ProtocolError, match=match):
        FrameReader(b, **reader_args).read(idle_timeout=5)


def test_bad_magic(pair):
    a, b = pair
    with no_fd_leak():
        a.sendall(frame(b"{}", magic=b"HTTP"))
        expect_protocol_error(b, "bad magic")


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 0xFFFF])
def test_wrong_version(pair, version):
    a, b = pair
    with no_fd_leak():
        a.sendall(frame(b"{}", version=version))
        expect_protocol_error(b, f"protocol version {version} is not supported")


@pytest.mark.parametrize("length", [1025, MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
def test_oversized_length_is_refused_before_reading_the_payload(pair, length):
    a, b = pair
    with no_fd_leak(), memfds(1) as (memfd,):
        send_raw(a, frame(b"{}", length=length, nfds=1), [memfd])
        max_bytes = 1024 if length == 1025 else MAX_FRAME_BYTES
        expect_protocol_error(b, "exceeds the", max_bytes=max_bytes)


def test_too_many_declared_fds(pair):
    a, b = pair
    with no_fd_leak():
        a.sendall(frame(b"{}", nfds=MAX_FDS + 1))
        expect_protocol_error(b, f"declares {MAX_FDS + 1} fds")


@pytest.mark.parametrize(("declared", "carried"), [(2, 1), (0, 3), (1, 0), (5, 250)])
def test_declared_fds_must_match_the_fds_carried(pair, declared, carried):
    a, b = pair
    with no_fd_leak(), memfds(1) as (memfd,):
        send_raw(a, frame(b'{"op":"hello"}', nfds=declared), [memfd] * carried)
        expect_protocol_error(b, f"declared {declared} fds but carried {carried}")


def test_more_fds_in_one_message_than_the_reader_accepts(pair):
    a, b = pair
    with no_fd_leak(), memfds(1) as (memfd,):
        send_raw(a, frame(b"{}", nfds=253), [memfd] * 253)  # SCM_MAX_FD: the kernel's most per message
        expect_protocol_error(b, "ancillary data was truncated")


@pytest.mark.parametrize(
    "payload",
    [b"", b"{", b"not json", b"\xff\xfe{}", b'{"a": NaN', b"[" * 100_000 + b"]" * 100_000],
    ids=["empty", "unterminated", "text", "bad-utf8", "bad-token", "deeply-nested"],
)
def test_non_json_payload(pair, payload):
    a, b = pair
    with no_fd_leak(), memfds(1) as (memfd,):
        sender = Sender(send_raw, a, frame(payload, nfds=1), [memfd])
        sender.start()
        expect_protocol_error(b, "not JSON|nests JSON too deeply")
        sender.join()


@pytest.mark.parametrize("payload", [b"[]", b"[1, 2]", b"1", b'"op"', b"null", b"true"])
def test_non_object_json(pair, payload):
    a, b = pair
    with no_fd_leak():
        a.sendall(frame(payload))
        expect_protocol_error(b, "must be a JSON object")


@pytest.mark.parametrize("cut", [1, 5, HEADER.size, HEADER.size + 3])
def test_truncated_frame_peer_closes_mid_frame(pair, cut):
    a, b = pair
    with no_fd_leak(), memfds(2) as files:
        whole = frame(b'{"op":"hello","pad":"xxxxxxxx"}', nfds=2)
        send_raw(a, whole[:cut], files)
        a.shutdown(socket.SHUT_WR)
        expect_protocol_error(b, "closed in the middle of a frame")


def test_trickled_frame_hits_the_deadline(pair):
    a, b = pair
    stop = threading.Event()
    whole = frame(b'{"op":"hello","pad":"' + b"x" * 64 + b'"}', nfds=1)

    def trickle(memfd):
        send_raw(a, whole[:1], [memfd])
        for index in range(1, len(whole)):
            if stop.wait(0.05):
                return
            a.send(whole[index : index + 1])

    with no_fd_leak(), memfds(1) as (memfd,):
        sender = Sender(trickle, memfd)
        sender.start()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"frame not complete within 0\.3 s"):
            FrameReader(b, deadline_s=0.3).read(idle_timeout=5)
        elapsed = time.monotonic() - started
        stop.set()
        sender.join()
    assert 0.25 <= elapsed < 3.0, f"the deadline of 0.3 s fired after {elapsed:.2f} s"


def test_idle_timeout_and_eof_between_frames(pair):
    a, b = pair
    with no_fd_leak():
        reader = FrameReader(b)
        with pytest.raises(TimeoutError, match="no frame arrived"):
            reader.read(idle_timeout=0.1)
        send_frame(a, {"op": "hello"})
        assert reader.read(idle_timeout=5) == ({"op": "hello"}, [])
        a.shutdown(socket.SHUT_WR)
        assert reader.read(idle_timeout=5) is None


# --- what the sender refuses ------------------------------------------------------------------------


def nothing_sent(b: socket.socket) -> bool:
    b.setblocking(False)
    try:
        b.recv(1)
    except BlockingIOError:
        return True
    finally:
        b.setblocking(True)
    return False


def test_sender_refuses_bad_messages(pair):
    a, b = pair
    with no_fd_leak(), memfds(1) as (memfd,):
        with pytest.raises(TypeError, match="must be a dict"):
            send_frame(a, ["op", "hello"])
        with pytest.raises(ValueError):
            send_frame(a, {"x": math.nan})
        with pytest.raises(ProtocolError, match="fds; the limit is"):
            send_frame(a, {"op": "x"}, [memfd] * (MAX_FDS + 1))
        with pytest.raises(ProtocolError, match="exceeds the"):
            send_frame(a, {"blob": "x" * MAX_FRAME_BYTES})
        # 4096 fds need 17 messages of at least one byte each; a 14-byte frame cannot carry them.
        with pytest.raises(ProtocolError, match="cannot carry"):
            send_frame(a, {}, [memfd] * MAX_FDS)
        assert nothing_sent(b), "a refused frame must not be partly sent"


def test_encode_is_compact_json():
    assert encode({"op": "hello", "n": [1, 2]}) == json.dumps({"op": "hello", "n": [1, 2]}, separators=(",", ":")).encode()
