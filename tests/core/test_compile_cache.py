"""Compile artifacts beside an entry: the put_artifact / get_artifact ops on a real server, and a real torch.compile round trip.

The wire tests use real server processes, real sockets and real fds; every
refused request must close every fd it brought and leave the entry as it was.
The round trip compiles a small model with inductor's CPU backend in one fresh
process, publishes the artifacts, then attaches, restores and compiles in
another fresh process with empty inductor and Triton cache directories.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile

import pytest

from tests.core.support import (
    ALL_SEALS,
    inode,
    make_fingerprint,
    pattern,
    publish_host_entry,
    resting_fd_count,
    settle_fd_count,
    sparse_memfd,
)
from tests.core.test_exhaustion import configured_server
from tests.helpers import run_python
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import CompileArtifactsUnavailable, ServerError
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import LoadedModel
from weightcache.core.memfd import read_memfd, sealed_memfd
from weightcache.core.request import LoadRequest
from weightcache.core.spare.compile_cache import publish_artifacts, restore_artifacts

KEY = "torch.compile;torch=test;triton=none;device=cpu"
MAX_BYTES = 1 << 20


def _row(socket_dir) -> dict:
    with Connection(socket_dir, timeout=10) as conn:
        [row] = conn.status()["entries"]
        return row


def test_an_artifact_is_kept_beside_its_entry_handed_out_sealed_and_dropped_with_it(server):
    baseline = resting_fd_count(server.pid)
    entry = publish_host_entry(server.socket_dir)
    first, second = pattern(5000, seed=1), pattern(7000, seed=2)
    sent = sealed_memfd(first)
    try:
        with Connection(server.socket_dir, timeout=10) as conn:
            reply = conn.put_artifact(entry.digest, KEY, sent)
            assert reply["bytes"] == len(first) and reply["replaced"] is False
            fd, size = conn.get_artifact(entry.digest, KEY)
            try:
                assert size == len(first) and read_memfd(fd, size) == first
                assert inode(fd) == inode(sent), "the engine gets the published memfd itself, not a copy"
                assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & ALL_SEALS == ALL_SEALS
            finally:
                os.close(fd)
            assert conn.get_artifact(entry.digest, KEY + ";other") is None, "another stack's key finds nothing"
            status = conn.status()
        row = status["entries"][0]
        assert (row["artifacts"], row["artifact_bytes"]) == (1, len(first))
        assert status["held_bytes"] == row["bytes"] + len(first), "artifacts count against the byte budget"

        replacement = sealed_memfd(second)
        try:
            with Connection(server.socket_dir, timeout=10) as conn:
                assert conn.put_artifact(entry.digest, KEY, replacement)["replaced"] is True
                fd, size = conn.get_artifact(entry.digest, KEY)
                os.close(fd)
        finally:
            os.close(replacement)
        assert size == len(second) and _row(server.socket_dir)["artifacts"] == 1
        assert settle_fd_count(server.pid, baseline + 3) == baseline + 3, (
            "the server holds the arena, the tensor table and the one artifact"
        )
    finally:
        os.close(sent)
    with Connection(server.socket_dir, timeout=10) as conn:
        conn.evict(entry.digest)
    assert settle_fd_count(server.pid, baseline) == baseline, "evicting the entry closes its artifacts' fds"


def _pipe_fd() -> int:
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


def _regular_file_fd() -> int:
    handle, path = tempfile.mkstemp()
    os.write(handle, b"not a memfd")
    os.unlink(path)
    return handle


def _unsealed_memfd() -> int:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, b"unsealed")
    return fd


# name -> (request fields beyond op, fds to send (made fresh), expected code, words the message must hold)
BAD_PUTS = {
    "pipe": ({}, lambda: [_pipe_fd()], "bad_request", "the artifact fd is not a memfd (file type"),
    "regular file": ({}, lambda: [_regular_file_fd()], "bad_request", "is not a memfd (it cannot be sealed)"),
    "unsealed memfd": ({}, lambda: [_unsealed_memfd()], "bad_request", "is not sealed against writes, shrinking and growing"),
    "write seal only": ({}, lambda: [sparse_memfd(64, fcntl.F_SEAL_WRITE)], "bad_request", "is not sealed"),
    "empty": ({}, lambda: [sparse_memfd(0)], "bad_request", "the artifact memfd is empty"),
    "too large": ({}, lambda: [sparse_memfd(MAX_BYTES + 1)], "too_large", f"exceeds the {MAX_BYTES} bytes the server keeps"),
    "no fd": ({}, list, "bad_request", "exactly one fd"),
    "two fds": ({}, lambda: [sealed_memfd(b"a"), sealed_memfd(b"b")], "bad_request", "exactly one fd"),
    "unknown digest": ({"digest": "0" * 64}, lambda: [sealed_memfd(b"x")], "not_found", "no entry 000000000000; publish"),
    "short digest": ({"digest": "abcd"}, lambda: [sealed_memfd(b"x")], "bad_request", "full digest (64 lower-case hex"),
    "digest not a string": ({"digest": 7}, lambda: [sealed_memfd(b"x")], "bad_request", "full digest"),
    "empty key": ({"key": ""}, lambda: [sealed_memfd(b"x")], "bad_request", "key must be a printable string of 1 to 256"),
    "long key": ({"key": "k" * 257}, lambda: [sealed_memfd(b"x")], "bad_request", "key must be a printable string"),
    "key with a newline": ({"key": "a\nb"}, lambda: [sealed_memfd(b"x")], "bad_request", "key must be a printable string"),
    "no key": ({"key": None}, lambda: [sealed_memfd(b"x")], "bad_request", "malformed put_artifact request"),
}


@pytest.mark.parametrize("case", list(BAD_PUTS))
def test_a_bad_put_artifact_gets_one_clear_error_and_leaks_nothing(socket_dir, case):
    fields, make_fds, code, words = BAD_PUTS[case]
    with configured_server(socket_dir, max_artifact_bytes=MAX_BYTES) as server:
        entry = publish_host_entry(socket_dir)
        kept = sealed_memfd(b"the artifact already kept")
        fds = make_fds()
        try:
            with Connection(socket_dir, timeout=10) as conn:
                conn.put_artifact(entry.digest, KEY, kept)
                baseline = resting_fd_count(server.pid)
                message = {"op": "put_artifact", "digest": entry.digest, "key": KEY, **fields}
                message = {k: v for k, v in message.items() if v is not None}
                with pytest.raises(ServerError) as caught:
                    conn.request(message, fds)
                assert caught.value.code == code and words in str(caught.value), str(caught.value)
                assert settle_fd_count(server.pid, baseline) == baseline, "every fd the refused request brought is closed"
                fd, size = conn.get_artifact(entry.digest, KEY)  # the connection goes on; what was kept stays
                os.close(fd)
                assert size == len(b"the artifact already kept")
        finally:
            for fd in [*fds, kept]:
                os.close(fd)
        assert server.proc.poll() is None


def test_get_artifact_refuses_fds_bad_addresses_and_finds_nothing_for_unknown_ones(server):
    entry = publish_host_entry(server.socket_dir)
    stray = sealed_memfd(b"stray")
    try:
        with Connection(server.socket_dir, timeout=10) as conn:
            baseline = resting_fd_count(server.pid)
            with pytest.raises(ServerError, match="op 'get_artifact' takes no fds; 1 were closed"):
                conn.request({"op": "get_artifact", "digest": entry.digest, "key": KEY}, [stray])
            with pytest.raises(ServerError, match="malformed get_artifact request: digest must be an entry's full digest"):
                conn.request({"op": "get_artifact", "digest": entry.digest[:12], "key": KEY})
            assert conn.get_artifact("f" * 64, KEY) is None and conn.get_artifact(entry.digest, KEY) is None
            assert settle_fd_count(server.pid, baseline) == baseline
    finally:
        os.close(stray)


def test_artifacts_are_bounded_per_entry_and_by_the_byte_budget(socket_dir):
    budget = 64 << 10  # the entry's arena is one 16 KiB page group
    with configured_server(socket_dir, max_artifacts_per_entry=2, byte_budget=budget) as server:
        entry = publish_host_entry(socket_dir)
        other = publish_host_entry(socket_dir, make_fingerprint(tp_rank=0), label="idle neighbour")
        fds = [sealed_memfd(pattern(4096, seed=i)) for i in range(3)]
        big = sparse_memfd(budget)
        try:
            with Connection(socket_dir, timeout=10) as conn:
                conn.put_artifact(entry.digest, "a", fds[0])
                conn.put_artifact(entry.digest, "b", fds[1])
                baseline = resting_fd_count(server.pid)
                with pytest.raises(ServerError) as caught:
                    conn.put_artifact(entry.digest, "c", fds[2])
                assert caught.value.code == "too_many" and "already holds 2 artifacts" in str(caught.value)
                assert conn.put_artifact(entry.digest, "b", fds[2])["replaced"] is True, (
                    "a known key is replaced, not counted again"
                )
                with pytest.raises(ServerError) as caught:
                    conn.put_artifact(entry.digest, "b", big)
                assert caught.value.code == "over_budget" and "nothing was evicted" in str(caught.value)
                digests = {row["digest"] for row in conn.status()["entries"]}
                assert digests == {entry.digest, other.digest}, "a refused artifact evicts nothing"
                assert settle_fd_count(server.pid, baseline) == baseline
        finally:
            for fd in [*fds, big]:
                os.close(fd)


# --- a real torch.compile round trip ------------------------------------------------------------------------------------

_ENGINE = """
import hashlib, json, sys, time
import torch
from torch._dynamo.utils import counters
from weightcache.core.flow.modes import load_model
from weightcache.core.spare.compile_cache import publish_artifacts, restore_artifacts

