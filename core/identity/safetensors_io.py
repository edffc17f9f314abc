"""Reading safetensors checkpoints: headers, checkpoint identity, bytes straight into arenas."""

from __future__ import annotations

import hashlib
import os
import struct
import typing
from collections.abc import Sequence
from pathlib import Path

import attrs

from weightcache.core.errors import InvalidCheckpoint
from weightcache.core.fileio import open_regular
from weightcache.core.identity import safetensors_header
from weightcache.core.identity.declared import CheckpointFiles
from weightcache.core.identity.digests import (
    SCHEME,
    DigestStore,
    FileKey,
    ProgressLike,
    checkpoint_digests,
    remembered_digests,
)
from weightcache.core.identity.safetensors_header import MAX_HEADER_BYTES, HeaderProblem
from weightcache.core.identity.safetensors_header import ST_DTYPES as ST_DTYPES  # its old home: the name stays here


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
    """Read and check the header of one safetensors file against safetensors' own rules (no weight byte is read).

    InvalidCheckpoint (NotRegularFile for a FIFO, a device or a socket, which is never opened to wait on) names the
    file and the first rule broken (``safetensors_header``): whatever a disk load would refuse, and a tensor named twice
    or a dtype weightcache does not handle. The last tensor must end where the file ends (``check_length``).
    """
    file = Path(file)
    fd = open_regular(file)
    with open(fd, "rb") as fh:
        key = FileKey.of_fd(fd)
        length = key.st_size
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise InvalidCheckpoint(file, f"{length} bytes long, too short for a safetensors file")
        (size,) = struct.unpack("<Q", prefix)
        if size > MAX_HEADER_BYTES:
            raise InvalidCheckpoint(
                file,
                f"it declares a {size:,}-byte header, more than safetensors reads ({MAX_HEADER_BYTES:,}): not a safetensors file",
            )
        if 8 + size > length:
            raise InvalidCheckpoint(
                file, f"it declares a {size:,}-byte header but is {length:,} bytes long: not a safetensors file"
            )
        raw = fh.read(size)
    try:
        parsed = safetensors_header.parse(raw)
    except HeaderProblem as exc:
        raise InvalidCheckpoint(file, exc.problem, *([exc.fix] if exc.fix else [])) from None
    data_start = 8 + size
    tensors = tuple(TensorInfo(r.name, r.dtype, r.shape, file, data_start + r.begin, r.end - r.begin) for r in parsed.records)
    header = Header(file=file, raw=prefix + raw, tensors=tensors, metadata=parsed.metadata, key=key)
    check_length(header)
    return header


def checkpoint_files(path: str | os.PathLike, declared: CheckpointFiles | None = None) -> list[Path]:
    """The safetensors weight files of a checkpoint (``declared``'s weight patterns; default: the root's, sharded via
    index.json, or every *.safetensors).

    Raises CheckpointNotFound when ``path`` does not exist, holds no matching file or
    lacks a shard its index names; NotRegularFile when a weight file is a FIFO, a device, a socket or a directory.
    """
    return (declared or CheckpointFiles()).weight_files(path)


def check_checkpoint(path: str | os.PathLike, declared: CheckpointFiles | None = None) -> list[Header]:
    """Every file's header of the checkpoint at ``path``, each checked (``read_header``); no weight byte is read.

    The CLI's ``load`` runs it before it imports torch, the cache modes (``modes``) before a first sight hashes a file
    or anything is published, and the reader reads every header through ``read_header`` again before it plans a byte: a
    missing path, a directory without safetensors, a FIFO or device in a weight file's place, a header a disk load
    would refuse or a cut-off file fails in milliseconds (CheckpointNotFound, InvalidCheckpoint) instead of deep inside
    a load, and nothing is published.
    """
    return [read_header(file) for file in checkpoint_files(path, declared)]


