"""A GPU's entry filled from a peer GPU's entry of the same content: device to device, over NVLink or PCIe."""

from __future__ import annotations

import typing

from weightcache.core.node.backends import TierCopy


class PeerGpuCopy(TierCopy):
    """Each arena copied GPU to GPU on the current stream; usable where this process sees the peer and may access it."""

    name: typing.ClassVar[str] = "peer_gpu"

    def unusable(self, source_tier: str, device_index: int) -> str | None:
        from weightcache.core.arena.cuda import can_access_peer
        from weightcache.core.device import visible_gpu_uuids

        visible = visible_gpu_uuids()
        if source_tier not in visible:
            return "it is not visible in this process"
        if not can_access_peer(device_index, visible.index(source_tier)):
            return f"cuda:{device_index} has no peer access to it"
        return None

    def fill(self, arenas: typing.Sequence[typing.Any], targets: typing.Sequence[typing.Any], device_index: int) -> None:
        import torch

        for arena, target in zip(arenas, targets, strict=True):
            target.copy_(arena.bytes_view(), non_blocking=True)
        torch.cuda.synchronize(device_index)
