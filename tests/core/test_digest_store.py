"""The digest store as an attacker with write access near it would try it: swapped directories, links, FIFOs, huge files.

A remembered digest stands for a file's bytes, so an entry the store did not
write itself must never be believed: each case below is a miss (the file is
hashed again), never a wrong digest, and never a hang.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from weightcache.core.identity.digests import MAX_ENTRY_BYTES, SCHEME, DigestStore, FileKey

REAL = f"{SCHEME}:{'a' * 64}"
FAKE = f"{SCHEME}:{'f' * 64}"


@pytest.fixture
def key(tmp_path) -> FileKey:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    return FileKey.of(weights)


@pytest.fixture
def store(tmp_path):
    with DigestStore.open(tmp_path / "store") as opened:
        yield opened


def forged_entry(key: FileKey, digest: str = FAKE) -> bytes:
    """What ``put`` would write for ``key``, with a digest of the attacker's choosing."""
    return json.dumps({"scheme": SCHEME, "key": key.as_list(), "digest": digest}).encode()


def debug_lines(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "weightcache.core.identity.digests" and r.levelno == logging.DEBUG
    ]


def test_a_store_directory_swapped_for_a_symlink_after_opening_redirects_no_read_and_no_write(tmp_path, store, key):
    store.put(key, REAL)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / key.entry_name).write_bytes(forged_entry(key))
    (tmp_path / "store").rename(tmp_path / "moved")
    (tmp_path / "store").symlink_to(elsewhere)

    assert store.get(key) == REAL, "the store read through a directory swapped in after it was checked"
    other = FileKey(key.st_dev, key.st_ino + 1, 1, 2, 3)
    store.put(other, REAL)
    assert sorted(os.listdir(elsewhere)) == [key.entry_name], "the store wrote into a directory swapped in after its check"
    assert (tmp_path / "moved" / other.entry_name).is_file()


def test_an_entry_that_is_a_symlink_to_a_forged_entry_is_a_miss(tmp_path, store, key, caplog):
    forged = tmp_path / "forged"
    forged.write_bytes(forged_entry(key))
    (tmp_path / "store" / key.entry_name).symlink_to(forged)
    with caplog.at_level(logging.DEBUG, logger="weightcache.core.identity.digests"):
        assert store.get(key) is None
    assert len(debug_lines(caplog)) == 1 and "link" in debug_lines(caplog)[0], caplog.text


def test_an_entry_that_is_a_symlink_to_another_keys_entry_is_a_miss(tmp_path, store, key):
    other = FileKey(key.st_dev, key.st_ino + 1, 1, 2, 3)
    store.put(other, FAKE)
    (tmp_path / "store" / key.entry_name).symlink_to(tmp_path / "store" / other.entry_name)
    assert store.get(key) is None


def test_a_fifo_in_an_entrys_place_is_a_miss_and_does_not_block(tmp_path, store, key, caplog):
    entry = tmp_path / "store" / key.entry_name
    os.mkfifo(entry, 0o600)
    got: list = []
    with caplog.at_level(logging.DEBUG, logger="weightcache.core.identity.digests"):
        reader = threading.Thread(target=lambda: got.append(store.get(key)), daemon=True)
        reader.start()
        reader.join(timeout=10)
    if reader.is_alive():  # unblock the reader the store left waiting for a writer
        os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail("get() blocked on a FIFO in an entry's place")
    assert got == [None]
    assert len(debug_lines(caplog)) == 1 and "not a regular file" in debug_lines(caplog)[0], caplog.text
    store.put(key, REAL)
    assert stat.S_ISREG(os.lstat(entry).st_mode) and store.get(key) == REAL, "put did not replace the FIFO"


def test_an_entry_larger_than_any_put_writes_is_a_miss(tmp_path, store, key, caplog):
    padded = forged_entry(key).ljust(64 << 20, b" ")  # a valid-looking entry, then 64 MiB of padding
    (tmp_path / "store" / key.entry_name).write_bytes(padded)
    with caplog.at_level(logging.DEBUG, logger="weightcache.core.identity.digests"):
        assert store.get(key) is None
    assert debug_lines(caplog) == [
        f"ignoring digest store entry {key.entry_name} in {tmp_path / 'store'}: it holds {len(padded)} bytes; "
        f"an entry holds at most {MAX_ENTRY_BYTES}"
    ]


def test_an_entry_owned_by_another_user_is_a_miss(tmp_path, store, key):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    entry = tmp_path / "store" / key.entry_name
    entry.write_bytes(forged_entry(key))
    os.chown(entry, 65534, 65534)
    assert store.get(key) is None


def test_what_put_writes_get_reads_and_no_temporary_file_is_left(tmp_path, store, key):
    store.put(key, REAL)
    assert store.get(key) == REAL
    assert os.listdir(tmp_path / "store") == [key.entry_name]
    assert stat.S_IMODE(os.lstat(tmp_path / "store" / key.entry_name).st_mode) == 0o600


def test_a_closed_store_remembers_nothing(tmp_path, key):
    store = DigestStore.open(tmp_path / "store")
    store.put(key, REAL)
    store.close()
    assert store.get(key) is None and store.directory is None
    store.put(key, FAKE)
    assert json.loads((tmp_path / "store" / key.entry_name).read_bytes())["digest"] == REAL


def test_a_store_is_built_with_open_not_from_a_bare_path(tmp_path):
    with pytest.raises(ValueError, match=r"DigestStore\.open"):
        DigestStore(Path(tmp_path))
    assert DigestStore(None).get(FileKey(1, 2, 3, 4, 5)) is None
