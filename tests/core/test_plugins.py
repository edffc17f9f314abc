"""The plugin manager: entry points, the block-list, the adapter facade."""

from __future__ import annotations

import pytest

from weightcache.core.errors import AdapterNotFound
from weightcache.core.plugins import Plugins, make_manager


def test_the_hf_adapter_registers_through_the_entry_point_group():
    assert "hf" in Plugins().names()


def test_an_environment_variable_blocks_adapters_by_name(monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_BLOCK_ADAPTERS", "hf, other")
    plugins = Plugins(make_manager())
    assert "hf" not in plugins.names()
    with pytest.raises(AdapterNotFound, match="blocked by \\$WEIGHTCACHE_BLOCK_ADAPTERS"):
        plugins.adapter("hf")


def test_an_unknown_adapter_names_the_installed_ones():
    with pytest.raises(AdapterNotFound, match="installed: .*hf"):
        Plugins().adapter("nope")
