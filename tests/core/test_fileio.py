"""Positioned reads and writes on real files: every byte moves, or a file that ends early says so."""

from __future__ import annotations

import os

import pytest

from weightcache.core.fileio import read_fully, write_fully


def test_a_write_then_a_read_at_an_offset_round_trip_through_a_memfd():
    fd = os.memfd_create("weightcache-test")
    try:
        os.ftruncate(fd, 1 << 20)
        data = bytes(range(256)) * 1024
        write_fully(fd, data, 4096)
        into = bytearray(len(data))
        read_fully(fd, into, 4096)
        assert bytes(into) == data
    finally:
        os.close(fd)


def test_a_file_that_ends_early_names_itself_and_where(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError, match="checkpoint file ended 60 bytes early, at byte 100"):
            read_fully(fd, bytearray(100), 60, "checkpoint file")
    finally:
        os.close(fd)
