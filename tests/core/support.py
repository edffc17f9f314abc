"""Helpers for the wire, server, fuzz and load tests: fingerprints, host entries, raw frames, /proc counters."""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

import attrs

from weightcache.core import PROTOCOL_VERSION
from weightcache.core.arena import ArenaSpec, backend
from weightcache.core.arena.checksum import checksum as arena_checksum
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import Fingerprint, sha256_json
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.layout.tensor_table import TensorTable
from weightcache.core.memfd import sealed_memfd as blob_memfd
from weightcache.core.socket_dir import SOCKET_NAME
from weightcache.core.wire.protocol import HEADER, MAGIC, FrameReader, close_fds

SOME_CHECKSUM = "wsum64v1:" + "0" * 32
"""A well-formed checksum for manifests the server checks without reading their bytes (it never computes one)."""
ERROR_CODES = {"protocol_error", "bad_request", "not_found", "attached", "ambiguous", "over_budget", "busy", "access_denied"}
ALL_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def make_fingerprint(**overrides) -> Fingerprint:
    """A fingerprint with every field set (a CPU host entry of a made-up model)."""
    fields = dict(
        checkpoint=sha256_json({"model.safetensors": {"w": {"dtype": "F32", "shape": [64, 64]}}}),
        architecture="WireTestForCausalLM",
        config=sha256_json({"hidden_size": 64}),
        tp_size=2,
        tp_rank=1,
        pp_size=1,
        pp_rank=0,
        dp_size=1,
        ep_size=1,
        ep_rank=0,
        dtype="float32",
        quantization="none",
        quantization_config=sha256_json({}),
        adapter="wiretest",
        adapter_version="1.0",
        engine="none",
        engine_version="0",
        torch_version="2.13.0",
        cuda_version="none",
        compute_capability="none",
        gpu_uuid="",
        protocol_version=PROTOCOL_VERSION,
        extra={"kernel": "reference"},
    )
    return Fingerprint(**{**fields, **overrides})


def sealed_memfd(data: bytes, checksum: str | None = None) -> tuple[int, ArenaSpec]:
    """A sealed host arena holding ``data``: ``(an exported fd the caller closes, its ArenaSpec)``.

    The spec carries the checksum of the arena's bytes, or ``checksum`` when given (a lie, for the tests that check it is caught).
    """
    host = backend("host")
    arena = host.create(len(data))
    try:
        fd = arena.export_fd()
        os.pwrite(fd, data, 0)
        host.seal(arena)
        return fd, attrs.evolve(arena.spec, checksum=checksum or arena_checksum(arena.bytes_view()))
    finally:
        arena.close()


def raw_wire(manifest: dict) -> tuple[dict, bytes]:
    """The wire form of a manifest's JSON form with every record stored as given, unchecked: what a broken or hostile
    publisher sends. TypeError or OverflowError for a value the binary table cannot hold (a float shape, a string offset)."""
    records = manifest["tensors"]
    if not isinstance(records, list):
        table = TensorTable.encode([], [], [], [], [], [], [], [], [], [], []).data
        return {**manifest, "tensors": records}, table
    table = TensorTable.encode(
        names=[r["name"] for r in records],
        kinds=[r["kind"] for r in records],
        dtypes=[r["dtype"] for r in records],
        shapes=[r["shape"] for r in records],
        strides=[r["stride"] for r in records],
        storage_offsets=[r["storage_offset"] for r in records],
        arenas=[r["arena"] for r in records],
        offsets=[r["offset"] for r in records],
        nbytes=[r["nbytes"] for r in records],
        persistent=[r.get("persistent", True) for r in records],
        attributes=[r.get("attributes", {}) for r in records],
    ).data
    return {**manifest, "tensors": {"records": len(records), "bytes": len(table)}}, table


def publish_raw(conn: Connection, fingerprint: Fingerprint, wire: dict, table: bytes, fds, label: str = "raw") -> dict:
    """Publish ``wire`` and ``table`` (a tensor table's bytes, valid or not) over ``fds`` without any check on this side."""
    table_fd = blob_memfd(table)
    try:
        message = {"op": "publish", "fingerprint": fingerprint.to_json(), "manifest": wire, "label": label}
        return conn.request(message, [*fds, table_fd])[0]
    finally:
        os.close(table_fd)


