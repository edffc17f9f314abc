"""How arena bytes move between nodes: the interface of a transport (``BACKENDS`` of ``node.backends`` names each).

A holder ``share``s regions of its memory once and publishes the ``reach`` text the
backend returns (how a peer connects: for NIXL, the agent's metadata); a puller
``read``s a holder's regions into its own with one-sided reads. No weight byte passes
through Python: the backend moves memory to memory.
"""

from __future__ import annotations

import abc
import time
import typing

import attrs

from weightcache.core.node.backends import CopyBackend, backend_class

MEMORY_KINDS: typing.Final = ("DRAM", "VRAM")
DEFAULT_TRANSPORT: typing.Final = "nixl"
"""The transport a sharing agent uses unless told otherwise (``weightcache fleet share --transport``)."""
MAX_REGION_BYTES: typing.Final = 1 << 50


@attrs.frozen
class Region:
    """A span of registered memory: its address in the owner's process, its length, its GPU index, DRAM or VRAM."""

    address: int
    length: int
    device: int = 0
    memory: str = "DRAM"

    def __attrs_post_init__(self) -> None:
        if self.memory not in MEMORY_KINDS:
            raise ValueError(f"a region's memory is {self.memory!r}, not one of {', '.join(MEMORY_KINDS)}")
        for name, value, top in (("address", self.address, 1 << 64), ("length", self.length, MAX_REGION_BYTES + 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < top:
                raise ValueError(f"a region's {name} is {value!r:.40}, not a whole number from 1 to {top - 1}")
        if isinstance(self.device, bool) or not isinstance(self.device, int) or not 0 <= self.device < 1024:
            raise ValueError(f"a region's device is {self.device!r:.40}, not a GPU index")

    def part(self, offset: int, length: int) -> "Region":
        """``length`` bytes of this region from ``offset``."""
        if not (0 <= offset and 0 < length and offset + length <= self.length):
            raise ValueError(f"bytes {offset} to {offset + length} are not within a region of {self.length}")
        return attrs.evolve(self, address=self.address + offset, length=length)

    def to_json(self) -> list:
        return [self.address, self.length, self.device, self.memory]

    @classmethod
    def from_json(cls, data: object) -> "Region":
        if not isinstance(data, list) or len(data) != 4:
            raise ValueError("a region is [address, length, device, memory]")
        return cls(*data)


def region_of_view(view: typing.Any) -> Region:
    """The region of a flat uint8 tensor on the CPU or a GPU (an arena's bytes, mapped in this process)."""
    if view.is_cuda:
        return Region(view.data_ptr(), view.numel(), view.device.index, "VRAM")
    return Region(view.data_ptr(), view.numel())


def region_of_arena(arena: typing.Any) -> Region:
    """The region of a mapped arena: host memory, or the GPU memory it is mapped on in this process."""
    if arena.spec.backend == "cuda":
        return region_of_view(arena.bytes_view())
    return Region(arena.address, arena.spec.size)


class Transport(CopyBackend):
    """One way to move registered memory between nodes (``BACKENDS`` names each)."""

    reach: typing.ClassVar[str] = "nodes"

    @abc.abstractmethod
    def share(self, regions: typing.Sequence[Region]) -> str:
        """Register ``regions`` of this process for peers to read; returns the reach text peers connect with."""

    @abc.abstractmethod
    def unshare(self, regions: typing.Sequence[Region]) -> None:
        """Stop sharing ``regions`` (before their memory is unmapped)."""

    @abc.abstractmethod
    def read(self, reach: str, remote: typing.Sequence[Region], local: typing.Sequence[Region], deadline_s: float) -> str:
        """Copy each ``remote`` region of the peer at ``reach`` into the ``local`` region of the same length.

        Returns how the bytes went (``GPU-direct``, ``host memory``, ...) for the output. Raises
        PullFailed when the peer is gone, refuses or does not finish within ``deadline_s``.
        """

    def read_in_pieces(
        self,
        reach: str,
        remote: Region,
        local: Region,
        piece_bytes: int,
        deadline_s: float,
        landed: typing.Callable[[int], None],
        available: typing.Callable[[], int] | None = None,
    ) -> str:
        """``read`` of one region in pieces of at most ``piece_bytes``, calling ``landed(n)`` once its first ``n`` bytes
        are here.

        ``available()``, where given, says how many leading bytes of ``remote`` may be read so far (it grows while the
        peer's own read lands them): the read goes on as long as it grows and stops, short of the region's end, once
        nothing more is available and nothing is in flight (``landed`` said how far it got); ``deadline_s`` then counts
        from the last piece started, as the peer lands the rest at its own pace. This form reads one piece after the
        other; a transport that can keep several reads in flight does better."""
        path, deadline, start = "nothing to read", time.monotonic() + deadline_s, 0
        while start < remote.length:
            end = min(start + piece_bytes, remote.length if available is None else min(available(), remote.length))
            if end <= start:
                break
            if available is not None:
                deadline = time.monotonic() + deadline_s
            left = max(deadline - time.monotonic(), 0.001)
            path = self.read(reach, [remote.part(start, end - start)], [local.part(start, end - start)], left)
            landed(end)
            start = end
        return path

    @abc.abstractmethod
    def memory_kinds(self) -> frozenset[str]:
        """The memory this transport registers: ``DRAM``, and ``VRAM`` where it can read GPU memory directly."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend (every region unshared first); no transfer writes into this process's memory after it."""


def transport(name: str, agent_name: str, devices: str = "") -> Transport:
    """A new ``name`` transport for this process (``agent_name`` unique in the fleet), on the network ``devices``
    (comma-separated interface names; empty: the backend's choice); ValueError for a name ``BACKENDS`` has no
    transport of."""
    found: Transport = backend_class(name, Transport)(agent_name, devices)
    return found
