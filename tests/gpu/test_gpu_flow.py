"""The whole flow on a GPU: CUDA arenas shared between engine processes (skipped without a GPU)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import Engine, open_fd_count, run_python

torch = pytest.importorskip("torch")

from weightcache.core.arena.cuda import unavailable_reason  # noqa: E402

_reason = unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"no CUDA GPU: {_reason}")

DEVICE = "cuda:0"
MiB = 1 << 20


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    """A random-weight Llama in bf16, large enough (161 MiB) for memory figures to mean something."""
    from tests.models import save_random_model

    return save_random_model("llama-gpu", tmp_path_factory.mktemp("gpu-llama"), dtype="bfloat16")


def _publish_in_subprocess(model_path, socket_dir):
    run_python(
        "import sys; from weightcache.core.flow.loader import prepare, publish; from weightcache.core.request import LoadRequest;"
        "publish(prepare(LoadRequest(model=sys.argv[1], device='cuda:0')), sys.argv[2])",
        str(model_path),
        str(socket_dir),
    )


def test_attached_outputs_equal_a_disk_load_bit_for_bit(server, gpu_model):
    _publish_in_subprocess(gpu_model, server.socket_dir)
    disk = Engine(gpu_model, server.socket_dir, mode="off", device=DEVICE)
    cached = Engine(gpu_model, server.socket_dir, mode="client", device=DEVICE)
    try:
        assert cached.ready["source"] == "cache"
        assert cached.ask("hash") == disk.ask("hash")
    finally:
        disk.close()
        cached.close()


def test_two_engines_share_one_copy(server, gpu_model):
    _publish_in_subprocess(gpu_model, server.socket_dir)
    first = Engine(gpu_model, server.socket_dir, device=DEVICE)
    second = Engine(gpu_model, server.socket_dir, device=DEVICE)
    try:
        weights = sum(p.stat().st_size for p in gpu_model.glob("*.safetensors"))
        assert weights > 150 * MiB
        for engine in (first, second):
            taken = engine.ready["gpu_bytes_taken"]
            assert taken < 64 * MiB, f"attach took {taken / MiB:.1f} MiB of GPU memory beyond the CUDA context"
        assert first.ask("hash") == second.ask("hash")
    finally:
        first.close()
        second.close()


def test_engines_survive_a_server_sigkill(server, gpu_model):
    _publish_in_subprocess(gpu_model, server.socket_dir)
    engine = Engine(gpu_model, server.socket_dir, device=DEVICE)
    try:
        before = engine.ask("hash")
        server.kill()
        assert engine.ask("hash") == before
    finally:
        engine.close()


def test_engines_survive_the_loader_sigkill(server, gpu_model):
    loader = Engine(gpu_model, server.socket_dir, mode="daemon", device=DEVICE)  # loads, publishes, keeps running
    engine = Engine(gpu_model, server.socket_dir, device=DEVICE)
    try:
        before = engine.ask("hash")
        loader.proc.send_signal(signal.SIGKILL)
        loader.proc.wait(timeout=60)
        assert engine.ask("hash") == before
        late = Engine(gpu_model, server.socket_dir, device=DEVICE)  # the server's fds keep the memory alive
        assert late.ask("hash") == before
        late.close()
    finally:
        loader.close()
        engine.close()


def test_evict_frees_gpu_memory_once_no_engine_maps_it(server, gpu_model):
    from weightcache.core.client.client import Connection

    torch.zeros(1, device=DEVICE)
    free_before = torch.cuda.mem_get_info()[0]
    _publish_in_subprocess(gpu_model, server.socket_dir)
    weights = sum(p.stat().st_size for p in gpu_model.glob("*.safetensors"))
    held = free_before - torch.cuda.mem_get_info()[0]
    assert held >= weights * 0.9, f"the server should keep {weights} bytes alive, holds {held}"
    with Connection(server.socket_dir) as conn:
        conn.evict(conn.status()["entries"][0]["digest"])
    assert free_before - torch.cuda.mem_get_info()[0] < 8 * MiB


def test_100_attach_detach_cycles_leave_memory_and_fds_where_they_were(server, gpu_model):
    from weightcache.core.client.attach import Attachment
    from weightcache.core.flow.loader import prepare
    from weightcache.core.request import LoadRequest

    _publish_in_subprocess(gpu_model, server.socket_dir)
    fingerprint = prepare(LoadRequest(model=str(gpu_model), device=DEVICE)).fingerprint
    Attachment.open(fingerprint, server.socket_dir).close()  # warm-up: contexts, granularity caches
    torch.cuda.synchronize()
    free_before, fds_before = torch.cuda.mem_get_info()[0], open_fd_count()
    for _ in range(100):
        attachment = Attachment.open(fingerprint, server.socket_dir)
        assert attachment.tensors
        attachment.close()
    torch.cuda.synchronize()
    assert abs(torch.cuda.mem_get_info()[0] - free_before) < 4 * MiB
    assert open_fd_count() == fds_before


def test_a_reordered_cuda_visible_devices_still_maps_the_right_gpu(server, gpu_model):
    """With CUDA_VISIBLE_DEVICES reversed, the index that now names the publisher's GPU attaches its entry (and, on two
    GPUs, the old index names the other GPU: another gpu_uuid, so never the first GPU's entry: a client fills its own)."""
    from weightcache.core.client.client import Connection
    from weightcache.core.device import cuda_index, visible_gpu_uuids

    _publish_in_subprocess(gpu_model, server.socket_dir)
    visible = visible_gpu_uuids()
    original = visible[cuda_index(DEVICE)]
    reordered = list(reversed(visible))
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(reordered)
    try:
        engine = Engine(gpu_model, server.socket_dir, device=f"cuda:{reordered.index(original)}")
        other = Engine(gpu_model, server.socket_dir, device="cuda:0") if len(visible) > 1 else None
    finally:
        if env_before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_before
    try:
        assert engine.ready["source"] == "cache"
        if other is not None:
            assert other.ready["digest"] != engine.ready["digest"], "the other GPU must not map this GPU's entry"
            with Connection(server.socket_dir) as connection:
                tiers = {row["digest"]: row["tier"] for row in connection.status()["entries"]}
            assert tiers[other.ready["digest"]] == reordered[0], "the other GPU's entry must live on that GPU"
    finally:
        engine.close()
        if other is not None:
            other.close()


