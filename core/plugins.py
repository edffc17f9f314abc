"""The plugin manager factory and the typed facade the rest of the core calls."""

from __future__ import annotations

import logging
import os
import typing

import pluggy

from weightcache.core import hookspecs
from weightcache.core.errors import AdapterNotFound

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.export import ArenaBuilder
    from weightcache.core.manifest import Manifest
    from weightcache.core.request import LoadRequest, ModelDescription

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "weightcache.adapters"
ENV_BLOCK = "WEIGHTCACHE_BLOCK_ADAPTERS"
CORE_PLUGIN = "weightcache.core.defaults"


def make_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A plugin manager with every spec, the core defaults and the installed adapters.

    Adapters named in ``$WEIGHTCACHE_BLOCK_ADAPTERS`` (comma-separated) are not loaded.
    """
    from weightcache.core import defaults

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in blocked_adapters():
        pm.set_blocked(name)
    pm.register(defaults, name=CORE_PLUGIN)
    if load_entry_points:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    pm.check_pending()
    return pm


def blocked_adapters() -> list[str]:
    return [name.strip() for name in os.environ.get(ENV_BLOCK, "").split(",") if name.strip()]


class Adapter:
    """One adapter's hooks (with the core defaults behind them), called by keyword."""

    def __init__(self, pm: pluggy.PluginManager, name: str):
        plugin = pm.get_plugin(name)
        if plugin is None or name == CORE_PLUGIN:
            known = sorted(n for n, _ in pm.list_name_plugin() if n != CORE_PLUGIN and pm.get_plugin(n) is not None)
            blocked = f"; blocked by ${ENV_BLOCK}" if name in blocked_adapters() else ""
            raise AdapterNotFound(
                f"no weightcache adapter named {name!r}{blocked}; installed: {', '.join(known) or 'none'}. "
                "Install the adapter's package (it registers in the 'weightcache.adapters' entry points)"
            )
        self.name = name
        self.plugin = plugin
        others = [p for n, p in pm.list_name_plugin() if p is not None and n not in (name, CORE_PLUGIN)]
        self._hook = lambda hook: pm.subset_hook_caller(hook, remove_plugins=others)

    def describe(self, request: "LoadRequest") -> "ModelDescription":
        return self._required("weightcache_describe", request=request)

    def quantization_allowlist(self, request: "LoadRequest") -> tuple[str, ...]:
        return tuple(self._hook("weightcache_quantization_allowlist")(request=request) or ())

    def load(self, request: "LoadRequest", builder: "ArenaBuilder | None") -> "torch.nn.Module":
        return self._required("weightcache_load", request=request, builder=builder)

    def quantize(self, request, model, description) -> "torch.nn.Module":
        result = self._hook("weightcache_quantize")(request=request, model=model, description=description)
        return model if result is None else result

    def export(self, request: "LoadRequest", model, builder: "ArenaBuilder") -> "Manifest":
        return self._required("weightcache_export", request=request, model=model, builder=builder)

    def manifest_extra(self, request: "LoadRequest", model) -> dict:
        return dict(self._hook("weightcache_manifest_extra")(request=request, model=model) or {})

    def rebind(self, request: "LoadRequest", tensors, manifest: "Manifest") -> "torch.nn.Module":
        return self._required("weightcache_rebind", request=request, tensors=tensors, manifest=manifest)

    def _required(self, hook: str, **kwargs):
        result = self._hook(hook)(**kwargs)
        if result is None:
            raise NotImplementedError(f"adapter {self.name!r} does not implement {hook}; it cannot serve this request")
        return result


class Plugins:
    """The installed adapters; ``Plugins().adapter("hf")`` gives one adapter's facade."""

    def __init__(self, pm: pluggy.PluginManager | None = None):
        self.pm = pm or make_manager()

    def adapter(self, name: str) -> Adapter:
        return Adapter(self.pm, name)

    def names(self) -> list[str]:
        return sorted(n for n, p in self.pm.list_name_plugin() if p is not None and n != CORE_PLUGIN)
