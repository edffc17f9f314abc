"""An engine's attachment to a cached entry: the connection, the mapped arenas and the tensors.

Also the one rule for when a ``client`` falls back to a disk load instead of
raising (``fallback_reason``): a cache miss is always safe, a wrong hit never is.
"""

from __future__ import annotations

import logging
import os
import time
import typing

from weightcache.core.arena import backend
from weightcache.core.arena.checksum import check_mapped, mismatched
from weightcache.core.client.client import Connection
from weightcache.core.client.replies import PublishReply
from weightcache.core.errors import (
    AccessDenied,
    ArenaError,
    CheckpointNotFound,
    EntryCorrupt,
    EntryNotFound,
    EntryUnusable,
    InvalidCheckpoint,
    LayoutMismatch,
    NotRegularFile,
    ServerError,
    ServerUnavailable,
    VersionNotFound,
    WeightCacheError,
)
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.gc_pause import gc_paused
from weightcache.core.socket_dir import SocketDir, SocketDirLike
from weightcache.core.wire.protocol import close_fds

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.arena.base import Arena
    from weightcache.core.client.watch import Republisher
    from weightcache.core.layout.manifest import Manifest

log = logging.getLogger(__name__)

# What decoding, checking, mapping or viewing an entry raises when its manifest does not fit this process.
_UNUSABLE = (ValueError, TypeError, OverflowError, RuntimeError, ArenaError)