def test_fp8_block_model_attached_equals_the_disk_quantized_model(server, gpu_model):
    run_python(
        "import sys; from weightcache.core.flow.loader import prepare, publish; from weightcache.core.request import LoadRequest;"
        "publish(prepare(LoadRequest(model=sys.argv[1], device='cuda:0', quantization='fp8-block')), sys.argv[2])",
        str(gpu_model),
        str(server.socket_dir),
    )
    code = """
import sys, json, hashlib, torch
import weightcache.core.quantization.fp8_block as fp8
from weightcache.core.flow.modes import load_model
mode = sys.argv[3]
if mode == "client":
    def refuse(*a, **k):
        raise AssertionError("a client must not quantize")
    fp8.quantize_weight = fp8.quantize_model = refuse
loaded = load_model(sys.argv[1], mode=mode, socket_dir=sys.argv[2], device="cuda:0", quantization="fp8-block", strict=True)
ids = (torch.arange(64).reshape(2, 32) * 31 % loaded.model.config.vocab_size).cuda()
with torch.no_grad():
    out = loaded.model(input_ids=ids)[0].float().cpu()
print(json.dumps({"source": loaded.source, "sha": hashlib.sha256(out.numpy().tobytes()).hexdigest()}))
"""
    import json

    disk = json.loads(run_python(code, str(gpu_model), str(server.socket_dir), "off").stdout.strip().splitlines()[-1])
    cached = json.loads(run_python(code, str(gpu_model), str(server.socket_dir), "client").stdout.strip().splitlines()[-1])
    assert cached["source"] == "cache" and cached["sha"] == disk["sha"]


