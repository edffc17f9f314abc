"""The tensor table: every tensor record of a manifest in one compact binary blob (names in one section, numbers in columns).

A manifest's tensor records travel as this table in a sealed memfd, not as
JSON: the server checks it once at publish (:meth:`TensorTable.check`, torch-
and numpy-free), keeps the memfd and hands the same one to every engine that
attaches, which reads the columns without parsing a record at a time.
docs/protocol.md ("Tensor table") gives the layout.

Layout, native little-endian, after a 24-byte header ``<4sIIIII`` (magic
``WCT1``, records, dims, name bytes, meta bytes, 0), each section starting at a
multiple of 8 bytes:

    storage_offset int64[records]   offset int64[records]   nbytes int64[records]
    shape int64[dims]   stride int64[dims]                 (dims: the records' ndim summed)
    arena uint32[records]   attributes uint32[records]     (0: none; k: meta["attributes"][k-1])
    kind uint8[records]   dtype uint8[records]   ndim uint8[records]   persistent uint8[records]
    names: UTF-8, each name followed by one NUL
    meta: UTF-8 JSON {"dtypes": [dtype names the dtype column indexes], "attributes": [objects]}
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import sys
import typing

from weightcache.core.dtypes import ITEM_SIZES
from weightcache.core.errors import InvalidManifest

KINDS = ("parameter", "buffer", "attribute")
"""``attribute``: a plain tensor attribute of a module (``module.W_UV = tensor``), neither parameter nor buffer."""
MAX_INDEX = 2**63 - 1
"""Largest size, stride or offset: torch keeps them as int64."""
MAX_ATTRIBUTE_BYTES = 4096
"""Largest JSON text of one record's ``attributes`` (flags such as ``format_ue8m0``, not data)."""
MAX_TENSORS = 1 << 20
"""Most records one table holds (1,048,576): a whole 1 T-parameter MoE checkpoint holds ~140,000."""
MAX_NDIM = 64
"""Most dimensions of one tensor."""
MAX_TABLE_BYTES = 256 << 20
"""Largest table (its memfd) a server reads."""

MAGIC = b"WCT1"
HEADER = struct.Struct("<4sIIIII")
_ALIGN = 8
# Columns in the order they lie: (name, typecode, per record or per dimension).
_COLUMNS: tuple[tuple[str, typing.Literal["q", "I", "B"], str], ...] = (
    ("storage_offset", "q", "records"),
    ("offset", "q", "records"),
    ("nbytes", "q", "records"),
    ("shape", "q", "dims"),
    ("stride", "q", "dims"),
    ("arena", "I", "records"),
    ("attributes", "I", "records"),
    ("kind", "B", "records"),
    ("dtype", "B", "records"),
    ("ndim", "B", "records"),
    ("persistent", "B", "records"),
)
_WIDTHS = {"q": 8, "I": 4, "B": 1}


def _pad(size: int) -> int:
    return -size % _ALIGN


def table_bytes(records: int, dims: int, name_bytes: int, meta_bytes: int) -> int:
    """The exact size of a table with these counts."""
    size = HEADER.size
    for _, code, per in _COLUMNS:
        size += (records if per == "records" else dims) * _WIDTHS[code]
        size += _pad(size)
    return size + name_bytes + meta_bytes


