"""Arena backends by name: ``host`` (memfd, any machine) and ``cuda`` (VMM, GPUs), one table of each, and the one that
holds a device's memory chosen by that device's kind from a second table."""

from __future__ import annotations

import typing

from weightcache.core.arena.base import Arena, ArenaBackend, ArenaSpec, round_up

if typing.TYPE_CHECKING:
    from weightcache.core.device import Device

__all__ = ["Arena", "ArenaBackend", "ArenaSpec", "backend", "backend_for_device", "round_up"]


ARENA_BACKENDS: typing.Final[dict[str, str]] = {
    "host": "weightcache.core.arena.host:HostArenaBackend",
    "cuda": "weightcache.core.arena.cuda:CudaArenaBackend",
}
"""Every arena backend by name, as ``module:class`` (imported on first use)."""

BY_DEVICE_KIND: typing.Final[dict[str, str]] = {"cpu": "host", "cuda": "cuda"}
"""The backend that holds memory on each kind of device."""


def backend(name: str) -> ArenaBackend:
    """The arena backend called ``name`` (a key of :data:`ARENA_BACKENDS`)."""
    if name not in ARENA_BACKENDS:
        raise ValueError(f"unknown arena backend {name!r}; use {' or '.join(repr(known) for known in ARENA_BACKENDS)}")
    from weightcache.core import entry_points

    return entry_points.load(ARENA_BACKENDS[name])()


def backend_for_device(device: "Device | str") -> ArenaBackend:
    """The backend that holds memory on ``device``: ``cuda`` for a GPU, ``host`` for the CPU."""
    from weightcache.core.device import Device

    return backend(BY_DEVICE_KIND[Device.parse(device).kind])
