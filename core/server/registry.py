"""The server's table of published entries: fds and manifests keyed by fingerprint digest, and the artifacts beside them."""

from __future__ import annotations

import logging
import os
import threading
import time
import typing

import attrs

from weightcache.core.errors import AmbiguousDigest
from weightcache.core.fingerprint import HOST_TIER, Fingerprint
from weightcache.core.progress import counted, format_bytes
from weightcache.core.wire.protocol import close_fds, encode

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
    """One published model rank: the server's own fds to its arenas and to its tensor table, its manifest, and its artifacts.

    ``manifest`` is the small JSON part of the manifest (arenas, aliases, extra,
    the table's size); the tensor records are in the sealed memfd ``table_fd``,
    checked once at publish and handed unchanged to every engine that attaches,
    so an entry costs the server O(1) heap whatever its tensor count (the
    table's pages are the memfd's, not the server's heap).
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
    table_fd: int = -1
    tensors: int = 0
    table_bytes: int = 0
    created: float = attrs.field(factory=time.time)
    last_used: float = attrs.field(factory=time.monotonic)
    sessions: dict = attrs.field(factory=dict)  # connection id -> client pid
    artifacts: dict = attrs.field(factory=dict)  # key -> Artifact
    tier_bytes: dict = attrs.field(factory=dict)  # tier (HOST_TIER or a GPU's UUID) -> arena bytes held there
    verified: bool = True
    """False for an entry that came back after a crash (systemd's fd store) and whose bytes nobody has checksummed
    since: it is served only to clients that verify it, until one says it matched."""

    @property
    def digest(self) -> str:
        return self.fingerprint.digest

    @property
    def held_bytes(self) -> int:
        """What the entry counts against the byte budget: its arenas and its artifacts."""
        return self.nbytes + sum(artifact.nbytes for artifact in self.artifacts.values())

    @property
    def tier(self) -> str:
        """Where the entry's arenas live: ``host`` or a GPU's UUID (tiers joined by ``+`` if several)."""
        return "+".join(self.tier_bytes) or HOST_TIER

    def held_in(self) -> dict[str, int]:
        """Bytes held per tier; artifacts (sealed memfds) count on the host."""
        held = dict(self.tier_bytes)
        artifacts = self.held_bytes - self.nbytes
        if artifacts:
            held[HOST_TIER] = held.get(HOST_TIER, 0) + artifacts
        return held

    def close_fds(self) -> None:
        """Close the server's fds to the arenas, the tensor table and the artifacts."""
        close_fds(self.fds)
        if self.table_fd >= 0:
            close_fds([self.table_fd])
            self.table_fd = -1
        close_fds([artifact.fd for artifact in self.artifacts.values()])

    def log_fields(self) -> dict:
        """The structured fields of a log line about this entry (``--log-format json`` shows them)."""
        return {"entry": self.digest, "model": self.label, "bytes": self.nbytes, "publisher_pid": self.published_by}

    def status(self) -> dict:
        fp = self.fingerprint
        return {
            "digest": self.digest,
            "label": self.label,
            # Not ParallelSpec.label: that validates ranks, and a status row must show any fingerprint a publisher sent.
            "rank": f"tp{fp.tp_rank}/{fp.tp_size} pp{fp.pp_rank}/{fp.pp_size} ep{fp.ep_rank}/{fp.ep_size}",
            "device": _shown(fp.gpu_uuid or "cpu"),
            "tier": _shown(self.tier),
            "content": fp.content_digest[:12],
            "quantization": _shown(fp.quantization),
            "dtype": _shown(fp.dtype),
            "bytes": self.nbytes,
            "tensors": self.tensors,
            "arenas": len(self.fds),
            "artifacts": len(self.artifacts),
            "artifact_bytes": self.held_bytes - self.nbytes,
            "attached_pids": sorted(set(self.sessions.values())),
            "published_by": self.published_by,
            "age_s": round(time.time() - self.created, 1),
            "verified": self.verified,
        }

    def take_bytes_of(self, other: Entry) -> None:
        """Hold ``other``'s fds, manifest and sizes instead of this entry's own (whose fds are closed); verified now."""
        old = attrs.evolve(self)
        for field in ("manifest", "fds", "nbytes", "table_fd", "tensors", "table_bytes", "tier_bytes", "published_by"):
            setattr(self, field, getattr(other, field))
        self.verified = True
        old.artifacts = {}  # they stay with this entry
        old.close_fds()


MAX_TIERS_SHOWN = 16
"""Tiers a status reply lists (the host and the GPUs holding most): a node has a few GPUs, and the reply must fit a frame."""
_TIER_CHARS = 64  # a GPU UUID is 40 characters


def tier_of(backend: str, device: str) -> str:
    """The tier an arena of ``backend`` on ``device`` counts in: ``HOST_TIER`` for host memory, else the GPU's UUID."""
    return HOST_TIER if backend == "host" else device


@attrs.frozen
class Budgets:
    """Most bytes held at once: in all (``total``), on the host tier (``host``), on each GPU (``per_gpu``).

    None is no limit. Entries count where their arenas live; artifacts count on the host.
    """

    total: int | None = None
    host: int | None = None
    per_gpu: int | None = None

    def of(self, tier: str) -> int | None:
        return self.host if tier == HOST_TIER else self.per_gpu

    def to_json(self) -> dict:
        return attrs.asdict(self)

    def describe(self) -> str:
        """``8.0 GiB in all, no limit on the host, 40.0 GiB per GPU`` (a log line's words, not a repr)."""
        parts = (
            (self.total, "in all", "no limit in all"),
            (self.host, "on the host", "no limit on the host"),
            (self.per_gpu, "per GPU", "no limit per GPU"),
        )
        return ", ".join(f"{format_bytes(value)} {where}" if value is not None else none for value, where, none in parts)


class OverBudget(Exception):
    """Publishing would exceed a byte budget even after evicting every unattached entry."""


class VersionConflict(Exception):
    """A version of a lineage is published with other bytes than the entry already held for that version."""


class TooManyArtifacts(Exception):
    """An entry already holds as many artifacts as the server allows."""


def _tier_name(tier: str) -> str:
    return "host tier" if tier == HOST_TIER else f"GPU {tier[:40]}"


@attrs.define
class Registry:
    """Entries by digest; every method is safe to call from many connection threads.

    :param budgets: most bytes held at once, in all and per tier; the least
        recently used entries that no engine has attached are evicted to make room.
    :param on_drop: told ``(digest, why)`` for each entry dropped, ``why`` one of ``budget``, ``request``, ``stopping``
        (the server's metrics count them).
    """

    budgets: Budgets = attrs.field(factory=Budgets)
    on_drop: typing.Callable[[str, str], None] | None = None
    on_publish: typing.Callable[[Entry], None] | None = None
    """Called with each entry added (the systemd fd store keeps its fds)."""
    on_evict: typing.Callable[[Entry], None] | None = None
    """Called with each entry evicted (not with those a stopping server closes)."""
    _entries: dict = attrs.field(factory=dict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def byte_budget(self) -> int | None:
        return self.budgets.total

    def publish(self, entry: Entry, evict: bool = True, requester: int | None = None) -> bool:
        """Add ``entry``; False (and its fds closed) if one with that digest exists already.

        An existing entry that is not verified takes a verified ``entry``'s bytes instead of its own (a publisher
        checksummed what it sends: an engine re-publishing after a crash checked its mapping first); it keeps its
        attach sessions and artifacts, and the answer is still False.

        Raises OverBudget, having evicted nothing, when the entry does not fit
        even after evicting every unattached entry (with ``evict`` False: without evicting any), and VersionConflict
        when another entry holds the same version of the same lineage (``Fingerprint.version``). Publishing a version
        drops its lineage's older versions that no engine has attached (``_drop_superseded``). ``requester``: the pid
        whose publish request this is (its log line's ``peer_pid``); None for an entry taken over or back from the fd
        store, which nobody requested now (its ``publisher_pid`` still names who published it first).
        """
        with self._lock:
            self._check_version(entry.fingerprint)
            existing = self._entries.get(entry.digest)
            if existing is not None:
                if existing.verified or not entry.verified:
                    entry.close_fds()
                    return False
                if self.on_evict is not None:
                    self.on_evict(existing)  # the fd store forgets the unverified fds ...
                existing.take_bytes_of(entry)
                if self.on_publish is not None:
                    self.on_publish(existing)  # ... and keeps the publisher's
                log.info("entry %s, not verified, now holds the bytes pid %d published", entry.digest[:12], entry.published_by)
                return False
            victims = self._victims(entry.held_in())
            if victims and not evict:
                raise OverBudget(
                    f"entry {entry.digest[:12]} ({entry.nbytes} bytes) does not fit the budgets beside the "
                    f"{len(self._entries)} entries held; give this server budgets at least the running server's"
                )
            for victim in victims:
                self._drop(victim.digest, reason="least recently used, to stay within the byte budget", why="budget")
            self._entries[entry.digest] = entry
            if self.on_publish is not None:
                self.on_publish(entry)
            self._drop_superseded(entry.fingerprint.lineage)
        log.info(
            "published %s (%s, %d bytes, %s)",
            entry.digest[:12],
            entry.label,
            entry.nbytes,
            counted(len(entry.fds), "arena"),
            extra={**entry.log_fields(), **({"peer_pid": requester} if requester is not None else {})},
        )
        return True

    def _check_version(self, fingerprint: Fingerprint) -> None:
        """VersionConflict if another entry holds ``fingerprint``'s version of its lineage with other bytes."""
        if fingerprint.version < 1:
            return
        lineage, version, digest = fingerprint.lineage, fingerprint.version, fingerprint.digest
        for other in self._entries.values():
            fp = other.fingerprint
            if fp.version == version and fp.lineage == lineage and other.digest != digest:
                raise VersionConflict(
                    f"version {version} of {lineage[:12]} is held already with other bytes (entry {other.digest[:12]}); "
                    "publish the next version instead"
                )

    def _drop_superseded(self, lineage: str) -> None:
        """Drop the versions of ``lineage`` older than its newest that no engine has attached (under the lock).

        Only versions made by a refit (1 and up) go: the entry published from disk stays for restarts, under the budgets.
        """
        held = [e for e in self._entries.values() if e.fingerprint.lineage == lineage]
        newest = max((e.fingerprint.version for e in held), default=0)
        for entry in held:
            if 1 <= entry.fingerprint.version < newest and not entry.sessions:
                self._drop(entry.digest, reason=f"superseded by version {newest}, attached by no engine", why="superseded")

    def versions(self, lineage: str) -> list[dict]:
        """The entries of ``lineage`` (``Fingerprint.lineage``), oldest version first: ``version``, ``digest``, ``fingerprint``."""
        with self._lock:
            held = [e for e in self._entries.values() if e.fingerprint.lineage == lineage]
        held.sort(key=lambda e: e.fingerprint.version)
        return [{"version": e.fingerprint.version, "digest": e.digest, "fingerprint": e.fingerprint.to_json()} for e in held]

    def _victims(self, needed: dict[str, int], keep: str | None = None) -> list[Entry]:
        """The least recently used unattached entries (never ``keep``) whose eviction makes room for ``needed``
        (bytes per tier) within every budget.

        Decided before anything is evicted: OverBudget, naming the budget, if even all of them would not make room.
        Only entries holding bytes where room is short are evicted.
        """
        candidates: list[tuple[str | None, int | None]] = [(None, self.budgets.total)]
        candidates += [(tier, self.budgets.of(tier)) for tier in needed]
        limits = [(tier, limit) for tier, limit in candidates if limit is not None]
        if not limits:
            return []

        def held(entry: Entry, tier: str | None) -> int:
            return entry.held_bytes if tier is None else entry.held_in().get(tier, 0)

        def want(tier: str | None) -> int:
            return sum(needed.values()) if tier is None else needed.get(tier, 0)

        idle = sorted((e for e in self._entries.values() if not e.sessions and e.digest != keep), key=lambda e: e.last_used)
        for tier, limit in limits:
            attached = sum(held(e, tier) for e in self._entries.values()) - sum(held(e, tier) for e in idle)
            if attached + want(tier) > limit:
                where = "the server's budget" if tier is None else f"the {_tier_name(tier)} budget"
                raise OverBudget(
                    f"{want(tier)} bytes do not fit {where} of {limit} bytes ({attached} held by attached entries, "
                    f"{sum(held(e, tier) for e in idle)} by idle ones; nothing was evicted); "
                    "raise the budget (weightcache serve --byte-budget/--host-budget/--gpu-budget), detach engines or evict entries"
                )
        victims: dict[str, Entry] = {}
        for tier, limit in limits:
            total = sum(held(e, tier) for e in self._entries.values() if e.digest not in victims)
            for entry in idle:
                if total + want(tier) <= limit:
                    break
                if entry.digest not in victims and held(entry, tier):
                    victims[entry.digest] = entry
                    total -= held(entry, tier)
        return list(victims.values())

    def checkout(self, digest: str, connection: int, pid: int, verifies: bool = False) -> tuple[Entry, list[int]] | None:
        """Attach entry ``digest`` to ``connection``, and duplicates of its arena fds and then its table fd, made under the
        lock (the caller closes them); None if there is no such entry, or it is not verified and the client does not
        declare that it ``verifies`` one (``Entry.verified``).

        The duplicates stay valid even if the entry is evicted before the reply is sent.
        """
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or (not entry.verified and not verifies):
                return None
            entry.sessions[connection] = pid
            entry.last_used = time.monotonic()
            fds: list[int] = []
            try:
                for fd in entry.fds:
                    fds.append(os.dup(fd))
                if entry.table_fd >= 0:
                    fds.append(os.dup(entry.table_fd))
            except BaseException:
                close_fds(fds)
                entry.sessions.pop(connection, None)
                raise
            return entry, fds

    def is_unverified(self, digest: str) -> bool:
        """Whether the server holds entry ``digest`` and it is not verified (a miss then says why)."""
        with self._lock:
            entry = self._entries.get(digest)
            return entry is not None and not entry.verified

    def mark_verified(self, digest: str, connection: int, checksums: typing.Sequence[object]) -> bool:
        """Entry ``digest`` is verified: ``connection``, which has it attached, found its arenas' ``checksums`` (the
        manifest's, in order) in their bytes. True if that cleared the flag (False: verified already).

        KeyError: no such entry; PermissionError: not attached over ``connection``; ValueError: other checksums.
        """
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                raise KeyError(f"no entry {digest[:12]}; `weightcache status` lists them")
            if connection not in entry.sessions:
                raise PermissionError(
                    f"entry {digest[:12]} is not attached over this connection; attach it, check it, then say so"
                )
            declared = [arena.get("checksum") for arena in entry.manifest["arenas"]]
            if list(checksums) != declared:
                raise ValueError(
                    f"the checksums sent are not entry {digest[:12]}'s ({len(declared)} arenas); send those of its manifest"
                )
            cleared, entry.verified = not entry.verified, True
        if cleared:
            log.info("entry %s (%s) verified: its arenas match their checksums", digest[:12], entry.label)
        return cleared

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
            for victim in self._victims({HOST_TIER: max(growth, 0)}, keep=digest):
                self._drop(
                    victim.digest, reason="least recently used, to make room for an artifact within the byte budget", why="budget"
                )
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
            if entry is None or artifact is None:
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

    def locate(self, fingerprint: Fingerprint) -> list[dict]:
        """The other entries holding ``fingerprint``'s content (same ``content_digest``): GPUs first, then the host.

        Each row: the entry's fingerprint (JSON), its tier and bytes. The loader copies from one of them.
        """
        content = fingerprint.content_digest
        with self._lock:
            found = [
                e for e in self._entries.values() if e.digest != fingerprint.digest and e.fingerprint.content_digest == content
            ]
        found.sort(key=lambda e: (e.tier == HOST_TIER, -e.last_used))
        return [{"fingerprint": e.fingerprint.to_json(), "tier": e.tier, "bytes": e.nbytes} for e in found]

    def detach(self, digest: str, connection: int) -> None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                entry.sessions.pop(connection, None)
                self._drop_superseded(entry.fingerprint.lineage)

    def drop_connection(self, connection: int) -> None:
        """Forget every attachment made over ``connection`` (its engine detached or died)."""
        with self._lock:
            lineages = set()
            for entry in self._entries.values():
                if entry.sessions.pop(connection, None) is not None:
                    lineages.add(entry.fingerprint.lineage)
            for lineage in lineages:
                self._drop_superseded(lineage)

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
            self._drop(entry.digest, reason="evicted on request", why="request")
            return [entry.digest]

    def _drop(self, digest: str, reason: str, why: str) -> None:
        entry = self._entries.pop(digest)
        if why != "stopping" and self.on_evict is not None:
            self.on_evict(entry)
        entry.close_fds()
        log.info("dropped %s (%s): %s", digest[:12], entry.label, reason, extra={**entry.log_fields(), "reason": why})
        if self.on_drop is not None:
            self.on_drop(digest, why)

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

    def snapshot(self) -> list[Entry]:
        """The entries, oldest first (a handover sends them; the caller keeps the registry from changing meanwhile)."""
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.held_bytes for e in self._entries.values())

    def tiers(self) -> dict[str, dict]:
        """Per tier: bytes held and its budget (None: no limit)."""
        held: dict[str, int] = {}
        with self._lock:
            for entry in self._entries.values():
                for tier, nbytes in entry.held_in().items():
                    held[tier] = held.get(tier, 0) + nbytes
        shown = sorted(held.items(), key=lambda item: (item[0] != HOST_TIER, -item[1]))[:MAX_TIERS_SHOWN]
        return {tier[:_TIER_CHARS]: {"held": nbytes, "budget": self.budgets.of(tier)} for tier, nbytes in shown}

    def close(self, handed_over: bool = False) -> None:
        """Close every fd (the server is stopping); ``handed_over``: a successor holds every entry, so nothing is
        dropped (no eviction is counted or logged, one line says the copies went)."""
        with self._lock:
            if handed_over:
                entries = list(self._entries.values())
                self._entries.clear()
                for entry in entries:
                    entry.close_fds()
                log.info("closed this server's copies of %s: the successor holds them", counted(len(entries), "entry"))
                return
            for digest in list(self._entries):
                self._drop(digest, reason="server stopping", why="stopping")
