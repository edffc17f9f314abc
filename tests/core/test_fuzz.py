"""Hypothesis-driven protocol fuzzing against one real server process.

Malformed, truncated, oversized, wrong-version and random-JSON frames, fds where
none are expected and none where they are: more than 10,000 cases, one
connection each. The server must answer every case with a well-formed reply or
close the connection, never crash, and end with the fds and memory it started with.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.support import (
    ERROR_CODES,
    assert_views_stay_in_their_regions,
    frame,
    make_fingerprint,
    pattern,
    publish_host_entry,
    publish_raw,
    raw_connect,
    read_replies,
    resting_fd_count,
    rss_kib,
    sealed_memfd,
    send_raw,
    settle_fd_count,
)
from tests.helpers import ServerProcess, wait_until
from weightcache.core import PROTOCOL_VERSION
from weightcache.core.client.client import Connection, wait_for_server
from weightcache.core.errors import ServerError
from weightcache.core.memfd import sealed_memfd as blob_memfd
from weightcache.core.wire.protocol import (
    MAGIC,
    MAX_FDS,
    MAX_FRAME_BYTES,
    close_fds,
    send_frame,
)

RSS_TOLERANCE_KIB = 20 << 10
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EXAMPLES = {
    "raw_bytes": 2000,
    "header_fields": 2500,
    "random_requests": 3000,
    "fds_where_none_expected": 1500,
    "no_fds_where_expected": 500,
    "oversized_or_wrong_version": 1000,
    "near_valid_publish": 600,
    "fuzzed_tables": 800,
}
OPS = ("hello", "publish", "attach", "detach", "status", "evict")


@attrs.define
class Fuzzed:
    """The server under fuzz, what it held before, and fds of every kind to throw at it."""

    server: ServerProcess
    entry: object
    fds: dict
    baseline_fds: int = 0
    baseline_rss_kib: int = 0
    cases: dict = attrs.field(factory=dict)
    strategies: dict = attrs.field(factory=dict)

    def count(self, test: str) -> None:
        self.cases[test] = self.cases.get(test, 0) + 1


@pytest.fixture(scope="module")
def fuzzed():
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
    socket_dir.chmod(0o700)
    server = ServerProcess.start(socket_dir)
    fds: dict[str, int] = {}
    try:
        entry = publish_host_entry(socket_dir, nbytes=4096)
        fds["sealed_memfd"], _ = sealed_memfd(pattern(4096))
        fds["table_memfd"] = blob_memfd(entry.manifest.to_wire()[1])
        fds["small_memfd"], _ = sealed_memfd(b"x")
        fds["unsealed_memfd"] = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fds["unsealed_memfd"], 4096)
        fds["pipe_read"], fds["pipe_write"] = os.pipe()
        left, right = socket.socketpair()
        fds["socket"], fds["socket_peer"] = left.detach(), right.detach()
        fds["dev_null"] = os.open(os.devnull, os.O_RDONLY)
        state = Fuzzed(server, entry, fds)
        # Warm up (thread stacks, allocator arenas) before taking the baseline.
        for _ in range(200):
            with Connection(socket_dir) as conn:
                conn.status()
        state.baseline_fds = resting_fd_count(server.pid)
        state.baseline_rss_kib = rss_kib(server.pid)
        yield state
    finally:
        close_fds(fds.values())
        try:
            server.stop()
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
        server.log_path.unlink(missing_ok=True)


def exchange(state: Fuzzed, data: bytes, fds=()) -> list[dict]:
    """Send ``data`` (and ``fds``) on a fresh connection, half-close, and return every well-formed reply.

    Half-closing means the server sees the end of a truncated frame at once instead of waiting out its deadline.
    """
    sock = raw_connect(state.server.socket_dir, timeout=10)
    try:
        try:
            send_raw(sock, data, fds)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server already refused the frame and closed; its reply may still be queued
        replies = read_replies(sock, timeout=10)
    finally:
        sock.close()
    check_replies(state, replies)
    return replies


def check_replies(state: Fuzzed, replies: list[dict]) -> None:
    for reply in replies:
        assert isinstance(reply.get("ok"), bool), reply
        if not reply["ok"]:
            error = reply.get("error")
            assert isinstance(error, dict) and error.get("code") in ERROR_CODES, reply
            assert isinstance(error.get("message"), str) and error["message"], reply
    assert state.server.proc.poll() is None, f"the server died:\n{state.server.log()[-5000:]}"


# --- strategies -------------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
FD_KINDS = ("sealed_memfd", "table_memfd", "small_memfd", "unsealed_memfd", "pipe_read", "pipe_write", "socket", "dev_null")
fd_kinds = st.lists(st.sampled_from(FD_KINDS), max_size=4)


# The strategies are built once per distinct base and kept: a strategy object new to hypothesis is validated on its
# first draw (its sub-strategies walked, emptiness computed), which cost more CPU than the server's answer when every
# example built its own. The same strategies, so the same cases; each draw still returns new
# objects, as a base copied per example did.
_MUTATED: dict[str, st.SearchStrategy] = {}


def mutated(base: dict) -> st.SearchStrategy:
    """``base`` itself, with a key removed, a key's value replaced, a key added, or anything else."""
    text = json.dumps(base)
    if text not in _MUTATED:
        keys = sorted(base)
        _MUTATED[text] = st.one_of(
            st.just(text).map(json.loads),
            st.sampled_from(keys).map(lambda key: {k: v for k, v in json.loads(text).items() if k != key}),
            st.tuples(st.sampled_from(keys), json_values).map(lambda kv: {**json.loads(text), kv[0]: kv[1]}),
            st.tuples(st.text(max_size=8), json_values).map(lambda kv: {**json.loads(text), kv[0]: kv[1]}),
            json_values,
        )
    return _MUTATED[text]


