"""A GPU's entry filled from the host tier (sealed host memfds), and a GPU entry kept there: through page-locked
bounce buffers (``arena.transfer``)."""

from __future__ import annotations

import typing

from weightcache.core.node.backends import TierCopy

if typing.TYPE_CHECKING:
    from weightcache.core.arena.transfer import Transfer


class HostTierCopy(TierCopy):
    """Host memory to GPU and back at DMA speed; usable by every GPU of the node."""

    name: typing.ClassVar[str] = "host_tier"

    def unusable(self, source_tier: str, device_index: int) -> str | None:
        return None

    def fill(self, arenas: typing.Sequence[typing.Any], targets: typing.Sequence[typing.Any], device_index: int) -> None:
        from weightcache.core.arena.transfer import Pair, host_to_device

        host_to_device([Pair(arena.fileno(), target) for arena, target in zip(arenas, targets, strict=True)])

    def keep(self, arenas: typing.Sequence[typing.Any], host_arenas: typing.Sequence[typing.Any]) -> Transfer:
        """Copy each GPU arena of ``arenas`` into the host arena of ``host_arenas`` of the same size."""
        from weightcache.core.arena.transfer import Pair, device_to_host

        return device_to_host([Pair(host.fileno(), arena.bytes_view()) for host, arena in zip(host_arenas, arenas, strict=True)])