def test_engines_republish_gpu_entries_to_a_restarted_server(socket_dir, gpu_model):
    from tests.helpers import ServerProcess, wait_until
    from weightcache.core.client.client import Connection

    first = ServerProcess.start(socket_dir)
    _publish_in_subprocess(gpu_model, socket_dir)
    engine = Engine(gpu_model, socket_dir, device=DEVICE)
    try:
        reference = engine.ask("hash")
        first.kill()
        second = ServerProcess.start(socket_dir)
        try:

            def entries():
                with Connection(socket_dir) as conn:
                    return conn.status()["entries"]

            assert wait_until(lambda: len(entries()) == 1, timeout=20)
            late = Engine(gpu_model, socket_dir, device=DEVICE)
            assert late.ask("hash") == reference
            late.close()
        finally:
            second.stop()
    finally:
        engine.close()
        first.kill()


def test_engines_map_gpu_weights_read_only_so_a_faulty_engine_cannot_corrupt_them(server, gpu_model):
    """Importers ask the driver for read-only mappings; a write from one engine faults in that engine only."""
    _publish_in_subprocess(gpu_model, server.socket_dir)
    probe = """
import sys, json, torch
from weightcache.core.flow.modes import load_model
loaded = load_model(sys.argv[1], mode="client", socket_dir=sys.argv[2], device="cuda:0", strict=True)
writable = [a.writable for a in loaded.attachment.arenas]
print(json.dumps({"writable": writable}), flush=True)
if sys.argv[3] == "write" and not any(writable):
    with torch.no_grad():
        next(loaded.model.parameters()).add_(1)
    torch.cuda.synchronize()
    print(json.dumps({"wrote": True}), flush=True)
"""
    import json

    good = Engine(gpu_model, server.socket_dir, device=DEVICE)
    before = good.ask("hash")
    try:
        first = run_python(probe, str(gpu_model), str(server.socket_dir), "look")
        writable = json.loads(first.stdout.strip().splitlines()[-1])["writable"]
        if any(writable):
            pytest.skip("this driver refused read-only VMM mappings (CU_MEM_ACCESS_FLAGS_PROT_READ); engines map read-write")
        bad = run_python(probe, str(gpu_model), str(server.socket_dir), "write", check=False)
        assert bad.returncode != 0 and '"wrote": true' not in bad.stdout, "a write to read-only weights must fail"
        assert good.ask("hash") == before
    finally:
        good.close()


@pytest.mark.parametrize("mode", ["cached", "process-direct", "here-direct"])
def test_a_first_sight_publish_on_the_gpu_digests_exactly_the_bytes_it_placed(gpu_model, tmp_path, mode, monkeypatch):
    """One pass to cuda:0: the arenas hold the files' tensors and the identity equals hashing the files on their own:
    through the page cache (whole pieces), and with O_DIRECT blocks read by the reader process into its page-locked
    shared slots, or by threads of this process."""
    import safetensors.torch

    from tests.helpers import assert_tensors_equal
    from weightcache.core.identity.digests import file_digest
    from weightcache.core.identity.safetensors_io import checkpoint_files
    from weightcache.core.load import reader
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.load.reader import read_checkpoint

    if mode != "cached":
        monkeypatch.setattr(reader, "WARM_SHARE", 2.0)  # never "in the page cache": blocks from the disk
        monkeypatch.setenv("WEIGHTCACHE_READ_PROCESS", "1" if mode.startswith("process") else "0")
    files = checkpoint_files(gpu_model)
    with ArenaBuilder(DEVICE) as builder:
        placed = read_checkpoint(gpu_model, builder)
        assert builder.read_mode.process == mode.startswith("process"), builder.read_mode
        expected = {name: t for file in files for name, t in safetensors.torch.load_file(file, device=DEVICE).items()}
        for name, (info, slot) in placed.items():
            tensor = builder.view(slot).view(getattr(torch, info.dtype)).view(info.shape)
            assert_tensors_equal(name, tensor, expected[name])
        assert {str(f): file_digest(f) for f in files} == {p: d.digest for p, d in builder.read_digests.items()}
