"""Reading a checkpoint into the page cache while Python imports: bounded, stoppable, harmless on bad files."""

from __future__ import annotations

import time

from weightcache.core.load.prefetch import CHUNK_BYTES, Prefetch, available_memory


def _files(tmp_path, sizes):
    files = []
    for number, size in enumerate(sizes):
        file = tmp_path / f"w{number}.safetensors"
        file.write_bytes(bytes([number]) * size)
        files.append(file)
    return files


def test_every_byte_is_read_ahead_when_memory_allows(tmp_path):
    files = _files(tmp_path, [3 * CHUNK_BYTES + 5, 7, CHUNK_BYTES])
    with Prefetch(files, limit=1 << 40, threads=3) as prefetch:
        deadline = time.monotonic() + 30
        while prefetch.done < sum(f.stat().st_size for f in files) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert prefetch.done == sum(f.stat().st_size for f in files)


def test_no_more_than_the_limit_is_read(tmp_path):
    files = _files(tmp_path, [4 * CHUNK_BYTES])
    with Prefetch(files, limit=2 * CHUNK_BYTES + 1, threads=2) as prefetch:
        time.sleep(0.5)
    assert prefetch.done == 2 * CHUNK_BYTES


def test_a_missing_or_vanishing_file_stops_nothing_else(tmp_path):
    files = _files(tmp_path, [CHUNK_BYTES, CHUNK_BYTES])
    gone = tmp_path / "gone.safetensors"
    with Prefetch([gone, *files], limit=1 << 40, threads=1) as prefetch:
        time.sleep(0.5)
    assert prefetch.done == 2 * CHUNK_BYTES


def test_stop_returns_at_once_and_a_zero_limit_starts_no_thread(tmp_path):
    files = _files(tmp_path, [8 * CHUNK_BYTES])
    start = time.monotonic()
    with Prefetch(files, limit=1 << 40, threads=2):
        pass
    assert time.monotonic() - start < 5
    with Prefetch(files, limit=0) as idle:
        assert not any(thread.is_alive() for thread in idle._threads)
    assert available_memory() > 0
