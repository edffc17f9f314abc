"""The fleet's records, settings and registry client without a fleet: signatures, shapes, deadlines, one-line errors."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.core.errors import FleetUnavailable
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.etcd import EtcdStore, prefix_end
from weightcache.core.node.fleet.records import (
    Claim,
    Content,
    FileContent,
    FileSeen,
    Holding,
    Landing,
    Relay,
    opened,
    seal,
    unseal,
)
from weightcache.core.node.fleet.transport import Region

SECRET = b"0123456789abcdef-secret"
CHECKSUM = "wsum64v1:" + "0" * 32


def fingerprint(**changes) -> Fingerprint:
    base = {f: "x" for f in ("checkpoint", "architecture", "config", "dtype", "quantization", "quantization_config")}
    base.update(adapter="hf", adapter_version="1", engine="", engine_version="", torch_version="2", cuda_version="")
    base.update(compute_capability="", gpu_uuid="", tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1)
    base.update(ep_size=1, ep_rank=0)
    return Fingerprint(**{**base, **changes})


def holding() -> Holding:
    return Holding("a", fingerprint(), "ab" * 32, "nixl", "cmVhY2g=", Region(4096, 100), (Region(8192, 4096),))


def test_a_sealed_record_opens_only_at_its_key_with_its_secret():
    key = b"/weightcache/holders/c/a"
    value = seal(key, holding().to_json(), SECRET)
    assert Holding.from_json(unseal(key, value, SECRET)) == holding()
    for other_key, secret in ((b"/weightcache/holders/c/b", SECRET), (key, b"another-fleets-secret-xx")):
        with pytest.raises(ValueError, match="not signed with this fleet's secret"):
            unseal(other_key, value, secret)
    tampered = value.replace(b'"node":"a"', b'"node":"b"')
    with pytest.raises(ValueError, match="not signed"):
        unseal(key, tampered, SECRET)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arenas": []}, "arenas must be a list of 1 to"),
        ({"arenas": [[0, CHECKSUM]]}, "an arena of 0 bytes"),
        ({"arenas": [[4096, "crc:1"]]}, "is not one this version computes"),
        ({"manifest_sha256": "zz"}, "manifest_sha256 is not a sha256"),
        ({"manifest_bytes": 1 << 40}, "a manifest of"),
        ({"origin": ""}, "origin is ''"),
    ],
)
def test_a_content_record_of_the_wrong_shape_is_refused_naming_the_field(change, message):
    good = Content(fingerprint(), "ab" * 32, 100, ((4096, CHECKSUM),), "a").to_json()
    assert Content.from_json(good).nbytes == 4096
    with pytest.raises(ValueError, match=message):
        Content.from_json({**good, **change})


@pytest.mark.parametrize(
    ("region", "message"),
    [
        ([0, 10, 0, "DRAM"], "address is 0"),
        ([4096, 0, 0, "DRAM"], "length is 0"),
        ([4096, 10, -1, "DRAM"], "device is -1"),
        ([4096, 10, 0, "HBM"], "not one of DRAM, VRAM"),
        ([4096, 10], r"\[address, length, device, memory\]"),
    ],
)
def test_a_region_a_holder_declares_is_checked(region, message):
    with pytest.raises(ValueError, match=message):
        Region.from_json(region)


def test_the_fleet_settings_say_which_variable_to_fix(tmp_path):
    assert FleetConfig.from_env({}) is None
    with pytest.raises(ValueError, match="neither WEIGHTCACHE_FLEET_SECRET_FILE nor WEIGHTCACHE_FLEET_SECRET"):
        FleetConfig.from_env({"WEIGHTCACHE_FLEET_ETCD": "http://127.0.0.1:2379"})
    with pytest.raises(ValueError, match="is not an http:// or https:// address"):
        FleetConfig.from_env({"WEIGHTCACHE_FLEET_ETCD": "127.0.0.1:2379", "WEIGHTCACHE_FLEET_SECRET": "s" * 16})
    with pytest.raises(ValueError, match="the fleet secret has 5 bytes"):
        FleetConfig.from_env({"WEIGHTCACHE_FLEET_ETCD": "http://h:1", "WEIGHTCACHE_FLEET_SECRET": "short"})
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    secret.chmod(0o644)
    env = {"WEIGHTCACHE_FLEET_ETCD": "http://h:1", "WEIGHTCACHE_FLEET_SECRET_FILE": str(secret)}
    with pytest.raises(ValueError, match=r"must belong to this user and be private \(chmod 600\)"):
        FleetConfig.from_env(env)
    secret.chmod(0o600)
    config = FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_NODE": "n1", "WEIGHTCACHE_FLEET_DEADLINE_S": "0.5"})
    assert config is not None and config.secret == b"s" * 32 and config.node == "n1" and config.deadline_s == 0.5
    assert "s" * 32 not in repr(config)  # the secret never shows in a log line
    with pytest.raises(ValueError, match="WEIGHTCACHE_FLEET_WAIT_S='soon' is not a number of seconds"):
        FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_WAIT_S": "soon"})
    assert config.fanout == 2
    assert FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_FANOUT": "1"}).fanout == 1  # type: ignore[union-attr]
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match=f"WEIGHTCACHE_FLEET_FANOUT='{re.escape(bad)}': use a whole number"):
            FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_FANOUT": bad})
    assert config.relay
    assert not FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_RELAY": "0"}).relay  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"WEIGHTCACHE_FLEET_RELAY='yes': use 1 \(on\) or 0 \(off\)"):
        FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_RELAY": "yes"})
    assert config.piece_bytes == 1 << 20
    assert FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_PIECE_BYTES": "65536"}).piece_bytes == 65536  # type: ignore[union-attr]
    for bad in ("4095", "1MiB", "-4096"):
        with pytest.raises(ValueError, match=f"WEIGHTCACHE_FLEET_PIECE_BYTES='{re.escape(bad)}': use a whole number of bytes"):
            FleetConfig.from_env({**env, "WEIGHTCACHE_FLEET_PIECE_BYTES": bad})


def test_a_registry_that_does_not_answer_costs_its_deadline_and_no_more():
    """A listener that accepts and never answers (a hung etcd): the call gives up at its deadline."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        store = EtcdStore([f"http://127.0.0.1:{silent.getsockname()[1]}"], deadline_s=0.5)
        start = time.monotonic()
        with pytest.raises(FleetUnavailable, match="did not answer") as caught:
            store.range(b"/weightcache/")
        assert caught.value.kind == "unreachable" and "disk" not in str(caught.value), "the store reads no disk"
        assert time.monotonic() - start < 5  # its 0.5 s deadline, within an order of magnitude


