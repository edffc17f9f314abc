"""How a new version's tensors line up with its model: the first difference, and the places its previous version keeps.

A version is switched to by showing its bytes at the addresses of the previous one, so it must hold every tensor at
the same place of arenas of the same sizes. The new tensors are copied straight into those places where they are
final already (``place_like``); what post-processing made is moved there after export (``conform``).
"""

from __future__ import annotations

import typing

import attrs

from weightcache.core.errors import LayoutMismatch
from weightcache.core.layout.manifest import Manifest, TensorRecord
from weightcache.core.load.export import ArenaBuilder, Slot

if typing.TYPE_CHECKING:
    import torch

_PLACE = ("arena", "offset")
_KEPT = tuple(field.name for field in attrs.fields(TensorRecord) if field.name not in _PLACE)


class Stored(typing.Protocol):
    """What a checkpoint says of one tensor (``safetensors_io.TensorInfo`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def state_difference(stored: "typing.Iterable[Stored]", state: "typing.Mapping[str, torch.Tensor]") -> str | None:
    """The first way ``state`` differs from the tensors the checkpoint stores (a name, shape or dtype), or None."""
    expected = {info.name: info for info in stored}
    for name, tensor in state.items():
        info = expected.get(name)
        if info is None:
            return f"tensor {name!r} is not in the checkpoint"
        if tuple(tensor.shape) != tuple(info.shape):
            return f"tensor {name!r} has shape {list(tensor.shape)} instead of {list(info.shape)}"
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != info.dtype:
            return f"tensor {name!r} has dtype {dtype} instead of {info.dtype}"
    missing = next((name for name in expected if name not in state), None)
    return None if missing is None else f"tensor {missing!r} is missing"


def place_like(
    template: Manifest, builder: ArenaBuilder, state: "typing.Mapping[str, torch.Tensor]"
) -> "dict[str, torch.Tensor]":
    """Plan ``template``'s arenas in the empty ``builder`` and copy each tensor of ``state`` that ``template`` holds as it
    is (same name, dtype and shape) to its place there; returns ``state`` with those tensors replaced by their copies."""
    import torch

    for spec in template.arenas:
        builder.view(builder.add_arena(spec.size))  # made now: export describes every arena, even one left empty here
    placed = dict(state)
    with torch.no_grad():
        for record in template.tensors:
            tensor = state.get(record.name)
            if tensor is None or tuple(tensor.shape) != record.shape or str(tensor.dtype) != f"torch.{record.dtype}":
                continue
            view = _view(builder, record)
            view.copy_(tensor)
            placed[record.name] = view
    return placed


def conform(manifest: Manifest, builder: ArenaBuilder, template: Manifest) -> tuple[Manifest, ArenaBuilder]:
    """The version ``builder`` holds, described by ``manifest``, with every tensor at ``template``'s place.

    ``builder``'s first arenas are ``template``'s (``place_like``); a tensor export put elsewhere is copied to its place
    and the other arenas are dropped. Where a tensor sits at another place of ``template``'s arenas, the whole version is
    copied into a new builder instead (returned; ``builder`` is closed). LayoutMismatch, naming the first difference,
    when the two differ in anything but places: nothing is published then.
    """
    import torch

    every = {record.name: record for record in manifest.tensors}
    theirs = dict(every)
    moves: list[tuple[TensorRecord, TensorRecord]] = []
    for record in template.tensors:
        found = theirs.pop(record.name, None)
        if found is None:
            raise LayoutMismatch("the new version", f"tensor {record.name!r} is missing after post-processing")
        for field in _KEPT:
            if getattr(found, field) != getattr(record, field):
                raise LayoutMismatch(
                    "the new version",
                    f"tensor {record.name!r} has {field} {getattr(found, field)!r:.80} instead of {getattr(record, field)!r:.80}",
                )
        if (found.arena, found.offset) != (record.arena, record.offset):
            moves.append((found, record))
    if theirs:
        raise LayoutMismatch("the new version", f"tensor {next(iter(theirs))!r} is not in the model")
    for what, mine, new in (
        ("tied weights", template.aliases, manifest.aliases),
        ("adapter state", template.extra, manifest.extra),
    ):
        if mine != new:
            raise LayoutMismatch("the new version", f"its {what} {new!r:.120} differ from {mine!r:.120}")
    count = len(template.arenas)
    target = builder
    if any(found.arena < count for found, _ in moves):  # a move could overwrite a tensor not moved yet
        target = ArenaBuilder(builder.device, chunk_bytes=builder.chunk_bytes)
        for spec in template.arenas:
            target.view(target.add_arena(spec.size))
        moves = [(every[record.name], record) for record in template.tensors]
    with torch.no_grad():
        for found, record in moves:
            if record.nbytes:
                target.view(Slot(record.arena, record.offset, record.nbytes)).copy_(
                    builder.view(Slot(found.arena, found.offset, found.nbytes))
                )
    if builder.device.is_cuda:
        torch.cuda.synchronize(builder.device.torch())
    if target is builder:
        builder.truncate(count)
    else:
        builder.close()
    return attrs.evolve(template, arenas=target.specs()), target


def _view(builder: ArenaBuilder, record: TensorRecord) -> "torch.Tensor":
    """The writable tensor ``record`` describes, in ``builder``'s arenas."""
    import torch

    typed = builder.view(Slot(record.arena, record.offset, record.nbytes)).view(getattr(torch, record.dtype))
    return typed.as_strided(record.shape, record.stride, typed.storage_offset() + record.storage_offset)  # absolute offset
