"""Reading safetensors checkpoints: headers, checkpoint identity, bytes straight into arenas."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import attrs

from weightcache.core.digests import SCHEME, DigestStore, ProgressLike, checkpoint_digests

MAX_HEADER_BYTES = 100 << 20

# safetensors dtype codes -> torch dtype names
ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
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


def read_header(file: str | os.PathLike) -> Header:
    """Parse the header of one safetensors file (reads only the header)."""
    file = Path(file)
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{file} declares a {size}-byte header; not a safetensors file?")
        raw = fh.read(size)
    try:
        header = json.loads(raw)
    except ValueError:
        raise ValueError(f"{file} has a header that is not JSON; the file is damaged") from None
    data_start = 8 + size
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which weightcache does not handle")
        tensors.append(TensorInfo(name, dtype, tuple(info["shape"]), file, data_start + begin, end - begin))
    return Header(file=file, raw=prefix + raw, tensors=tuple(sorted(tensors, key=lambda t: t.start)), metadata=metadata)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded via index.json, or every *.safetensors)."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}; weightcache reads safetensors checkpoints only")
    return files


def checkpoint_identity(path: str | os.PathLike, store: DigestStore | None = None, progress: ProgressLike | None = None) -> str:
    """sha256 over the digest scheme and every safetensors file's relative name and content digest.

    The same bytes in two directories give the same identity; any changed byte
    (data or header) gives another. Digests come from ``store`` (default: the
    user's ``DigestStore``) while a file is unchanged, else the file is hashed once
    (see ``weightcache.core.digests``; ``progress`` counts the bytes hashed).
    """
    path = Path(path)
    files = checkpoint_files(path)
    digest = hashlib.sha256(SCHEME.encode())
    for file, content in zip(files, checkpoint_digests(files, store, progress)):
        relative = file.name if path.is_file() else str(file.relative_to(path))
        for part in (relative.encode(), content.encode()):
            digest.update(struct.pack("<Q", len(part)) + part)
    return digest.hexdigest()


def checkpoint_tensors(path: str | os.PathLike) -> list[TensorInfo]:
    """Every tensor of a checkpoint, file by file in byte order."""
    return [t for file in checkpoint_files(path) for t in read_header(file).tensors]
