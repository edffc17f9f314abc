"""A fleet on one machine: etcd from its package, three servers with their sharing agents, pulls over NIXL.

Real processes throughout: etcd (random ports, data in a temporary directory), ``weightcache serve`` per node (a
socket directory each), ``weightcache fleet share`` beside each, and each fleet load as a process of its node
(``load_on``: a child of the test zygote, its log read by the test); loads without a fleet run in this process. Each
node lives in a network namespace of its own on a bridge where the machine allows it (root), else on separate ports
of 127.0.0.1: ``test_the_fleet_runs_in_network_namespaces`` is skipped with the reason then (``-rs`` shows it;
``WEIGHTCACHE_TEST_FLEET_NETWORK=namespaces`` makes it a failure, as CI does). Each test kills every process it started
and removes every namespace and veth, failed or not.

Here: the transport's reads in pieces, the network, and a pull from a peer. Beside it: test_fleet_chain.py (many
nodes at once, relays), test_fleet_faults.py (what goes wrong), test_fleet_stores.py (a digest store per node),
test_plan_fleet.py; their fixtures are in tests/core/conftest.py, their loads and checks in fleet_loads.py.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import zygote
from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.fleet_loads import REGION_OF_MMAP, load, load_on, registry, wait_listed
from tests.core.fleet_network import NETNS_DIR
from tests.core.fleet_support import LEASE_TTL_S, Fleet, skip_unless_a_fleet_runs, wait_for
from tests.helpers import run_python

skip_unless_a_fleet_runs()  # etcd and NIXL, or the module is skipped saying which is missing


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