def assert_views_stay_in_their_regions(manifest: Manifest, fds) -> None:
    """Map host arena ``fds`` and check every view of ``manifest`` lies inside its record's region and can be read."""
    import torch

    host = backend("host")
    arenas = [host.map(fd, spec) for fd, spec in zip(fds, manifest.arenas, strict=True)]
    try:
        views = manifest.views(arenas)
        for record in manifest.tensors:
            tensor = views[record.name]
            assert tensor.dtype == getattr(torch, record.dtype) and tuple(tensor.shape) == record.shape, record
            if tensor.numel() == 0:
                continue
            assert tuple(tensor.stride()) == record.stride, record
            start = tensor.data_ptr() - arenas[record.arena].address
            reach = (sum((n - 1) * s for n, s in zip(record.shape, record.stride, strict=True)) + 1) * tensor.element_size()
            assert record.offset <= start and start + reach <= record.offset + record.nbytes, f"{record} views outside its region"
            tensor.clone()  # every element can be read
        for alias, target in manifest.aliases.items():
            assert views[alias] is views[target]
        del views, tensor
    finally:
        for arena in arenas:
            arena.close()


def sparse_memfd(size: int, seals: int = ALL_SEALS) -> int:
    """A memfd of ``size`` zero bytes (no page touched) with ``seals`` added; the caller closes it."""
    fd = os.memfd_create("weightcache-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def pattern(nbytes: int, seed: int = 7) -> bytes:
    """Deterministic non-trivial bytes."""
    return bytes((i * 31 + seed) % 251 for i in range(nbytes))


@attrs.frozen
class HostEntry:
    """An entry published straight through the client API."""

    fingerprint: Fingerprint
    manifest: Manifest
    digest: str
    data: bytes


def host_manifest(spec: ArenaSpec, nbytes: int) -> Manifest:
    """One float32 parameter ``w`` covering the first ``nbytes`` of one arena, tied as ``w_tied``."""
    count = nbytes // 4
    record = TensorRecord(
        name="w",
        kind="parameter",
        dtype="float32",
        shape=(count,),
        stride=(1,),
        storage_offset=0,
        arena=0,
        offset=0,
        nbytes=count * 4,
    )
    return Manifest(tensors=[record], arenas=[spec], aliases={"w_tied": "w"}, extra={"source": "wire-tests"})


def publish_host_entry(
    socket_dir,
    fingerprint: Fingerprint | None = None,
    nbytes: int = 16384,
    label: str = "wire-test",
    checksum: str | None = None,
) -> HostEntry:
    """Build a sealed memfd arena, publish it with ``Connection.publish`` and close this side's fd.

    ``checksum``: declare this one instead of the bytes' own (the server keeps what it is told).
    """
    fingerprint = fingerprint or make_fingerprint()
    data = pattern(nbytes)
    fd, spec = sealed_memfd(data, checksum)
    try:
        manifest = host_manifest(spec, nbytes)
        with Connection(socket_dir, timeout=10) as conn:
            reply = conn.publish(fingerprint, manifest, [fd], label=label)
    finally:
        os.close(fd)
    return HostEntry(fingerprint, manifest, reply["digest"], data)


def frame(
    payload: bytes, *, magic: bytes = MAGIC, version: int = PROTOCOL_VERSION, nfds: int = 0, length: int | None = None
) -> bytes:
    """A raw frame with any header fields, right or wrong."""
    return HEADER.pack(magic, version, nfds, len(payload) if length is None else length) + payload


def raw_connect(socket_dir, timeout: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(Path(socket_dir) / SOCKET_NAME))
    return sock


def send_raw(sock: socket.socket, data: bytes, fds=()) -> None:
    """Send ``data`` with ``fds`` riding on its first byte (any count: no splitting)."""
    import array

    fds = list(fds)
    if fds:
        sock.sendmsg([data[:1] if data else b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[1:]
    if data:
        sock.sendall(data)


def read_replies(sock: socket.socket, timeout: float = 10.0) -> list[dict]:
    """Every reply until the server closes (fds that came along are closed); the peer must close within ``timeout``."""
    reader = FrameReader(sock, deadline_s=timeout)
    replies = []
    while True:
        try:
            frame = reader.read(idle_timeout=timeout)
        except (ConnectionResetError, BrokenPipeError):
            return replies
        if frame is None:
            return replies
        message, fds = frame
        close_fds(fds)
        replies.append(message)


def fd_count(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def resting_fd_count(pid: int, timeout: float = 10.0) -> int:
    """``pid``'s fd count once it stops changing (the threads of earlier connections have closed theirs)."""
    deadline = time.monotonic() + timeout
    count = fd_count(pid)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        again = fd_count(pid)
        if again == count:
            break
        count = again
    return count


def settle_fd_count(pid: int, expected: int, timeout: float = 10.0) -> int:
    """Wait until ``pid`` has ``expected`` fds (its connection threads close theirs asynchronously); the last count."""
    deadline = time.monotonic() + timeout
    count = fd_count(pid)
    while count != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        count = fd_count(pid)
    return count


def inode(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino
