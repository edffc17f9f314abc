"""Content digests of files, remembered per file version: an unchanged file costs a stat and one small read.

A file's digest covers every byte: the file is cut into fixed 64 MiB pieces from
offset 0, each piece is hashed with sha256 (pieces of all files in one thread
pool: hashlib releases the GIL), and the digest is sha256 over the file size and
the piece digests in order. ``SCHEME`` names the method; the digest carries it
as a prefix so that a later scheme never matches an earlier one.

A ``DigestStore`` remembers digests by ``FileKey`` (device, inode, size, mtime
and ctime of the file, symlinks followed). A user cannot set a file's ctime and
every write changes it, so a changed key is the only way bytes can have changed
under a remembered digest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import attrs

from weightcache.core.cpus import usable_cpus
from weightcache.core.fileio import READ_FLAGS
from weightcache.core.progress import counted

log = logging.getLogger(__name__)

SCHEME = "wc-sha256-tree-64MiB"
PIECE_BYTES = 64 << 20
READ_BYTES = 8 << 20  # one pread; each worker holds one such buffer
ENV_CACHE_DIR = "WEIGHTCACHE_CACHE_DIR"
MAX_ENTRY_BYTES = 4096
"""Largest store entry read; ``put`` writes about 250 bytes, so a larger file is not one of ours."""
RACY_WINDOW_NS = 100_000_000
"""A file changed less than this before hashing began is hashed but not remembered.

