"""How arena bytes move between tiers and nodes: one interface, one module per backend, and the one table that names
them all.

A backend is a ``CopyBackend``; its ``reach`` says which copies it makes, and with them the methods its callers use:

- ``tiers``: within a node, in the loader's process, into this GPU's new arenas (``TierCopy``: a peer GPU's entry, the
  host tier);
- ``nodes``: between nodes, one-sided reads of memory a holder shares (``fleet.transport.Transport``: NIXL);
- ``group``: every rank of a ``torch.distributed`` group at once (``seeding.TorchDistributedLink``).

``BACKENDS`` is the only place a built-in backend is named: the node's fills, the fleet's pulls and shares, and seeding
look theirs up here (:func:`backend_class`). A new backend (RDMA, another transport) is a module with its class and a
line in ``BACKENDS``, or, from an installed package, an entry point of the ``weightcache.transports`` group
(``name = "module:Class"``), which :func:`backends` adds to the table.
"""

from __future__ import annotations

import abc
import functools
import typing

from weightcache.core import entry_points

REACHES: typing.Final = ("tiers", "nodes", "group")

BACKENDS: typing.Final[dict[str, str]] = {
    "peer_gpu": "weightcache.core.node.peer_gpu:PeerGpuCopy",
    "host_tier": "weightcache.core.node.host_tier:HostTierCopy",
    "nixl": "weightcache.core.node.fleet.nixl:NixlTransport",
    "torch_distributed": "weightcache.core.node.seeding:TorchDistributedLink",
}
"""Every built-in copy backend by name, as ``module:class`` (imported on first use)."""

ENTRY_POINT_GROUP = "weightcache.transports"


@functools.cache
def backends() -> dict[str, str]:
    """Every copy backend by name: :data:`BACKENDS` and the installed packages' (read once a process)."""
    return entry_points.registered(ENTRY_POINT_GROUP, BACKENDS)


class CopyBackend(abc.ABC):
    """One way to move arena bytes; ``name`` is its key in ``BACKENDS``, ``reach`` one of ``REACHES``."""

    name: typing.ClassVar[str]
    reach: typing.ClassVar[str]

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release what the backend holds."""


class TierCopy(CopyBackend):
    """A copy within the node into this GPU's new arenas, from an attached entry's arenas (``reach`` ``tiers``)."""

    reach: typing.ClassVar[str] = "tiers"

    @abc.abstractmethod
    def unusable(self, source_tier: str, device_index: int) -> str | None:
        """Why this process cannot copy from the entry on ``source_tier`` to GPU ``device_index``, or None."""

    @abc.abstractmethod
    def fill(self, arenas: typing.Sequence[typing.Any], targets: typing.Sequence[typing.Any], device_index: int) -> None:
        """Copy each of ``arenas`` (an attachment's) into the uint8 GPU tensor of ``targets`` of the same length;
        returns once every byte arrived."""


def backend_class(name: str, kind: type) -> typing.Any:
    """The class ``BACKENDS`` names ``name``, which must be a ``kind`` (``TierCopy``, ``Transport``, ...); ValueError
    naming the backends of that kind for an unknown name or one of another kind."""
    table = backends()
    found = _imported(table[name]) if name in table else None
    if found is None or not issubclass(found, kind):
        known = sorted(other for other, where in table.items() if issubclass(_imported(where), kind))
        problem = (
            f"unknown copy backend {name!r}" if found is None else f"{name!r} is a {found.reach} copy, not a {kind.__name__}"
        )
        raise ValueError(f"{problem}; the {kind.__name__} backends are {', '.join(known) or 'none'} (BACKENDS in {__name__})")
    return found


def _imported(where: str) -> type[CopyBackend]:
    found = entry_points.load(where)
    if not (isinstance(found, type) and issubclass(found, CopyBackend)):
        raise TypeError(f"copy backend {where} is not a CopyBackend class")
    return found
