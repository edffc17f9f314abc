"""Arena checksums on the GPU: the CPU's value, on the arena's own device, at memory speed (the CPU half: tests/core/test_checksum.py).

Run with ``-s`` to see the speed.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from tests.core.test_checksum import reference  # noqa: E402
from weightcache.core.arena import checksum as checksums  # noqa: E402
from weightcache.core.arena.checksum import checksum  # noqa: E402
from weightcache.core.arena.cuda import unavailable_reason  # noqa: E402

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no CUDA GPU: {_REASON}")
two_gpus = pytest.mark.skipif(
    _REASON is not None or torch.cuda.device_count() < 2,
    reason=f"needs two GPUs, this process sees {torch.cuda.device_count() if _REASON is None else 0}",
)


@pytest.mark.parametrize("nbytes", [1, 13, 8 * 4096 + 5, (3 << 20) + 7])
def test_the_gpu_computes_the_cpus_checksum(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    on_gpu = checksum(data.to("cuda:0"))
    assert on_gpu == checksum(data)
    if nbytes < 1 << 20:
        assert on_gpu == reference(data.numpy().tobytes())


def test_chunks_fold_on_the_gpu_as_on_the_cpu(monkeypatch):
    data = torch.randint(0, 256, (8 * 4096 * 9 + 77,), dtype=torch.uint8)
    monkeypatch.setattr(checksums, "CHUNK_WORDS", 2 * 4096)
    assert checksum(data.to("cuda:0")) == checksum(data)


def test_a_cuda_arena_is_checksummed_at_seal_on_its_gpu():
    from weightcache.core.load.export import ArenaBuilder

    with ArenaBuilder("cuda:0") as builder:
        view = builder.view(builder.plan(5 << 20))
        view.copy_(torch.randint(0, 256, (5 << 20,), dtype=torch.uint8))
        del view
        builder.seal()
        [arena] = builder.arenas
        assert arena.spec.checksum == checksum(arena.bytes_view().cpu())


_ON_CUDA1_ONLY = """
import torch
from weightcache.core.arena.checksum import checksum
from weightcache.core.cuda_driver import check, driver
data = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:1")
print(checksum(data) == checksum(data.cpu()))
cu = driver()
states = [check(cu.cuDevicePrimaryCtxGetState(check(cu.cuDeviceGet(i), "cuDeviceGet")), "state") for i in range(2)]
print("active contexts:", [i for i, (_, active) in enumerate(states) if active])
"""


@two_gpus
def test_checksumming_on_the_second_gpu_makes_no_context_on_the_first():
    done = subprocess.run([sys.executable, "-c", _ON_CUDA1_ONLY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["True", "active contexts: [1]"], done.stdout


def test_sixteen_gib_are_checksummed_in_tens_of_milliseconds():
    nbytes = 16 << 30
    free, _ = torch.cuda.mem_get_info(0)
    if free < nbytes + (2 << 30):
        pytest.skip(f"cuda:0 has {free >> 30} GiB free; this needs 18")
    data = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    data.view(torch.int64).random_()
    checksum(data)
    runs = []
    for _ in range(3):
        torch.cuda.synchronize(0)
        start = time.perf_counter()
        checksum(data)
        runs.append(time.perf_counter() - start)
    best = min(runs)
    print(f"checksum of 16 GiB on cuda:0: {best * 1e3:.1f} ms ({nbytes / best / 1e12:.2f} TB/s)")
    assert best < 0.1, f"16 GiB took {best * 1e3:.0f} ms; expected tens of ms (two memory-bound passes)"
