"""What a publish must carry: manifests every client can view, short labels, sealed memfds; and evict by prefix.

Refusals are checked against a real ``weightcache serve`` process with real sealed memfds; the fuzz
test publishes Hypothesis-made manifests and views every accepted one the way an engine does.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.core.support import (
    ALL_SEALS,
    SOME_CHECKSUM,
    assert_views_stay_in_their_regions,
    frame,
    make_fingerprint,
    pattern,
    publish_host_entry,
    publish_raw,
    raw_connect,
    raw_wire,
    sealed_memfd,
    send_raw,
    sparse_memfd,
)
from tests.helpers import ServerProcess
from weightcache.core.arena import ArenaSpec, backend
from weightcache.core.client.client import Connection
from weightcache.core.dtypes import ITEM_SIZES
from weightcache.core.errors import InvalidManifest, ServerError
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.server.registry import MAX_LABEL_CHARS, Entry, Registry
from weightcache.core.wire.protocol import FrameReader

ARENA_BYTES = 4096


def base_manifest() -> dict:
    """The JSON of two float32 tensors side by side in one arena, ``a`` then ``b``, 16 elements each, and an alias of ``b``."""
    records = [
        TensorRecord(
            name=name,
            kind="parameter",
            dtype="float32",
            shape=(16,),
            stride=(1,),
            storage_offset=0,
            arena=0,
            offset=offset,
            nbytes=64,
        )
        for name, offset in (("a", 0), ("b", 64))
    ]
    return Manifest(
        tensors=records, arenas=[ArenaSpec(backend="host", size=ARENA_BYTES, checksum=SOME_CHECKSUM)], aliases={"tied": "b"}
    ).to_json()


@pytest.fixture(scope="module")
def served():
    """One server for the module and one sealed memfd of ARENA_BYTES to publish (the server dups it)."""
    server = ServerProcess.start()
    fd, spec = sealed_memfd(pattern(ARENA_BYTES))
    assert spec.size == ARENA_BYTES
    try:
        yield server, fd
    finally:
        os.close(fd)
        server.stop()
        server.close()


_names = itertools.count()


def publish(server, fd: int, manifest: dict, label: str = "validation") -> dict:
    """Publish the JSON form ``manifest`` over ``fd``, its records unchecked on this side, under a fingerprint never
    used before; the server's reply."""
    wire, table = raw_wire(manifest)
    with Connection(server.socket_dir, timeout=10) as conn:
        return publish_raw(conn, make_fingerprint(architecture=f"Validation{next(_names)}"), wire, table, [fd], label=label)


def status(server) -> dict:
    with Connection(server.socket_dir, timeout=10) as conn:
        return conn.status()


def evict_all(server) -> None:
    with Connection(server.socket_dir, timeout=10) as conn:
        for entry in conn.status()["entries"]:
            conn.evict(entry["digest"], force=True)


# --- manifests no client could view are refused at publish, naming the tensor and the field ------------

