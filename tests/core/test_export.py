"""Placing tensors into arenas: slots never outgrow their arena, failures name the tensor, every record lands in an arena."""

from __future__ import annotations

import pytest
import torch

from weightcache.core.errors import ArenaError
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.flow.modes import load_model
from weightcache.core.load.export import ArenaBuilder, NamedTensor, Slot, export_module, export_tensors
from weightcache.core.request import LoadRequest


@pytest.fixture
def builder():
    built = ArenaBuilder("cpu")
    try:
        yield built
    finally:
        built.close()


def test_a_plan_after_its_arena_exists_gets_whole_bytes_that_overlap_nothing(builder):
    first = builder.plan(4000)
    first_bytes = builder.view(first)
    first_bytes.fill_(1)
    second = builder.plan(1024)  # the first arena (one 4096-byte page) has no room left
    second_bytes = builder.view(second)
    assert second_bytes.numel() == 1024, f"{second} got a view of {second_bytes.numel()} bytes"
    second_bytes.fill_(2)
    assert bool((first_bytes == 1).all()), "writing the second slot changed the first"
    for slot in (first, second):
        assert slot.offset + slot.nbytes <= builder.arenas[slot.arena].spec.size, f"{slot} outgrew its arena"


def test_a_plan_after_its_arena_exists_uses_the_arenas_spare_bytes(builder):
    first = builder.plan(1000)
    builder.view(first)
    second = builder.plan(1000)
    assert second.arena == first.arena and second.offset >= first.offset + first.nbytes
    assert builder.view(second).numel() == 1000
    assert len(builder.specs()) == 1, "small leftovers belong in the page the arena already has"


@pytest.mark.parametrize("slot", [Slot(0, 4096, 16), Slot(0, 4000, 200), Slot(0, -16, 16), Slot(3, 0, 16)])
def test_view_refuses_a_slot_outside_its_arena_and_names_it(builder, slot):
    builder.view(builder.plan(100))
    with pytest.raises(ArenaError) as caught:
        builder.view(slot)
    assert str(slot) in str(caught.value)


def test_nothing_is_planned_or_written_after_sealing(builder):
    slot = builder.plan(100)
    builder.view(slot)
    builder.seal()
    with pytest.raises(ArenaError, match="sealed"):
        builder.plan(100)
    with pytest.raises(ArenaError, match="sealed"):
        builder.view(slot)


def test_a_tensor_whose_copy_fails_names_itself(builder):
    items = [
        NamedTensor("dense.weight", "parameter", torch.ones(4, 4)),
        NamedTensor("sparse.table", "buffer", torch.eye(4).to_sparse()),
    ]
    with pytest.raises(ArenaError) as caught:
        export_tensors(items, {}, builder, release=False)
    message = str(caught.value)
    assert "buffer 'sparse.table'" in message and "to_dense()" in message, message
    assert "dense.weight" not in message


def test_module_export_keeps_buffers_the_arenas_did_not_hold_yet(builder):
    """Tensors read into arenas first, then a module whose other buffer must go in after them (the checkpoint path)."""
    module = torch.nn.Linear(1000, 1, bias=False)
    module.register_buffer("ids", torch.arange(300), persistent=False)  # 2400 bytes: more than the first page has left
    slot = builder.plan(4000)
    builder.view(slot).view(torch.float32).copy_(module.weight.detach().reshape(-1))
    module.weight = torch.nn.Parameter(builder.view(slot).view(torch.float32).view(1, 1000), requires_grad=False)
    manifest = export_module(module, builder, release=False)
    records = {record.name: record for record in manifest.tensors}
    assert (records["weight"].arena, records["weight"].offset) == (0, 0), "a tensor already in an arena is not copied"
    assert records["ids"].arena == 1
    ids = builder.view(Slot(records["ids"].arena, records["ids"].offset, records["ids"].nbytes)).view(torch.int64)
    assert torch.equal(ids, torch.arange(300))


def _tensor_at(model, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, leaf)


