"""This node as a relay: while it pulls a content, it serves what it has checked so far to the node behind it.

Its record (``relays/<content>/<node>``, under the fill's lease) is listed when the pull
starts: etcd's create revision of that key is the node's place in the content's chain.
The manifest, once its sha256 matched the content record, and each arena, once read,
sealed and checksummed against it, are registered with the transport and added to the
record, in order: a reader of the record may read every region it lists. The record
goes with the lease (the fill closed, or the node died); ``close`` removes it at once
and unregisters the memory before the arenas are freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

from weightcache.core.errors import FleetUnavailable
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.node.fleet.records import Relay
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.node.fleet.transport import Region, Transport

log = logging.getLogger(__name__)


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
        self.registry.relay(self.record(), self.lease)

    def arena_checked(self, region: Region) -> None:
        """Serve the next arena (read, sealed and checksummed against the content record; ``region`` its mapping)."""
        self.link.share([region])
        self._arenas.append(region)
        self.registry.relay(self.record(), self.lease)

    def downstream_done(self) -> bool:
        """Whether no node reads from this relay any more: none is listed after it, or the next one (the only one that
        reads from this relay) has checked as many arenas as this relay holds."""
        relays, _ = self.registry.relays(self.content_digest)
        later = [r for r in relays if r.revision > self.revision]
        return not later or min(later, key=lambda r: r.revision).verified >= len(self._arenas)

    def close(self) -> None:
        """Remove the record, then unregister what it listed (before the memory is freed)."""
        with contextlib.suppress(FleetUnavailable):  # else it goes with the lease
            self.registry.drop_relay(self.content_digest)
        regions = ([self._manifest] if self._manifest is not None else []) + self._arenas
        self.link.unshare(regions)
        self._manifest, self._arenas, self._manifest_buffer = None, [], None