model_dir, socket_dir, role = sys.argv[1:4]
loaded = load_model(model_dir, mode="client", socket_dir=socket_dir, strict=True)
restored = restore_artifacts(loaded, strict=True) if role == "restore" else None
ids = (torch.arange(32).reshape(2, 16) * 31) % loaded.model.config.vocab_size
compiled = torch.compile(loaded.model)
start = time.perf_counter()
with torch.inference_mode():
    logits = compiled(input_ids=ids).logits
seconds = time.perf_counter() - start
published = publish_artifacts(loaded, strict=True) if role == "publish" else None
print(json.dumps({
    "digest": hashlib.sha256(logits.float().numpy().tobytes()).hexdigest(),
    "compile_s": seconds,
    "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
    "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
    "published": published.nbytes if published else None,
    "restored": restored.nbytes if restored else None,
}))
"""


def _compile_in_a_fresh_process(model, socket_dir, role: str, tmp_path) -> dict:
    caches = tmp_path / role
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }  # 2 shared cores: no pool of compile workers
    assert not caches.exists(), "each process starts with empty inductor and Triton caches"
    proc = run_python(_ENGINE, str(model), str(socket_dir), role, env=env, timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restored_compile_artifacts_give_the_cold_compiles_outputs_bit_for_bit(server, model_dir, tmp_path, record_property):
    model = model_dir("llama")
    publish(prepare(LoadRequest(model=str(model))), server.socket_dir)
    cold = _compile_in_a_fresh_process(model, server.socket_dir, "publish", tmp_path)
    assert cold["fx_misses"] >= 1 and cold["fx_hits"] == 0 and cold["published"] > 0, cold
    assert _row(server.socket_dir)["artifacts"] == 1
    warm = _compile_in_a_fresh_process(model, server.socket_dir, "restore", tmp_path)
    assert warm["restored"] == cold["published"], (warm, cold)
    assert warm["fx_hits"] >= 1 and warm["fx_misses"] == 0, f"the restored process compiled from scratch: {warm}"
    assert warm["digest"] == cold["digest"], "the restored compile's outputs differ from the cold compile's"
    record_property("compile_cold_s", round(cold["compile_s"], 2))
    record_property("compile_restored_s", round(warm["compile_s"], 2))
    print(
        f"\ncompile + first forward: cold {cold['compile_s']:.1f} s, restored {warm['compile_s']:.1f} s "
        f"({cold['published']} bytes of artifacts)"
    )


def test_without_an_entry_or_a_server_the_engine_only_compiles_from_scratch(server, caplog):
    from_disk = LoadedModel(model=None, source="disk", mode="off")
    assert publish_artifacts(from_disk) is None and restore_artifacts(from_disk) is None
    assert "without a cached entry" in caplog.text
    with pytest.raises(CompileArtifactsUnavailable, match="without a cached entry"):
        restore_artifacts(from_disk, strict=True)

    entry = publish_host_entry(server.socket_dir)
    attachment = Attachment.open(entry.fingerprint, server.socket_dir)
    attached = LoadedModel(model=None, source="cache", mode="client", fingerprint=entry.fingerprint, attachment=attachment)
    try:
        assert restore_artifacts(attached) is None, "no artifacts kept yet: a cold compile, no warning"
        with pytest.raises(CompileArtifactsUnavailable, match="nothing was compiled in this process yet"):
            publish_artifacts(attached, strict=True)
        server.kill()
        caplog.clear()
        assert restore_artifacts(attached) is None
        assert "could not ask the server for compile artifacts: no weightcache server" in caplog.text
    finally:
        attached.close()
