"""The manifest: where every tensor of a published model lies in its arenas."""

from __future__ import annotations

import typing

import attrs

from weightcache.core.arena.base import ArenaSpec
from weightcache.core.dtypes import dtype_name, to_dtype

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.arena.base import Arena

KINDS = ("parameter", "buffer", "attribute")
"""``attribute``: a plain tensor attribute of a module (``module.W_UV = tensor``), neither parameter nor buffer."""


def _ints(value) -> tuple[int, ...]:
    return tuple(map(int, value))


@attrs.frozen
class TensorRecord:
    """One tensor: its identity, layout and place in an arena.

    ``offset`` is the byte offset of the tensor's storage region in arena
    ``arena``; the tensor is that region viewed as ``dtype`` and strided by
    ``shape``/``stride`` from element ``storage_offset``. ``attributes`` holds
    the JSON-able Python attributes an engine hung on the tensor (e.g.
    ``format_ue8m0``), restored on rebind.
    """

    name: str
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    dtype: str = attrs.field(converter=dtype_name)
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    stride: tuple[int, ...] = attrs.field(converter=_ints)
    storage_offset: int
    arena: int
    offset: int
    nbytes: int
    persistent: bool = True
    attributes: dict = attrs.field(factory=dict, hash=False, validator=attrs.validators.instance_of(dict))

    def to_json(self) -> dict:
        data = {**attrs.asdict(self), "shape": list(self.shape), "stride": list(self.stride)}
        if not self.attributes:
            del data["attributes"]  # most tensors carry none: keep manifests small
        return data

    @classmethod
    def from_json(cls, data: dict) -> "TensorRecord":
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"malformed tensor record: {exc}") from None


@attrs.frozen
class Manifest:
    """Every tensor of one published model rank, its arenas, tied-weight aliases and adapter state.

    :param aliases: alias name -> name of the tensor it shares (tied weights).
    :param extra: small JSON-able state an adapter needs to rebuild the model
        (model class, flags set by post-processing).
    """

    tensors: tuple[TensorRecord, ...] = attrs.field(converter=tuple)
    arenas: tuple[ArenaSpec, ...] = attrs.field(converter=tuple)
    aliases: dict = attrs.field(factory=dict, hash=False)
    extra: dict = attrs.field(factory=dict, hash=False)

    @tensors.validator
    def _check(self, _attr, records):
        seen = set()
        for record in records:
            if record.name in seen:
                raise ValueError(f"manifest names tensor {record.name!r} twice")
            seen.add(record.name)
            if not 0 <= record.arena < len(self.arenas):
                raise ValueError(f"tensor {record.name!r} points at arena {record.arena}, manifest has {len(self.arenas)}")
            if record.offset < 0 or record.offset + record.nbytes > self.arenas[record.arena].size:
                raise ValueError(f"tensor {record.name!r} lies outside arena {record.arena}")
        for alias, target in self.aliases.items():
            if target not in seen:
                raise ValueError(f"alias {alias!r} points at unknown tensor {target!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of all arenas together."""
        return sum(spec.size for spec in self.arenas)

    def to_json(self) -> dict:
        return {
            "tensors": [record.to_json() for record in self.tensors],
            "arenas": [spec.to_json() for spec in self.arenas],
            "aliases": dict(self.aliases),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        try:
            return cls(
                tensors=[TensorRecord.from_json(t) for t in data["tensors"]],
                arenas=[ArenaSpec.from_json(a) for a in data["arenas"]],
                aliases={str(k): str(v) for k, v in data.get("aliases", {}).items()},
                extra=dict(data.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed manifest: {exc}") from None

    def views(self, arenas: "typing.Sequence[Arena]") -> "dict[str, torch.Tensor]":
        """Tensors viewing the mapped ``arenas`` (no copy), aliases included."""
        if len(arenas) != len(self.arenas):
            raise ValueError(f"manifest has {len(self.arenas)} arenas, {len(arenas)} were mapped")
        bytes_views = [arena.bytes_view() for arena in arenas]
        typed: dict = {}  # (arena, dtype) -> the whole arena viewed as dtype: one as_strided per tensor after that
        tensors = {}
        for record in self.tensors:
            key = (record.arena, record.dtype)
            base = typed.get(key)
            if base is None:
                base = typed[key] = _typed_base(bytes_views[record.arena], record.dtype)
            tensors[record.name] = view_of(bytes_views[record.arena], record, base)
        for alias, target in self.aliases.items():
            tensors[alias] = tensors[target]
        return tensors


def _typed_base(arena_bytes, dtype_name: str):
    dtype = to_dtype(dtype_name)
    itemsize = dtype.itemsize
    return arena_bytes.view(dtype) if arena_bytes.numel() % itemsize == 0 else None


def view_of(arena_bytes: "torch.Tensor", record: TensorRecord, typed_base=None) -> "torch.Tensor":
    """The tensor ``record`` describes, viewing ``arena_bytes`` without a copy.

    ``typed_base`` (the whole arena viewed as the record's dtype) saves two
    tensor operations per record when the offset is a multiple of the item size.
    """
    dtype = to_dtype(record.dtype)
    if typed_base is not None and record.nbytes and record.offset % dtype.itemsize == 0:
        return typed_base.as_strided(record.shape, record.stride, record.offset // dtype.itemsize + record.storage_offset)
    typed = arena_bytes[record.offset : record.offset + record.nbytes].view(dtype)
    if record.nbytes == 0:
        return typed.reshape(record.shape)
    if record.storage_offset == 0 and typed.numel() == _numel(record.shape) and record.stride == _contiguous_stride(record.shape):
        return typed.view(record.shape)
    return typed.as_strided(record.shape, record.stride, typed.storage_offset() + record.storage_offset)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _contiguous_stride(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
