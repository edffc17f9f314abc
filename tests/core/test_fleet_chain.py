"""Many nodes at once: a relay frees its landing buffers, leases run out, a server that stops takes its records, new
nodes at once read the disk once (the claim) and pull the rest, a holder serves a few at a time, the chain of relays
(each node from the one ahead before it published), a relay killed or lying mid-chain. The fleet's fixtures are in
tests/core/conftest.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import typing

import attrs
import pytest

from tests import zygote
from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.fleet_loads import (
    REGION_OF_MMAP,
    arena_reads,
    entries,
    holder_spec,
    holder_with_arenas,
    holding,
    keys_under,
    listed,
    load,
    load_at_once,
    load_on,
    registry,
    relay_records,
    said,
    some_fingerprint,
    wait_listed,
)
from tests.core.fleet_support import LEASE_TTL_S, Node, fleet_env, skip_unless_a_fleet_runs, slow_sending, wait_for
from tests.helpers import run_python
from weightcache.core.flow.loader import Published, prepare
from weightcache.core.identity.digests import RACY_WINDOW_NS, checkpoint_digests
from weightcache.core.identity.safetensors_io import Sighting, checkpoint_files
from weightcache.core.request import LoadRequest

skip_unless_a_fleet_runs()  # etcd and NIXL, or the module is skipped saying which is missing

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
    report = json.loads(run_python(RELAY_BUFFERS, json.dumps(some_fingerprint().to_json()), env=env).stdout.splitlines()[-1])
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
    outputs = load_at_once(nodes, path)
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    from_disk = [s for s in sources if "copied from node" not in s]
    assert len(from_disk) == 1, said(outputs)
    assert sum("copied from node" in s for s in sources) == 2, said(outputs)
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
    outputs = load_at_once(nodes, path, WEIGHTCACHE_FLEET_FANOUT="1", WEIGHTCACHE_FLEET_RELAY="0")
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert all("copied from node" in s for s in sources), said(outputs)
    waited = [err for _, err in outputs if "waiting for a free slot" in err]
    assert waited, said(outputs)
    assert {e["digest"] for n in nodes for e in entries(n)} == {first.digest}
    wait_listed(etcd, first.fingerprint.content_digest, [a, *nodes], "every node listing it")


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
    outputs = load_at_once(nodes, model_dir("llama"))
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    if not all("copied from node" in s for s in sources):  # the whole story: which node read the disk, and why
        agent = "\n".join(a.sharer_output().splitlines()[-40:])
        pytest.fail("\n\n".join("\n".join(lines) for lines in said(outputs)) + f"\n\nnode a's agent:\n{agent}")
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
    spec = {**holder_spec(fleet.etcd, "liar", honest, first.fingerprint, True, tmp_path), "relay": relay, "content": None}
    with holding(spec, tmp_path, fleet.network.node("liar")):
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
    arenas = len(spec["sizes"]) if lie == "checked" else 0
    relayed = f"/relays/{first.fingerprint.content_digest}/liar: node liar pulls it and serves the {arenas} arenas"
    assert shown.returncode == 0 and any(relayed in line for line in shown.stdout.splitlines()), shown.stdout
    assert published.kind == "node" and published.source.startswith("node honest over"), published.log[-3000:]
    failed = published.lines("from relay liar failed")
    assert len(failed) == 1 and "checksum" in failed[0], published.log[-3000:]
    assert {r.node for r in arena_reads(published.log)} == {"honest"}
    assert published.digest == first.digest
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)