Filesystems stamp ctime from a coarse clock (one tick: 1-10 ms on Linux), so a
second write within the tick of the first keeps the ctime; waiting out the
window makes sure any later write gets another ctime (git's "racy clean" rule).
"""


class ProgressLike(Protocol):
    """What ``checkpoint_digests`` reports hashed bytes to (``core.progress.Progress`` is one)."""

    def update(self, nbytes: int) -> None: ...

    def close(self) -> None: ...


@attrs.frozen
class FileKey:
    """What ``os.stat`` (symlinks followed) says about one version of a file."""

    st_dev: int
    st_ino: int
    st_size: int
    st_mtime_ns: int
    st_ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> FileKey:
        return cls._from(os.stat(path))

    @classmethod
    def of_fd(cls, fd: int) -> FileKey:
        """The key of the file ``fd`` has open (whatever its path names now)."""
        return cls._from(os.fstat(fd))

    @classmethod
    def _from(cls, info: os.stat_result) -> FileKey:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def as_list(self) -> list[int]:
        return [getattr(self, field.name) for field in attrs.fields(FileKey)]

    @property
    def entry_name(self) -> str:
        """The store's file name for this key: sha256 of the scheme and the key."""
        return hashlib.sha256(json.dumps([SCHEME, *self.as_list()]).encode()).hexdigest()


@attrs.frozen
class FileDigest:
    """The content digest of one version (``key``) of a file, computed from the bytes one read of it returned."""

    path: Path
    key: FileKey
    digest: str


def hashing_threads() -> int:
    """Threads that hash pieces: min(8, 2 x the CPUs this process may run on)."""
    return min(8, 2 * usable_cpus())


def _hash_piece(path: Path, offset: int, length: int) -> bytes:
    """sha256 of ``length`` bytes of ``path`` at ``offset`` (fewer when the file got shorter meanwhile).

    Each piece opens the file itself, so a checkpoint of thousands of files never holds thousands of fds.
    """
    digest = hashlib.sha256()
    buffer = bytearray(min(READ_BYTES, length))
    view = memoryview(buffer)
    done = 0
    fd = os.open(path, READ_FLAGS)
    try:
        while done < length:
            count = os.preadv(fd, [view[: min(len(buffer), length - done)]], offset + done)
            if not count:
                break
            digest.update(view[:count])
            done += count
    finally:
        os.close(fd)
    return digest.digest()


def piece_offsets(size: int) -> range:
    """Where the pieces of a file of ``size`` bytes start (each ``PIECE_BYTES`` long, the last one shorter)."""
    return range(0, size, PIECE_BYTES)


def combine(size: int, pieces: list[bytes]) -> str:
    """A file's digest from its size and the sha256 of each of its pieces, in order (the scheme's last step)."""
    digest = hashlib.sha256(struct.pack("<Q", size))
    for piece in pieces:
        digest.update(piece)
    return f"{SCHEME}:{digest.hexdigest()}"


def _hash_files(files: list[Path], keys: list[FileKey], progress: ProgressLike | None = None) -> list[str]:
    """The digest of each file (``keys``: their stat before hashing); all pieces share one thread pool."""
    pieces: list[dict[int, bytes]] = [{} for _ in files]
    with concurrent.futures.ThreadPoolExecutor(max_workers=hashing_threads(), thread_name_prefix="wc-digest") as pool:
        futures = {
            pool.submit(_hash_piece, file, offset, min(PIECE_BYTES, key.st_size - offset)): (index, offset)
            for index, (file, key) in enumerate(zip(files, keys, strict=True))
            for offset in piece_offsets(key.st_size)
        }
        try:
            for future in concurrent.futures.as_completed(futures):
                index, offset = futures[future]
                pieces[index][offset] = future.result()
                if progress is not None:
                    progress.update(min(PIECE_BYTES, keys[index].st_size - offset))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return [combine(key.st_size, [found[o] for o in sorted(found)]) for key, found in zip(keys, pieces, strict=True)]


def file_digest(path: str | os.PathLike) -> str:
    """The content digest of one file (``SCHEME:hex``), computed now."""
    return _hash_files([Path(path)], [FileKey.of(path)])[0]


@attrs.define
class DigestStore:
    """Remembered digests, one small file per ``FileKey`` in a private directory.

    Build it with ``open``: the directory is opened once (``O_DIRECTORY | O_NOFOLLOW``)
    and checked on that descriptor, and every entry is read, written and renamed
    relative to it, never through a path. So a directory swapped for a symlink
    after the check, or an entry that is a symlink, a FIFO, someone else's file or
    larger than ``MAX_ENTRY_BYTES``, redirects nothing: such an entry is a miss.
    ``DigestStore(None)`` has no trusted directory: every digest is computed and
    nothing is remembered.
    """

    directory: Path | None
    """Where the store was opened (for messages; accesses go through ``fd``)."""
    fd: int | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if (self.directory is None) != (self.fd is None):
            raise ValueError("build a DigestStore with DigestStore.open(directory), or DigestStore(None) for none")

    @classmethod
    def open(cls, directory: str | os.PathLike | None = None) -> DigestStore:
        """The store in ``directory`` (default ``default_directory()``), created 0700 when missing.

        A directory that another user could write (a symlink, another owner,
        group- or world-writable) is not used: one warning says why and how to fix it.
        """
        path = Path(directory) if directory is not None else default_directory()
        try:
            fd = _open_private(path)
        except _Untrusted as exc:
            log.warning(
                "weightcache: not remembering checkpoint digests in %s: %s; every start hashes the checkpoint "
                "(set %s to a directory of your own with mode 0700)",
                path,
                exc,
                ENV_CACHE_DIR,
            )
            return cls(None)
        return cls(path, fd)

    def close(self) -> None:
        """Close the directory; the store then remembers nothing (``default_store()``'s stays open for the process)."""
        if self.fd is not None:
            fd, self.fd, self.directory = self.fd, None, None
            os.close(fd)

    def __enter__(self) -> DigestStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, key: FileKey) -> str | None:
        """The digest remembered for ``key``, or None (also for an entry that is not a small file of ours, or corrupt)."""
        name = key.entry_name
        data = self.read_entry(name, MAX_ENTRY_BYTES)
        if data is None:
            return None
        try:
            entry = json.loads(data)
        except ValueError:
            self._ignore(name, "it is not JSON")
            return None
        if not isinstance(entry, dict) or entry.get("key") != key.as_list() or not _valid_digest(entry.get("digest")):
            self._ignore(name, "it is not the entry of this file version")
            return None
        return entry["digest"]

    def read_entry(self, name: str, limit: int) -> bytes | None:
        """The bytes of entry ``name``, or None: missing, no trusted directory, or not a regular file of ours of at most
        ``limit`` bytes (a link, a FIFO, someone else's file: each a miss, logged)."""
        if self.fd is None:
            return None
        try:
            # O_NONBLOCK: opening a FIFO put in an entry's place must not wait for a writer.
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink
            self._ignore(
                name, "it cannot be opened without following a link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
            )
            return None
        try:
            problem = _entry_problem(os.fstat(fd), limit)
            data = b"" if problem else _read_all(fd, limit + 1)
        finally:
            os.close(fd)
        if problem:
            self._ignore(name, problem)
            return None
        return data

    def _ignore(self, name: str, why: str) -> None:
        log.debug("ignoring digest store entry %s in %s: %s", name, self.directory, why)

    def put(self, key: FileKey, digest: str) -> None:
        """Remember ``digest`` for ``key`` (atomically: a temporary file renamed into place, both relative to the store)."""
        self.write_entry(key.entry_name, json.dumps({"scheme": SCHEME, "key": key.as_list(), "digest": digest}).encode())

    def write_entry(self, name: str, data: bytes) -> None:
        """Store ``data`` as entry ``name``: a temporary file renamed into place, both relative to the store; a failure
        is logged and leaves the entry as it was (nothing remembered)."""
        if self.fd is None:
            return
        temporary = f".tmp-{secrets.token_hex(8)}"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except OSError as exc:
            log.debug("could not remember %s in %s: %s", name, self.directory, exc)
            return
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            log.debug("could not remember %s in %s: %s", name, self.directory, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=self.fd)


