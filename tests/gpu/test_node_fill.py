"""The node as one cache on real GPUs: a GPU's entry filled from a peer GPU or the host tier, never wrong, never partial.

One GPU suffices for the host tier; the peer tests need two (each skips, saying so, with fewer).
Every fill is compared bit for bit with the same GPU's disk load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import Engine, run_cli

torch = pytest.importorskip("torch")

from weightcache.core.arena.cuda import unavailable_reason  # noqa: E402

_reason = unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"no CUDA GPU: {_reason}")
two_gpus = pytest.mark.skipif(
    _reason is not None or torch.cuda.device_count() < 2,
    reason=f"needs two GPUs, this process sees {torch.cuda.device_count() if _reason is None else 0}",
)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    """A random-weight Llama in bf16 (72 MiB) with tied embeddings left untied, saved by transformers."""
    from tests.models import save_random_model

    return save_random_model("llama-gpu-small", tmp_path_factory.mktemp("node-llama"), dtype="bfloat16")


def load(model, socket_dir, device: str, tier: str = "device") -> str:
    """``weightcache load`` in its own process; its one line of output."""
    args = ("--model", str(model), "--device", device, "--tier", tier, "--socket-dir", str(socket_dir))
    return run_cli("load", *args, timeout=300).stdout.strip()


def status(socket_dir) -> list[dict]:
    from weightcache.core.client.client import Connection

    with Connection(socket_dir) as connection:
        return connection.status()["entries"]


def assert_attaches_like_a_disk_load(model, socket_dir, device: str) -> None:
    from tests.adapters.test_hf_checkpoints import assert_same_bits, forward, named_tensors
    from weightcache.core.flow.modes import load_model

    def compare(cached, disk) -> None:  # its locals (views of the arenas) are gone before the arenas are unmapped
        assert cached.source == "cache"
        actual, expected = named_tensors(cached.model), named_tensors(disk.model)
        assert sorted(actual) == sorted(expected)
        for name, tensor in expected.items():
            assert actual[name].device == tensor.device, name
            assert_same_bits(name, actual[name], tensor)
        assert_same_bits("output", forward(cached.model), forward(disk.model))

    disk = load_model(str(model), mode="off", device=device)
    cached = load_model(str(model), mode="client", device=device, socket_dir=socket_dir, strict=True)
    try:
        failure = None
        try:
            compare(cached, disk)
        except AssertionError as exc:
            failure = str(exc)  # the message only: a traceback's frames would keep views of the arenas alive
        assert failure is None, failure
    finally:
        cached.close()


def test_the_host_tier_holds_a_gpu_made_model_and_fills_the_gpu_from_it(server, gpu_model):
    line = load(gpu_model, server.socket_dir, "cuda:0", tier="host")
    assert " on the host tier:" in line, line
    assert [row["tier"] for row in status(server.socket_dir)] == ["host"]
    line = load(gpu_model, server.socket_dir, "cuda:0")
    assert "copied from the host tier" in line, line
    assert sorted(row["tier"] for row in status(server.socket_dir))[-1] == "host"
    assert_attaches_like_a_disk_load(gpu_model, server.socket_dir, "cuda:0")


def test_evicting_the_gpu_entry_keeps_its_host_copy_and_a_client_refills_from_it(server, gpu_model):
    line = load(gpu_model, server.socket_dir, "cuda:0", tier="both")
    assert "kept on the host tier as" in line, line
    gpu = next(row for row in status(server.socket_dir) if row["tier"] != "host")
    subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "evict", gpu["digest"], "--socket-dir", str(server.socket_dir)],
        check=True,
    )
    assert [row["tier"] for row in status(server.socket_dir)] == ["host"]
    engine = Engine(gpu_model, server.socket_dir, mode="client", device="cuda:0")  # a client: fills from the node, no disk
    try:
        assert engine.ready["source"] == "cache"
    finally:
        engine.close()
    assert sorted(row["tier"] != "host" for row in status(server.socket_dir)) == [False, True]


def test_a_source_gone_before_the_copy_costs_one_log_line_and_the_next_source_is_used(server, gpu_model, caplog):
    from weightcache.core.fingerprint import HOST_TIER
    from weightcache.core.flow.loader import prepare
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.node import fill
    from weightcache.core.request import LoadRequest

    load(gpu_model, server.socket_dir, "cuda:0", tier="host")
    fingerprint = prepare(LoadRequest(model=str(gpu_model), device="cuda:0")).fingerprint
    [host] = fill.sources(fingerprint, server.socket_dir)
    gone = fill.Source(fingerprint.on_device(HOST_TIER + "-evicted"), HOST_TIER, host.nbytes)  # evicted meanwhile
    with ArenaBuilder("cuda:0") as builder:
        copied = fill.copy_from_node(fingerprint, builder, server.socket_dir, [gone, host])
        assert copied is not None and copied.source == host
    assert "failed" in caplog.text and "trying the next source" in caplog.text


def test_a_filler_killed_before_it_publishes_leaves_no_entry(server, gpu_model):
    load(gpu_model, server.socket_dir, "cuda:0", tier="host")
    before = status(server.socket_dir)
    child = subprocess.Popen(
        [sys.executable, "-c", _FILL_THEN_WAIT, str(gpu_model), str(server.socket_dir)], stdout=subprocess.PIPE, text=True
    )
    with child.stdout:
        assert child.stdout.readline().strip() == "copied"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert [row["digest"] for row in status(server.socket_dir)] == [row["digest"] for row in before]


_FILL_THEN_WAIT = """
import sys, time
from weightcache.core.node import fill
from weightcache.core.load.export import ArenaBuilder
from weightcache.core.flow.loader import prepare
from weightcache.core.request import LoadRequest
fingerprint = prepare(LoadRequest(model=sys.argv[1], device="cuda:0")).fingerprint
with ArenaBuilder("cuda:0") as builder:
    assert fill.copy_from_node(fingerprint, builder, sys.argv[2]) is not None
    print("copied", flush=True)
    time.sleep(600)
