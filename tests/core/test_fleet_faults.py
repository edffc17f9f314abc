"""Fleet faults: a holder without its content record, a liar, records without the fleet's secret, a holder killed mid-transfer,
a read past its deadline, etcd stalled or killed, watches, records nested deep, invalid claims, two agents of one name,
two users on one host, a NIXL write from a stranger, one bad arena: each costs a line or a warning and never a wrong
byte. The fleet's fixtures are in tests/core/conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import attrs
import pytest

from tests import zygote
from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.fleet_loads import (
    arena_reads,
    entries,
    holder_spec,
    holder_with_arenas,
    holding,
    keys_under,
    listed,
    load,
    load_on,
    registry,
    some_fingerprint,
    wait_listed,
)
from tests.core.fleet_support import LEASE_TTL_S, Etcd, fleet_env, skip_unless_a_fleet_runs, wait_for
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.flow.loader import prepare
from weightcache.core.identity.digests import RACY_WINDOW_NS, checkpoint_digests
from weightcache.core.identity.safetensors_io import checkpoint_files
from weightcache.core.node.fleet.etcd import EtcdStore
from weightcache.core.node.fleet.records import Relay, seal
from weightcache.core.request import LoadRequest

skip_unless_a_fleet_runs()  # etcd and NIXL, or the module is skipped saying which is missing


def test_a_holder_whose_content_record_left_is_waited_for_with_its_own_line(network_fleet, model_dir, tmp_path):
    """A holder listed without a content record (its declarer left): the puller says it waits for the record, not for
    a slot, gives the holder two lease TTLs to list it again, then reads the disk."""
    fleet, node = network_fleet
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = {**holder_spec(fleet.etcd, "recordless", honest, first.fingerprint, False, tmp_path), "content": None}
    with holding(spec, tmp_path, fleet.network.node("recordless")):
        published = load_on(b, path)
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
    with holding(holder_spec(etcd, "liar", honest, first.fingerprint, True, tmp_path), tmp_path, fleet.network.node("liar")):
        assert listed(etcd, first.fingerprint.content_digest) == ["liar"]
        published = load_on(b, path)
    assert published.kind == "disk"
    assert [line for line in published.lines("from node liar failed") if "checksum" in line], published.log[-3000:]
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_records_without_the_fleets_secret_are_left_out_with_one_line(network_fleet, model_dir, tmp_path):
    fleet, node = network_fleet
    etcd = fleet.etcd
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = holder_spec(etcd, "stranger", honest, first.fingerprint, False, tmp_path, secret="another-fleets-secret-0123")
    with holding(spec, tmp_path, fleet.network.node("stranger")):
        published = load_on(b, path)
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
    spec = holder_spec(etcd, "dying", honest, first.fingerprint, False, tmp_path)
    with holding(spec, tmp_path, fleet.network.node("dying"), UCX_TLS="tcp") as dying:
        dying.send_signal(signal.SIGSTOP)  # its UCX worker answers nothing, the read stalls
        threading.Timer(1.0, dying.kill).start()  # then it dies, mid-read
        start = time.monotonic()
        published = load_on(b, path, UCX_TLS="tcp")
        elapsed = time.monotonic() - start
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
    # an order of magnitude (the whole load takes seconds on a loaded machine): a stalled registry never holds it
    assert stalled_s < 90, f"a stalled registry held the load {stalled_s:.1f} s"
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
    fingerprint = some_fingerprint()
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
    spec = {**holder_spec(fleet.etcd, "liar", honest, first.fingerprint, False, tmp_path), "relay": True, "content": None}
    spec["arenas"][2] = None  # random bytes for arena 2 alone
    with holding(spec, tmp_path, fleet.network.node("liar")):
        b = node("b", share=False)
        published = load_on(b, model_dir("llama"), WEIGHTCACHE_TEST_LOG_LEVEL="DEBUG")
    assert published.kind == "node" and published.digest == first.digest, published.log[-3000:]
    failed = published.lines("from relay liar failed")
    assert len(failed) == 1 and "arena 2" in failed[0] and "checksum" in failed[0], published.log[-3000:]
    reads = arena_reads(published.log)
    assert [(r.index, r.node) for r in reads[:2]] == [(0, "liar"), (1, "liar")], reads
    assert [r.index for r in reads] == list(range(arenas)) and {r.node for r in reads[2:]} == {"a"}, reads
    assert_attaches_like_from_pretrained(model_dir("llama"), b.socket_dir, "float32", None)