@st.composite
def manifests(draw, base: dict):
    manifest = json.loads(json.dumps(base))
    choice = draw(st.integers(0, 4))
    if choice == 1:
        manifest["arenas"][0] = draw(mutated(manifest["arenas"][0]))
    elif choice == 2:
        manifest["tensors"] = draw(mutated(manifest["tensors"]))
    elif choice == 3:
        manifest = draw(mutated(manifest))
    elif choice == 4:
        manifest["aliases"] = draw(json_values)
    return manifest


OP_NAMES, ANY_OP = st.sampled_from(OPS), st.text(max_size=10) | json_values
REQUEST_OPS = st.integers(0, 9).flatmap(lambda i: OP_NAMES if i < 8 else ANY_OP)
REQUEST_FIELDS = st.sets(st.sampled_from(["fingerprint", "manifest", "label", "digest", "force", "junk"]))


def requests(state: Fuzzed) -> st.SearchStrategy:
    """Requests on ``state``'s entry (one strategy per state, see ``mutated``)."""
    if "requests" not in state.strategies:
        # Never a prefix of the fixture's entry: fuzzing must not evict what it attaches to.
        digests = json_values.filter(lambda v: not (isinstance(v, str) and state.entry.digest.startswith(v) and v))
        state.strategies["requests"] = _requests(state, manifests(state.entry.manifest.to_wire()[0]), digests)
    return state.strategies["requests"]


@st.composite
def _requests(draw, state: Fuzzed, manifest: st.SearchStrategy, digests: st.SearchStrategy) -> dict:
    fingerprint = state.entry.fingerprint.to_json()
    message = {"op": draw(REQUEST_OPS)}
    fields = draw(REQUEST_FIELDS)
    if "fingerprint" in fields:
        message["fingerprint"] = draw(mutated(fingerprint))
    if "manifest" in fields:
        message["manifest"] = draw(manifest)
    if "label" in fields:
        message["label"] = draw(json_values)
    if "digest" in fields:
        message["digest"] = draw(digests)
    if "force" in fields:
        message["force"] = draw(json_values)
    if "junk" in fields:
        message[draw(st.text(max_size=8))] = draw(json_values)
    return message


# --- the cases --------------------------------------------------------------------------------------


@settings(max_examples=EXAMPLES["raw_bytes"], **FUZZ)
@given(prefix=st.sampled_from([b"", MAGIC, MAGIC + b"\x00\x01", frame(b""), frame(b"", length=20)]), body=st.binary(max_size=300))
def test_raw_bytes(fuzzed, prefix, body):
    fuzzed.count("raw_bytes")
    exchange(fuzzed, prefix + body)


