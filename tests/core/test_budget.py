"""The server's byte budget: what an entry counts, when idle entries are evicted, and what is refused.

Every test runs a real ``weightcache serve --byte-budget`` process and publishes real sealed memfds.
"""

from __future__ import annotations

import os

import pytest

from tests.core.support import (
    SOME_CHECKSUM,
    host_manifest,
    make_fingerprint,
    publish_host_entry,
    publish_raw,
    raw_wire,
    sparse_memfd,
)
from tests.helpers import ServerProcess
from weightcache.core.arena import ArenaSpec
from weightcache.core.arena.base import PLAUSIBLE_GRANULE, PLAUSIBLE_SLACK
from weightcache.core.client.client import Connection
from weightcache.core.errors import ServerError

KIB = 1024
MIB = 1024 * KIB


@pytest.fixture
def budget_server(socket_dir):
    """Factory: a server on ``socket_dir`` with a byte budget of ``budget`` bytes, stopped afterwards."""
    started = []

    def start(budget: int) -> ServerProcess:
        started.append(ServerProcess.start(socket_dir, "--byte-budget", str(budget)))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def entries(socket_dir) -> dict[str, dict]:
    with Connection(socket_dir, timeout=10) as conn:
        return {e["digest"]: e for e in conn.status()["entries"]}


def held_bytes(socket_dir) -> int:
    with Connection(socket_dir, timeout=10) as conn:
        return conn.status()["held_bytes"]


def publish(socket_dir, name: str, nbytes: int) -> str:
    return publish_host_entry(socket_dir, make_fingerprint(architecture=name), nbytes=nbytes, label=name).digest


def test_a_publish_that_cannot_fit_evicts_nothing(budget_server):
    server = budget_server(64 * KIB)
    socket_dir = server.socket_dir
    idle = publish(socket_dir, "Idle", 16 * KIB)
    held = publish(socket_dir, "Held", 16 * KIB)
    with Connection(socket_dir) as holder:
        holder.attach(make_fingerprint(architecture="Held"))
        before = entries(socket_dir)
        # 16 KiB attached + 56 KiB new > 64 KiB even with the idle entry gone: refused, and the idle entry stays.
        with pytest.raises(ServerError) as refused:
            publish(socket_dir, "TooBig", 56 * KIB)
        assert refused.value.code == "over_budget", refused.value
        assert "nothing was evicted" in str(refused.value) and "16384 held by attached entries" in str(refused.value)
        assert set(entries(socket_dir)) == set(before) == {idle, held}, "a refused publish must not evict anything"
        assert held_bytes(socket_dir) == 32 * KIB
        # 16 KiB attached + 48 KiB new fits once the idle entry goes: it goes, the attached one stays.
        fits = publish(socket_dir, "Fits", 48 * KIB)
        assert set(entries(socket_dir)) == {held, fits}
        assert held_bytes(socket_dir) == 64 * KIB


def test_the_least_recently_used_idle_entry_goes_first_and_only_as_many_as_needed(budget_server):
    server = budget_server(48 * KIB)
    socket_dir = server.socket_dir
    first = publish(socket_dir, "First", 16 * KIB)
    second = publish(socket_dir, "Second", 16 * KIB)
    with Connection(socket_dir) as conn:
        conn.attach(make_fingerprint(architecture="First"))
        conn.detach(first)  # First is now used more recently than Second
    third = publish(socket_dir, "Third", 32 * KIB)
    assert set(entries(socket_dir)) == {first, third}, f"expected {second[:12]} (least recently used) to go"


