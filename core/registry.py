"""The server's table of published entries: fds and manifests keyed by fingerprint digest, and the artifacts beside them."""

from __future__ import annotations

import logging
import os
import threading
import time

import attrs

from weightcache.core.errors import AmbiguousDigest
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.protocol import close_fds, encode

log = logging.getLogger(__name__)

MAX_LABEL_CHARS = 256
"""Longest label a publish may carry (longer ones are refused); also the most characters of any
fingerprint text a status row shows, so that every row, and so the status reply, stays small."""


def _check_label(_entry, _attribute, label) -> None:
    if not isinstance(label, str):
        raise ValueError(f"the label must be a string, not {type(label).__name__}")
    if len(label) > MAX_LABEL_CHARS:
        raise ValueError(f"the label has {len(label)} characters, more than the {MAX_LABEL_CHARS} allowed; shorten it")


MAX_ARTIFACT_KEY_CHARS = 256
"""Longest key an artifact may be stored under."""


def _shown(text: str) -> str:
    """``text`` cut to MAX_LABEL_CHARS characters for a status row."""
    return text[:MAX_LABEL_CHARS]


@attrs.frozen
class Artifact:
    """A blob kept beside an entry (compile artifacts): the server's own fd to a sealed memfd and its size."""

    fd: int
    nbytes: int


@attrs.define
class Entry:
    """One published model rank: the server's own fds to its arenas and its manifest, and its artifacts.

    ``nbytes`` is what the arenas count against the byte budget: the real size
    of each host memfd, the declared size of each CUDA arena. ``held_bytes``
    adds the artifacts' sizes.
    """

    fingerprint: Fingerprint
    manifest: dict
    fds: list[int]
    nbytes: int
    label: str = attrs.field(validator=_check_label)
    published_by: int
    created: float = attrs.field(factory=time.time)
    last_used: float = attrs.field(factory=time.monotonic)
    sessions: dict = attrs.field(factory=dict)  # connection id -> client pid
    artifacts: dict = attrs.field(factory=dict)  # key -> Artifact

    @property
    def digest(self) -> str:
        return self.fingerprint.digest

    @property
    def held_bytes(self) -> int:
        """What the entry counts against the byte budget: its arenas and its artifacts."""
        return self.nbytes + sum(artifact.nbytes for artifact in self.artifacts.values())

    def close_fds(self) -> None:
        """Close the server's fds to the arenas and the artifacts."""
        close_fds(self.fds)
        close_fds([artifact.fd for artifact in self.artifacts.values()])

    def status(self) -> dict:
        fp = self.fingerprint
        return {
            "digest": self.digest,
            "label": self.label,
            "rank": f"tp{fp.tp_rank}/{fp.tp_size} pp{fp.pp_rank}/{fp.pp_size} ep{fp.ep_rank}/{fp.ep_size}",
            "device": _shown(fp.gpu_uuid or "cpu"),
            "quantization": _shown(fp.quantization),
            "dtype": _shown(fp.dtype),
            "bytes": self.nbytes,
            "tensors": len(self.manifest.get("tensors", ())),
            "arenas": len(self.fds),
            "artifacts": len(self.artifacts),
            "artifact_bytes": self.held_bytes - self.nbytes,
            "attached_pids": sorted(set(self.sessions.values())),
            "published_by": self.published_by,
            "age_s": round(time.time() - self.created, 1),
        }


class OverBudget(Exception):
    """Publishing would exceed the byte budget even after evicting every unattached entry."""


class TooManyArtifacts(Exception):
    """An entry already holds as many artifacts as the server allows."""