@settings(max_examples=EXAMPLES["header_fields"], **FUZZ)
@given(
    magic=st.one_of(st.just(MAGIC), st.binary(min_size=4, max_size=4)),
    version=st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 0xFFFF)),
    declared_fds=st.one_of(st.none(), st.integers(0, 8), st.integers(0, 0xFFFF)),
    length=st.one_of(st.none(), st.integers(0, 64), st.integers(0, 0xFFFFFFFF)),
    payload=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode())),
    kinds=fd_kinds,
    repeat=st.one_of(st.just(1), st.integers(1, 253)),
    cut=st.one_of(st.none(), st.integers(0, 250)),
)
def test_header_fields(fuzzed, magic, version, declared_fds, length, payload, kinds, repeat, cut):
    """Every header field right or wrong, fds of any kind (up to the kernel's 253 per message), truncated anywhere."""
    fuzzed.count("header_fields")
    fds = [fuzzed.fds[kind] for kind in kinds] * repeat
    fds = fds[:253]
    nfds = len(fds) if declared_fds is None else declared_fds
    data = frame(payload, magic=magic, version=version, nfds=nfds, length=length)
    if cut is not None:
        data = data[:cut]
    exchange(fuzzed, data or b"\0", fds)


FRAME_FDS = st.one_of(st.just([]), st.just(["sealed_memfd", "table_memfd"]), fd_kinds)


@settings(max_examples=EXAMPLES["random_requests"], **FUZZ)
@given(data=st.data())
def test_random_requests(fuzzed, data):
    """Well-framed JSON with random ops and fields, near-valid fingerprints and manifests, any fds."""
    fuzzed.count("random_requests")
    messages = data.draw(st.lists(requests(fuzzed), min_size=1, max_size=3))
    kinds = data.draw(st.lists(FRAME_FDS, min_size=len(messages), max_size=len(messages)))
    sent = b"".join(frame(json.dumps(m).encode(), nfds=len(k)) for m, k in zip(messages, kinds, strict=True))
    sock = raw_connect(fuzzed.server.socket_dir, timeout=10)
    try:
        try:
            for message, frame_kinds in zip(messages, kinds, strict=True):
                send_frame(sock, message, [fuzzed.fds[k] for k in frame_kinds])
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        replies = read_replies(sock, timeout=10)
    finally:
        sock.close()
    check_replies(fuzzed, replies)
    assert sent and len(replies) <= len(messages), "one reply per request at most"


@settings(max_examples=EXAMPLES["near_valid_publish"], **FUZZ)
@given(data=st.data())
def test_near_valid_publish(fuzzed, data):
    """A publish one field away from valid: refused cleanly, or accepted as an entry every client can list."""
    fuzzed.count("near_valid_publish")
    base = fuzzed.entry.fingerprint.to_json()
    field = data.draw(st.sampled_from(sorted(base)))
    typed = {
        str: st.text(max_size=12),
        int: st.integers(-1, 8),
        dict: st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    }
    fitting = typed[type(base[field])]
    fingerprint = {**base, field: data.draw(st.integers(0, 3).flatmap(lambda i: fitting if i else json_values))}
    base_manifest = fuzzed.entry.manifest.to_wire()[0]
    manifest = data.draw(st.one_of(st.just(base_manifest), manifests(base_manifest)))
    kinds = data.draw(st.one_of(st.just(["sealed_memfd", "table_memfd"]), fd_kinds))
    message = {"op": "publish", "fingerprint": fingerprint, "manifest": manifest, "label": data.draw(st.text(max_size=12))}
    fds = [fuzzed.fds[kind] for kind in kinds]
    [reply] = exchange(fuzzed, frame(json.dumps(message).encode(), nfds=len(fds)), fds)
    if not reply["ok"]:
        assert reply["error"]["code"] == "bad_request", reply
        return
    with Connection(fuzzed.server.socket_dir) as conn:
        listed = {e["digest"]: e for e in conn.status()["entries"]}
        entry = listed[reply["digest"]]
        assert all(isinstance(entry[key], str) for key in ("digest", "label", "rank", "device", "dtype")), entry
        if reply["digest"] != fuzzed.entry.digest:
            assert conn.evict(reply["digest"], force=True) == [reply["digest"]]


@settings(max_examples=EXAMPLES["fds_where_none_expected"], **FUZZ)
@given(
    op=st.sampled_from([op for op in OPS if op != "publish"]),
    kinds=st.lists(st.sampled_from(FD_KINDS), min_size=1, max_size=6),
    repeat=st.one_of(st.just(1), st.integers(1, 300)),
)
def test_fds_where_none_expected(fuzzed, op, kinds, repeat):
    fuzzed.count("fds_where_none_expected")
    message = {"op": op, "fingerprint": fuzzed.entry.fingerprint.to_json(), "digest": "0000"}
    fds = ([fuzzed.fds[kind] for kind in kinds] * repeat)[:MAX_FDS]
    sock = raw_connect(fuzzed.server.socket_dir, timeout=10)
    try:
        send_frame(sock, message, fds)
        sock.shutdown(socket.SHUT_WR)
        replies = read_replies(sock, timeout=10)
    finally:
        sock.close()
    check_replies(fuzzed, replies)
    assert len(replies) == 1 and replies[0]["error"]["code"] == "bad_request", replies
    assert "takes no fds" in replies[0]["error"]["message"]