@attrs.frozen
class Sighting:
    """A checkpoint's declared files seen once: each file (weights first, then configs), its version (one stat, or the
    header read's) and the digest the store remembers for that version (None: first sight). What identifies the
    checkpoint comes from here, so the files are stat'ed once per load, not once per question asked of them."""

    path: Path
    files: tuple[Path, ...]
    keys: tuple[FileKey, ...]
    remembered: tuple[str | None, ...]
    weights: int = -1
    """How many of ``files`` are weight files (the others are configs); -1: all."""

    @classmethod
    def of(
        cls,
        path: str | os.PathLike,
        store: DigestStore | None = None,
        headers: "Sequence[Header] | None" = None,
        declared: CheckpointFiles | None = None,
    ) -> Sighting:
        """``path``'s declared files (default ``CheckpointFiles()``) as they are now (``headers``: the weight files as
        ``check_checkpoint`` read them, not stat'ed again)."""
        declared = declared or CheckpointFiles()
        if headers is None:
            weights = declared.weight_files(path)
            keys = [FileKey.of(file) for file in weights]
        else:
            weights = [header.file for header in headers]
            keys = [header.key if header.key is not None else FileKey.of(header.file) for header in headers]
        configs = declared.config_files(path, weights)
        keys += [FileKey.of(file) for file in configs]
        files = weights + configs
        return cls(Path(path), tuple(files), tuple(keys), tuple(remembered_digests(keys, store)), len(weights))

    @property
    def weight_files(self) -> tuple[Path, ...]:
        return self.files if self.weights < 0 else self.files[: self.weights]

    @property
    def identity(self) -> str | None:
        """The checkpoint identity when every file's digest is remembered, else None (no file is read for it)."""
        if any(digest is None for digest in self.remembered):
            return None
        return identity_of(self.path, list(self.files), typing.cast("list[str]", list(self.remembered)))

    def identify(self, store: DigestStore | None = None, progress: ProgressLike | None = None) -> str:
        """The checkpoint identity; the files seen for the first time are hashed (``progress`` counts their bytes)."""
        return self.identity or identity_of(
            self.path, list(self.files), checkpoint_digests(self.files, store, progress, keys=self.keys)
        )


def check_first_sight(
    path: str | os.PathLike, store: DigestStore | None = None, declared: CheckpointFiles | None = None
) -> Sighting:
    """``read_header`` for each weight file of the checkpoint whose digest ``store`` does not remember (stat only for the
    rest); returns what it saw, for the checkpoint's identity.

    A remembered file was checked before it was first hashed, and its key (size, times, inode) still matches: a
    restart's attach opens no checkpoint file, while a file never seen, a changed one or a FIFO is checked first.
    """
    sighting = Sighting.of(path, store, declared=declared)
    for file, digest in zip(sighting.weight_files, sighting.remembered, strict=False):
        if digest is None:
            read_header(file)
    return sighting


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


def checkpoint_identity(
    path: str | os.PathLike,
    store: DigestStore | None = None,
    progress: ProgressLike | None = None,
    declared: CheckpointFiles | None = None,
) -> str:
    """sha256 over the digest scheme and every declared file's relative name and content digest (``declared``: the
    adapter's ``CheckpointFiles``, default the root's safetensors files and config.json).

    The same bytes in two directories give the same identity; any changed byte
    (data or header) gives another. Digests come from ``store`` (default: the
    user's ``DigestStore``) while a file is unchanged, else the file is hashed once
    (see ``weightcache.core.identity.digests``; ``progress`` counts the bytes hashed).
    """
    return Sighting.of(path, store, declared=declared).identify(store, progress)


def identity_of(path: str | os.PathLike, files: "list[Path]", digests: "list[str]") -> str:
    """The checkpoint identity of ``path`` from its declared ``files`` and their content digests, in the same order."""
    path = Path(path)
    single = path.is_file()
    digest = hashlib.sha256(SCHEME.encode())
    named = sorted(
        (file.name if single else str(file.relative_to(path)), content) for file, content in zip(files, digests, strict=True)
    )
    for relative, content in named:  # by name: the order files were listed in never changes the identity
        for part in (relative.encode(), content.encode()):
            digest.update(struct.pack("<Q", len(part)) + part)
    return digest.hexdigest()


def checkpoint_tensors(path: str | os.PathLike, declared: CheckpointFiles | None = None) -> list[TensorInfo]:
    """Every tensor of a checkpoint's weight files, file by file in byte order, each named as the checkpoint calls it: its
    own name in the root's files, ``folder/name`` in a subfolder's (``CheckpointFiles.tensor_prefix``)."""
    declared = declared or CheckpointFiles()
    tensors = []
    for file in declared.weight_files(path):
        prefix = declared.tensor_prefix(path, file)
        tensors += [attrs.evolve(t, name=prefix + t.name) if prefix else t for t in read_header(file).tensors]
    return tensors
