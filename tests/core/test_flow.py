"""The whole flow through real processes: publish, attach, share, fall back, survive."""

from __future__ import annotations

import signal
import subprocess
import sys

import attrs
import pytest

from tests.helpers import Engine, assert_tensors_equal
from weightcache.core.client.attach import Attachment
from weightcache.core.errors import EntryNotFound, FingerprintMismatch, ServerUnavailable
from weightcache.core.fingerprint import FIELDS
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.request import LoadRequest


def outputs(model):
    import torch

    input_ids = torch.arange(32, dtype=torch.long).reshape(2, 16) * 31 % model.config.vocab_size
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return out[0]


def publish_model(path, socket_dir, **kwargs):
    return publish(prepare(LoadRequest(model=str(path), **kwargs)), socket_dir)


@pytest.mark.parametrize(
    "kind,dtype,sharded", [("llama", "float32", False), ("llama", "bfloat16", True), ("qwen2", "float16", False)]
)
def test_client_mode_matches_disk_load_bit_for_bit(server, model_dir, kind, dtype, sharded):
    path = model_dir(kind, dtype, sharded)
    published = publish_model(path, server.socket_dir)
    assert published.created
    disk = load_model(str(path), mode="off")
    cached = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        assert cached.source == "cache" and disk.source == "disk"
        disk_state = dict(disk.model.state_dict())
        for name, tensor in cached.model.state_dict().items():
            assert_tensors_equal(name, tensor, disk_state[name])
        assert_tensors_equal("logits", outputs(cached.model), outputs(disk.model))
        assert not [n for n, t in cached.model.named_parameters() if t.device.type == "meta"]
    finally:
        cached.close()


def test_daemon_mode_starts_a_server_publishes_and_attaches(socket_dir, model_dir):
    path = model_dir("llama")
    first = load_model(str(path), mode="daemon", socket_dir=socket_dir)
    second = load_model(str(path), mode="daemon", socket_dir=socket_dir)
    try:
        assert first.source == second.source == "cache"
        assert "load_s" in first.timings and "load_s" not in second.timings  # the second found the entry
        assert_tensors_equal("logits", outputs(second.model), outputs(load_model(str(path)).model))
    finally:
        first.close()
        second.close()
        from weightcache.core.client.client import Connection

        with Connection(socket_dir) as conn:
            server_pid = conn.hello()["pid"]
        import os

        os.kill(server_pid, signal.SIGTERM)


def test_real_minilm_checkpoint_round_trips(server, minilm_dir):
    publish_model(minilm_dir, server.socket_dir)
    cached = load_model(str(minilm_dir), mode="client", socket_dir=server.socket_dir, strict=True)
    disk = load_model(str(minilm_dir), mode="off")
    try:
        assert_tensors_equal("last_hidden_state", outputs(cached.model), outputs(disk.model))
    finally:
        cached.close()


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_tied_weights_stay_tied(server, model_dir, kind):
    path = model_dir(kind)
    published = publish_model(path, server.socket_dir)
    assert published.manifest.aliases, "the tied head should be published once, as an alias"
    cached = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        model = cached.model
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert_tensors_equal("logits", outputs(model), outputs(load_model(str(path)).model))
    finally:
        cached.close()


@pytest.mark.serial  # reads the machine-wide Shmem of /proc/meminfo: another worker's arenas would count
def test_two_engines_share_one_physical_copy(server, minilm_dir):
    path = minilm_dir  # 87 MiB of weights: large against the machine's background noise in Shmem
    publish_model(path, server.socket_dir)
    shmem_before = _meminfo("Shmem")
    first = Engine(path, server.socket_dir)
    second = Engine(path, server.socket_dir)
    try:
        shmem_after = _meminfo("Shmem")
        inodes_first, inodes_second = first.ask("maps")["inodes"], second.ask("maps")["inodes"]
        assert inodes_first and inodes_first == inodes_second, "both engines must map the same memfd"
        weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        assert shmem_after - shmem_before < weights / 4, "attaching must not copy the weights"
        assert first.ask("hash") == second.ask("hash")
        status = _status(server.socket_dir)
        assert set(status["entries"][0]["attached_pids"]) == {first.ready["pid"], second.ready["pid"]}
    finally:
        first.close()
        second.close()


