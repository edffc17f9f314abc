"""The fleet tests' loads and checks: a load on a node (in this process, or as a process of the node), the registry as a
test reads it, a holder that lies or dies (tests/core/fleet_holder.py), loads on several nodes at once and the arena
reads their logs tell."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import typing

import attrs
import pytest

from tests import zygote
from tests.core.fleet_network import NodeNetwork
from tests.core.fleet_support import SECRET, Etcd, Node, fleet_env, wait_for
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import Fingerprint, canonical_json
from weightcache.core.flow.loader import Published, prepare, publish
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.records import Content, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.request import LoadRequest


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


def holder_spec(etcd: Etcd, node: str, source: Node, fingerprint, random_bytes: bool, tmp_path, secret: str = SECRET) -> dict:
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


@contextlib.contextmanager
def holding(spec: dict, tmp_path, net: NodeNetwork, **extra_env: str) -> typing.Iterator[subprocess.Popen]:
    """A fleet_holder of ``spec`` (``start_holder``) while the block runs, stopped after it."""
    holder = start_holder(spec, tmp_path, net, **extra_env)
    try:
        yield holder
    finally:
        stop(holder)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def some_fingerprint() -> Fingerprint:
    base = {f: "x" for f in ("checkpoint", "architecture", "config", "dtype", "quantization", "quantization_config")}
    base.update(adapter="hf", adapter_version="1", engine="", engine_version="", torch_version="2", cuda_version="")
    base.update(compute_capability="", gpu_uuid="", tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1)
    return Fingerprint(**{**base, "ep_size": 1, "ep_rank": 0})


def said(outputs: list[tuple[str, str]]) -> list[list[str]]:
    """What each load logged above DEBUG, and its last line: why it pulled or read the disk."""
    return [[line for line in err.splitlines() if " DEBUG " not in line][-12:] + out.splitlines()[-1:] for out, err in outputs]


def load_at_once(nodes: list[Node], path, envs: list[dict] | None = None, **extra_env: str) -> list[tuple[str, str]]:
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