def test_a_memfd_larger_than_its_declared_size_is_refused(budget_server):
    server = budget_server(1 * MIB)
    socket_dir = server.socket_dir
    fd = sparse_memfd(256 * MIB)  # no page touched: costs nothing
    try:
        manifest = host_manifest(ArenaSpec(backend="host", size=4 * KIB, checksum=SOME_CHECKSUM), 4 * KIB)
        with Connection(socket_dir) as conn, pytest.raises(ServerError) as refused:
            conn.publish(make_fingerprint(architecture="Hidden"), manifest, [fd])
    finally:
        os.close(fd)
    assert refused.value.code == "bad_request", refused.value
    assert f"memfd is {256 * MIB} bytes but its manifest declares 4096" in str(refused.value)
    assert entries(socket_dir) == {} and held_bytes(socket_dir) == 0


def test_a_host_arena_counts_its_memfds_real_size(budget_server):
    server = budget_server(1 * MIB)
    socket_dir = server.socket_dir
    fd = sparse_memfd(8 * KIB)  # one page more than declared: plausible, and counted in full
    try:
        manifest = host_manifest(ArenaSpec(backend="host", size=4 * KIB, checksum=SOME_CHECKSUM), 4 * KIB)
        with Connection(socket_dir) as conn:
            digest = conn.publish(make_fingerprint(architecture="Padded"), manifest, [fd])["digest"]
    finally:
        os.close(fd)
    assert entries(socket_dir)[digest]["bytes"] == 8 * KIB
    assert held_bytes(socket_dir) == 8 * KIB


def _cuda_manifest(declared: int, extent: int) -> tuple[dict, bytes]:
    """The wire form of one CUDA arena declaring ``declared`` bytes whose only tensor reaches ``extent`` bytes."""
    spec = ArenaSpec(
        backend="cuda", size=max(declared, extent), device="GPU-00000000-0000-0000-0000-000000000000", checksum=SOME_CHECKSUM
    )
    manifest = host_manifest(spec, extent).to_json()
    manifest["arenas"][0]["size"] = declared
    return raw_wire(manifest)


@pytest.mark.parametrize(
    ("declared", "accepted"),
    [
        (2 * MIB, True),  # the extent rounded up to the granularity: what the loader allocates
        (PLAUSIBLE_GRANULE + PLAUSIBLE_SLACK, True),  # a granularity of up to 4 MiB
        (PLAUSIBLE_GRANULE + PLAUSIBLE_SLACK + 4 * KIB, False),
        (1024 * MIB, False),  # a small model that claims a whole GiB
    ],
)
def test_a_cuda_arena_must_declare_a_size_plausible_for_its_tensors(budget_server, declared, accepted):
    server = budget_server(8 * 1024 * MIB)  # room for any claim: only plausibility refuses
    # The server never sizes a CUDA fd (that needs CUDA): any fd stands in for one here.
    fd = sparse_memfd(4 * KIB)
    try:
        with Connection(server.socket_dir) as conn:
            if accepted:
                digest = publish_raw(conn, make_fingerprint(architecture="Cuda"), *_cuda_manifest(declared, 4 * KIB), [fd])[
                    "digest"
                ]
            else:
                with pytest.raises(ServerError) as refused:
                    publish_raw(conn, make_fingerprint(architecture="Cuda"), *_cuda_manifest(declared, 4 * KIB), [fd])
    finally:
        os.close(fd)
    if accepted:
        assert entries(server.socket_dir)[digest]["bytes"] == declared, "a CUDA arena counts its declared size"
    else:
        assert refused.value.code == "bad_request", refused.value
        assert f"cuda arena 0 declares {declared} bytes but its tensors reach only 4096" in str(refused.value)
        assert entries(server.socket_dir) == {}


def test_a_cuda_arena_smaller_than_its_tensors_is_refused(budget_server):
    server = budget_server(64 * MIB)
    fd = sparse_memfd(4 * KIB)
    try:
        with Connection(server.socket_dir) as conn, pytest.raises(ServerError) as refused:
            publish_raw(conn, make_fingerprint(architecture="Cuda"), *_cuda_manifest(2 * MIB, 4 * MIB), [fd])
    finally:
        os.close(fd)
    assert refused.value.code == "bad_request" and "ends past arena 0" in str(refused.value), refused.value
