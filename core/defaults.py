"""The core's default hook implementations; an adapter's own implementation runs first."""

from __future__ import annotations

from weightcache.core.export import export_module
from weightcache.core.hookspecs import hookimpl


@hookimpl(trylast=True)
def weightcache_export(request, model, builder):
    """Copy every parameter and buffer into the builder's arenas (tied weights once)."""
    return export_module(model, builder)


@hookimpl(trylast=True)
def weightcache_quantization_allowlist(request):
    return ()
