"""Plugins that outside packages register through an entry-point group, beside the built-ins a table names.

Adapters have their own manager (``flow/plugins.py``: pluggy, hook checks); quantization methods and transports are one
class each, so a table of ``name -> "module:attribute"`` is all they need: the built-ins' table, with what installed
packages add through the group's entry points (``[project.entry-points."weightcache.quantization"]``). A built-in name
is never replaced: an entry point that takes one is skipped with a warning that names its package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import typing

log = logging.getLogger(__name__)


def registered(group: str, builtin: typing.Mapping[str, str]) -> dict[str, str]:
    """Each name of ``builtin`` and of ``group``'s entry points, with the ``module:attribute`` that holds it."""
    table = dict(builtin)
    for entry_point in importlib.metadata.entry_points(group=group):
        if entry_point.name in builtin:
            package = entry_point.dist.name if entry_point.dist else "an unknown package"
            log.warning("%s: %s's entry point %r takes a built-in name; skipped", group, package, entry_point.name)
            continue
        table.setdefault(entry_point.name, entry_point.value)
    return table


def load(where: str) -> typing.Any:
    """The object ``module:attribute`` names (the module imported on first use)."""
    module, _, attribute = where.partition(":")
    found: typing.Any = importlib.import_module(module)
    for part in attribute.split(".") if attribute else ():
        found = getattr(found, part)
    return found