"""


@two_gpus
def test_a_peer_gpu_fills_the_second_gpu_bit_identical_to_its_disk_load(server, gpu_model):
    load(gpu_model, server.socket_dir, "cuda:0")
    line = load(gpu_model, server.socket_dir, "cuda:1")
    assert "copied from peer GPU" in line, line
    tiers = {row["tier"] for row in status(server.socket_dir)}
    assert len(tiers) == 2 and "host" not in tiers
    assert_attaches_like_a_disk_load(gpu_model, server.socket_dir, "cuda:1")


@two_gpus
def test_an_evicted_peer_entry_falls_back_to_the_host_tier(server, gpu_model, caplog):
    from weightcache.core.client.client import Connection
    from weightcache.core.flow.loader import prepare
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.node import fill
    from weightcache.core.request import LoadRequest

    load(gpu_model, server.socket_dir, "cuda:0", tier="both")
    fingerprint = prepare(LoadRequest(model=str(gpu_model), device="cuda:1")).fingerprint
    found = fill.sources(fingerprint, server.socket_dir)
    assert [source.tier == "host" for source in found] == [False, True]
    with Connection(server.socket_dir) as connection:
        connection.evict(found[0].fingerprint.digest)
    with ArenaBuilder("cuda:1") as builder:
        copied = fill.copy_from_node(fingerprint, builder, server.socket_dir, found)
        assert copied is not None and copied.source.tier == "host"
    assert "trying the next source" in caplog.text


_LOAD_ON_CUDA1_THEN_LIST_CONTEXTS = """
import sys
from weightcache.core.cuda_driver import check, driver
from weightcache.core.cli.cli import main
assert main(["load", "--model", sys.argv[1], "--device", "cuda:1", "--socket-dir", sys.argv[2]]) == 0
cu = driver()
states = [check(cu.cuDevicePrimaryCtxGetState(check(cu.cuDeviceGet(i), "cuDeviceGet")), "state") for i in range(2)]
print("active contexts:", [i for i, (_, active) in enumerate(states) if active])
"""


def load_on_cuda1_and_list_contexts(model, socket_dir) -> tuple[str, str]:
    """``weightcache load --device cuda:1`` in a child; (its output, the GPUs it holds a CUDA context on)."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_ON_CUDA1_THEN_LIST_CONTEXTS, str(model), str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *output, contexts = done.stdout.strip().splitlines()
    return "\n".join(output), contexts


