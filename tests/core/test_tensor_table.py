"""The tensor table: round trips, malformed blobs refused by name, a million records checked in bounded time and memory,
and a server that holds many large entries in O(1) heap each."""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc

import pytest

from tests.core.support import make_fingerprint, publish_raw, rss_kib, sealed_memfd
from tests.helpers import ServerProcess
from weightcache.core.arena import ArenaSpec
from weightcache.core.client.client import Connection
from weightcache.core.errors import InvalidManifest, ServerError
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.layout.tensor_table import HEADER, MAX_TENSORS, TensorTable


def expert_table(count: int, itemsize_offsets: int = 8) -> TensorTable:
    """``count`` float32 tensors of shape (1, 2) side by side, named like a MoE checkpoint's experts."""
    names = [
        f"model.layers.{i // 3000}.mlp.experts.{(i // 3) % 1000}.{('down', 'gate', 'up')[i % 3]}_proj.weight"
        for i in range(count)
    ]
    return TensorTable.encode(
        names=names,
        kinds=["parameter"] * count,
        dtypes=["float32"] * count,
        shapes=[(1, 2)] * count,
        strides=[(2, 1)] * count,
        storage_offsets=[0] * count,
        arenas=[0] * count,
        offsets=range(0, itemsize_offsets * count, itemsize_offsets),
        nbytes=[8] * count,
        persistent=[True] * count,
        attributes=[{}] * count,
    )


def two_records() -> list[TensorRecord]:
    common = dict(kind="parameter", dtype="float32", stride=(1,), storage_offset=0, arena=0, nbytes=64)
    return [
        TensorRecord(name="a", shape=(16,), offset=0, attributes={"format_ue8m0": True}, **common),
        TensorRecord(name="b", shape=(16,), offset=64, **common),
    ]


def test_a_manifest_round_trips_through_its_wire_form():
    manifest = Manifest(tensors=two_records(), arenas=[ArenaSpec("host", 4096)], aliases={"tied": "b"}, extra={"x": 1})
    wire, table = manifest.to_wire()
    assert wire["tensors"] == {"records": 2, "bytes": len(table)} and "format_ue8m0" not in json.dumps(wire)
    for trusted in (False, True):
        again = Manifest.from_wire(json.loads(json.dumps(wire)), table, trusted=trusted)
        assert again == manifest and list(again.tensors) == two_records()
        assert again.names == ["a", "b"] and again.arena_extents() == (128,)


def _table_with(change) -> bytes:
    data = bytearray(Manifest(tensors=two_records(), arenas=[ArenaSpec("host", 4096)]).table.data)
    change(data)
    return bytes(data)


def _header(data: bytearray, **fields) -> None:
    names = ("magic", "records", "dims", "name_bytes", "meta_bytes", "reserved")
    values = dict(zip(names, HEADER.unpack_from(data), strict=True))
    data[: HEADER.size] = HEADER.pack(*{**values, **fields}.values())


def _replace(old: bytes, new: bytes):
    def change(data: bytearray) -> None:
        at = data.rindex(old)
        data[at : at + len(old)] = new

    return change


