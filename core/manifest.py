"""The manifest: where every tensor of a published model lies in its arenas."""

from __future__ import annotations

import typing

import attrs

from weightcache.core.arena.base import ArenaSpec
from weightcache.core.dtypes import ITEM_SIZES, to_dtype
from weightcache.core.errors import InvalidManifest

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.arena.base import Arena

KINDS = ("parameter", "buffer", "attribute")
"""``attribute``: a plain tensor attribute of a module (``module.W_UV = tensor``), neither parameter nor buffer."""
MAX_INDEX = 2**63 - 1
"""Largest size, stride or offset: torch keeps them as int64."""
MAX_ATTRIBUTE_BYTES = 4096
"""Largest JSON text of one record's ``attributes`` (flags such as ``format_ue8m0``, not data)."""

_INDEX_FIELDS = ("storage_offset", "arena", "offset", "nbytes")


def _as_tuple(value):
    """A list or tuple becomes a tuple; anything else is kept for the record's check to refuse (never coerced)."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _wire_dtype(value):
    """``"torch.bfloat16"`` -> ``"bfloat16"``; anything but a string is kept for the record's check to refuse."""
    return value.removeprefix("torch.") if isinstance(value, str) else value


def _is_index(value) -> bool:
    """Whether ``value`` is a usable size, stride or offset: a JSON integer (not a bool) in [0, 2**63)."""
    return type(value) is int and 0 <= value <= MAX_INDEX


