"""Arena checksums (core/arena/checksum.py): the value, where it is computed, and that bytes that moved are checked.

The GPU computes the same value (tests/gpu/test_cuda_arena.py); the fills that check it run
on GPUs (tests/gpu/test_node_fill.py); seeding, re-publishing and ``weightcache verify``
check it on the CPU here too (test_seeding.py, test_restart.py, test_verify.py).
"""

from __future__ import annotations

import os
import random
import time

import attrs
import pytest
import torch

from tests.core.support import host_manifest, make_fingerprint, pattern, publish_host_entry, sealed_memfd
from weightcache.core.arena import ArenaSpec
from weightcache.core.arena import checksum as checksums
from weightcache.core.arena.checksum import SCHEME, checksum, is_checksum
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import ChecksumMismatch, ServerError
from weightcache.core.load.export import ArenaBuilder, export_state
from weightcache.core.load.publish import publish_arenas

_MASK = (1 << 64) - 1


def reference(data: bytes) -> str:
    """The scheme written out with Python integers, word by word."""
    data += bytes(-len(data) % 8)
    weighted = plain = 0
    for index in range(len(data) // 8):
        word = int.from_bytes(data[8 * index : 8 * index + 8], "little")
        weighted = (weighted + word * (2 * index + 1)) & _MASK
        plain = (plain + word) & _MASK
    return f"{SCHEME}:{weighted:016x}{plain:016x}"


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def random_bytes(nbytes: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(nbytes)


@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, 8 * 4096 - 3, 8 * 4096 * 3 + 13, 100_003])
def test_the_checksum_is_the_scheme_written_out(nbytes):
    data = random_bytes(nbytes, seed=nbytes)
    assert checksum(as_tensor(data)) == reference(data)