MALFORMED = {
    "cut-short": (lambda d: d.__delitem__(slice(-3, None)), "", "tensors"),
    "bad-magic": (lambda d: d.__setitem__(slice(0, 4), b"JSON"), "", "tensors"),
    "too-many-records": (lambda d: _header(d, records=MAX_TENSORS + 1), "", "tensors"),
    "dims-disagree": (lambda d: _header(d, dims=3), "", "tensors"),
    "empty-name": (_replace(b"a\0b\0", b"\0bb\0"), "", "name"),
    "two-tensors-one-name": (_replace(b"a\0b\0", b"a\0a\0"), "a", "name"),
    "names-not-utf8": (_replace(b"a\0b\0", b"\xff\0b\0"), "", "tensors"),
    "meta-not-json": (_replace(b'{"dtypes"', b'["dtypes"'), "", "tensors"),
    "unknown-dtype": (_replace(b'"float32"', b'"float99"'), "a", "dtype"),
    "attributes-with-nan": (_replace(b'{"format_ue8m0":true}', b'{"format_ue8m0":NaN }'), "a", "attributes"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_table_is_refused_naming_what_is_wrong(case):
    change, tensor, field = MALFORMED[case]
    data = _table_with(change)
    wire = {"tensors": {"records": 2, "bytes": len(data)}, "arenas": [{"backend": "host", "size": 4096, "device": "cpu"}]}
    with pytest.raises(InvalidManifest) as refused:
        Manifest.from_wire(wire, data)
    assert (refused.value.tensor, refused.value.field) == (tensor, field), refused.value


def test_a_column_value_no_client_could_use_is_refused_by_name():
    columns = dict(
        names=["a", "b"],
        kinds=["parameter", "buffer"],
        dtypes=["float32", "float32"],
        shapes=[(16,), (16,)],
        strides=[(1,), (1,)],
        storage_offsets=[0, 0],
        arenas=[0, 0],
        offsets=[0, 64],
        nbytes=[64, 64],
        persistent=[True, True],
        attributes=[{}, {}],
    )
    faults = [
        ("kinds", ["parameter", "weights"], "kind"),
        ("persistent", [True, 2], "persistent"),
        ("shapes", [(16,), (-1,)], "shape"),
        ("shapes", [(16,), (1,) * 65], "shape"),
        ("arenas", [0, 1], "arena"),
        ("offsets", [0, -64], "offset"),
        ("nbytes", [64, 66], "nbytes"),
    ]
    for column, values, field in faults:
        fixed = {**columns, column: values}
        if column == "shapes":
            fixed["strides"] = [(1,) * len(shape) for shape in values]
        table = TensorTable.encode(**fixed)
        with pytest.raises(InvalidManifest) as refused:
            table.check([4096])
        assert (refused.value.tensor, refused.value.field) == ("b", field), (column, refused.value)


def test_a_million_records_are_checked_in_bounded_time_and_memory():
    count = 1_000_000
    data = expert_table(count).data
    assert len(data) < 128 * count, "a record costs about a hundred bytes on the wire"
    start = time.perf_counter()
    table = TensorTable(data)
    table.check([8 * count])
    seconds = time.perf_counter() - start
    assert seconds < 60, f"checking {count} records took {seconds:.1f} s"
    del table, data
    # Memory a record, over a fifth of the records: tracemalloc makes every allocation cost ten times as much (14 s
    # of CPU over the million), and a bound per record holds at any count (a fixed overhead only weighs more here).
    count //= 5
    data = expert_table(count).data
    tracemalloc.start()
    try:
        TensorTable(data).check([8 * count])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 320 * count, f"checking {count} records peaked at {peak / count:.0f} bytes a record"


def test_a_header_claiming_more_records_than_allowed_is_refused_before_reading_them():
    data = bytearray(HEADER.size)
    struct.pack_into(HEADER.format, data, 0, b"WCT1", MAX_TENSORS + 1, 0, 0, 0, 0)
    with pytest.raises(InvalidManifest, match="split the model"):
        TensorTable(bytes(data))


def test_the_server_holds_many_large_entries_in_constant_heap_each_and_answers_status_in_one_small_frame():
    """Each entry keeps its table in the publisher's sealed memfd: the server's RSS grows by a few KiB an entry,
    whatever the tensor count, and status, locate and evict cost O(entries)."""
    count, entries = 50_000, 24

    def big(index: int):
        return make_fingerprint(architecture="Big", gpu_uuid=f"GPU-{index:08d}")

    table = expert_table(count).data
    arena_fd, spec = sealed_memfd(b"\0" * (8 * count))
    wire = {"tensors": {"records": count, "bytes": len(table)}, "arenas": [spec.to_json()], "aliases": {}, "extra": {}}
    server = ServerProcess.start()
    try:
        with Connection(server.socket_dir, timeout=120) as conn:
            for warm in range(2):  # the allocator's high-water mark: checking a table needs a few MiB for a moment
                publish_raw(conn, make_fingerprint(architecture=f"Warm{warm}"), wire, table, [arena_fd])
            before = rss_kib(server.pid)
            start = time.perf_counter()
            for index in range(entries):
                publish_raw(conn, big(index), wire, table, [arena_fd])
            publish_s = (time.perf_counter() - start) / entries
            grown = rss_kib(server.pid) - before
            start = time.perf_counter()
            status = conn.status()
            located = conn.locate(big(0))
            status_s = time.perf_counter() - start
            reply = conn.attach(big(3))
            os.close(*reply.fds)
            assert reply.manifest().names[:1] == ["model.layers.0.mlp.experts.0.down_proj.weight"]
            assert conn.evict(reply.digest, force=True) == [reply.digest]
        assert [e["tensors"] for e in status["entries"]] == [count] * (entries + 2)
        assert len(json.dumps(status)) < 1200 * (entries + 2), "a status row does not grow with the tensor count"
        assert len(located) == min(entries - 1, 16), "every other entry holds the same content (16 at most are named)"
        assert grown < 64 * entries, f"the server's RSS grew by {grown / entries:.0f} KiB an entry of {count} tensors"
        assert status_s < 1.0, f"status and locate over {entries} entries took {status_s:.2f} s"
        print(f"\nserver: {grown / entries:.0f} KiB RSS an entry of {count} tensors; publish check {publish_s:.2f} s")
    finally:
        os.close(arena_fd)
        server.stop()
        server.close()


def test_a_server_refuses_a_table_that_is_not_a_sealed_memfd():
    server = ServerProcess.start()
    arena_fd, spec = sealed_memfd(b"\0" * 4096)
    manifest = Manifest(tensors=two_records(), arenas=[spec])
    wire, table = manifest.to_wire()
    unsealed = os.memfd_create("unsealed-table", os.MFD_CLOEXEC)
    os.write(unsealed, table)
    try:
        with Connection(server.socket_dir) as conn:
            with pytest.raises(ServerError, match="the tensor table memfd is not sealed"):
                conn.request(
                    {"op": "publish", "fingerprint": make_fingerprint().to_json(), "manifest": wire}, [arena_fd, unsealed]
                )
            with pytest.raises(ServerError, match="1 arenas but 0 arena fds came"):
                publish_raw(conn, make_fingerprint(), wire, table, [])
            assert conn.status()["entries"] == []
    finally:
        os.close(unsealed)
        os.close(arena_fd)
        server.stop()
        server.close()
