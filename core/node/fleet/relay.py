"""This node as a relay: while it pulls a content, it serves what it has checked so far to the node behind it.

Its record (``relays/<content>/<node>``, under the fill's lease) is listed when the pull
starts: etcd's create revision of that key is the node's place in the content's chain.
The manifest, once its sha256 matched the content record, and each arena, once read,
sealed and checksummed against it, are registered with the transport and added to the
record, in order: a reader of the record may read every region it lists. The record
goes with the lease (the fill closed, or the node died); ``close`` removes it at once
and unregisters the memory before the arenas are freed.

The arena being read lands first in a landing buffer of its own (anonymous memory,
registered), listed in the record as its bytes land (``Landing``), so the node behind
reads it piece by piece while it arrives instead of one whole arena later; once it is
all there it is copied into the entry's arena, which is sealed and checked as before.
(Not the arena itself: sealing unmaps its writable mapping, which a read still in
flight would then read from.) A landing buffer's memory is freed once the next relay
listed behind this one (the one that reads from it) has checked that arena, and its mapping
(zeros by then) only when the transport has closed. At most
``LANDING_BUFFERS`` are kept: past that (a node behind has stalled) the next arenas
land in the entry directly and are served once checked, as whole arenas.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import time
import typing

from weightcache.core.errors import FleetUnavailable
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node.fleet.records import Landing, Relay
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.node.fleet.transport import Region, Transport

log = logging.getLogger(__name__)

LANDING_BUFFERS: typing.Final = 3
"""Landing buffers kept at most: the arena landing now and two that a node behind may still be reading."""
LIST_EVERY_S: typing.Final = 0.1
"""The record is written again as bytes land at most this often (the node behind wakes on each write: an etcd watch)."""


class Relaying:
    """This node's relay record of ``fingerprint``'s content under ``lease``, and the regions it has registered."""

    def __init__(self, registry: FleetRegistry, fingerprint: Fingerprint, link: Transport, lease: int):
        self.registry = registry
        self.fingerprint = fingerprint
        self.link = link
        self.lease = lease
        self.revision = 0
        self._manifest_buffer: ctypes.Array | None = None
        self._manifest: Region | None = None
        self._arenas: list[Region] = []
        self._landing: Landing | None = None
        self._buffers: dict[int, tuple[mmap.mmap, Region]] = {}
        """Landing buffers by arena index, registered; freed once the next relay behind has checked that arena."""
        self._spent: list[mmap.mmap] = []
        """Landing buffers no longer listed that a read may still reach: unmapped once the transport has closed."""
        self._listed_at = 0.0
        self._unlisted = False

    @property
    def content_digest(self) -> str:
        return self.fingerprint.content_digest

    def record(self) -> Relay:
        return Relay(
            self.registry.config.node,
            self.fingerprint,
            self.link.name,
            self.link.share([]),
            self._manifest,
            tuple(self._arenas),
            self._landing,
            self.revision,
        )

    def list(self) -> int:
        """List the record (nothing checked yet); its create revision, this node's place in the chain."""
        self.registry.relay(self.record(), self.lease)
        relays, _ = self.registry.relays(self.content_digest)
        mine = next((r for r in relays if r.node == self.registry.config.node), None)
        if mine is None:
            raise FleetUnavailable(self.registry.config.endpoints, "this node's relay record was not listed")
        self.revision = mine.revision
        return self.revision

    def manifest_checked(self, data: bytes) -> None:
        """Serve the manifest (its sha256 matched the content record)."""
        self._manifest_buffer = ctypes.create_string_buffer(data, len(data))
        region = Region(ctypes.addressof(self._manifest_buffer), len(data))
        self.link.share([region])
        self._manifest = region
        self._list()

    def arena_checked(self, region: Region) -> None:
        """Serve the next arena (read, sealed and checksummed against the content record; ``region`` its mapping)."""
        self.link.share([region])
        self._arenas.append(region)
        self._landing = None
        self._list()

    def landing_buffer(self, index: int, size: int) -> Region | None:
        """A registered buffer for arena ``index`` to land in, listed with nothing landed yet; None when
        ``LANDING_BUFFERS`` are held (a node behind has not checked theirs): the arena then lands in the entry."""
        self._free_passed()
        if len(self._buffers) >= LANDING_BUFFERS:
            return None
        buffer = mmap.mmap(-1, size)
        pointer = ctypes.c_char.from_buffer(buffer)
        region = Region(ctypes.addressof(pointer), size)
        del pointer  # (an exported pointer would keep the buffer from being closed)
        self.link.share([region])
        self._buffers[index] = (buffer, region)
        self._landing = Landing(index, 0, region)
        self._unlisted = True
        self.list_landed()
        return region

    def landed(self, index: int, nbytes: int) -> None:
        """The first ``nbytes`` of arena ``index`` have landed in its buffer: list them (at most every ``LIST_EVERY_S``)."""
        if self._landing is None or self._landing.arena != index:
            return
        self._landing = Landing(index, nbytes, self._landing.region)
        self._unlisted = True
        if time.monotonic() - self._listed_at >= LIST_EVERY_S:
            self.list_landed()

    def list_landed(self) -> None:
        """List what has landed since the record was last written, if anything has (``landed`` waits between writes).

        The registry out of reach costs nothing here: the node behind sees the pieces later, or reads the arena once
        it is checked (whose listing does raise)."""
        if self._unlisted:
            try:
                self._list()
            except FleetUnavailable as exc:
                log.debug("weightcache: listing the landed bytes of %s: %s", self.fingerprint.short, exc)

    def landing_failed(self, index: int) -> None:
        """A read into arena ``index``'s buffer broke off: unlist it; it is freed once the transport has closed."""
        held = self._buffers.pop(index, None)
        if held is not None:
            self.link.unshare([held[1]])
            self._spent.append(held[0])
        if self._landing is not None and self._landing.arena == index:
            self._landing, self._unlisted = None, True
            self.list_landed()

    def _free_passed(self) -> None:
        """Free the landing buffers of arenas the next relay behind this one has checked: only it reads a buffer while
        the arena lands (a node that turns to this relay when the one between fails reads the arenas it lacks as
        checked arenas, and a landing buffer only from the arena landing then). Their memory goes at once; their
        mappings stay until the transport has closed, so a read that comes late anyway (a node behind that says it
        checked more than it did) reads zeros, which its checksum refuses, and never unmapped memory in this process."""
        done = [index for index in self._buffers if self._landing is None or index != self._landing.arena]
        if not done:
            return
        try:
            relays, _ = self.registry.relays(self.content_digest)
        except FleetUnavailable as exc:  # kept until the next look, or until the transport has closed
            log.debug("weightcache: reading the relays behind this node: %s", exc)
            return
        behind = [r for r in relays if r.revision > self.revision]
        passed = min(behind, key=lambda r: r.revision).verified if behind else len(self._arenas)
        for index in done:
            if index < passed:
                buffer, region = self._buffers.pop(index)
                self.link.unshare([region])
                buffer.madvise(mmap.MADV_REMOVE)  # its memory goes now; its mapping when the transport has closed
                self._spent.append(buffer)

    def _list(self) -> None:
        self.registry.relay(self.record(), self.lease)
        self._listed_at, self._unlisted = time.monotonic(), False

    def downstream_done(self) -> bool:
        """Whether no node reads from this relay any more: none is listed after it, or the next one (the only one that
        reads from this relay) has checked as many arenas as this relay holds."""
        relays, _ = self.registry.relays(self.content_digest)
        later = [r for r in relays if r.revision > self.revision]
        return not later or min(later, key=lambda r: r.revision).verified >= len(self._arenas)

    def close(self) -> tuple[mmap.mmap, ...]:
        """Remove the record, then unregister what it listed (before the memory is freed); returns the landing
        buffers, for the caller to close once the transport has closed (a read may still reach them until then)."""
        with contextlib.suppress(FleetUnavailable):  # else it goes with the lease
            self.registry.drop_relay(self.content_digest)
        regions = ([self._manifest] if self._manifest is not None else []) + self._arenas
        regions += [region for _, region in self._buffers.values()]
        self.link.unshare(regions)
        buffers = (*self._spent, *(buffer for buffer, _ in self._buffers.values()))
        self._manifest, self._arenas, self._manifest_buffer, self._landing = None, [], None, None
        self._buffers, self._spent = {}, []
        return buffers
