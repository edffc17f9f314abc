"""Arena backends by name: ``host`` (memfd, any machine) and ``cuda`` (VMM, GPUs)."""

from __future__ import annotations

from weightcache.core.arena.base import Arena, ArenaBackend, ArenaSpec, round_up

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


def backend_for_device(device) -> ArenaBackend:
    """The backend that holds memory on ``device`` (a torch device or its string)."""
    kind = str(device).split(":", 1)[0]
    return backend("cuda" if kind == "cuda" or str(device).startswith("GPU-") else "host")