@pytest.mark.parametrize("kind", ["bert", "llama-odd", "gemma", "mixtral"])
def test_every_manifest_tensor_lies_in_an_arena_after_rebind(server, model_dir, kind):
    path = model_dir(kind)
    publish(prepare(LoadRequest(model=str(path))), server.socket_dir)
    cached = load_model(str(path), mode="client", socket_dir=server.socket_dir, strict=True)
    try:
        model, manifest = cached.model, cached.attachment.manifest
        ranges = [(arena.bytes_view().data_ptr(), arena.spec.size) for arena in cached.attachment.arenas]
        records = {record.name: record for record in manifest.tensors}
        named = {**records, **{alias: records[target] for alias, target in manifest.aliases.items()}}
        for name, record in named.items():
            tensor = _tensor_at(model, name)
            start = tensor.data_ptr()
            end = start + record.nbytes
            assert any(base <= start and end <= base + size for base, size in ranges), (
                f"{record.kind} {name!r} ({tensor.dtype}, {tuple(tensor.shape)}) lies outside every arena of the attachment"
            )
        model_names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
            n for n, _ in model.named_buffers(remove_duplicate=False)
        }
        assert model_names <= set(named), f"not in the manifest: {sorted(model_names - set(named))}"
        assert any(record.kind == "buffer" for record in manifest.tensors), "the model's buffers must be published too"
    finally:
        cached.close()


def test_add_arena_gives_a_whole_arena_of_its_own_that_later_slots_do_not_share():
    from weightcache.core.load.export import ArenaBuilder

    with ArenaBuilder("cpu", chunk_bytes=1 << 20) as builder:
        first = builder.plan(100)
        whole = builder.add_arena(8192)
        after = builder.plan(100)
        assert (whole.arena, whole.offset, whole.nbytes) == (1, 0, 8192)
        assert first.arena == 0 and after.arena == 2
        builder.view(whole).fill_(7)
        builder.view(first), builder.view(after)
        assert [spec.size for spec in builder.specs()][1] == 8192


def test_a_host_arena_is_filled_through_its_memfd_and_mapped_only_when_viewed():
    """What a host-tier copy does: write each new arena's memfd with pwritev (no mapping, no page faults), seal, read."""
    import os

    from weightcache.core.load.export import ArenaBuilder

    def mapped_arenas() -> int:
        with open("/proc/self/maps") as maps:
            return sum("memfd:weightcache-arena" in line for line in maps)

    before = mapped_arenas()
    with ArenaBuilder("cpu") as builder:
        slots = [builder.add_arena((index + 1) << 16) for index in range(3)]
        arenas = [builder.arena(slot) for slot in slots]
        assert mapped_arenas() == before
        for index, arena in enumerate(arenas):
            assert os.pwritev(arena.fileno(), [bytes([index]) * arena.spec.size], 0) == arena.spec.size
        builder.seal()
        assert [spec.size for spec in builder.specs()] == [(index + 1) << 16 for index in range(3)]
        assert [set(arena.bytes_view().tolist()) for arena in arenas] == [{0}, {1}, {2}]
        assert mapped_arenas() == before + 3
        with pytest.raises(PermissionError):
            os.pwritev(arenas[0].fileno(), [b"x"], 0)  # sealed: nobody writes a published arena again


def test_arenas_seal_one_at_a_time_and_an_unsealed_one_is_planned_again(builder):
    """A copy checked arena by arena: arena 0 sealed (read-only, checksummed) while arena 1 is still written; arena 1,
    replaced, comes back empty and of the same size, and the old one is the caller's to close."""
    first, second = builder.add_arena(4096), builder.add_arena(4096)
    builder.view(first).fill_(1)
    spec = builder.seal_arena(0)
    assert spec.checksum is not None and builder.seal_arena(0) == spec  # idempotent
    builder.view(second).fill_(2)  # the other arenas stay writable
    old = builder.replace_arena(1)
    assert old is not None
    old.close()
    assert int(builder.view(second).sum()) == 0 and builder.view(second).numel() == 4096
    builder.seal()
    assert builder.specs()[0] == spec
    with pytest.raises(ArenaError, match="sealed"):
        builder.replace_arena(0)