class TensorTable:
    """A decoded table: columns as memoryviews over its bytes, names as a list of str.

    Decoding checks only the structure (header, section sizes, UTF-8, one name
    per record); :meth:`check` checks every record against the arenas.
    Raises :class:`InvalidManifest` (field ``tensors``) on a malformed blob.
    """

    # The columns (_COLUMNS), each a memoryview of ints over the table's bytes.
    storage_offset: memoryview
    offset: memoryview
    nbytes: memoryview
    shape: memoryview
    stride: memoryview
    arena: memoryview
    attributes: memoryview
    kind: memoryview
    dtype: memoryview
    ndim: memoryview
    persistent: memoryview

    def __init__(self, data: bytes):
        if sys.byteorder != "little":
            raise InvalidManifest("", "tensors", "tensor tables are little-endian; this host is not")
        self.data = data
        if len(data) < HEADER.size:
            raise InvalidManifest("", "tensors", f"a table holds at least {HEADER.size} bytes, not {len(data)}")
        magic, records, dims, name_bytes, meta_bytes, reserved = HEADER.unpack_from(data)
        if magic != MAGIC or reserved:
            raise InvalidManifest("", "tensors", f"bad table magic {magic!r}: not a weightcache tensor table")
        if records > MAX_TENSORS:
            raise InvalidManifest(
                "", "tensors", f"{records} records exceed the {MAX_TENSORS} a table may hold; split the model into more ranks"
            )
        if dims > records * MAX_NDIM:
            raise InvalidManifest("", "tensors", f"{dims} dimensions for {records} records: more than {MAX_NDIM} each")
        expected = table_bytes(records, dims, name_bytes, meta_bytes)
        if len(data) != expected:
            raise InvalidManifest("", "tensors", f"the table is {len(data)} bytes, its header says {expected}")
        self.count = records
        self.dims = dims
        self._starts: list[int] | None = None
        view = memoryview(data)
        position = HEADER.size
        for name, code, per in _COLUMNS:
            length = (records if per == "records" else dims) * _WIDTHS[code]
            setattr(self, name, view[position : position + length].cast(code))
            position += length + _pad(position + length)
        blob = data[position : position + name_bytes]
        if (records and not blob.endswith(b"\0")) or blob.count(b"\0") != records:
            raise InvalidManifest("", "tensors", f"the name section must hold {records} NUL-terminated names")
        if blob.startswith(b"\0") or b"\0\0" in blob:
            raise InvalidManifest(self._first_empty_name(blob), "name", "must be a non-empty string")
        try:
            self.names: list[str] = blob.decode("utf-8").split("\0")[:-1] if records else []
            meta = json.loads(data[position + name_bytes :].decode("utf-8")) if meta_bytes else {}
        except UnicodeDecodeError as exc:
            raise InvalidManifest("", "tensors", f"names and meta must be UTF-8 ({exc})") from None
        except (ValueError, RecursionError) as exc:
            raise InvalidManifest("", "tensors", f"the table's meta is not JSON ({exc!s:.200})") from None
        if not isinstance(meta, dict) or set(meta) - {"dtypes", "attributes"}:
            raise InvalidManifest("", "tensors", "the table's meta must be an object with only 'dtypes' and 'attributes'")
        self.dtypes = meta.get("dtypes", [])
        self.attribute_sets = meta.get("attributes", [])
        if not isinstance(self.dtypes, list) or not isinstance(self.attribute_sets, list):
            raise InvalidManifest("", "tensors", "the table's meta 'dtypes' and 'attributes' must be lists")

    def _first_empty_name(self, blob: bytes) -> str:
        """The name before the first empty one (for the message), or '' when the first is empty."""
        if blob.startswith(b"\0"):
            return ""
        return blob[: blob.index(b"\0\0")].rsplit(b"\0", 1)[-1].decode("utf-8", "replace")

    @classmethod
    def encode(
        cls,
        names: typing.Sequence[str],
        kinds: typing.Iterable[str],
        dtypes: typing.Iterable[str],
        shapes: typing.Sequence[typing.Sequence[int]],
        strides: typing.Iterable[typing.Sequence[int]],
        storage_offsets: typing.Iterable[int],
        arenas: typing.Iterable[int],
        offsets: typing.Iterable[int],
        nbytes: typing.Iterable[int],
        persistent: typing.Iterable[bool],
        attributes: typing.Iterable[dict],
    ) -> "TensorTable":
        """The table of these columns (one item per record). Values are stored as given, unchecked:
        OverflowError for one no column can hold; :meth:`check` says what a client could not view."""
        import array

        dtype_codes: dict[str, int] = {}
        attribute_codes: dict[str, int] = {}
        attribute_sets: list[dict] = []

        def attribute_code(value: dict) -> int:
            if not value:
                return 0
            key = json.dumps(value, sort_keys=True)
            code = attribute_codes.get(key)
            if code is None:
                attribute_sets.append(value)
                code = attribute_codes[key] = len(attribute_sets)
            return code

        kind_codes = {kind: code for code, kind in enumerate(KINDS)}
        shapes = list(shapes)
        columns = {
            "storage_offset": array.array("q", storage_offsets),
            "offset": array.array("q", offsets),
            "nbytes": array.array("q", nbytes),
            "shape": array.array("q", itertools.chain.from_iterable(shapes)),
            "stride": array.array("q", itertools.chain.from_iterable(strides)),
            "arena": array.array("I", arenas),
            "attributes": array.array("I", map(attribute_code, attributes)),
            "kind": array.array("B", (kind_codes.get(kind, 255) for kind in kinds)),
            "dtype": array.array("B", (dtype_codes.setdefault(d, len(dtype_codes)) for d in dtypes)),
            "ndim": array.array("B", map(len, shapes)),
            "persistent": array.array("B", persistent),
        }
        if len(columns["stride"]) != len(columns["shape"]):
            raise ValueError("every record's stride must have as many dimensions as its shape")
        names_blob = "".join(name + "\0" for name in names).encode("utf-8")
        meta = json.dumps({"dtypes": list(dtype_codes), "attributes": attribute_sets}, separators=(",", ":")).encode()
        records, dims = len(columns["kind"]), len(columns["shape"])
        parts = [HEADER.pack(MAGIC, records, dims, len(names_blob), len(meta), 0)]
        size = HEADER.size
        for name, _, _ in _COLUMNS:
            raw = columns[name].tobytes()
            size += len(raw)
            parts += [raw, b"\0" * _pad(size)]
            size += _pad(size)
        return cls(b"".join([*parts, names_blob, meta]))

    def check(self, arena_sizes: typing.Sequence[int]) -> None:
        """Raise :class:`InvalidManifest` naming the first record (and field) no client could view in arenas of ``arena_sizes``.

        Each rule is screened over a whole column at C speed (``min``/``max``/``map``);
        only the strided extent walks the records one by one, and memory stays
        within a few words per record (docs/protocol.md, "Tensor table").
        """
        names, count = self.names, self.count
        if len(set(names)) != count:
            seen: set[str] = set()
            for name in names:
                if name in seen:
                    raise InvalidManifest(name, "name", "names a second tensor")
                seen.add(name)
        if len(self.dtypes) > 255 or len(set(map(repr, self.dtypes))) != len(self.dtypes):
            raise InvalidManifest("", "tensors", f"meta dtypes {self.dtypes!r:.200} must be distinct")
        self._screen("kind", self.kind, lambda code: code < len(KINDS), lambda c: f"code {c} is not one of {KINDS}")
        self._screen(
            "dtype", self.dtype, lambda code: code < len(self.dtypes), lambda c: f"code {c} indexes none of the table's dtypes"
        )
        for code, name in enumerate(self.dtypes):
            if not isinstance(name, str) or name not in ITEM_SIZES:
                raise InvalidManifest(
                    self._user(self.dtype, code), "dtype", f"{name!r:.40} is not one of {', '.join(sorted(ITEM_SIZES))}"
                )
        for index, value in enumerate(self.attribute_sets):
            problem = _attribute_set_problem(value)
            if problem is not None:
                raise InvalidManifest(self._user(self.attributes, index + 1), "attributes", problem)
        self._screen("persistent", self.persistent, lambda flag: flag <= 1, lambda f: f"must be 0 or 1, not {f}")
        self._screen("shape", self.ndim, lambda ndim: ndim <= MAX_NDIM, lambda n: f"has {n} dimensions, more than {MAX_NDIM}")
        if sum(self.ndim) != self.dims:
            raise InvalidManifest(
                "", "tensors", f"the records' dimensions add up to {sum(self.ndim)}, the header says {self.dims}"
            )
        sets = len(self.attribute_sets)
        self._screen("attributes", self.attributes, lambda code: code <= sets, lambda c: f"set {c} is not in the table's meta")
        for field in ("storage_offset", "offset", "nbytes"):
            self._screen(field, getattr(self, field), lambda v: v >= 0, lambda v: f"must not be negative, got {v}")
        self._screen(
            "arena",
            self.arena,
            lambda a: a < len(arena_sizes),
            lambda a: f"{a} is not below the manifest's {len(arena_sizes)} arenas",
        )
        for field in ("shape", "stride"):
            column = getattr(self, field)
            if column and min(column) < 0:
                self._dimension_fault(field)
        self._check_regions(arena_sizes)

    def _screen(self, field: str, column, ok, problem) -> None:
        """Every value of ``column`` passes ``ok`` (screened by its extremes), else InvalidManifest for the first that fails."""
        if not column or (ok(min(column)) and ok(max(column))):
            return
        for index, value in enumerate(column):
            if not ok(value):
                raise InvalidManifest(self.names[index], field, problem(value))

    def _user(self, column, code: int) -> str:
        """The name of the first record whose ``column`` holds ``code`` ('' when none does)."""
        for index, value in enumerate(column):
            if value == code:
                return self.names[index]
        return ""

    def _dimension_fault(self, field: str) -> typing.NoReturn:
        column, position = getattr(self, field), 0
        for index, ndim in enumerate(self.ndim):
            for dim in range(ndim):
                if column[position + dim] < 0:
                    raise InvalidManifest(
                        self.names[index], field, f"dimension {dim} must not be negative, got {column[position + dim]}"
                    )
            position += ndim
        raise AssertionError("no negative dimension found")

    def _check_regions(self, arena_sizes: typing.Sequence[int]) -> None:
        """Item-size multiples, element count, strided extent within the region, region within the arena."""
        itemsizes = [ITEM_SIZES[name] for name in self.dtypes]
        shape, stride = self.shape, self.stride
        position = 0
        for index, (ndim, code, storage_offset, offset, nbytes, arena) in enumerate(
            zip(self.ndim, self.dtype, self.storage_offset, self.offset, self.nbytes, self.arena, strict=True)
        ):
            itemsize = itemsizes[code]
            end = position + ndim
            sizes = shape[position:end]
            problem = None
            if offset % itemsize:
                problem = "offset", f"{offset} is not a multiple of {self.dtypes[code]}'s item size ({itemsize} bytes)"
            elif nbytes % itemsize:
                problem = "nbytes", f"{nbytes} is not a multiple of {self.dtypes[code]}'s item size ({itemsize} bytes)"
            elif 0 in sizes:
                pass
            elif math.prod(sizes) > MAX_INDEX:
                problem = "shape", f"{list(sizes)} holds more than 2**63-1 elements"
            else:
                last = storage_offset + sum(map(_reach, sizes, stride[position:end]))
                if (last + 1) * itemsize > nbytes:
                    problem = (
                        "nbytes",
                        (
                            f"the view (shape {list(sizes)}, stride {list(stride[position:end])}, storage_offset {storage_offset}) "
                            f"reaches {(last + 1) * itemsize} bytes into its region, which holds only {nbytes}"
                        ),
                    )
            if problem is None and offset + nbytes > arena_sizes[arena]:
                problem = (
                    "offset",
                    (f"its region [{offset}, {offset + nbytes}) ends past arena {arena} ({arena_sizes[arena]} bytes)"),
                )
            if problem is not None:
                raise InvalidManifest(self.names[index], *problem)
            position = end

    def extents(self, arenas: int) -> tuple[int, ...]:
        """Per arena, the end of the last tensor region in it (0 for an arena no tensor uses)."""
        ends = [0] * arenas
        for arena, offset, nbytes in zip(self.arena, self.offset, self.nbytes, strict=True):
            if offset + nbytes > ends[arena]:
                ends[arena] = offset + nbytes
        return tuple(ends)

    def dims_of(self, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Record ``index``'s shape and stride."""
        starts = self.starts()
        return tuple(self.shape[starts[index] : starts[index + 1]]), tuple(self.stride[starts[index] : starts[index + 1]])

    def starts(self) -> list[int]:
        """Where each record's dimensions start in ``shape``/``stride``, and one past the last (computed once)."""
        if self._starts is None:
            self._starts = list(itertools.accumulate(self.ndim, initial=0))
        return self._starts


def numel(shape: typing.Iterable[int]) -> int:
    """Elements of a tensor of ``shape``."""
    return math.prod(shape)


def contiguous_stride(shape: typing.Sequence[int]) -> tuple[int, ...]:
    """The stride of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _reach(size: int, stride: int) -> int:
    return (size - 1) * stride


def _attribute_set_problem(value) -> str | None:
    """Why ``value`` cannot be a record's ``attributes``, or None."""
    if not isinstance(value, dict) or not all(isinstance(key, str) and key for key in value):
        return "must be an object whose keys are attribute names"
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return "must hold JSON values only (booleans, numbers, strings, lists, objects)"
    if len(text) > MAX_ATTRIBUTE_BYTES:
        return f"hold more than {MAX_ATTRIBUTE_BYTES} bytes of JSON; only small flags belong there"
    return None
