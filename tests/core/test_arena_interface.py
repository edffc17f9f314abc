"""The Arena interface declares what the core calls on any arena (mypy checks the callers against it)."""

from __future__ import annotations

import os

import pytest

from weightcache.core.arena.base import Arena, ArenaBackend
from weightcache.core.arena.host import HostArenaBackend


def test_the_interface_declares_every_member_the_core_calls():
    for member in ("bytes_view", "export_fd", "close", "address", "fileno"):
        assert hasattr(Arena, member), member
    assert "on_device" in ArenaBackend.map.__code__.co_varnames and "writable" in ArenaBackend.map.__code__.co_varnames


def test_a_host_arena_is_a_file_with_an_address():
    backend = HostArenaBackend()
    with backend.create(4096) as arena:
        arena.bytes_view()[:4] = 7
        assert os.fstat(arena.fileno()).st_size >= 4096 and arena.address != 0
        backend.seal(arena)
        fd = arena.export_fd()
        try:
            with pytest.raises(ValueError, match="on_device"):
                backend.map(fd, arena.spec, on_device=1)
            with backend.map(fd, arena.spec) as mapped:
                assert mapped.bytes_view()[:4].tolist() == [7] * 4
        finally:
            os.close(fd)


def test_an_arena_that_is_no_file_says_to_export_an_fd():
    class Elsewhere(Arena):
        def bytes_view(self):
            raise NotImplementedError

        def export_fd(self) -> int:
            return -1

        @property
        def address(self) -> int:
            return 0

        def close(self) -> None:
            pass

    with pytest.raises(TypeError, match="export_fd"):
        Elsewhere().fileno()


def test_the_host_backend_seals_only_host_arenas():
    class Foreign(Arena):
        """A stand-in that is no host arena: its members are never called."""

        bytes_view = export_fd = close = None
        address = 0

    with pytest.raises(TypeError, match="host arenas"):
        HostArenaBackend().seal(Foreign())
