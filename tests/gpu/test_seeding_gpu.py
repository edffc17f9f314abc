"""``weightcache seed`` over NCCL: two GPUs of one host as two nodes, one server each (skipped without two CUDA GPUs).

Run with ``-s`` to see the GB/s each rank reports, e.g.
``python3 -m pytest tests/gpu/test_seeding_gpu.py -v -s -p no:cacheprovider``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import free_port, run_python
from weightcache.core.client import Connection

torch = pytest.importorskip("torch")

from weightcache.core.arena.cuda import unavailable_reason  # noqa: E402


def _two_gpus_reason() -> str | None:
    reason = unavailable_reason()
    if reason is not None:
        return f"no CUDA GPU: {reason}"
    if torch.cuda.device_count() < 2:
        return f"needs two GPUs, this process sees {torch.cuda.device_count()}"
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


_REASON = _two_gpus_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

TIMEOUT_S = 240


def _seed(socket_dir, device: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "weightcache.core.cli",
        "seed",
        "--socket-dir",
        str(socket_dir),
        "--device",
        device,
        "--timeout-s",
        "120",
        *args,
    ]


def test_nccl_seeds_a_gpu_entry_into_another_gpus_server(nodes, model_dir):
    a, b = nodes
    path = model_dir("llama-500m")  # ~500 MB in fp32
    run_python(
        "import sys; from weightcache.core.loader import prepare, publish; from weightcache.core.request import LoadRequest;"
        "publish(prepare(LoadRequest(model=sys.argv[1], device='cuda:0')), sys.argv[2])",
        str(path),
        str(a.socket_dir),
    )
    port = free_port()
    # NVLink multicast stays off (the machine's rule; a broadcast never uses it anyway).
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NCCL_NVLS_ENABLE": "0"}
    commands = [_seed(a.socket_dir, "cuda:0", "--model", str(path)), _seed(b.socket_dir, "cuda:1")]
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, command in enumerate(commands)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        print(f"rank {rank} exit {proc.returncode}: {stdout.strip()}")
        assert proc.returncode == 0, f"rank {rank} failed (exit {proc.returncode}):\n{stderr[-5000:]}"
    assert outputs[1][0].startswith("rank 1: received and published"), outputs[1][0]

    with Connection(b.socket_dir) as connection:
        (entry,) = connection.status()["entries"]
    checked = run_python(
        """
import sys, torch
from weightcache.core.arena.devices import gpu_uuid
from weightcache.core.attach import Attachment
from weightcache.core.loader import prepare
from weightcache.core.modes import load_model
from weightcache.core.request import LoadRequest

model, a, b, digest = sys.argv[1:5]
fingerprint = prepare(LoadRequest(model=model, device="cuda:0")).fingerprint
here = fingerprint.on_device(gpu_uuid(1))
assert here.digest == digest, f"server B holds {digest[:12]}, expected cuda:1's fingerprint {here.digest[:12]}"
source, copy = Attachment.open(fingerprint, a), Attachment.open(here, b)
try:
    assert len(source.arenas) == len(copy.arenas)
    for index, (ours, theirs) in enumerate(zip(source.arenas, copy.arenas)):
        size = ours.spec.size
        assert theirs.spec.device == gpu_uuid(1), theirs.spec
        assert torch.equal(ours.bytes_view()[:size].to("cuda:1"), theirs.bytes_view()[:size]), f"arena {index} differs"
finally:
    source.close()
    copy.close()
loaded = load_model(model, mode="client", socket_dir=b, device="cuda:1", strict=True)
try:
    assert loaded.source == "cache", loaded.source
    devices = {p.device for p in loaded.model.parameters()}
    assert devices == {torch.device("cuda", 1)}, devices
    with torch.no_grad():
        loaded.model(input_ids=torch.arange(16, device="cuda:1").reshape(1, 16))
finally:
    loaded.close()
print("ok")
""",
        str(path),
        str(a.socket_dir),
        str(b.socket_dir),
        entry["digest"],
    )
    assert checked.stdout.strip().endswith("ok"), checked.stdout