@two_gpus
def test_loading_for_the_second_gpu_makes_no_context_on_the_first(server, gpu_model):
    """A CUDA context costs hundreds of MiB of its GPU: a loader for cuda:1, from disk or from cuda:0's entry, makes none on cuda:0."""
    from weightcache.core.client.client import Connection

    output, contexts = load_on_cuda1_and_list_contexts(gpu_model, server.socket_dir)
    assert "copied from" not in output, output
    assert contexts == "active contexts: [1]", f"from disk: {contexts}"
    with Connection(server.socket_dir) as connection:
        connection.evict(status(server.socket_dir)[0]["digest"])
    load(gpu_model, server.socket_dir, "cuda:0")
    output, contexts = load_on_cuda1_and_list_contexts(gpu_model, server.socket_dir)
    assert "copied from peer GPU" in output, output
    assert contexts == "active contexts: [1]", f"from the peer: {contexts}"


@two_gpus
def test_two_engines_on_two_gpus_each_attach_their_own_gpus_entry(server, gpu_model):
    load(gpu_model, server.socket_dir, "cuda:0")
    engines = [Engine(gpu_model, server.socket_dir, mode="client", device=f"cuda:{i}") for i in range(2)]
    disk = Engine(gpu_model, server.socket_dir, mode="off", device="cuda:1")
    try:
        assert [engine.ready["source"] for engine in engines] == ["cache", "cache"]
        digests = [engine.ready["digest"] for engine in engines]
        assert len(set(digests)) == 2
        rows = {row["digest"]: row for row in status(server.socket_dir)}
        assert [rows[d]["attached_pids"] for d in digests] == [[engine.ready["pid"]] for engine in engines]
        assert engines[0].ask("hash") == engines[1].ask("hash") == disk.ask("hash")
    finally:
        for engine in (*engines, disk):
            engine.close()


def publish_corrupt_copy(fingerprint, socket_dir, tier: str) -> None:
    """Replace the entry ``fingerprint`` names with a copy on ``tier`` (``host``, or ``cuda:N``) whose bytes differ in one
    byte but that declares the original's checksums: a corrupted copy as a fill meets it. The original is evicted."""
    import attrs

    from weightcache.core.arena.transfer import Pair, device_to_host
    from weightcache.core.client.attach import Attachment
    from weightcache.core.client.client import Connection
    from weightcache.core.fingerprint import HOST_TIER
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.wire.protocol import close_fds

    original = Attachment.open(fingerprint, socket_dir)
    try:
        declared = list(original.manifest.arenas)
        with ArenaBuilder("cpu" if tier == "host" else tier) as copy:
            slots = [copy.add_arena(spec.size) for spec in declared]
            if tier == "host":
                device_to_host(
                    [Pair(copy.arena(s).fileno(), a.bytes_view()) for s, a in zip(slots, original.arenas, strict=True)]
                )
                fd = copy.arena(slots[0]).fileno()
                os.pwrite(fd, bytes([os.pread(fd, 1, 4096)[0] ^ 0xFF]), 4096)  # one byte of arena 0, before sealing
            else:
                for slot, arena in zip(slots, original.arenas, strict=True):
                    copy.view(slot).copy_(arena.bytes_view())
                copy.view(slots[0])[4096] ^= 0xFF
                torch.cuda.synchronize(tier)
            copy.seal()
            lying = [attrs.evolve(spec, checksum=want.checksum) for spec, want in zip(copy.specs(), declared, strict=True)]
            manifest = attrs.evolve(original.manifest, arenas=lying)
            fds = [arena.export_fd() for arena in copy.arenas]
            try:
                with Connection(socket_dir) as connection:
                    if tier != "host":
                        original.connection.detach(original.digest)
                        connection.evict(original.digest)
                    where = fingerprint.on_device(HOST_TIER) if tier == "host" else fingerprint
                    connection.publish(where, manifest, fds, label="corrupt copy")
            finally:
                close_fds(fds)
    finally:
        original.close()


