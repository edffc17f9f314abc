"""A copy of a checkpoint without its weights, so that any weight read fails loudly.

Why this proves "no disk I/O before the refusal": each ``*.safetensors`` file
is copied up to the end of its header (the 8-byte length and the JSON header)
and cut there. Configs, tokenizers and headers read as before, but every
attempt to read a tensor hits a file shorter than its header declares:
safetensors raises, a raw ``pread`` comes back short. Other weight formats
(``*.bin``, ``*.pt``, ...) are copied empty. The kit also checks the control:
a plain disk load of the weightless copy must fail.

The copy is another checkpoint as far as the cache goes (the checkpoint
identity hashes the files' content, so it differs from the original's); that
does not matter here, because the quantization check runs before the
fingerprint is computed: a refused method never gets as far as hashing.

Using a copy keeps the check independent of permissions (``chmod 000`` does not
stop root) and of the process (no monkeypatching of file reads).
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz", ".npy", ".onnx", ".pkl")


def copy_without_weights(source: str | Path, target: str | Path) -> Path:
    """Copy the checkpoint ``source`` (a directory or one ``.safetensors`` file) to ``target`` without weight bytes."""
    source, target = Path(source), Path(target)
    if source.is_file():
        target.mkdir(parents=True, exist_ok=True)
        destination = target / source.name
        _copy_file(source, destination)
        return destination
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            destination.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(path, destination)
    return target


def _copy_file(path: Path, destination: Path) -> None:
    if path.suffix == ".safetensors":
        destination.write_bytes(_header_only(path))
    elif path.suffix in WEIGHT_SUFFIXES:
        destination.write_bytes(b"")
    else:
        shutil.copyfile(path, destination)


def _header_only(path: Path) -> bytes:
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            return prefix
        (size,) = struct.unpack("<Q", prefix)
        return prefix + fh.read(size)