def test_a_faulty_engine_cannot_corrupt_another_engines_weights(server, model_dir):
    path = model_dir("llama")
    publish_model(path, server.socket_dir)
    good = Engine(path, server.socket_dir)
    bad = Engine(path, server.socket_dir)
    try:
        before = good.ask("hash")
        bad.proc.stdin.write("write\n")
        bad.proc.stdin.flush()
        assert bad.proc.wait(timeout=60) == -signal.SIGSEGV, "a write to sealed, read-only weights must fault"
        bad.close()
        assert good.ask("hash") == before
    finally:
        good.close()


def test_engine_outputs_survive_a_server_sigkill(server, model_dir):
    path = model_dir("llama")
    publish_model(path, server.socket_dir)
    engine = Engine(path, server.socket_dir)
    try:
        before = engine.ask("hash")
        server.kill()
        assert engine.ask("hash") == before
    finally:
        engine.close()


def test_each_fingerprint_field_mismatch_is_named(server, model_dir):
    path = model_dir("llama")
    fingerprint = publish_model(path, server.socket_dir).fingerprint
    for field in FIELDS:
        value = getattr(fingerprint, field)
        changed = (
            {"extra": {"kernel": "other"}} if field == "extra" else {field: value + 1 if isinstance(value, int) else value + "x"}
        )
        with pytest.raises(FingerprintMismatch) as caught:
            Attachment.open(attrs.evolve(fingerprint, **changed), server.socket_dir)
        expected = ("extra.kernel",) if field == "extra" else (field,)
        assert caught.value.fields == expected


def test_client_mode_falls_back_to_disk_and_names_the_fields(server, model_dir, caplog):
    path = model_dir("llama")
    publish_model(path, server.socket_dir, dtype="float32")
    loaded = load_model(str(path), mode="client", socket_dir=server.socket_dir, dtype="bfloat16")
    assert loaded.source == "disk"
    assert "dtype" in loaded.fallback_reason
    assert any("dtype" in r.getMessage() and "from disk" in r.getMessage() for r in caplog.records)
    with pytest.raises(FingerprintMismatch) as caught:
        load_model(str(path), mode="client", socket_dir=server.socket_dir, dtype="bfloat16", strict=True)
    assert caught.value.fields == ("dtype",)


def test_client_mode_without_a_server_falls_back_or_raises(socket_dir, model_dir):
    path = model_dir("llama")
    loaded = load_model(str(path), mode="client", socket_dir=socket_dir)
    assert loaded.source == "disk" and "no weightcache server" in loaded.fallback_reason
    with pytest.raises(ServerUnavailable):
        load_model(str(path), mode="client", socket_dir=socket_dir, strict=True)


def test_empty_server_reports_no_entry(server, model_dir):
    with pytest.raises(EntryNotFound) as caught:
        load_model(str(model_dir("llama")), mode="client", socket_dir=server.socket_dir, strict=True)
    assert not isinstance(caught.value, FingerprintMismatch)


@pytest.mark.serial  # reads the machine-wide Shmem of /proc/meminfo: another worker's arenas would count
def test_a_loader_killed_at_any_point_leaves_no_partial_entry(server, minilm_dir):
    """Publishing is one frame: a killed loader leaves either nothing or a whole entry, and no memory."""
    path = minilm_dir  # 87 MiB: a leaked arena would stand out from the machine's background noise
    shmem_before = _meminfo("Shmem")
    outcomes = set()
    for delay in (0.2, 0.8, 1.5, 2.5, 4.0):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weightcache.core.cli.cli",
                "load",
                "--socket-dir",
                str(server.socket_dir),
                "--model",
                str(path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        entries = _status(server.socket_dir)["entries"]
        outcomes.add(len(entries))
        if entries:  # published before the kill: it must be whole
            cached = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
            assert_tensors_equal("logits", outputs(cached.model), outputs(load_model(str(path)).model))
            cached.close()
            from weightcache.core.client.client import Connection

            with Connection(server.socket_dir) as conn:
                conn.evict(entries[0]["digest"])
    assert 0 in outcomes, "no kill landed before the publish; the test did not test anything"
    assert _meminfo("Shmem") - shmem_before < 16 << 20, "a killed loader's arenas must be freed"


def test_cli_status_lists_entries(server, model_dir):
    path = model_dir("llama")
    published = publish_model(path, server.socket_dir)
    out = subprocess.run(
        [sys.executable, "-m", "weightcache.core.cli.cli", "status", "--socket-dir", str(server.socket_dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert published.digest[:12] in out and "LlamaForCausalLM" in out


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _status(socket_dir) -> dict:
    from weightcache.core.client.client import Connection

    with Connection(socket_dir) as conn:
        return conn.status()
