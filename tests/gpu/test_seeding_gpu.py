"""``weightcache seed`` over NCCL: two GPUs of one host as two nodes, one server each (skipped without two CUDA GPUs).

Run with ``-s`` to see the GB/s each rank reports, e.g.
``python3 -m pytest tests/gpu/test_seeding_gpu.py -v -s -p no:cacheprovider``.
"""

from __future__ import annotations

import json

import pytest

from tests.core.test_seeding import run_ranks, seed_command, sender_script
from tests.helpers import run_python
from weightcache.core.client.client import Connection
from weightcache.core.fingerprint import Fingerprint

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


def test_nccl_seeds_a_gpu_entry_into_another_gpus_server(nodes, model_dir):
    a, b = nodes
    path = model_dir("llama-500m")  # ~500 MB in fp32
    run_python(
        "import sys; from weightcache.core.flow.loader import prepare, publish; from weightcache.core.request import LoadRequest;"
        "publish(prepare(LoadRequest(model=sys.argv[1], device='cuda:0')), sys.argv[2])",
        str(path),
        str(a.socket_dir),
    )
    # NVLink multicast stays off (the machine's rule; a broadcast never uses it anyway).
    ranks = run_ranks(
        seed_command(a.socket_dir, "--device", "cuda:0", "--model", str(path), timeout_s=120),
        seed_command(b.socket_dir, "--device", "cuda:1", timeout_s=120),
        wait_s=TIMEOUT_S,
        env={"NCCL_NVLS_ENABLE": "0"},
    )
    for rank, done in enumerate(ranks):
        print(f"rank {rank} exit {done.returncode}: {done.stdout.strip()}")
        assert done.returncode == 0, f"rank {rank} failed (exit {done.returncode}):\n{done.stderr[-5000:]}"
    assert ranks[1].stdout.startswith("rank 1: received and published"), ranks[1].stdout

    with Connection(b.socket_dir) as connection:
        (entry,) = connection.status()["entries"]
    checked = run_python(
        """
import sys, torch
from weightcache.core.device import gpu_uuid
from weightcache.core.client.attach import Attachment
from weightcache.core.flow.loader import prepare
from weightcache.core.flow.modes import load_model
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


def publish_on_cuda0(path, socket_dir) -> Fingerprint:
    """``weightcache load``'s publish of ``path`` on cuda:0, in a process of its own; its fingerprint."""
    printed = run_python(
        "import sys, json; from weightcache.core.flow.loader import prepare, publish; from weightcache.core.request import LoadRequest;"
        "print(json.dumps(publish(prepare(LoadRequest(model=sys.argv[1], device='cuda:0')), sys.argv[2]).fingerprint.to_json()))",
        str(path),
        str(socket_dir),
    ).stdout.strip()
    return Fingerprint.from_json(json.loads(printed.splitlines()[-1]))


def test_nccl_bytes_that_differ_from_the_senders_checksums_are_refused_on_the_receiving_gpu(nodes, model_dir):
    """A sender that flips a byte of every arena it broadcasts: the receiver checksums on cuda:1 and publishes nothing."""
    a, b = nodes
    path = model_dir("llama")
    fingerprint = publish_on_cuda0(path, a.socket_dir)
    sender, receiver = run_ranks(
        sender_script(a.socket_dir, fingerprint, "bytes"),
        seed_command(b.socket_dir, "--device", "cuda:1", timeout_s=120),
        wait_s=TIMEOUT_S,
        env={"NCCL_NVLS_ENABLE": "0", "WC_SEED_DEVICE": "cuda:0"},
    )
    assert sender.returncode == 0, sender.stderr[-5000:]
    assert receiver.returncode == 1, receiver.stderr[-5000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert "arena 0 from rank 0 does not hold the bytes it declared" in message and "nothing was published" in message, message
    with Connection(b.socket_dir) as connection:
        assert connection.status()["entries"] == []


def test_nccl_a_sender_declaring_more_than_the_receiving_gpu_has_free_is_refused_before_allocation(nodes, model_dir):
    a, b = nodes
    path = model_dir("llama")
    fingerprint = publish_on_cuda0(path, a.socket_dir)
    sender, receiver = run_ranks(
        sender_script(a.socket_dir, fingerprint, "ghost"),  # a 1 TiB arena that a 1 TiB tensor fills
        seed_command(b.socket_dir, "--device", "cuda:1", timeout_s=120),
        wait_s=TIMEOUT_S,
        env={"NCCL_NVLS_ENABLE": "0", "WC_SEED_DEVICE": "cuda:0"},
    )
    assert receiver.returncode == 1, receiver.stderr[-5000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert "the entry needs 1.0 TiB on cuda:1" in message and "nothing was allocated" in message, message
    assert sender.returncode == 1 and "no weights were sent" in sender.stderr, sender.stderr[-5000:]
    with Connection(b.socket_dir) as connection:
        assert connection.status()["entries"] == []