def test_a_registry_nobody_listens_on_is_unavailable_at_once():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = EtcdStore([f"http://127.0.0.1:{port}"], deadline_s=5)
    start = time.monotonic()
    with pytest.raises(FleetUnavailable, match=f"127.0.0.1:{port}"):
        store.get(b"/k")
    assert time.monotonic() - start < 2


def test_a_prefix_ends_where_etcd_expects():
    assert prefix_end(b"/weightcache/holders/") == b"/weightcache/holders0"
    assert prefix_end(b"a\xff") == b"b"


def test_holdings_keep_their_fields_through_json():
    assert Holding.from_json(holding().to_json()) == holding()
    assert attrs.evolve(holding(), reach="x").reach == "x"


def test_a_relay_record_lists_exactly_the_arenas_it_says_are_verified():
    relay = Relay("b", fingerprint(), "nixl", "cmVhY2g=", None, ())
    assert relay.verified == 0 and Relay.from_json(relay.to_json()) == relay
    grown = attrs.evolve(relay, manifest=Region(4096, 100), arenas=(Region(8192, 4096), Region(16384, 4096)))
    assert Relay.from_json(grown.to_json(), revision=7) == grown and Relay.from_json(grown.to_json(), 7).revision == 7
    claims_more = {**grown.to_json(), "verified": 3}
    with pytest.raises(ValueError, match="it says 3 arenas are verified and lists 2"):
        Relay.from_json(claims_more)
    key = b"/weightcache/relays/c/b"
    with pytest.raises(ValueError, match="not signed"):
        unseal(key, seal(key, grown.to_json(), SECRET).replace(b'"verified":2', b'"verified":1'), SECRET)


def test_a_relay_record_lands_only_the_arena_after_its_verified_ones_within_its_buffer():
    checked = Relay("b", fingerprint(), "nixl", "cmVhY2g=", Region(4096, 100), (Region(8192, 4096),))
    landing = attrs.evolve(checked, landing=Landing(1, 1024, Region(1 << 20, 4096)))
    assert Relay.from_json(landing.to_json()) == landing and Relay.from_json(checked.to_json()).landing is None
    body = landing.to_json()
    for bad, error in [
        ({**body["landing"], "arena": 0}, "it lands arena 0 with 1 verified"),
        ({**body["landing"], "arena": 2}, "it lands arena 2 with 1 verified"),
        ({**body["landing"], "landed": 4097}, "4097 bytes landed in a region of 4096"),
        ({**body["landing"], "landed": -1}, "-1 bytes landed"),
        ({**body["landing"], "landed": True}, "True bytes landed"),
        ({**body["landing"], "arena": "1"}, "not an arena's index"),
        ({**body["landing"], "region": [0, 4096, 0, "DRAM"]}, "address"),
        ([1, 1024], "landing must be an object"),
    ]:
        with pytest.raises(ValueError, match=error):
            Relay.from_json({**body, "landing": bad})