@settings(max_examples=EXAMPLES["no_fds_where_expected"], **FUZZ)
@given(data=st.data(), label=json_values)
def test_no_fds_where_expected(fuzzed, data, label):
    """A publish without its arenas' fds is refused and publishes nothing."""
    fuzzed.count("no_fds_where_expected")
    manifest = data.draw(manifests(fuzzed.entry.manifest.to_wire()[0]))
    fingerprint = {**fuzzed.entry.fingerprint.to_json(), "tp_rank": 0}
    message = {"op": "publish", "fingerprint": fingerprint, "manifest": manifest, "label": label}
    replies = exchange(fuzzed, frame(json.dumps(message).encode()))
    assert len(replies) == 1 and replies[0]["error"]["code"] == "bad_request", replies


@st.composite
def mangled_tables(draw, table: bytes) -> bytes:
    """``table`` with a few bytes overwritten (header counts, columns, names, meta), cut short or grown."""
    data = bytearray(table)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(data) - 1) | st.integers(0, 23))  # the header half the time
        data[where : where + 1] = bytes([draw(st.integers(0, 255))])
    change = draw(st.integers(0, 5))
    if change == 1:
        data = data[: draw(st.integers(0, len(data)))]
    elif change == 2:
        data += draw(st.binary(max_size=64))
    return bytes(data)


@settings(max_examples=EXAMPLES["fuzzed_tables"], **FUZZ)
@given(data=st.data())
def test_fuzzed_tables(fuzzed, data):
    """A publish whose tensor table is mangled: refused, or accepted only if every view it describes stays in its region."""
    fuzzed.count("fuzzed_tables")
    wire, table = fuzzed.entry.manifest.to_wire()
    mangled = data.draw(mangled_tables(table))
    wire = {**wire, "tensors": {"records": data.draw(st.sampled_from([1, 0, 2])), "bytes": len(mangled)}}
    fingerprint = make_fingerprint(architecture="MangledTable", tp_rank=0)
    with Connection(fuzzed.server.socket_dir) as conn:
        try:
            publish_raw(conn, fingerprint, wire, mangled, [fuzzed.fds["sealed_memfd"]])
        except ServerError as exc:
            assert exc.code == "bad_request", exc
            return
        reply = conn.attach(fingerprint)
        try:
            assert_views_stay_in_their_regions(reply.manifest(), reply.fds)
        finally:
            close_fds(reply.fds)
            conn.evict(reply.digest, force=True)


@settings(max_examples=EXAMPLES["oversized_or_wrong_version"], **FUZZ)
@given(
    version=st.integers(0, 0xFFFF),
    length=st.one_of(st.integers(0, 64), st.integers(MAX_FRAME_BYTES + 1, 0xFFFFFFFF)),
    kinds=fd_kinds,
    tail=st.binary(max_size=100),
)
def test_oversized_or_wrong_version(fuzzed, version, length, kinds, tail):
    fuzzed.count("oversized_or_wrong_version")
    if version == PROTOCOL_VERSION and length <= MAX_FRAME_BYTES:
        length = MAX_FRAME_BYTES + 1 + length
    fds = [fuzzed.fds[kind] for kind in kinds]
    replies = exchange(fuzzed, frame(tail, version=version, length=length, nfds=len(fds)), fds)
    assert len(replies) == 1 and replies[0]["error"]["code"] == "protocol_error", replies
    expected = "exceeds the" if version == PROTOCOL_VERSION else f"protocol version {version} is not supported"
    assert expected in replies[0]["error"]["message"]


# --- slowly trickled frames (each costs the deadline, so a few explicit ones) -----------------------

_SHORT_DEADLINE_SERVER = """
import logging, sys
from weightcache.core.server.server import ServerConfig, serve
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
serve(ServerConfig(socket_dir=sys.argv[1], frame_deadline_s=float(sys.argv[2])))
"""
SHORT_DEADLINE_S = 0.5