def test_a_corrupted_host_tier_copy_is_refused_on_the_gpu_and_the_disk_is_used(server, gpu_model, caplog):
    from weightcache.core.client.client import Connection
    from weightcache.core.flow.loader import prepare
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.node import fill
    from weightcache.core.request import LoadRequest

    load(gpu_model, server.socket_dir, "cuda:0")
    fingerprint = prepare(LoadRequest(model=str(gpu_model), device="cuda:0")).fingerprint
    publish_corrupt_copy(fingerprint, server.socket_dir, "host")
    with Connection(server.socket_dir) as connection:
        connection.evict(fingerprint.digest)  # only the corrupt host copy is left
    [host] = fill.sources(fingerprint, server.socket_dir)
    with ArenaBuilder("cuda:0") as builder:
        assert fill.copy_from_node(fingerprint, builder, server.socket_dir, [host]) is None
    assert "arena 0 from the host tier does not hold the bytes it declared" in caplog.text, caplog.text
    line = load(gpu_model, server.socket_dir, "cuda:0")
    assert "copied from" not in line, line  # read from the disk
    assert_attaches_like_a_disk_load(gpu_model, server.socket_dir, "cuda:0")


@two_gpus
def test_a_corrupted_peer_gpu_entry_is_refused_on_the_gpu_and_the_next_source_is_used(server, gpu_model, caplog):
    from weightcache.core.flow.loader import prepare
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.node import fill
    from weightcache.core.request import LoadRequest

    load(gpu_model, server.socket_dir, "cuda:0", tier="both")
    source = prepare(LoadRequest(model=str(gpu_model), device="cuda:0")).fingerprint
    publish_corrupt_copy(source, server.socket_dir, "cuda:0")  # GPU0's entry now lies; the host copy is sound
    wanted = prepare(LoadRequest(model=str(gpu_model), device="cuda:1")).fingerprint
    found = fill.sources(wanted, server.socket_dir)
    assert [s.tier == "host" for s in found] == [False, True]
    with ArenaBuilder("cuda:1") as builder:
        copied = fill.copy_from_node(wanted, builder, server.socket_dir, found)
        assert copied is not None and copied.source.tier == "host"
    assert "arena 0 from peer GPU" in caplog.text and "does not hold the bytes it declared" in caplog.text, caplog.text


def test_weightcache_verify_checks_a_gpu_entry_on_its_gpu_and_finds_a_corrupt_one(server, gpu_model):
    from weightcache.core.flow.loader import prepare
    from weightcache.core.request import LoadRequest

    load(gpu_model, server.socket_dir, "cuda:0")
    good = run_cli("verify", "--socket-dir", str(server.socket_dir))
    assert good.stdout.splitlines()[-1] == "1 entry checked, 0 corrupt", good.stdout
    fingerprint = prepare(LoadRequest(model=str(gpu_model), device="cuda:0")).fingerprint
    publish_corrupt_copy(fingerprint, server.socket_dir, "cuda:0")
    bad = run_cli("verify", "--drop", "--socket-dir", str(server.socket_dir), check=False)
    assert bad.returncode == 2 and "CORRUPT arena 0 (dropped)" in bad.stdout, bad.stdout + bad.stderr
    assert status(server.socket_dir) == []
