"""Positioned reads and writes on real files: every byte moves, or a file that ends early says so."""

from __future__ import annotations

import os

import pytest

from weightcache.core.fileio import HUGE_PAGE, DirectBuffer, huge_pages_offered, read_fully, write_fully


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


@pytest.mark.parametrize(
    ("setting", "offered"),
    [("always [madvise] never", True), ("[always] madvise never", True), ("always madvise [never]", False)],
)
def test_huge_pages_are_offered_where_the_kernel_setting_says_always_or_madvise(tmp_path, setting, offered):
    path = tmp_path / "enabled"
    path.write_text(setting + "\n")
    assert huge_pages_offered(str(path)) is offered
    assert huge_pages_offered(str(tmp_path / "missing")) is False  # no THP in the kernel


def _huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap ``start``..``end`` (/proc/self/smaps)."""
    huge, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < end and high > start
            elif inside and head == "AnonHugePages:":
                huge += int(line.split()[1]) << 10
    return huge


def test_a_direct_buffer_is_aligned_present_and_in_huge_pages_where_the_kernel_offers_them(tmp_path):
    """O_DIRECT reads into it work, its start is huge-page aligned, and where THP is offered its memory is huge pages
    (what makes a virtio disk take a read as one segment)."""
    buffer = DirectBuffer(3 * HUGE_PAGE + 4096)
    try:
        assert buffer.address % HUGE_PAGE == 0
        assert len(buffer.view) == 3 * HUGE_PAGE + 4096
        if huge_pages_offered():
            assert _huge_bytes_in(buffer.address, buffer.address + 3 * HUGE_PAGE) >= HUGE_PAGE
        path = tmp_path / "data"
        data = os.urandom(2 * HUGE_PAGE)
        path.write_bytes(data)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = os.open(path, os.O_RDONLY)  # a file system without O_DIRECT (tmpfs): the buffer still reads
        try:
            read_fully(fd, buffer.view[: len(data)], 0)
        finally:
            os.close(fd)
        assert bytes(buffer.view[: len(data)]) == data
    finally:
        buffer.close()