@pytest.fixture(scope="module")
def impatient_server():
    """A server whose frame deadline is 0.5 s."""
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
    socket_dir.chmod(0o700)
    log_path = Path(str(socket_dir) + ".server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SHORT_DEADLINE_SERVER, str(socket_dir), str(SHORT_DEADLINE_S)],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    server = ServerProcess(socket_dir, proc, log_path)
    try:
        wait_for_server(socket_dir, timeout=20)
        yield server
    finally:
        try:
            assert server.stop() == 0
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)
            log_path.unlink(missing_ok=True)


HELLO = frame(b'{"op":"hello","pad":"' + b"x" * 40 + b'"}')
TRICKLED = frame(b'{"op":"hello","pad":"' + b"x" * 40 + b'"}', nfds=1)  # declares the fd its first byte carries


@pytest.mark.parametrize(
    ("name", "chunks", "interval"),
    [
        ("one-byte-every-100ms", [TRICKLED[i : i + 1] for i in range(len(TRICKLED))], 0.1),
        ("header-then-silence", [TRICKLED[:12]], 0.0),
        ("first-byte-then-silence", [TRICKLED[:1]], 0.0),
        ("all-but-the-last-byte", [TRICKLED[:-1]], 0.0),
        ("ten-bytes-every-200ms", [TRICKLED[i : i + 10] for i in range(0, len(TRICKLED), 10)], 0.2),
    ],
)
def test_trickled_frame_is_dropped_at_the_deadline(impatient_server, name, chunks, interval):
    baseline = resting_fd_count(impatient_server.pid)
    memfd, _ = sealed_memfd(b"trickle")
    sock = raw_connect(impatient_server.socket_dir, timeout=10)
    stop = threading.Event()

    def trickle():
        try:
            send_raw(sock, chunks[0], [memfd])  # an fd on the first byte: the server must close it when it gives up
            for chunk in chunks[1:]:
                if stop.wait(interval):
                    return
                sock.send(chunk)
        except OSError:
            pass  # the server hung up

    sender = threading.Thread(target=trickle, daemon=True)
    try:
        started = time.monotonic()
        sender.start()
        try:
            tail = sock.recv(1024)
        except ConnectionResetError:
            tail = b""
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        sender.join(5)
        sock.close()
        os.close(memfd)
    assert tail == b"", "a frame that misses its deadline gets no reply: the connection just closes"
    assert SHORT_DEADLINE_S * 0.8 <= elapsed < SHORT_DEADLINE_S * 10, f"{name}: closed after {elapsed:.2f} s"
    assert settle_fd_count(impatient_server.pid, baseline) == baseline
    assert wait_until(lambda: "frame not complete within 0.5 s" in impatient_server.log())
    with Connection(impatient_server.socket_dir) as conn:
        assert conn.hello()["pid"] == impatient_server.pid


def test_slow_frame_within_the_deadline_is_answered(impatient_server):
    sock = raw_connect(impatient_server.socket_dir, timeout=10)
    try:
        for index in range(0, len(HELLO), 16):
            sock.send(HELLO[index : index + 16])
            time.sleep(0.05)
        sock.shutdown(socket.SHUT_WR)
        replies = read_replies(sock)
    finally:
        sock.close()
    assert [r["ok"] for r in replies] == [True]


# --- afterwards -------------------------------------------------------------------------------------


def test_server_survived_every_case_and_returned_to_baseline(fuzzed):
    assert fuzzed.server.proc.poll() is None
    assert "unexpected error" not in fuzzed.server.log(), "every bad frame must get a deliberate answer, not a traceback"
    with Connection(fuzzed.server.socket_dir) as conn:
        assert conn.hello()["pid"] == fuzzed.server.pid
        entries = conn.status()["entries"]
        assert fuzzed.entry.digest in {e["digest"] for e in entries}, "fuzzing must not lose the published entry"
        for entry in entries:  # near-valid publishes may have succeeded; drop them to compare fds
            if entry["digest"] != fuzzed.entry.digest:
                conn.evict(entry["digest"], force=True)
    count = settle_fd_count(fuzzed.server.pid, fuzzed.baseline_fds)
    assert count == fuzzed.baseline_fds, f"server holds {count} fds, {fuzzed.baseline_fds} before fuzzing"
    rss = rss_kib(fuzzed.server.pid)
    assert rss <= fuzzed.baseline_rss_kib + RSS_TOLERANCE_KIB, f"server RSS grew from {fuzzed.baseline_rss_kib} KiB to {rss} KiB"
    if set(fuzzed.cases) == set(EXAMPLES):  # every fuzz test ran in this session
        total = sum(fuzzed.cases.values())
        assert total >= 10_000, f"only {total} cases ran: {fuzzed.cases}"
