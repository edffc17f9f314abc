"""Arena backends by name: ``host`` (memfd, any machine) and ``cuda`` (VMM, GPUs)."""

from __future__ import annotations

import typing

from weightcache.core.arena.base import Arena, ArenaBackend, ArenaSpec, round_up

if typing.TYPE_CHECKING:
    from weightcache.core.device import Device

__all__ = ["Arena", "ArenaBackend", "ArenaSpec", "backend", "backend_for_device", "round_up"]


def backend(name: str) -> ArenaBackend:
    """The arena backend called ``name`` (``host`` or ``cuda``)."""
    if name == "host":
        from weightcache.core.arena.host import HostArenaBackend

        return HostArenaBackend()
    if name == "cuda":
        from weightcache.core.arena.cuda import CudaArenaBackend

        return CudaArenaBackend()
    raise ValueError(f"unknown arena backend {name!r}; use 'host' or 'cuda'")


def backend_for_device(device: "Device | str") -> ArenaBackend:
    """The backend that holds memory on ``device``: ``cuda`` for a GPU, ``host`` for the CPU."""
    from weightcache.core.device import Device

    return backend("cuda" if Device.parse(device).is_cuda else "host")
