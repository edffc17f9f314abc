"""Host <-> GPU transfers refuse what they cannot copy before any CUDA work (the copies themselves: tests/gpu)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from weightcache.core.arena.transfer import Pair, device_to_host, host_to_device  # noqa: E402
from weightcache.core.errors import ArenaError  # noqa: E402


@pytest.mark.parametrize("copy", [host_to_device, device_to_host])
def test_device_bytes_that_are_not_a_flat_cuda_byte_tensor_are_refused(copy):
    fd = os.memfd_create("weightcache-test")
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ArenaError, match="one flat uint8 CUDA tensor"):
            copy([Pair(fd, torch.zeros(4096, dtype=torch.uint8))])
    finally:
        os.close(fd)