def default_directory() -> Path:
    """``$WEIGHTCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/weightcache/digests``, else ``~/.cache/weightcache/digests``."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "weightcache" / "digests"


_default_stores: dict[Path, DigestStore] = {}
_default_lock = threading.Lock()


def default_store() -> DigestStore:
    """The store of ``default_directory()``, opened (and checked, warned about) once per process."""
    path = default_directory()
    with _default_lock:
        if path not in _default_stores:
            _default_stores[path] = DigestStore.open(path)
        return _default_stores[path]


def checkpoint_digests(
    files: Iterable[str | os.PathLike],
    store: DigestStore | None = None,
    progress: ProgressLike | None = None,
    keys: "Sequence[FileKey] | None" = None,
) -> list[str]:
    """The content digest of each of ``files``, in order: remembered ones from ``store``, the others hashed now.

    ``store`` defaults to ``default_store()``; ``keys`` are the files' versions where the caller has them already
    (else each file is stat'ed here). Hashing logs one INFO line and
    reports bytes to ``progress`` (an object with ``update(nbytes)`` and ``close()``).
    """
    checkpoint = [Path(file) for file in files]
    store = default_store() if store is None else store
    started = time.time_ns()
    keys = list(keys) if keys is not None else [FileKey.of(file) for file in checkpoint]
    digests = remembered_digests(keys, store)
    unknown = [index for index, digest in enumerate(digests) if digest is None]
    if unknown:
        paths, unknown_keys = [checkpoint[i] for i in unknown], [keys[i] for i in unknown]
        log.info(
            "first sight of %s (%.2f GiB) of %s: hashing their content",
            counted(len(paths), "file"),
            sum(key.st_size for key in unknown_keys) / 2**30,
            os.path.commonpath([str(p.parent) for p in paths]),
        )
        try:
            hashed = _hash_files(paths, unknown_keys, progress)
        finally:
            if progress is not None:
                progress.close()
        for index, path, key, digest in zip(unknown, paths, unknown_keys, hashed, strict=True):
            digests[index] = digest
            remember(store, path, key, digest, started)
    return [digest for digest in digests if digest is not None]


def remembered_digests(keys: Iterable[FileKey], store: DigestStore | None = None) -> list[str | None]:
    """The digest ``store`` (default ``default_store()``) remembers for each file version, None where it has none."""
    store = default_store() if store is None else store
    return [store.get(key) for key in keys]


def remember(store: DigestStore, path: Path, key: FileKey, digest: str, started_ns: int) -> None:
    """Record ``digest`` of ``path`` (version ``key``, read from ``started_ns`` on) unless the file changed while it
    was read or just before (see ``RACY_WINDOW_NS``)."""
    try:
        now = FileKey.of(path)
    except OSError:
        now = None
    if now != key:
        log.warning(
            "weightcache: %s changed while it was hashed; its digest is not remembered. "
            "Start engines only after the checkpoint is written completely.",
            path,
        )
    elif started_ns - max(key.st_mtime_ns, key.st_ctime_ns) >= RACY_WINDOW_NS:
        store.put(key, digest)


def _valid_digest(value) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


_DIGEST = re.compile(re.escape(SCHEME) + ":[0-9a-f]{64}")


class _Untrusted(Exception):
    """Why a directory must not hold digests (the message says how to fix it)."""


def _open_private(path: Path) -> int:
    """An ``O_DIRECTORY | O_NOFOLLOW`` fd of ``path`` (created 0700 when missing), checked on that fd; else _Untrusted.

    The checks read ``fstat`` of the descriptor, not the path: what was checked is what every later access uses.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise _Untrusted(f"it cannot be created ({exc.strerror})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise _Untrusted("it is a symlink" if path.is_symlink() else "it is not a directory") from None
        raise _Untrusted(f"it cannot be opened ({exc.strerror})") from None
    problem = _untrusted(os.fstat(fd), path)
    if problem:
        os.close(fd)
        raise _Untrusted(problem)
    return fd


def _untrusted(info: os.stat_result, path: Path) -> str | None:
    """Why the directory ``info`` describes (``fstat`` of an open fd) must not hold digests, or None when it may."""
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"the group or others can write it (mode {stat.S_IMODE(info.st_mode):04o}; run `chmod 700 {path}`)"
    return None


def _read_all(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``fd`` from where it stands (``os.read`` may return less than asked)."""
    chunks, left = [], limit
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _entry_problem(info: os.stat_result, limit: int = MAX_ENTRY_BYTES) -> str | None:
    """Why an open store entry is not one ``write_entry`` wrote (a regular file of ours, at most ``limit`` bytes), or None."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
    if info.st_size > limit:
        return f"it holds {info.st_size} bytes; an entry holds at most {limit}"
    return None
