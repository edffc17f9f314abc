"""A digest store per node, as separate machines have (issue 52, item 3): new nodes read the checkpoint once between
them and learn the rest from the fleet's records of its files; a CLI load that pulls reads only the headers; a file
changed in place is a miss everywhere. The fleet's fixtures are in tests/core/conftest.py."""

from __future__ import annotations

import os
import typing

import pytest

from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.fleet_loads import entries, keys_under, load_at_once, said
from tests.core.fleet_support import Node, evict, resident_bytes, skip_unless_a_fleet_runs, wait_for
from tests.helpers import past_the_racy_window
from weightcache.core.client.client import Connection
from weightcache.core.identity.safetensors_io import checkpoint_files

skip_unless_a_fleet_runs()  # etcd and NIXL, or the module is skipped saying which is missing


def own_store(node: Node, tmp_path) -> dict:
    """``node``'s environment with a digest store of its own (``WEIGHTCACHE_CACHE_DIR``), which has hashed nothing."""
    return node.env(WEIGHTCACHE_CACHE_DIR=str(tmp_path / f"digests-{node.name}"))


def copy_of(model_dir, tmp_path) -> typing.Any:
    """A copy of the test model of this test's own (its files can be changed), past the racy window."""
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(model_dir("llama"), copy)
    past_the_racy_window(copy)
    return copy


def test_new_nodes_with_a_digest_store_each_read_the_checkpoint_once_between_them(fleet, model_dir, tmp_path):
    """Three new nodes, each with a digest store that has hashed nothing, load a checkpoint nobody has hashed, at once,
    through the CLI: one reads it, the others learn its content from the fleet's records of its files and pull."""
    etcd, node = fleet
    nodes = [node(name) for name in ("a", "b", "c")]
    path = copy_of(model_dir, tmp_path)
    outputs = load_at_once(nodes, path, [own_store(n, tmp_path) for n in nodes])
    sources = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert sum("copied from node" in s for s in sources) == 2, said(outputs)
    readers = [err for _, err in outputs if "this node reads it" in err]
    learned = [err for _, err in outputs if "learned the content of 1 file " in err]
    assert len(readers) == 1 and len(learned) == 2, said(outputs)
    assert len({e["digest"] for n in nodes for e in entries(n)}) == 1
    assert keys_under(etcd, "sightings") == [] and keys_under(etcd, "claims") == []
    assert len(keys_under(etcd, "files")) == 1
    assert_attaches_like_from_pretrained(path, nodes[2].socket_dir, "float32", None)


@pytest.mark.parametrize("options", [(), ("--no-prefetch",)], ids=["default", "no-prefetch"])
def test_a_cli_load_that_pulls_reads_only_the_headers_from_storage(fleet, model_dir, tmp_path, options):
    """A node that learns the content and pulls reads the headers from storage and nothing else (at most 1 MiB), as
    the kernel's page cache shows: the checkpoint was dropped from it before, and nothing else reads it meanwhile."""
    etcd, node = fleet
    a, b = node("a"), node("b")
    path = copy_of(model_dir, tmp_path)
    done = a.load(path, env=own_store(a, tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    wait_for(lambda: len(keys_under(etcd, "files")) == 1, 30, "node a writing the record of the checkpoint's file")
    evict(path)
    assert resident_bytes(path) == 0, "the page cache still holds the checkpoint: nothing would be read from storage"
    pulled = b.load(path, *options, env=own_store(b, tmp_path))
    assert pulled.returncode == 0 and "copied from node a" in pulled.stdout, pulled.stderr[-3000:]
    read = resident_bytes(path)
    assert read <= 1 << 20, f"the pulling node read {read} bytes of the checkpoint from storage"


def change_in_place(checkpoint) -> None:
    """Change bytes of the first tensor of the checkpoint's file in place: its size kept, its mtime set back."""
    (file,) = checkpoint_files(checkpoint)
    before = file.stat()
    from weightcache.core.identity.safetensors_io import read_header

    tensor = read_header(file).tensors[0]
    with open(file, "r+b") as fh:
        fh.seek(tensor.start)
        old = fh.read(64)
        fh.seek(tensor.start)
        fh.write(bytes(255 - byte for byte in old))
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    past_the_racy_window(checkpoint)


def test_a_file_changed_in_place_with_its_mtime_set_back_is_a_miss_on_every_node(fleet, model_dir, tmp_path):
    """Node a reads the checkpoint and the fleet records its file; node c learns from the record and pulls. The file's
    bytes change in place (size kept, mtime restored): no node serves the old bytes, neither a new one (b) nor c, which
    remembered the old digest; both end with the new bytes."""
    etcd, node = fleet
    a, b, c = node("a"), node("b"), node("c")
    path = copy_of(model_dir, tmp_path)
    first = a.load(path, env=own_store(a, tmp_path))
    assert first.returncode == 0, first.stderr[-3000:]
    (old,) = {e["digest"] for e in entries(a)}
    wait_for(lambda: len(keys_under(etcd, "files")) == 1, 30, "node a writing the record of the checkpoint's file")
    learned = c.load(path, env=own_store(c, tmp_path))
    assert learned.returncode == 0 and "copied from node a" in learned.stdout, learned.stderr[-3000:]
    change_in_place(path)
    fresh = b.load(path, env=own_store(b, tmp_path))
    assert fresh.returncode == 0 and "copied from node" not in fresh.stdout, fresh.stderr[-3000:]
    assert "this node reads it" in fresh.stderr, fresh.stderr[-3000:]
    (new,) = {e["digest"] for e in entries(b)}
    assert new != old
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)
    with Connection(c.socket_dir) as connection:
        connection.evict(old, force=True)  # (its sharing agent holds it)
    again = c.load(path, env=own_store(c, tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert {e["digest"] for e in entries(c)} == {new}, again.stderr[-3000:]
    assert_attaches_like_from_pretrained(path, c.socket_dir, "float32", None)