class Attachment:
    """A mapped entry. Keep it alive as long as the model uses its tensors; ``close()`` detaches.

    It keeps the entry's fds, so it can publish the entry again to a restarted
    server without touching the disk (``reattach``, driven by ``watch``).

    ``unverified``: the server handed over an entry nobody has checksummed since a crash; ``verify`` (or, for a
    caller that checks the bytes its own way, ``confirm_verified``) clears it.
    """

    def __init__(
        self,
        connection: Connection,
        fingerprint: Fingerprint,
        digest: str,
        manifest: "Manifest",
        fds,
        label: str,
        map_on: int | None = None,
    ):
        self.connection: Connection | None = connection
        self.fingerprint = fingerprint
        self.digest = digest
        self.manifest = manifest
        self.label = label
        self.fds = list(fds)
        self.socket_dir: SocketDir | None = None
        self.watcher: Republisher | None = None
        self.arenas: list[Arena] = []
        self.timings: dict[str, float] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.unverified = False
        try:
            if len(self.fds) != len(manifest.arenas):
                raise ValueError(f"the manifest lists {len(manifest.arenas)} arenas but {len(self.fds)} fds came")
            start = time.perf_counter()
            for fd, spec in zip(self.fds, manifest.arenas, strict=True):
                self.arenas.append(_map(fd, spec, map_on))
            self.timings["map_s"] = time.perf_counter() - start
            start = time.perf_counter()
            self.tensors = manifest.views(self.arenas)
            self.timings["views_s"] = time.perf_counter() - start
        except _UNUSABLE as exc:
            self.close()
            raise EntryUnusable(digest, f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(
        cls,
        fingerprint: Fingerprint,
        socket_dir: SocketDirLike = None,
        timeout: float = 30.0,
        map_on: int | None = None,
        checked_by_caller: bool = False,
    ) -> "Attachment":
        """Ask the server at ``socket_dir`` for ``fingerprint`` and map the answer.

        ``map_on``: map CUDA arenas for this GPU index over peer access, wherever they live (a peer fill).
        An entry not verified since a server crash is checksummed here before it is returned (``verify``), unless
        the caller checks the bytes its own way (``checked_by_caller``: a fill checks its copy) and then calls
        ``confirm_verified``.

        Raises ServerUnavailable, AccessDenied, ServerError, FingerprintMismatch,
        EntryNotFound, EntryUnusable or EntryCorrupt. Whatever fails, every fd received and
        the connection are closed.
        """
        attachment = cls._open(
            lambda connection: connection.attach(fingerprint, verifies=True), fingerprint, socket_dir, timeout, map_on
        )
        if attachment.unverified and not checked_by_caller:
            try:
                attachment.verify()  # closes it and raises EntryCorrupt on a mismatch
            except BaseException:
                attachment.close()
                raise
        return attachment

    @classmethod
    def by_digest(cls, digest: str, socket_dir: SocketDirLike = None, timeout: float = 30.0) -> "Attachment":
        """Map the entry whose full digest is ``digest`` (as ``status`` lists it), whatever its fingerprint: a scrub's
        attach (it checks every arena itself and calls ``confirm_verified``)."""
        return cls._open(lambda connection: connection.attach_digest(digest, verifies=True), None, socket_dir, timeout, None)

    @classmethod
    def _open(
        cls, ask, fingerprint: Fingerprint | None, socket_dir: SocketDirLike, timeout: float, map_on: int | None
    ) -> "Attachment":
        """Attach with ``ask(connection)`` and map the reply; ``fingerprint`` None: the one the reply carries."""
        start = time.perf_counter()
        socket_dir = SocketDir.parse(socket_dir)
        connection = Connection(socket_dir, timeout=timeout)
        try:
            reply = ask(connection)
        except BaseException:
            connection.close()
            raise
        requested = time.perf_counter()
        try:
            manifest = reply.manifest()
            if fingerprint is None:
                fingerprint = Fingerprint.from_json(reply.fingerprint or {})
        except BaseException as exc:
            close_fds(reply.fds)
            connection.close()
            if isinstance(exc, _UNUSABLE):
                raise EntryUnusable(reply.digest, f"{type(exc).__name__}: {exc}") from exc
            raise
        decoded = time.perf_counter()
        attachment = cls(connection, fingerprint, reply.digest, manifest, reply.fds, reply.label, map_on)
        attachment.socket_dir = socket_dir
        attachment.unverified = reply.verify
        attachment.timings.update(request_s=requested - start, manifest_s=decoded - requested)
        return attachment

    def verify(self) -> None:
        """Checksum every mapped arena (each where it lives) against the manifest and tell the server they matched.

        On a mismatch the entry is dropped from the server unless other engines have it attached, this attachment is
        closed and EntryCorrupt raised (a ``client`` falls back to the disk on it).
        """
        start = time.perf_counter()
        bad = mismatched(self.arenas)
        self.timings["verify_s"] = time.perf_counter() - start
        if not bad:
            self.confirm_verified()
            return
        index, actual = bad[0]
        expected = self.arenas[index].spec.checksum
        for arena, checksum in bad:  # the error names the first; the mode runner's fallback is the one warning
            log.debug("weightcache: entry %s: arena %d does not match its checksum (%s)", self.digest[:12], arena, checksum)
        pids: tuple[int, ...] | None = ()
        try:
            if self.connection is not None:
                self.connection.detach(self.digest)  # this process keeps nothing of it
                pids = self.connection.drop_corrupt(self.digest)
        except WeightCacheError as exc:
            log.warning("weightcache: could not drop the corrupt entry %s from the server: %s", self.digest[:12], exc)
        finally:
            self.close()
        raise EntryCorrupt(self.digest, index, expected, actual, pids or (), dropped=pids is None)

    def confirm_verified(self) -> None:
        """Tell the server the bytes of this (unverified) entry matched its checksums; nothing if it is verified."""
        if self.unverified and self.connection is not None:
            self.connection.verified(self.digest, [arena.spec.checksum for arena in self.arenas])
        self.unverified = False

    def reattach(self) -> bool:
        """After a server restart: publish this entry again from the fds held here and attach to it anew.

        Returns whether this engine's publish created the entry (False: another engine was first).
        The mapped arenas are checksummed first (each where it lives) and must match the
        manifest's checksums: ChecksumMismatch, and nothing published, if they do not.
        """
        connection = Connection(self.socket_dir)  # first: while no server answers, nothing is checksummed
        try:
            check_mapped(
                self.arenas,
                "this engine's mapping",
                "The mapped bytes changed since they were published: restart this engine from disk (`weightcache load`)",
            )
            created = PublishReply.from_json(
                connection.publish(self.fingerprint, self.manifest, self.fds, label=self.label)
            ).created
            reply = connection.attach(self.fingerprint)
            close_fds(reply.fds)  # this engine keeps the fds it already holds
        except BaseException:
            connection.close()
            raise
        old, self.connection = self.connection, connection
        if old is not None:
            old.close()
        return created

    @property
    def version(self) -> int:
        """The version of its model this attachment maps (0: the one published from disk; see ``fetch_version``)."""
        return self.fingerprint.version

    @gc_paused()  # a full collection of an engine's heap would outlast the fetch
    def fetch_version(self, version: int | None = None, timeout: float = 30.0) -> "Attachment | None":
        """Attach version ``version`` of this entry's model (None: the newest the server holds) beside this one, map it,
        checksum every arena and check it has this entry's layout; None when it is the version mapped here already.

        Nothing changes for the tensors of this attachment: ``switch_to`` does that, when the engine chooses (between
        two steps). VersionNotFound when the server holds no such version, EntryCorrupt when its bytes fail their
        checksums, LayoutMismatch when its layout differs (each time nothing is kept attached).
        """
        with Connection(self.socket_dir, timeout=timeout) as connection:
            held = connection.versions(self.fingerprint.lineage)
        wanted = [row for row in held if row.version == version] if version is not None else held[-1:]
        if not wanted:
            raise VersionNotFound(self.fingerprint.lineage, version, [row.version for row in held])
        target = wanted[0]
        if target.digest == self.digest:
            return None
        pending = Attachment.open(target.fingerprint, self.socket_dir, timeout=timeout, checked_by_caller=True)
        try:
            pending.verify()  # every version is checksummed where it is mapped before any engine switches to it
            difference = self.manifest.layout_difference(pending.manifest)
            if difference is not None:
                raise LayoutMismatch(f"version {target.version} ({target.digest[:12]})", difference)
        except BaseException:
            pending.close()
            raise
        pending.tensors = {}
        for arena in pending.arenas:
            arena.unmap()  # the switch maps the memory itself: unmapping what the checksum read costs nothing then
        return pending

    @gc_paused()  # the engine cannot step meanwhile: no full collection of its heap in between
    def switch_to(self, pending: "Attachment") -> None:
        """Show ``pending``'s bytes (from ``fetch_version``) at this attachment's addresses and become it.

        Every tensor, CUDA graph and compiled kernel that holds this attachment's addresses reads the new version
        afterwards; the old version's connection is closed (the server frees the version once no engine maps it, and
        the watcher, if any, watches the new one). Call it between two
        steps: nothing may read the weights meanwhile. If an arena cannot be switched, those switched already get their
        old memory back and the error is raised: the engine keeps running on its old version, never on a mix.
        """
        if pending is self or len(pending.arenas) != len(self.arenas) or pending.connection is None:
            raise ValueError("switch to an attachment fetch_version returned, and only once")
        start = time.perf_counter()
        switched = 0
        try:
            for mine, theirs in zip(self.arenas, pending.arenas, strict=True):
                mine.take_memory_of(theirs)
                switched += 1
        except BaseException:
            self._switch_back(switched)
            raise
        self.timings["switch_s"] = time.perf_counter() - start
        # The old version's fds are closed while the server still holds it (its session is open): if it is freed, its
        # pages are freed in the server, not in this engine's thread.
        close_fds(self.fds)
        self.fds, pending.fds = pending.fds, []
        pending.tensors = {}
        for arena in pending.arenas:
            arena.close()  # its own handle of the new version; this attachment's arenas hold the memory now
        pending.arenas = []
        watching = self.watcher is not None
        if self.watcher is not None:  # it reads the old connection's socket (and shuts it down)
            self.watcher.stop()
            self.watcher = None
        old_connection, self.connection, pending.connection = self.connection, pending.connection, None
        self.fingerprint, self.digest, self.manifest, self.label = (
            pending.fingerprint,
            pending.digest,
            pending.manifest,
            pending.label,
        )
        pending.close()
        if old_connection is not None:
            old_connection.close()  # the server forgets this engine's session of the old version as it sees it close
        if watching:
            self.watch()

    def _switch_back(self, count: int) -> None:
        """Map the old version (still held in ``self.fds``) back under the first ``count`` arenas after a failed switch."""
        for arena, fd, spec in list(zip(self.arenas, self.fds, self.manifest.arenas, strict=False))[:count]:
            old = backend(spec.backend).map(fd, spec)
            try:
                arena.take_memory_of(old)
            finally:
                old.close()

    def watch(self, poll_s: float = 0.2) -> None:
        """Re-publish this entry whenever the server restarts (a background thread; see ``core.watch``)."""
        from weightcache.core.client.watch import Republisher

        if self.watcher is None:
            self.watcher = Republisher(self, poll_s)
            self.watcher.start()

    def close(self) -> None:
        """Drop the tensors, unmap the arenas, close the fds and the connection (idempotent)."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        self.tensors = {}
        for arena in self.arenas:
            arena.close()
        self.arenas = []
        close_fds(self.fds)
        self.fds = []
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def __repr__(self) -> str:
        return f"<Attachment {self.digest[:12]} {self.label} pid={os.getpid()} arenas={len(self.arenas)}>"


def _map(fd: int, spec, map_on: int | None) -> "Arena":
    if map_on is not None and spec.backend == "cuda":
        return backend("cuda").map(fd, spec, on_device=map_on)
    return backend(spec.backend).map(fd, spec)


_FALLBACKS = (
    (ServerUnavailable, "no_server"),
    (AccessDenied, "access_denied"),
    (ServerError, "busy"),  # only ``busy``: another server error is a bug to show
    (EntryNotFound, "not_found"),  # a fingerprint mismatch too: its message names the fields
    (EntryUnusable, "unusable"),
    (EntryCorrupt, "corrupt"),  # back from a crash with other bytes: dropped, never used
    (CheckpointNotFound, "not_cacheable"),  # a hub id not in the local cache, ``.bin`` weights only
    (InvalidCheckpoint, "not_cacheable"),  # a file weightcache cannot read (the engine's own load decides)
)


def fallback_kind(exc: BaseException) -> str | None:
    """Which reason a ``client`` has to load from disk instead of raising ``exc``, or None when it must raise.

    A missing or refusing server, an untrusted one (AccessDenied), a busy one, no matching
    entry (or one not verified since a crash), an entry this process cannot use, one whose bytes
    failed their checksums here, or a checkpoint the cache cannot serve: each only
    costs the disk load, whose own errors are the engine's as without weightcache. Anything
    else (a rebind that does not fit, a FIFO or device in a weight file's place, a bug) raises. The kinds are the server's fallback
    metric's reasons (``weightcache.core.server.metrics.FALLBACK_KINDS``) where a server is told.
    """
    if isinstance(exc, ServerError) and exc.code != "busy":
        return None
    if isinstance(exc, NotRegularFile):
        return None  # the disk load would wait on a FIFO for ever: raise, in one line
    return next((kind for cls, kind in _FALLBACKS if isinstance(exc, cls)), None)


def fallback_reason(exc: BaseException) -> str | None:
    """Why a ``client`` may load from disk instead of raising ``exc`` (one line; see ``fallback_kind``), or None."""
    return str(exc) if fallback_kind(exc) is not None else None
