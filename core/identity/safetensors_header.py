"""The rules a safetensors header must meet before any byte of its file is trusted: safetensors' own.

A safetensors file is an 8-byte length, a JSON header and the data. safetensors' reader (``read_metadata`` and
``Metadata::validate`` in its Rust crate) refuses a header that is not UTF-8, not JSON, nested more than 127 levels
deep, longer than 100,000,000 bytes; ``__metadata__`` other than a map of strings to strings; a record without a
string dtype, a shape of integers and two integer data offsets; a shape whose element count overflows 64 bits; a
record whose bytes disagree with its dtype and shape; and offsets that, sorted, do not tile the data from its first
byte to its last (an overlap, a hole, a gap at the end). ``parse`` applies the same rules, so that weightcache refuses
what a disk load refuses and accepts what it accepts, with two refusals of its own: a tensor named twice (safetensors
keeps the last record without a word; another reader could keep the first) and a dtype weightcache does not handle.
No file is read here: ``safetensors_io.read_header`` reads the bytes and names the file in the error.
"""

from __future__ import annotations

import json
import math
import re
import typing

import attrs

from weightcache.core.dtypes import item_size

MAX_HEADER_BYTES = 100_000_000
"""safetensors' limit on a header's length."""

MAX_DEPTH = 127
"""The deepest nesting of JSON arrays and objects safetensors parses (the header's own object is level 1)."""

U64_MAX = (1 << 64) - 1

# safetensors dtype codes -> torch dtype names
ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

METADATA = "__metadata__"
FIELDS = ("dtype", "shape", "data_offsets")
NOT_JSON = "its header is not a safetensors JSON object"


class HeaderProblem(ValueError):
    """What is wrong with a header, in words; ``fix`` says what to do when it is not a damaged file's usual advice."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem)


@attrs.frozen
class Record:
    """One tensor's record: its name, torch dtype name, shape and bytes ``begin``..``end`` of the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@attrs.frozen
class Parsed:
    """A header that meets the rules: its records in data order, its metadata and where its last tensor ends."""

    records: tuple[Record, ...]
    metadata: dict[str, str]
    data_bytes: int


def parse(raw: bytes) -> Parsed:
    """The header ``raw`` (the JSON between the length and the data) checked against safetensors' rules.

    HeaderProblem names the first rule broken. The data region's own length is the caller's to compare with
    ``data_bytes`` (the rules ask that the last tensor end where the file ends).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HeaderProblem("its header is not UTF-8 text") from None
    _check_nesting(raw)
    try:
        header = json.loads(text, object_pairs_hook=_object, parse_constant=_no_constant, **_number_hooks(text))
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise HeaderProblem(NOT_JSON)
    if _UTF16_ESCAPE.search(text) and _holds_lone_surrogate(header):
        raise HeaderProblem("its header holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is no character")
    twice = _duplicates(header)
    if twice:
        name = sorted(twice)[0]
        raise HeaderProblem(
            f"its header has {METADATA} twice" if name == METADATA else f"its header names tensor {name!r:.120} twice"
        )
    metadata = header.pop(METADATA, None)
    if metadata is None:
        metadata = {}
    elif not (isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())):
        raise HeaderProblem(f"its header's {METADATA} is not a map of strings to strings")
    records = sorted((_record(name, info) for name, info in header.items()), key=lambda r: (r.begin, r.end))
    return Parsed(tuple(records), dict(metadata), _check_tiling(records))


def _record(name: str, info: typing.Any) -> Record:
    """One tensor's record, typed; HeaderProblem names the tensor and what is wrong with it."""
    malformed = HeaderProblem(
        f"the header's record of tensor {name!r:.120} is malformed (it needs dtype, shape and data_offsets)"
    )
    if not isinstance(info, dict) or not all(field in info for field in FIELDS):
        raise malformed
    twice = sorted(_duplicates(info) & set(FIELDS))
    if twice:
        raise HeaderProblem(f"the header's record of tensor {name!r:.120} gives {twice[0]} twice")
    code, shape, offsets = _dtype_code(info["dtype"]), info["shape"], info["data_offsets"]
    if code is None or not _integers(shape) or not (_integers(offsets) and len(offsets) == 2):
        raise malformed
    dtype = ST_DTYPES.get(code)
    if dtype is None:
        raise HeaderProblem(
            f"tensor {name!r:.120} has dtype {code!r:.40}, which weightcache does not handle",
            fix=f"use a checkpoint whose tensors are {', '.join(sorted(ST_DTYPES))}",
        )
    begin, end = offsets
    elements = 1
    for size in shape:  # in order, as safetensors multiplies: an overflow before a zero still counts
        elements *= size
        if elements > U64_MAX:
            break
    if elements * item_size(dtype) * 8 > U64_MAX:  # safetensors counts bits
        raise HeaderProblem(f"tensor {name!r:.120} has shape {shape!s:.80}, whose size overflows 64 bits")
    if end < begin:
        raise HeaderProblem(f"tensor {name!r:.120}'s data offsets end ({end:,}) before they begin ({begin:,})")
    needed = elements * item_size(dtype)
    if end - begin != needed:
        raise HeaderProblem(f"tensor {name!r:.120} spans {end - begin:,} bytes but its dtype and shape need {needed:,}")
    return Record(name, dtype, tuple(shape), begin, end)