def _attributes_json(value: dict) -> str | None:
    """The JSON text of a record's attributes, or None when they are not JSON values."""
    import json

    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _index_problem(value) -> str:
    """Why ``value`` is not a usable size, stride or offset (``_is_index(value)`` is false)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an integer, not {type(value).__name__} {value!r:.40}"
    if value < 0:
        return f"must not be negative, got {value}"
    return f"{value} exceeds 2**63-1"


@attrs.frozen
class TensorRecord:
    """One tensor: its identity, layout and place in an arena.

    ``offset`` is the byte offset of the tensor's storage region in arena
    ``arena``; the tensor is that region viewed as ``dtype`` and strided by
    ``shape``/``stride`` from element ``storage_offset``. ``attributes`` holds
    the JSON-able Python attributes an engine hung on the tensor (e.g.
    ``format_ue8m0``), restored on rebind. A record that no client could view
    raises :class:`InvalidManifest` (no field is coerced).
    """

    name: str
    kind: str
    dtype: str = attrs.field(converter=_wire_dtype)
    shape: tuple[int, ...] = attrs.field(converter=_as_tuple)
    stride: tuple[int, ...] = attrs.field(converter=_as_tuple)
    storage_offset: int
    arena: int
    offset: int
    nbytes: int
    persistent: bool = True
    attributes: dict = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        fault = self._fault()
        if fault is not None:
            raise InvalidManifest(str(self.name), *fault)

    def _fault(self) -> tuple[str, str] | None:
        """``(field, problem)`` of the first fault that would stop a client viewing this record, or None."""
        if not isinstance(self.name, str) or not self.name:
            return "name", "must be a non-empty string"
        if self.kind not in KINDS:
            return "kind", f"{self.kind!r:.40} is not one of {', '.join(KINDS)}"
        if not isinstance(self.dtype, str) or self.dtype not in ITEM_SIZES:
            return "dtype", f"{self.dtype!r:.40} is not one of {', '.join(sorted(ITEM_SIZES))}"
        for field in _INDEX_FIELDS:
            value = getattr(self, field)
            if not _is_index(value):
                return field, _index_problem(value)
        for field in ("shape", "stride"):
            value = getattr(self, field)
            if not isinstance(value, tuple):
                return field, f"must be a list of integers, not {type(value).__name__}"
            for dim, item in enumerate(value):
                if not _is_index(item):
                    return field, f"dimension {dim} {_index_problem(item)}"
        if len(self.stride) != len(self.shape):
            return "stride", f"has {len(self.stride)} dimensions, shape has {len(self.shape)}"
        if not isinstance(self.persistent, bool):
            return "persistent", f"must be true or false, not {type(self.persistent).__name__}"
        if not isinstance(self.attributes, dict) or not all(isinstance(key, str) and key for key in self.attributes):
            return "attributes", "must be an object whose keys are attribute names"
        text = _attributes_json(self.attributes)
        if text is None:
            return "attributes", "must hold JSON values only (booleans, numbers, strings, lists, objects)"
        if len(text) > MAX_ATTRIBUTE_BYTES:
            return "attributes", f"hold more than {MAX_ATTRIBUTE_BYTES} bytes of JSON; only small flags belong there"
        itemsize = ITEM_SIZES[self.dtype]
        if self.offset % itemsize:
            return "offset", f"{self.offset} is not a multiple of {self.dtype}'s item size ({itemsize} bytes)"
        if self.nbytes % itemsize:
            return "nbytes", f"{self.nbytes} is not a multiple of {self.dtype}'s item size ({itemsize} bytes)"
        if _numel(self.shape) > MAX_INDEX:
            return "shape", f"{list(self.shape)} holds more than 2**63-1 elements"
        extent = self.extent_bytes
        if extent > self.nbytes:
            return "nbytes", (
                f"the view (shape {list(self.shape)}, stride {list(self.stride)}, storage_offset {self.storage_offset}) "
                f"reaches {extent} bytes into its region, which holds only {self.nbytes}"
            )
        return None

    @property
    def extent_bytes(self) -> int:
        """Bytes from the region's start up to the end of the view's last element (0 without elements)."""
        if 0 in self.shape:
            return 0
        last = self.storage_offset + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride, strict=True))
        return (last + 1) * ITEM_SIZES[self.dtype]

    def to_json(self) -> dict:
        data = {**attrs.asdict(self), "shape": list(self.shape), "stride": list(self.stride)}
        if not self.attributes:
            del data["attributes"]  # most tensors carry none: keep manifests small
        return data

    @classmethod
    def from_json(cls, data: dict) -> "TensorRecord":
        if not isinstance(data, dict):
            raise InvalidManifest("", "tensors", f"every record must be an object, not {type(data).__name__}")
        unknown, missing = data.keys() - _RECORD_FIELDS, _REQUIRED_RECORD_FIELDS.difference(data)
        if unknown or missing:
            name = data.get("name")
            raise InvalidManifest(
                name if isinstance(name, str) else "",
                ", ".join(sorted(unknown) + sorted(missing)),
                f"unknown fields {sorted(unknown)}, missing fields {sorted(missing)}",
            )
        return cls(**data)


_RECORD_FIELDS = frozenset(field.name for field in attrs.fields(TensorRecord))
_REQUIRED_RECORD_FIELDS = frozenset(field.name for field in attrs.fields(TensorRecord) if field.default is attrs.NOTHING)


@attrs.frozen
class Manifest:
    """Every tensor of one published model rank, its arenas, tied-weight aliases and adapter state.

    Constructing one checks everything a client needs to view it (docs/protocol.md, "Manifest"):
    a manifest that no client could view raises :class:`InvalidManifest`.

    :param aliases: alias name -> name of the tensor it shares (tied weights).
    :param extra: small JSON-able state an adapter needs to rebuild the model
        (model class, flags set by post-processing).
    """

    tensors: tuple[TensorRecord, ...] = attrs.field(converter=tuple)
    arenas: tuple[ArenaSpec, ...] = attrs.field(converter=tuple)
    aliases: dict = attrs.field(factory=dict, hash=False)
    extra: dict = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        names: set[str] = set()
        for record in self.tensors:
            if record.name in names:
                raise InvalidManifest(record.name, "name", "names a second tensor")
            names.add(record.name)
            if record.arena >= len(self.arenas):
                raise InvalidManifest(
                    record.name, "arena", f"{record.arena} is not below the manifest's {len(self.arenas)} arenas"
                )
            size = self.arenas[record.arena].size
            if record.offset + record.nbytes > size:
                raise InvalidManifest(
                    record.name,
                    "offset",
                    f"its region [{record.offset}, {record.offset + record.nbytes}) ends past arena {record.arena} ({size} bytes)",
                )
        if not isinstance(self.aliases, dict):
            raise InvalidManifest("", "aliases", f"must be an object, not {type(self.aliases).__name__}")
        for alias, target in self.aliases.items():
            if not isinstance(alias, str) or not isinstance(target, str):
                raise InvalidManifest("", "aliases", f"alias {alias!r:.80} -> {target!r:.80}: both must be strings")
            if alias in names:
                raise InvalidManifest(alias, "aliases", "an alias may not reuse a tensor's name")
            if target not in names:
                raise InvalidManifest("", "aliases", f"alias {alias!r:.80} points at unknown tensor {target!r:.80}")
        if not isinstance(self.extra, dict):
            raise InvalidManifest("", "extra", f"must be an object, not {type(self.extra).__name__}")

    @property
    def nbytes(self) -> int:
        """Bytes of all arenas together, as their specs declare them."""
        return sum(spec.size for spec in self.arenas)

    def arena_extents(self) -> tuple[int, ...]:
        """Per arena, the end of the last tensor region in it (0 for an arena no tensor uses)."""
        extents = [0] * len(self.arenas)
        for record in self.tensors:
            extents[record.arena] = max(extents[record.arena], record.offset + record.nbytes)
        return tuple(extents)

    def to_json(self) -> dict:
        return {
            "tensors": [record.to_json() for record in self.tensors],
            "arenas": [spec.to_json() for spec in self.arenas],
            "aliases": dict(self.aliases),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        """Parse and check a manifest from the wire; InvalidManifest (a ValueError) names the first fault."""
        if not isinstance(data, dict):
            raise InvalidManifest("", "manifest", f"must be an object, not {type(data).__name__}")
        for field in ("tensors", "arenas"):
            if not isinstance(data.get(field), list):
                raise InvalidManifest("", field, f"must be a list, not {type(data.get(field)).__name__}")
        arenas = []
        for index, spec in enumerate(data["arenas"]):
            try:
                arenas.append(ArenaSpec.from_json(spec))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise InvalidManifest("", f"arenas[{index}]", f"malformed arena spec ({exc!s:.200})") from None
        return cls(
            tensors=[TensorRecord.from_json(t) for t in data["tensors"]],
            arenas=arenas,
            aliases=data.get("aliases", {}),
            extra=data.get("extra", {}),
        )

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


def view_of(arena_bytes: "torch.Tensor", record: TensorRecord, typed_base: "torch.Tensor | None" = None) -> "torch.Tensor":
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