def test_a_region_part_stays_within_the_region():
    region = Region(4096, 100, 1, "VRAM")
    assert region.part(10, 90) == Region(4106, 90, 1, "VRAM")
    for offset, length in [(0, 101), (-1, 10), (50, 0), (100, 1)]:
        with pytest.raises(ValueError, match="not within a region of 100"):
            region.part(offset, length)


def test_gpu_memory_to_gpu_memory_is_called_gpu_direct_only_over_an_rdma_device():
    """On the H200 with TCP alone, UCX read VRAM through host buffers at 0.4 GB/s while the output said GPU-direct
    (it went by the regions' kinds): the path names RDMA only where UCX has an RDMA device to read over."""
    from weightcache.core.node.fleet.nixl import gpu_direct_possible, path_of

    gpu, host = Region(1 << 20, 4096, 0, "VRAM"), Region(1 << 20, 4096)
    assert not gpu_direct_possible("", ()) and not gpu_direct_possible("lo", ("mlx5_0",))
    assert gpu_direct_possible("", ("mlx5_0",)) and gpu_direct_possible("eth0,mlx5_0:1", ("mlx5_0", "mlx5_1"))
    assert path_of(gpu, gpu, gpu_direct=True).startswith("GPU-direct (NIXL/UCX over RDMA")
    assert "through host buffers" in path_of(gpu, gpu) and "GPU-direct" not in path_of(gpu, gpu)
    assert path_of(host, host, gpu_direct=True) == "host memory to host memory (NIXL/UCX)"
    assert path_of(host, gpu) == "host memory to GPU (NIXL/UCX)"


RECORD_KINDS = (Content, Holding, Claim, FileContent, lambda body: Relay.from_json(body, 3))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
FIELDS = ("fingerprint", "node", "arenas", "manifest", "region", "seen", "digest", "landing", "verified", "reach")


def parser(kind):
    return kind.from_json if isinstance(kind, type) else kind


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6), kind=st.sampled_from(RECORD_KINDS))
def test_a_signed_record_of_any_shape_is_refused_with_a_value_error_only(body, kind):
    """What a node with the secret but another version (or a bug) writes: any shape is a ValueError, nothing else."""
    key = b"/weightcache/holders/c/a"
    try:
        opened(key, seal(key, body, SECRET), SECRET, parser(kind))
    except ValueError:
        pass


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("where", ["value", "body"])
def test_a_record_nested_100k_deep_is_refused_with_one_line(where):
    key = b"/weightcache/claims/c"
    value = deep(100_000) if where == "value" else b'{"mac": "00", "body": {"node": ' + deep(100_000) + b"}}"
    for kind in RECORD_KINDS:
        with pytest.raises(ValueError, match=r"nested too deep|not JSON"):
            opened(key, value, SECRET, parser(kind))


def test_a_mac_that_is_not_ascii_is_refused_as_unsigned():
    key = b"/weightcache/claims/c"
    with pytest.raises(ValueError, match="not signed"):
        unseal(key, json.dumps({"body": {"node": "a"}, "mac": "\u00e9" * 64}).encode(), SECRET)


def test_a_file_record_keeps_its_fields_and_refuses_another_scheme():
    seen = FileSeen(1000, 1, 2, 3, "cd" * 32)
    record = FileContent(seen, "wc-sha256-tree-64MiB:" + "ef" * 32, "a")
    assert FileContent.from_json(record.to_json()) == record
    assert seen.name != FileSeen(1000, 1, 3, 3, "cd" * 32).name  # another change time: another key
    with pytest.raises(ValueError, match="not of the scheme"):
        FileContent.from_json({**record.to_json(), "digest": "md5:" + "ef" * 16})


class Dripping:
    """An HTTP server that answers every request with a valid reply, one byte every ``every_s`` seconds."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(connection,), daemon=True).start()

    def _drip(self, connection: socket.socket) -> None:
        body = json.dumps({"kvs": [], "padding": "x" * 400}).encode()
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        with connection:
            try:
                connection.recv(65536)
                for byte in reply:
                    if self.stop.wait(self.every_s):
                        return
                    connection.sendall(bytes([byte]))
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_a_registry_that_drips_its_reply_costs_the_deadline_of_the_whole_call():
    """A server that sends one byte every 0.05 s never lets a read time out; the call's deadline is for all of it."""
    server = Dripping(0.05)
    try:
        store = EtcdStore([server.url], deadline_s=1.0)
        with pytest.raises(FleetUnavailable, match="no whole reply within 1 s"):
            store.range(b"/weightcache/")
    finally:
        server.close()