def _check_tiling(records: list[Record]) -> int:
    """Where the data ends; HeaderProblem unless the records, in data order, cover it from byte 0 without overlap or hole."""
    end, previous = 0, None
    for record in records:
        if previous is not None and record.begin < end:
            raise HeaderProblem(
                f"tensor {record.name!r:.120} starts at byte {record.begin:,} of the data, inside tensor "
                f"{previous.name!r:.120} (bytes {previous.begin:,}..{previous.end:,}): their offsets overlap"
            )
        if record.begin > end:
            where = f"after tensor {previous.name!r:.120}" if previous is not None else "at the start of the data"
            raise HeaderProblem(
                f"{record.begin - end:,} bytes {where} belong to no tensor (a hole before tensor {record.name!r:.120})"
            )
        end, previous = record.end, record
    return end


def _dtype_code(value: typing.Any) -> str | None:
    """A record's dtype code: a string, or serde's other spelling of it, a one-key map to null (``{"F32": null}``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1 and not _duplicates(value):
        (code, unit), *_ = value.items()
        return code if unit is None else None
    return None


def _integers(value: typing.Any) -> bool:
    """Whether ``value`` is a JSON array of unsigned 64-bit integers (not booleans, not floats such as 1.0)."""
    return isinstance(value, list) and all(type(n) is int and 0 <= n <= U64_MAX for n in value)


class _Repeated(dict):
    """A JSON object that gave some of its keys more than once (the last value kept, as json and serde do)."""

    twice: frozenset[str] = frozenset()


def _object(pairs: list[tuple[str, typing.Any]]) -> dict:
    found = dict(pairs)
    if len(found) == len(pairs):
        return found
    repeated = _Repeated(found)
    seen: set[str] = set()
    twice: set[str] = set()
    for key, _ in pairs:
        (twice if key in seen else seen).add(key)
    repeated.twice = frozenset(twice)
    return repeated


def _duplicates(value: dict) -> frozenset[str]:
    """The keys the JSON object ``value`` gave more than once."""
    return value.twice if isinstance(value, _Repeated) else frozenset()


def _no_constant(name: str) -> typing.NoReturn:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A JSON number with a fraction or an exponent; ValueError where it overflows a double (serde's 'out of range')."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range")
    return value


def _integer(digits: str) -> int | float:
    """A JSON integer as serde reads it: up to 2**64 - 1 an integer, else (negative, ``-0``, larger) a double, refused
    where even a double overflows."""
    if not digits.startswith("-"):
        value = int(digits)
        if value <= U64_MAX:
            return value
    return _finite(digits)


_SERDE_INTEGER = re.compile(r"-[0-9]|[0-9]{20}")


def _number_hooks(text: str) -> dict:
    """``json.loads`` hooks for numbers: doubles that do not overflow, integers as ``_integer`` reads them.

    The integer hook costs a Python call per integer, so it is passed only where a negative or a 20-digit integer
    can occur; every other integer reads the same either way.
    """
    hooks: dict[str, typing.Callable] = {"parse_float": _finite}
    if _SERDE_INTEGER.search(text):
        hooks["parse_int"] = _integer
    return hooks


_UTF16_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _holds_lone_surrogate(value: typing.Any) -> bool:
    """Whether a string anywhere in the parsed ``value`` (keys too) holds an unpaired surrogate (no UTF-8 for it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(key) or _holds_lone_surrogate(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_lone_surrogate(item) for item in value)
    return False


_BRACKETS_AND_QUOTES = bytes(range(256)).translate(None, b'[]{}"')
_STRING = re.compile(rb'"[^"]*"')
_INNERMOST = re.compile(rb"\[\]|\{\}")


def _check_nesting(raw: bytes) -> None:
    """HeaderProblem where the JSON nests deeper than ``MAX_DEPTH`` (or its brackets do not pair up), before any parse
    recurses into it.

    Escaped backslashes and quotes go first, then every byte but brackets and quotes, then the strings; each pass of
    ``_INNERMOST`` then removes the innermost pairs, one level of nesting per pass.
    """
    shape = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _BRACKETS_AND_QUOTES)
    shape = _STRING.sub(b"", shape)
    for _ in range(MAX_DEPTH):
        if not shape:
            return
        inner = _INNERMOST.sub(b"", shape)
        if inner == shape:
            raise HeaderProblem(NOT_JSON)  # brackets that do not pair up
        shape = inner
    if shape:
        raise HeaderProblem(f"its header's JSON nests deeper than {MAX_DEPTH} levels, more than safetensors reads")
