"""The manifest: where every tensor of a published model lies in its arenas.

Its tensor records live in a :class:`~weightcache.core.layout.tensor_table.TensorTable`
(compact columns, checked in one pass); :class:`TensorRecord` is one record as
an object, for the publishers that build them and the JSON form (docs, seeding).
"""

from __future__ import annotations

import collections.abc
import typing

import attrs

from weightcache.core.arena.base import ArenaSpec
from weightcache.core.dtypes import ITEM_SIZES
from weightcache.core.errors import InvalidManifest
from weightcache.core.layout.tensor_table import KINDS, MAX_ATTRIBUTE_BYTES, MAX_INDEX, TensorTable, numel
from weightcache.core.layout.views import MappedTensors, UnmadeTensors

if typing.TYPE_CHECKING:
    from weightcache.core.arena.base import Arena

__all__ = ["KINDS", "MAX_ATTRIBUTE_BYTES", "MAX_INDEX", "Manifest", "Records", "TensorRecord"]

_INDEX_FIELDS = ("storage_offset", "arena", "offset", "nbytes")


def _as_tuple(value):
    """A list or tuple becomes a tuple; anything else is kept for the record's check to refuse (never coerced)."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _specs(value: typing.Iterable[ArenaSpec]) -> tuple[ArenaSpec, ...]:
    return tuple(value)


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
        if numel(self.shape) > MAX_INDEX:
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


class Records(collections.abc.Sequence):
    """A manifest's tensor records: its table, plus the record objects it was built from (else made on demand).

    ``trusted``: the table was checked already (by the server, before any
    client saw it), so a manifest made from it checks nothing again.
    """

    def __init__(self, table: TensorTable, records: "tuple[TensorRecord, ...] | None" = None, trusted: bool = False):
        self.table = table
        self._records = records
        self.trusted = trusted

    @classmethod
    def from_records(cls, records: "typing.Iterable[TensorRecord]") -> "Records":
        records = tuple(records)
        for record in records:
            if not isinstance(record, TensorRecord):
                raise InvalidManifest("", "tensors", f"every record must be a TensorRecord, not {type(record).__name__}")
        table = TensorTable.encode(
            names=[r.name for r in records],
            kinds=[r.kind for r in records],
            dtypes=[r.dtype for r in records],
            shapes=[r.shape for r in records],
            strides=[r.stride for r in records],
            storage_offsets=[r.storage_offset for r in records],
            arenas=[r.arena for r in records],
            offsets=[r.offset for r in records],
            nbytes=[r.nbytes for r in records],
            persistent=[r.persistent for r in records],
            attributes=[r.attributes for r in records],
        )
        return cls(table, records)

    def __len__(self) -> int:
        return self.table.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if self._records is None:
            self._records = tuple(self._materialize())
        return self._records[index]

    def __iter__(self):
        return iter(self[:] if self._records is None else self._records)

    def __eq__(self, other) -> bool:
        if isinstance(other, Records) and other.table.data == self.table.data:
            return True
        return isinstance(other, collections.abc.Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<Records of {len(self)} tensors>"

    def _materialize(self) -> "typing.Iterator[TensorRecord]":
        table = self.table
        starts = table.starts()
        sets = table.attribute_sets
        for index, name in enumerate(table.names):
            begin, end = starts[index], starts[index + 1]
            attribute = table.attributes[index]
            yield TensorRecord(
                name=name,
                kind=KINDS[table.kind[index]],
                dtype=table.dtypes[table.dtype[index]],
                shape=tuple(table.shape[begin:end]),
                stride=tuple(table.stride[begin:end]),
                storage_offset=table.storage_offset[index],
                arena=table.arena[index],
                offset=table.offset[index],
                nbytes=table.nbytes[index],
                persistent=bool(table.persistent[index]),
                attributes=dict(sets[attribute - 1]) if attribute else {},
            )


def _as_records(value) -> Records:
    return value if isinstance(value, Records) else Records.from_records(value)


@attrs.frozen
class Manifest:
    """Every tensor of one published model rank, its arenas, tied-weight aliases and adapter state.

    Constructing one checks everything a client needs to view it (docs/protocol.md, "Manifest"):
    a manifest that no client could view raises :class:`InvalidManifest`.

    :param tensors: the records (TensorRecord objects, or a table's :class:`Records`).
    :param aliases: alias name -> name of the tensor it shares (tied weights).
    :param extra: small JSON-able state an adapter needs to rebuild the model
        (model class, flags set by post-processing).
    """

    tensors: Records = attrs.field(converter=_as_records)
    arenas: tuple[ArenaSpec, ...] = attrs.field(converter=_specs)
    aliases: dict = attrs.field(factory=dict, hash=False)
    extra: dict = attrs.field(factory=dict, hash=False)

    def __attrs_post_init__(self) -> None:
        if self.tensors.trusted:
            return
        self.table.check([spec.size for spec in self.arenas])
        if not isinstance(self.aliases, dict):
            raise InvalidManifest("", "aliases", f"must be an object, not {type(self.aliases).__name__}")
        names = set(self.table.names) if self.aliases else set()
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
    def table(self) -> TensorTable:
        """The tensor records as columns (what travels on the wire)."""
        return self.tensors.table

    @property
    def names(self) -> list[str]:
        """The tensors' names, in record order (no record objects made)."""
        return self.table.names

    @property
    def nbytes(self) -> int:
        """Bytes of all arenas together, as their specs declare them."""
        return sum(spec.size for spec in self.arenas)

    def arena_extents(self) -> tuple[int, ...]:
        """Per arena, the end of the last tensor region in it (0 for an arena no tensor uses)."""
        return self.table.extents(len(self.arenas))

    def to_json(self) -> dict:
        """The whole manifest as JSON, a record per tensor (docs, seeding; the wire carries :meth:`to_wire`)."""
        return {
            "tensors": [record.to_json() for record in self.tensors],
            "arenas": [spec.to_json() for spec in self.arenas],
            "aliases": dict(self.aliases),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        """Parse and check a manifest's JSON form; InvalidManifest (a ValueError) names the first fault."""
        if not isinstance(data, dict):
            raise InvalidManifest("", "manifest", f"must be an object, not {type(data).__name__}")
        if not isinstance(data.get("tensors"), list):
            raise InvalidManifest("", "tensors", f"must be a list, not {type(data.get('tensors')).__name__}")
        return cls(
            tensors=[TensorRecord.from_json(t) for t in data["tensors"]],
            arenas=_arenas(data),
            aliases=data.get("aliases", {}),
            extra=data.get("extra", {}),
        )

    def to_wire(self) -> tuple[dict, bytes]:
        """What a publish carries: the small JSON part (arenas, aliases, extra, the table's size) and the table's bytes."""
        table = self.table
        return {
            "tensors": {"records": table.count, "bytes": len(table.data)},
            "arenas": [spec.to_json() for spec in self.arenas],
            "aliases": dict(self.aliases),
            "extra": dict(self.extra),
        }, table.data

    @classmethod
    def from_wire(cls, data: dict, table: bytes, trusted: bool = False) -> "Manifest":
        """The manifest of a publish or an attach reply: its JSON part and its table's bytes.

        The server checks every record (``trusted=False``); an engine takes
        what its server checked (``trusted=True``: structure only, no record
        checked again; torch still refuses any view outside its arena).
        """
        if not isinstance(data, dict):
            raise InvalidManifest("", "manifest", f"must be an object, not {type(data).__name__}")
        summary = data.get("tensors")
        if not isinstance(summary, dict) or summary.get("bytes") != len(table):
            raise InvalidManifest("", "tensors", f"must say the table's size ({len(table)} bytes), not {summary!r:.120}")
        parsed = TensorTable(table)
        if summary.get("records") != parsed.count:
            raise InvalidManifest("", "tensors", f"says {summary.get('records')!r:.40} records, the table holds {parsed.count}")
        return cls(
            tensors=Records(parsed, trusted=trusted),
            arenas=_arenas(data),
            aliases=data.get("aliases", {}),
            extra=data.get("extra", {}),
        )

    def layout_difference(self, other: "Manifest") -> str | None:
        """The first way ``other`` lays its tensors out differently from this manifest (a sentence), or None.

        Everything but the arenas' bytes counts: the records (name, kind, dtype, shape, stride, place), the arenas'
        number, backend, size and device, the aliases and the adapter's extra state. Two manifests without a difference
        can show each other's bytes at the same addresses (a refit's switch).
        """
        mine, theirs = [spec.to_json() for spec in self.arenas], [spec.to_json() for spec in other.arenas]
        for spec in (*mine, *theirs):
            spec.pop("checksum", None)
        if len(mine) != len(theirs):
            return f"{len(theirs)} arenas instead of {len(mine)}"
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if a != b:
                return f"arena {index} is {b} instead of {a}"
        if self.table.data != other.table.data:
            return _first_record_difference(self.tensors, other.tensors)
        if self.aliases != other.aliases:
            return f"tied weights {other.aliases} instead of {self.aliases}"
        if self.extra != other.extra:
            keys = sorted(k for k in set(self.extra) | set(other.extra) if self.extra.get(k) != other.extra.get(k))
            return (
                f"the adapter's state {keys[0]!r} is {other.extra.get(keys[0])!r:.80} instead of {self.extra.get(keys[0])!r:.80}"
            )
        return None

    def views(self, arenas: "typing.Sequence[Arena]") -> "MappedTensors":
        """Tensors viewing the mapped ``arenas`` (no copy), aliases included: a dict that remembers the table and arenas
        (``rebind_module`` makes its Parameters from them in batches) and makes its own tensors on its first read."""
        if len(arenas) != len(self.arenas):
            raise ValueError(f"manifest has {len(self.arenas)} arenas, {len(arenas)} were mapped")
        return UnmadeTensors.of(self.table, [arena.bytes_view() for arena in arenas], dict(self.aliases))


def _first_record_difference(mine: Records, theirs: Records) -> str:
    """The first record of ``theirs`` that differs from ``mine`` (same position), as a sentence."""
    by_name = {record.name: record for record in mine}
    for index, record in enumerate(theirs):
        if index >= len(mine):
            return f"tensor {record.name!r} is not in the model"
        expected = by_name.get(record.name)
        if expected is None:
            return f"tensor {record.name!r} is not in the model"
        if record != expected or mine[index].name != record.name:
            for field in attrs.fields(TensorRecord):
                a, b = getattr(expected, field.name), getattr(record, field.name)
                if a != b:
                    return f"tensor {record.name!r} has {field.name} {b!r:.80} instead of {a!r:.80}"
            return f"tensor {record.name!r} comes at position {index} instead of {mine[index].name!r}"
    missing = [record.name for record in mine[len(theirs) :]]
    return f"tensor {missing[0]!r} is missing" if missing else "the tensor tables differ"


def _arenas(data: dict) -> list[ArenaSpec]:
    if not isinstance(data.get("arenas"), list):
        raise InvalidManifest("", "arenas", f"must be a list, not {type(data.get('arenas')).__name__}")
    arenas = []
    for index, spec in enumerate(data["arenas"]):
        try:
            arenas.append(ArenaSpec.from_json(spec))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidManifest("", f"arenas[{index}]", f"malformed arena spec ({exc!s:.200})") from None
    return arenas
