"""Reading safetensors checkpoints: headers, checkpoint identity, bytes straight into arenas."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import attrs

from weightcache.core.dtypes import item_size
from weightcache.core.errors import CheckpointNotFound, InvalidCheckpoint
from weightcache.core.identity.digests import SCHEME, DigestStore, FileKey, ProgressLike, checkpoint_digests

MAX_HEADER_BYTES = 100 << 20

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


@attrs.frozen
class TensorInfo:
    """One tensor in a safetensors file: where its bytes lie and what they are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in the file
    nbytes: int


@attrs.frozen
class Header:
    """One safetensors file's header: its raw bytes and its tensors."""

    file: Path
    raw: bytes = attrs.field(repr=False)
    tensors: tuple[TensorInfo, ...]
    metadata: dict = attrs.field(factory=dict, hash=False)
    key: FileKey | None = attrs.field(default=None, eq=False)
    """The version of the file the header was read from."""


def read_header(file: str | os.PathLike) -> Header:
    """Parse and check the header of one safetensors file (reads only the header).

    Raises InvalidCheckpoint when the header is not safetensors or a tensor's record is
    malformed or has a dtype weightcache does not handle. The data region is not checked
    here (``check_checkpoint`` compares it with the file's length).
    """
    file = Path(file)
    with open(file, "rb") as fh:
        key = FileKey.of_fd(fh.fileno())
        length = key.st_size
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise InvalidCheckpoint(file, f"{length} bytes long, too short for a safetensors file")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER_BYTES or 8 + size > length:
            raise InvalidCheckpoint(
                file, f"it declares a {size:,}-byte header but is {length:,} bytes long: not a safetensors file"
            )
        raw = fh.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise InvalidCheckpoint(file, "its header is not a safetensors JSON object")
    data_start = 8 + size
    metadata = header.pop("__metadata__", None) or {}
    tensors = [_tensor_info(file, name, info, data_start) for name, info in header.items()]
    return Header(file=file, raw=prefix + raw, tensors=tuple(sorted(tensors, key=lambda t: t.start)), metadata=metadata, key=key)


def _tensor_info(file: Path, name: str, info, data_start: int) -> TensorInfo:
    """One header record as a TensorInfo; InvalidCheckpoint names the tensor and what is wrong with its record."""
    try:
        stored, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        valid = all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)) and begin <= end
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        raise InvalidCheckpoint(
            file, f"the header's record of tensor {name!r:.120} is malformed (it needs dtype, shape and data_offsets)"
        )
    dtype = ST_DTYPES.get(stored)
    if dtype is None:
        raise InvalidCheckpoint(
            file,
            f"tensor {name!r:.120} has dtype {stored!r:.40}, which weightcache does not handle",
            fix=f"use a checkpoint whose tensors are {', '.join(sorted(ST_DTYPES))}",
        )
    expected = math.prod(shape) * item_size(dtype)
    if end - begin != expected:
        raise InvalidCheckpoint(
            file, f"tensor {name!r:.120} spans {end - begin:,} bytes but its dtype and shape need {expected:,}"
        )
    return TensorInfo(name, dtype, shape, file, data_start + begin, end - begin)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded via index.json, or every *.safetensors).

    Raises CheckpointNotFound when ``path`` does not exist, holds no safetensors file or
    lacks a shard its index names.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointNotFound(path, "a file, but not a *.safetensors file")
        return [path]
    if not path.exists():
        raise CheckpointNotFound(path, "no such file or directory")
    if not path.is_dir():
        raise CheckpointNotFound(path, "not a file or directory")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InvalidCheckpoint(index, "not a safetensors index (a JSON object with a weight_map)") from None
        files = [path / name for name in names]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise CheckpointNotFound(path, f"{len(missing)} shards its index names are missing ({', '.join(missing[:3])})")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        contents = "it is empty" if not any(path.iterdir()) else "it holds no *.safetensors file"
        raise CheckpointNotFound(path, f"{contents} (weightcache reads safetensors checkpoints only)")
    return files


def check_checkpoint(path: str | os.PathLike) -> list[Header]:
    """Every file's header of the checkpoint at ``path``, each checked against the file's length; no weight byte is read.

    Run it before loading: a missing path, a directory without safetensors, a damaged
    header or a cut-off file fails here in milliseconds (CheckpointNotFound,
    InvalidCheckpoint) instead of deep inside a load.
    """
    headers = [read_header(file) for file in checkpoint_files(path)]
    for header in headers:
        check_length(header)
    return headers


def check_length(header: Header) -> None:
    """InvalidCheckpoint unless the file ends where its last tensor's data ends (a cut-off download or copy does not)."""
    expected = max((t.start + t.nbytes for t in header.tensors), default=len(header.raw))
    size = header.key.st_size if header.key is not None else header.file.stat().st_size
    missing = expected - size
    if missing:
        problem = (
            f"{missing:,} bytes shorter than its header says (cut off?)"
            if missing > 0
            else f"{-missing:,} bytes longer than its header says"
        )
        raise InvalidCheckpoint(header.file, f"it is {problem}")


def checkpoint_identity(path: str | os.PathLike, store: DigestStore | None = None, progress: ProgressLike | None = None) -> str:
    """sha256 over the digest scheme and every safetensors file's relative name and content digest.

    The same bytes in two directories give the same identity; any changed byte
    (data or header) gives another. Digests come from ``store`` (default: the
    user's ``DigestStore``) while a file is unchanged, else the file is hashed once
    (see ``weightcache.core.identity.digests``; ``progress`` counts the bytes hashed).
    """
    files = checkpoint_files(path)
    return identity_of(path, files, checkpoint_digests(files, store, progress))


def identity_of(path: str | os.PathLike, files: "list[Path]", digests: "list[str]") -> str:
    """The checkpoint identity of ``path`` from its weight ``files`` and their content digests, in the same order."""
    path = Path(path)
    digest = hashlib.sha256(SCHEME.encode())
    for file, content in zip(files, digests, strict=True):
        relative = file.name if path.is_file() else str(file.relative_to(path))
        for part in (relative.encode(), content.encode()):
            digest.update(struct.pack("<Q", len(part)) + part)
    return digest.hexdigest()


def checkpoint_tensors(path: str | os.PathLike) -> list[TensorInfo]:
    """Every tensor of a checkpoint, file by file in byte order."""
    return [t for file in checkpoint_files(path) for t in read_header(file).tensors]