@attrs.define
class Registry:
    """Entries by digest; every method is safe to call from many connection threads.

    :param byte_budget: most bytes held at once (None: no limit); the least
        recently used entries that no engine has attached are evicted to make room.
    """

    byte_budget: int | None = None
    _entries: dict = attrs.field(factory=dict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def publish(self, entry: Entry) -> bool:
        """Add ``entry``; False (and its fds closed) if one with that digest exists already.

        Raises OverBudget, having evicted nothing, when the entry does not fit
        even after evicting every unattached entry.
        """
        with self._lock:
            if entry.digest in self._entries:
                close_fds(entry.fds)
                return False
            for victim in self._victims(entry.nbytes):
                self._drop(victim.digest, reason="least recently used, to stay within the byte budget")
            self._entries[entry.digest] = entry
        log.info("published %s (%s, %d bytes, %d arenas)", entry.digest[:12], entry.label, entry.nbytes, len(entry.fds))
        return True

    def _victims(self, nbytes: int, keep: str | None = None) -> list[Entry]:
        """The least recently used unattached entries (never ``keep``) whose eviction makes room for ``nbytes``.

        Decided before anything is evicted: OverBudget if even all of them would not make room.
        """
        if self.byte_budget is None:
            return []
        held = sum(e.held_bytes for e in self._entries.values())
        idle = sorted((e for e in self._entries.values() if not e.sessions and e.digest != keep), key=lambda e: e.last_used)
        idle_bytes = sum(e.held_bytes for e in idle)
        if held - idle_bytes + nbytes > self.byte_budget:
            raise OverBudget(
                f"{nbytes} bytes do not fit the server's budget of {self.byte_budget} bytes "
                f"({held - idle_bytes} held by attached entries, {idle_bytes} by idle ones; nothing was evicted); "
                "raise --byte-budget, detach engines or evict entries"
            )
        victims = []
        while held + nbytes > self.byte_budget:
            victim = idle.pop(0)
            victims.append(victim)
            held -= victim.held_bytes
        return victims

    def _attach_locked(self, fingerprint: Fingerprint, connection: int, pid: int) -> Entry | None:
        entry = self._entries.get(fingerprint.digest)
        if entry is not None:
            entry.sessions[connection] = pid
            entry.last_used = time.monotonic()
        return entry

    def checkout(self, fingerprint: Fingerprint, connection: int, pid: int) -> tuple[Entry, list[int]] | None:
        """Like ``attach``, plus duplicates of the entry's fds made under the lock (the caller closes them).

        The duplicates stay valid even if the entry is evicted before the reply is sent.
        """
        with self._lock:
            entry = self._attach_locked(fingerprint, connection, pid)
            if entry is None:
                return None
            fds: list[int] = []
            try:
                for fd in entry.fds:
                    fds.append(os.dup(fd))
            except BaseException:
                close_fds(fds)
                entry.sessions.pop(connection, None)
                raise
            return entry, fds

    def put_artifact(self, digest: str, key: str, fd: int, nbytes: int, max_count: int) -> bool:
        """Keep ``fd`` (a sealed memfd of ``nbytes``) as entry ``digest``'s artifact ``key``; True if it replaced one.

        On success the registry owns ``fd``. Raises KeyError (no such entry),
        TooManyArtifacts or OverBudget (nothing evicted), leaving ``fd`` to the caller.
        Unattached entries other than ``digest`` are evicted, least recently used first, to make room.
        """
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                raise KeyError(f"no entry {digest[:12]}; publish or attach the model first (`weightcache status` lists entries)")
            old = entry.artifacts.get(key)
            if old is None and len(entry.artifacts) >= max_count:
                raise TooManyArtifacts(
                    f"entry {digest[:12]} already holds {len(entry.artifacts)} artifacts, the most the server keeps per entry; "
                    "replace one under its key or evict the entry"
                )
            growth = nbytes - (old.nbytes if old is not None else 0)
            for victim in self._victims(max(growth, 0), keep=digest):
                self._drop(victim.digest, reason="least recently used, to make room for an artifact within the byte budget")
            entry.artifacts[key] = Artifact(fd, nbytes)
            entry.last_used = time.monotonic()
        if old is not None:
            close_fds([old.fd])
        log.info(
            "kept artifact %r of %s (%d bytes%s)", key[:80], digest[:12], nbytes, ", replacing the previous one" if old else ""
        )
        return old is not None

    def checkout_artifact(self, digest: str, key: str) -> tuple[int, int] | None:
        """A duplicate of entry ``digest``'s artifact ``key`` (the caller closes it) and its size, or None."""
        with self._lock:
            entry = self._entries.get(digest)
            artifact = entry.artifacts.get(key) if entry is not None else None
            if artifact is None:
                return None
            entry.last_used = time.monotonic()
            return os.dup(artifact.fd), artifact.nbytes

    def closest(self, fingerprint: Fingerprint) -> tuple[str | None, tuple[str, ...]]:
        """The digest of the entry that differs from ``fingerprint`` in the fewest fields, and those fields."""
        with self._lock:
            candidates = [(e.fingerprint.mismatched_fields(fingerprint), e.digest) for e in self._entries.values()]
        if not candidates:
            return None, ()
        fields, digest = min(candidates, key=lambda c: len(c[0]))
        return digest, fields

    def detach(self, digest: str, connection: int) -> None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                entry.sessions.pop(connection, None)

    def drop_connection(self, connection: int) -> None:
        """Forget every attachment made over ``connection`` (its engine detached or died)."""
        with self._lock:
            for entry in self._entries.values():
                entry.sessions.pop(connection, None)

    def evict(self, prefix: str, force: bool = False) -> list[str]:
        """Evict the one entry whose digest is or starts with ``prefix``; an attached one only with ``force``.

        A prefix that matches several entries raises AmbiguousDigest and evicts nothing.
        """
        if len(prefix) < 4:
            raise ValueError("give at least 4 characters of the entry's digest")
        with self._lock:
            exact = self._entries.get(prefix)
            matches = [exact] if exact is not None else [e for d, e in self._entries.items() if d.startswith(prefix)]
            if not matches:
                raise KeyError(f"no entry matches {prefix!r:.80}; `weightcache status` lists them")
            if len(matches) > 1:
                raise AmbiguousDigest(prefix, sorted(e.digest for e in matches))
            [entry] = matches
            if entry.sessions and not force:
                pids = sorted(set(entry.sessions.values()))
                raise PermissionError(
                    f"entry {entry.digest[:12]} is attached by pids {pids}; detach those engines "
                    "or evict with --force (their mappings stay valid; memory is freed once they exit)"
                )
            self._drop(entry.digest, reason="evicted on request")
            return [entry.digest]

    def _drop(self, digest: str, reason: str) -> None:
        entry = self._entries.pop(digest)
        entry.close_fds()
        log.info("dropped %s (%s): %s", digest[:12], entry.label, reason)

    def status(self, max_bytes: int | None = None) -> tuple[list[dict], int]:
        """A row per entry, oldest first, and how many rows were left out to keep the rows' JSON within ``max_bytes``."""
        with self._lock:
            rows = [e.status() for e in self._entries.values()]
        if max_bytes is None:
            return rows, 0
        used = 0
        for count, row in enumerate(rows):
            used += len(encode(row)) + 1  # the comma between rows
            if used > max_bytes:
                return rows[:count], len(rows) - count
        return rows, 0

    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.held_bytes for e in self._entries.values())

    def close(self) -> None:
        """Close every fd (the server is stopping)."""
        with self._lock:
            for digest in list(self._entries):
                self._drop(digest, reason="server stopping")
