"""The server's table of published entries: fds and manifests keyed by fingerprint digest."""

from __future__ import annotations

import logging
import os
import threading
import time

import attrs

from weightcache.core.fingerprint import Fingerprint
from weightcache.core.protocol import close_fds

log = logging.getLogger(__name__)


@attrs.define
class Entry:
    """One published model rank: the server's own fds to its arenas and its manifest."""

    fingerprint: Fingerprint
    manifest: dict
    fds: list[int]
    nbytes: int
    label: str
    published_by: int
    created: float = attrs.field(factory=time.time)
    last_used: float = attrs.field(factory=time.monotonic)
    sessions: dict = attrs.field(factory=dict)  # connection id -> client pid

    @property
    def digest(self) -> str:
        return self.fingerprint.digest

    def status(self) -> dict:
        fp = self.fingerprint
        return {
            "digest": self.digest,
            "label": self.label,
            "rank": f"tp{fp.tp_rank}/{fp.tp_size} pp{fp.pp_rank}/{fp.pp_size} ep{fp.ep_rank}/{fp.ep_size}",
            "device": fp.gpu_uuid or "cpu",
            "quantization": fp.quantization,
            "dtype": fp.dtype,
            "bytes": self.nbytes,
            "tensors": len(self.manifest.get("tensors", ())),
            "arenas": len(self.fds),
            "attached_pids": sorted(set(self.sessions.values())),
            "published_by": self.published_by,
            "age_s": round(time.time() - self.created, 1),
        }


class OverBudget(Exception):
    """Publishing would exceed the byte budget even after evicting every unattached entry."""


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
        """Add ``entry``; False (and its fds closed) if one with that digest exists already."""
        with self._lock:
            if entry.digest in self._entries:
                close_fds(entry.fds)
                return False
            self._make_room(entry.nbytes)
            self._entries[entry.digest] = entry
        log.info("published %s (%s, %d bytes, %d arenas)", entry.digest[:12], entry.label, entry.nbytes, len(entry.fds))
        return True

    def _make_room(self, nbytes: int) -> None:
        if self.byte_budget is None:
            return
        held = sum(e.nbytes for e in self._entries.values())
        idle = sorted((e for e in self._entries.values() if not e.sessions), key=lambda e: e.last_used)
        while held + nbytes > self.byte_budget and idle:
            victim = idle.pop(0)
            self._drop(victim.digest, reason="least recently used, to stay within the byte budget")
            held -= victim.nbytes
        if held + nbytes > self.byte_budget:
            raise OverBudget(
                f"{nbytes} bytes do not fit the server's budget of {self.byte_budget} bytes "
                f"({held} held by attached entries); raise --byte-budget or evict entries"
            )

    def attach(self, fingerprint: Fingerprint, connection: int, pid: int) -> Entry | None:
        """The entry for ``fingerprint``, now marked attached by ``connection``; None if absent."""
        with self._lock:
            return self._attach_locked(fingerprint, connection, pid)

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
        """Evict the entries whose digest starts with ``prefix``; attached ones only with ``force``."""
        if len(prefix) < 4:
            raise ValueError("give at least 4 characters of the entry's digest")
        with self._lock:
            matches = [e for d, e in self._entries.items() if d.startswith(prefix)]
            if not matches:
                raise KeyError(f"no entry matches {prefix!r}; `weightcache status` lists them")
            attached = [e for e in matches if e.sessions]
            if attached and not force:
                pids = sorted({p for e in attached for p in e.sessions.values()})
                raise PermissionError(
                    f"entry {attached[0].digest[:12]} is attached by pids {pids}; detach those engines "
                    "or evict with --force (their mappings stay valid; memory is freed once they exit)"
                )
            for entry in matches:
                self._drop(entry.digest, reason="evicted on request")
            return [e.digest for e in matches]

    def _drop(self, digest: str, reason: str) -> None:
        entry = self._entries.pop(digest)
        close_fds(entry.fds)
        log.info("dropped %s (%s): %s", digest[:12], entry.label, reason)

    def status(self) -> list[dict]:
        with self._lock:
            return [e.status() for e in self._entries.values()]

    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def close(self) -> None:
        """Close every fd (the server is stopping)."""
        with self._lock:
            for digest in list(self._entries):
                self._drop(digest, reason="server stopping")