BAD_RECORDS = {
    "shape-float": ({"shape": [16.0]}, "shape"),
    "shape-string": ({"shape": ["16"]}, "shape"),
    "shape-bool": ({"shape": [True]}, "shape"),
    "shape-negative": ({"shape": [-16]}, "shape"),
    "shape-not-a-list": ({"shape": 16}, "shape"),
    "stride-negative": ({"stride": [-1]}, "stride"),
    "stride-wrong-length": ({"stride": [1, 1]}, "stride"),
    "stride-beyond-int64": ({"stride": [2**63]}, "stride"),
    "storage-offset-float": ({"storage_offset": 0.0}, "storage_offset"),
    "offset-string": ({"offset": "0"}, "offset"),
    "nbytes-bool": ({"nbytes": True}, "nbytes"),
    "arena-bool": ({"arena": False}, "arena"),
    "arena-out-of-range": ({"arena": 1}, "arena"),
    "offset-not-a-multiple-of-the-item-size": ({"offset": 2}, "offset"),
    "nbytes-not-a-multiple-of-the-item-size": ({"nbytes": 66}, "nbytes"),
    "dtype-unknown": ({"dtype": "complex64"}, "dtype"),
    "dtype-not-a-string": ({"dtype": 4}, "dtype"),
    "kind-unknown": ({"kind": "weights"}, "kind"),
    "persistent-not-a-bool": ({"persistent": 1}, "persistent"),
    "unknown-field": ({"junk": 1}, "junk"),
    "view-reaches-the-neighbour": ({"stride": [2]}, "nbytes"),  # 31 elements of 16: it would read b
    "storage-offset-past-the-region": ({"storage_offset": 1}, "nbytes"),
    "region-past-the-arena": ({"offset": ARENA_BYTES}, "offset"),
}
NOT_ON_THE_WIRE = {
    "shape-float",
    "shape-string",
    "shape-bool",
    "shape-not-a-list",
    "stride-wrong-length",
    "stride-beyond-int64",
    "storage-offset-float",
    "offset-string",
    "nbytes-bool",
    "arena-bool",
    "persistent-not-a-bool",
    "unknown-field",
}
"""Faults of the JSON form that the binary table cannot carry: its columns hold integers only (a bool is 0 or 1),
one ``ndim`` serves shape and stride, and a record has no other fields. The JSON form (seeding) still refuses them."""


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_tensor_no_client_could_view_is_refused_naming_the_tensor_and_field(served, case):
    server, fd = served
    change, field = BAD_RECORDS[case]
    manifest = base_manifest()
    manifest["tensors"][0].update(change)
    with pytest.raises(InvalidManifest) as local:
        Manifest.from_json(json.loads(json.dumps(manifest)))
    assert (local.value.tensor, local.value.field) == ("a", field), "clients refuse what the server refuses"
    if case in NOT_ON_THE_WIRE:
        if not case.endswith(("bool", "unknown-field")):
            with pytest.raises((TypeError, OverflowError, ValueError)):
                raw_wire(manifest)
        return
    with pytest.raises(ServerError) as refused:
        publish(server, fd, manifest)
    assert refused.value.code == "bad_request", refused.value
    assert f"tensor 'a' field '{field}'" in str(refused.value), refused.value
    assert status(server)["entries"] == [], "a refused publish leaves no entry"