def test_chunks_fold_in_their_offsets_and_both_reductions_agree(monkeypatch):
    data = random_bytes(8 * 4096 * 7 + 77)
    monkeypatch.setattr(checksums, "CHUNK_WORDS", 2 * 4096)  # seven chunks and a tail
    assert checksum(as_tensor(data)) == reference(data)
    words = as_tensor(data[: 8 * (len(data) // 8)]).view(torch.int64)
    by_columns, by_rows = checksums._sums(words.view(torch.uint8), True), checksums._sums(words.view(torch.uint8), False)
    assert [int(v) for v in by_columns] == [int(v) for v in by_rows], "the CUDA and the CPU reduction must agree"


def test_an_unaligned_view_is_checksummed_like_its_bytes():
    data = random_bytes(9000)
    assert checksum(as_tensor(data)[3:]) == reference(data[3:])


def test_a_changed_swapped_or_shifted_word_changes_the_checksum():
    data = bytearray(random_bytes(8 * 5000))
    original = checksum(as_tensor(bytes(data)))
    flipped = bytearray(data)
    flipped[12345] ^= 0x01
    swapped = bytearray(data)
    swapped[0:8], swapped[8 * 4099 : 8 * 4100] = data[8 * 4099 : 8 * 4100], data[0:8]
    shifted = bytes(8) + bytes(data[:-8])
    for name, changed in (("one bit", flipped), ("two words swapped", swapped), ("shifted by a word", shifted)):
        assert checksum(as_tensor(bytes(changed))) != original, name


def test_only_well_formed_checksums_of_this_scheme_are_accepted():
    good = checksum(as_tensor(b"weights"))
    assert is_checksum(good) and good.startswith("wsum64v1:")
    for bad in (None, 7, "", "wsum64v2:" + "0" * 32, "wsum64v1:" + "0" * 31, "wsum64v1:" + "G" * 32, good.upper()):
        assert not is_checksum(bad), bad
        if bad is not None:
            with pytest.raises(ValueError, match="is not a wsum64v1 checksum"):
                ArenaSpec(backend="host", size=4096, checksum=bad)
    spec = ArenaSpec(backend="host", size=4096, checksum=good)
    assert ArenaSpec.from_json(spec.to_json()) == spec


def test_a_publish_without_checksums_is_refused_saying_what_to_do(server):
    fd, spec = sealed_memfd(pattern(4096))
    try:
        manifest = host_manifest(attrs.evolve(spec, checksum=None), 4096)
        assert "checksum" not in manifest.to_wire()[0]["arenas"][0]
        with Connection(server.socket_dir) as connection:
            with pytest.raises(ServerError, match="arena 0 carries no checksum of its bytes") as refused:
                connection.publish(make_fingerprint(), manifest, [fd])
            assert connection.status()["entries"] == []
    finally:
        os.close(fd)
    assert refused.value.code == "bad_request"


def test_publish_computes_each_arenas_checksum_from_its_sealed_bytes_and_attach_returns_it(server):
    state = {f"w{i}": torch.randn(300, 70 + i) for i in range(6)}
    with ArenaBuilder("cpu", chunk_bytes=64 << 10) as builder:
        manifest = export_state(state, builder)
        assert all(spec.checksum is None for spec in manifest.arenas)  # not sealed yet
        reply = publish_arenas(builder, make_fingerprint(), manifest, server.socket_dir)
        sealed = builder.specs()
    assert len(sealed) > 1 and all(is_checksum(spec.checksum) for spec in sealed)
    attachment = Attachment.open(make_fingerprint(), server.socket_dir)
    try:
        assert attachment.digest == reply.digest
        assert list(attachment.manifest.arenas) == sealed
        for arena, spec in zip(attachment.arenas, sealed, strict=True):
            assert checksum(arena.bytes_view()) == spec.checksum
    finally:
        attachment.close()


def test_bytes_copied_from_an_entry_whose_checksum_lies_are_refused_and_nothing_is_published(server):
    """What a fill does with a host-tier source (on a GPU in tests/gpu/test_node_fill.py), with host arenas."""
    liar = publish_host_entry(server.socket_dir, checksum=f"{SCHEME}:{'ab' * 16}")
    source = Attachment.open(liar.fingerprint, server.socket_dir)
    try:
        with ArenaBuilder("cpu") as builder:
            for arena in source.arenas:
                builder.view(builder.add_arena(arena.spec.size)).copy_(arena.bytes_view())
            with pytest.raises(
                ChecksumMismatch, match=r"arena 0 from the host tier does not hold the bytes it declared"
            ) as caught:
                publish_arenas(
                    builder, make_fingerprint(dtype="float16"), source.manifest, server.socket_dir, copied_from="the host tier"
                )
    finally:
        source.close()
    assert caught.value.arena == 0 and caught.value.expected == f"{SCHEME}:{'ab' * 16}"
    assert "nothing was published" in str(caught.value) and "weightcache verify --drop" in str(caught.value)
    with Connection(server.socket_dir) as connection:
        assert [row["digest"] for row in connection.status()["entries"]] == [liar.digest]


def test_a_copy_of_another_size_is_refused_even_when_its_bytes_match():
    data = random_bytes(4096)
    declared = [ArenaSpec(backend="host", size=4096, checksum=checksum(as_tensor(data)))]
    copied = [attrs.evolve(declared[0], size=8192, checksum=checksum(as_tensor(data + bytes(4096))))]
    with pytest.raises(ChecksumMismatch, match="over 8192 bytes where 4096 were declared"):
        checksums.check_copy(declared, copied, "rank 0")
    with pytest.raises(ChecksumMismatch, match="rank 0 declared no checksum"):
        checksums.check_copy([attrs.evolve(declared[0], checksum=None)], declared, "rank 0")


def test_checksum_speed_on_this_cpu_is_reported():
    """Not a limit: reports the speed at which a host-tier copy and a CPU entry are checked (decision 31)."""
    data = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8)
    checksum(data)
    start = time.perf_counter()
    checksum(data)
    seconds = time.perf_counter() - start
    print(
        f"checksum of 256 MiB on the CPU ({torch.get_num_threads()} threads): {seconds * 1e3:.0f} ms, {0.25 / seconds:.2f} GiB/s"
    )
