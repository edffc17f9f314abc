"""The loads the kit makes: each through the core's mode runner, each with scratch space of its own."""

from __future__ import annotations

import typing

import attrs

from weightcache.core.socket_dir import SocketDirLike

if typing.TYPE_CHECKING:
    from weightcache.core.flow.modes import LoadedModel
    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.request import LoadRequest


def load(
    request: "LoadRequest",
    mode: str,
    plugins: "Plugins | None" = None,
    socket_dir: SocketDirLike = None,
    strict: bool = False,
) -> "LoadedModel":
    """``request`` through the core's mode runner in ``mode`` (what every engine integration calls)."""
    from weightcache.core.flow.modes import CacheOptions, run

    return run(fresh(request), CacheOptions(mode=mode, socket_dir=socket_dir, strict=strict), plugins=plugins)


def fresh(request: "LoadRequest") -> "LoadRequest":
    """``request`` with scratch space of its own: every load the kit makes starts like a new engine's."""
    return attrs.evolve(request, state={})