BAD_MANIFESTS = {
    "alias-to-an-unknown-tensor": (lambda m: m["aliases"].update(tied="c"), "aliases"),
    "alias-target-not-a-string": (lambda m: m["aliases"].update(tied=1), "aliases"),
    "alias-shadows-a-tensor": (lambda m: m["aliases"].update(a="b"), "aliases"),
    "aliases-not-an-object": (lambda m: m.update(aliases=[["tied", "b"]]), "aliases"),
    "extra-not-an-object": (lambda m: m.update(extra=[["model_class", "X"]]), "extra"),
    "arena-size-float": (lambda m: m["arenas"][0].update(size=4096.0), "arenas[0]"),
    "arena-size-string": (lambda m: m["arenas"][0].update(size="4096"), "arenas[0]"),
    "tensors-not-a-list": (lambda m: m.update(tensors={"a": 1}), "tensors"),
    "two-tensors-one-name": (lambda m: m["tensors"][1].update(name="a"), "name"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_a_manifest_no_client_could_use_is_refused_naming_the_field(served, case):
    server, fd = served
    change, field = BAD_MANIFESTS[case]
    manifest = base_manifest()
    change(manifest)
    with pytest.raises(InvalidManifest) as local:
        Manifest.from_json(json.loads(json.dumps(manifest)))
    assert local.value.field == field
    with pytest.raises(ServerError) as refused:
        publish(server, fd, manifest)
    assert refused.value.code == "bad_request" and f"field '{field}'" in str(refused.value), refused.value
    assert status(server)["entries"] == []


def test_the_item_size_table_matches_torch():
    for name, size in ITEM_SIZES.items():
        assert torch.empty(0, dtype=getattr(torch, name)).element_size() == size, name


# --- fuzz: whatever the server accepts, a client can view ---------------------------------------------

ARENA_SIZES = (4096, 8192)
WEIRD = st.one_of(st.integers(-3, -1), st.floats(0, 8), st.booleans(), st.text(max_size=2), st.none(), st.just(2**63))


def _extent(shape, stride, storage_offset, itemsize) -> int:
    if 0 in shape:
        return 0
    return (storage_offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize


@st.composite
def viewable_records(draw, name: str, sizes: list[int]) -> dict:
    """A record a client can view in arenas of ``sizes``, often right at a boundary (tight region, end of arena)."""
    dtype = draw(st.sampled_from(sorted(ITEM_SIZES)))
    itemsize = ITEM_SIZES[dtype]
    ndim = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    stride = draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim))
    storage_offset = draw(st.integers(0, 4))
    extent = _extent(shape, stride, storage_offset, itemsize)
    nbytes = draw(st.sampled_from([extent, extent + itemsize, extent + 256]))
    arena = draw(st.integers(0, len(sizes) - 1))
    last = (sizes[arena] - nbytes) // itemsize * itemsize  # the region ends exactly at the arena's end
    offset = draw(st.sampled_from([0, last]) | st.integers(0, last // itemsize).map(lambda k: k * itemsize))
    return {
        "name": name,
        "kind": draw(st.sampled_from(["parameter", "buffer"])),
        "dtype": dtype,
        "shape": shape,
        "stride": stride,
        "storage_offset": storage_offset,
        "arena": arena,
        "offset": offset,
        "nbytes": nbytes,
        "persistent": draw(st.booleans()),
    }


@st.composite
def perturbed(draw, value):
    """``value`` one step off: an integer +-1 or of a wrong type, a list with one such element or one more dimension."""
    if isinstance(value, list):
        if not value or draw(st.booleans()):
            return [*value, draw(st.integers(0, 3))]
        index = draw(st.integers(0, len(value) - 1))
        return [*value[:index], draw(perturbed(value[index])), *value[index + 1 :]]
    if isinstance(value, str):
        return draw(st.sampled_from(["complex64", "weights", "", "torch.float32"]) | WEIRD)
    return draw(st.sampled_from([value + 1, value - 1]) | WEIRD)


@st.composite
def fuzzed_manifests(draw) -> dict:
    """A viewable manifest, or one with a single field perturbed (half the time)."""
    sizes = draw(st.lists(st.sampled_from(ARENA_SIZES), min_size=1, max_size=2))
    names = [f"t{i}" for i in range(draw(st.integers(1, 4)))]
    tensors = [draw(viewable_records(name, sizes)) for name in names]
    aliases = draw(st.sampled_from([{}, {"tied": names[-1]}]))
    if draw(st.booleans()):
        record = draw(st.sampled_from(tensors))
        field = draw(st.sampled_from([*sorted(set(record) - {"name"}), "aliases"]))
        if field == "aliases":
            aliases = draw(st.sampled_from([{"tied": "missing"}, {names[0]: names[-1]}, {"tied": 0}]))
        else:
            record[field] = draw(perturbed(record[field]))
    return {
        "tensors": tensors,
        "arenas": [{"backend": "host", "size": s, "device": "cpu", "checksum": SOME_CHECKSUM} for s in sizes],
        "aliases": aliases,
        "extra": {},
    }


@pytest.fixture(scope="module")
def arena_fds():
    """A sealed memfd of each size in ARENA_SIZES, holding distinct bytes."""
    fds = {size: sealed_memfd(pattern(size, seed=size % 251))[0] for size in ARENA_SIZES}
    yield fds
    for fd in fds.values():
        os.close(fd)


def _only_torch_prefixed_dtypes(manifest: dict) -> bool:
    """Whether the server's refusal may be only a ``torch.``-prefixed dtype, which ``Manifest.from_json`` strips."""
    records = manifest["tensors"]
    return (
        isinstance(records, list)
        and any(
            isinstance(r, dict)
            and isinstance(r.get("dtype"), str)
            and r["dtype"].removeprefix("torch.") in ITEM_SIZES
            and r["dtype"].startswith("torch.")
            for r in records
        )
        and _accepted_once_normalized(manifest)
    )


def _accepted_once_normalized(manifest: dict) -> bool:
    try:
        Manifest.from_json(manifest)
    except InvalidManifest:
        return False
    return True


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifest=fuzzed_manifests())
def test_every_manifest_the_server_accepts_can_be_viewed_by_a_client(served, arena_fds, manifest):
    server, _ = served
    fingerprint = make_fingerprint(architecture=f"Fuzz{next(_names)}")
    fds = [arena_fds[spec["size"]] for spec in manifest["arenas"]]
    try:
        wire, table = raw_wire(manifest)
    except (TypeError, OverflowError, ValueError):
        event("not representable in the table")
        with pytest.raises(InvalidManifest):
            Manifest.from_json(manifest)
        return
    with Connection(server.socket_dir, timeout=10) as conn:
        try:
            publish_raw(conn, fingerprint, wire, table, fds)
        except ServerError as exc:
            event("refused")
            assert exc.code == "bad_request", exc
            if _only_torch_prefixed_dtypes(manifest):
                # The wire table carries the dtype as sent; the JSON form takes str(torch.float32) by design and
                # strips the prefix, so a publisher going through Manifest never sends it.
                event("dtype normalized by from_json")
                return
            with pytest.raises(InvalidManifest):
                Manifest.from_json(manifest)
            return
        event("accepted")
        reply = conn.attach(fingerprint)
        try:
            assert_views_stay_in_their_regions(reply.manifest(), reply.fds)
        finally:
            for fd in reply.fds:
                os.close(fd)
        conn.evict(reply.digest, force=True)


# --- labels: bounded, so status always fits a frame ---------------------------------------------------


def test_a_label_longer_than_the_bound_is_refused_and_one_at_the_bound_is_kept(served):
    server, _ = served
    with pytest.raises(ServerError) as refused:
        publish_host_entry(
            server.socket_dir, make_fingerprint(architecture="LongLabel"), nbytes=4096, label="x" * (MAX_LABEL_CHARS + 1)
        )
    assert refused.value.code == "bad_request" and f"more than the {MAX_LABEL_CHARS} allowed" in str(refused.value)
    label = "é" * MAX_LABEL_CHARS
    publish_host_entry(server.socket_dir, make_fingerprint(architecture="FullLabel"), nbytes=4096, label=label)
    assert [e["label"] for e in status(server)["entries"]] == [label]
    evict_all(server)


@pytest.mark.parametrize("where", ["label", "manifest"])
def test_a_huge_non_ascii_text_is_refused_and_status_and_attach_still_answer(served, where):
    server, fd = served
    # 24 MiB of UTF-8 in the frame; JSON-escaped in a status or attach reply it would be 72 MiB, past the 64 MiB frame limit.
    huge = "\U0001f600" * (6 << 20)
    manifest = base_manifest()
    message = {"op": "publish", "fingerprint": make_fingerprint(architecture="HugeText").to_json(), "manifest": manifest}
    if where == "label":
        message["label"] = huge
    else:
        manifest["extra"]["note"] = huge
    payload = json.dumps(message, ensure_ascii=False).encode()
    sock = raw_connect(server.socket_dir)
    try:
        send_raw(sock, frame(payload, nfds=1), [fd])
        reply, reply_fds = FrameReader(sock, deadline_s=30).read(idle_timeout=30)
    finally:
        sock.close()
    assert reply_fds == [] and reply["ok"] is False and reply["error"]["code"] == "bad_request", str(reply)[:300]
    assert status(server)["entries"] == []


def test_status_leaves_out_the_rows_past_its_byte_bound():
    registry = Registry()
    for i in range(20):
        registry.publish(
            Entry(
                fingerprint=make_fingerprint(architecture=f"Row{i}"),
                manifest={},
                fds=[],
                nbytes=0,
                label="r" * MAX_LABEL_CHARS,
                published_by=1,
            )
        )
    rows, omitted = registry.status()
    assert len(rows) == 20 and omitted == 0
    row_bytes = len(json.dumps(rows[0], separators=(",", ":"))) + 1
    rows, omitted = registry.status(max_bytes=5 * row_bytes + row_bytes // 2)
    assert len(rows) == 5 and omitted == 15


def test_status_rows_cut_long_fingerprint_texts(served):
    server, _ = served
    fingerprint = make_fingerprint(architecture="LongUuid", gpu_uuid="GPU-" + "\U0001f600" * (1 << 16))
    publish_host_entry(server.socket_dir, fingerprint, nbytes=4096)
    [row] = status(server)["entries"]
    assert row["device"] == fingerprint.gpu_uuid[:MAX_LABEL_CHARS]
    evict_all(server)


# --- evict by prefix ----------------------------------------------------------------------------------


def _two_fingerprints_sharing_a_prefix(chars: int = 4):
    seen = {}
    for i in itertools.count():
        fingerprint = make_fingerprint(architecture=f"Prefix{i}")
        other = seen.setdefault(fingerprint.digest[:chars], fingerprint)
        if other is not fingerprint:
            return other, fingerprint


def test_an_ambiguous_evict_prefix_is_refused_and_lists_the_matches(served):
    server, _ = served
    first, second = _two_fingerprints_sharing_a_prefix()
    for fingerprint in (first, second):
        publish_host_entry(server.socket_dir, fingerprint, nbytes=4096)
    prefix = first.digest[:4]
    with Connection(server.socket_dir) as conn, pytest.raises(ServerError) as refused:
        conn.evict(prefix)
    assert refused.value.code == "ambiguous", refused.value
    assert first.digest[:12] in str(refused.value) and second.digest[:12] in str(refused.value)
    assert "give more characters" in str(refused.value)
    assert {e["digest"] for e in status(server)["entries"]} == {first.digest, second.digest}, "nothing was evicted"

    cli = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "evict", "--socket-dir", str(server.socket_dir), prefix],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 1 and cli.stdout == "", cli
    assert (
        f"matches 2 entries ({min(first.digest, second.digest)[:12]}, {max(first.digest, second.digest)[:12]})" in cli.stderr
    ), cli.stderr
    assert len(status(server)["entries"]) == 2

    with Connection(server.socket_dir) as conn:
        assert conn.evict(first.digest) == [first.digest], "a full digest matches exactly one entry"
    assert [e["digest"] for e in status(server)["entries"]] == [second.digest]
    evict_all(server)


# --- host arenas are sealed against writes, shrinking, growing and further sealing ------------------


def test_a_sealed_host_arena_carries_every_seal():
    host = backend("host")
    arena = host.create(4096)
    try:
        host.seal(arena)
        fd = arena.export_fd()
    finally:
        arena.close()
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        for seal in ("F_SEAL_WRITE", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL"):
            assert seals & getattr(fcntl, seal), f"{seal} is missing from {seals:#x}"
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 8192)  # F_SEAL_GROW
    finally:
        os.close(fd)


def test_a_memfd_that_can_still_grow_is_refused(served):
    server, _ = served
    fd = sparse_memfd(ARENA_BYTES, seals=ALL_SEALS & ~fcntl.F_SEAL_GROW)
    try:
        with pytest.raises(ServerError) as refused:
            publish(server, fd, base_manifest())
    finally:
        os.close(fd)
    assert refused.value.code == "bad_request" and "growing" in str(refused.value), refused.value
    assert status(server)["entries"] == []
