"""A node's sharing agent: registers its server's entries with the transport once, and lists them in the registry.

It runs beside the server (``weightcache fleet share``), attaches each entry the server
holds (an entry back from a crash is checksummed first), registers its arenas and its
manifest's bytes with the transport, and writes a holding record under its own lease,
which it renews. An entry whose arenas differ from the fleet's record of that content
is not shared (one warning). An entry gone from the server is unregistered and its
record deleted. When the server stops answering, the agent revokes its lease (every
record of this node vanishes at once) and exits; killed, its lease runs out instead.

Shared entries stay attached: the server does not evict them to make room while they
are shared (stop the agent, or ``evict --force``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import socket
import threading
import time
import typing

import attrs

from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import FleetUnavailable, ServerUnavailable, WeightCacheError
from weightcache.core.fingerprint import canonical_json
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.records import Agent, Content, Holding, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry, renew_lease
from weightcache.core.node.fleet.transport import DEFAULT_TRANSPORT, Region, Transport, region_of_arena, transport
from weightcache.core.progress import counted
from weightcache.core.socket_dir import SocketDir

log = logging.getLogger(__name__)

POLL_S: typing.Final = 0.5


@attrs.define
class Shared:
    """One entry this node shares: its attachment (which keeps the memory mapped) and what it registered."""

    attachment: Attachment
    manifest_buffer: typing.Any = attrs.field(repr=False)
    holding: Holding
    origin: str
    """The node that read the content from the disk, as the record in force named it: a record this node writes
    again (its origin left, and the record with its lease) keeps that name."""


class Sharer:
    """Shares the entries of the server at ``socket_dir`` with the fleet ``config`` names, over ``transport_name``."""

    def __init__(self, config: FleetConfig, socket_dir: SocketDir | None, transport_name: str = DEFAULT_TRANSPORT):
        self.config = config
        self.socket_dir = socket_dir
        self.registry = FleetRegistry(config)
        self.link: Transport = transport(
            transport_name, f"{config.node}-share-{os.getpid()}-{secrets.token_hex(4)}", config.devices
        )
        self.shared: dict[str, Shared] = {}
        self.refused: set[str] = set()
        self.lease = 0
        self._lease_lost = threading.Event()
        self._registry_down = False

    def run(self, stop: threading.Event, poll_s: float = POLL_S) -> int:
        """Share until ``stop`` is set (0) or the server goes away (3); the lease is revoked either way."""
        finished = threading.Event()
        # On a thread of its own: registering a large entry with the transport, or a slow server, must not hold the
        # renewal past the lease's TTL (the node's records would vanish while it still holds them).
        renewer = threading.Thread(
            target=renew_lease,
            args=(self.registry, lambda: self.lease, finished, self._ran_out),
            name="weightcache-fleet-lease",
            daemon=True,
        )
        renewer.start()
        listed = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    with Connection(self.socket_dir) as connection:
                        entries = connection.status().get("entries", [])
                except ServerUnavailable as exc:
                    log.warning("weightcache: the server stopped answering (%s); leaving the fleet", exc)
                    return 3
                try:
                    if not self.lease or self._lease_lost.is_set():
                        self._lease_lost.clear()
                        self.lease = self.registry.store.grant(self.config.lease_ttl_s)
                        self._take_name()
                        self._hold_all()  # again, after a lease that ran out while the registry was away
                        listed = time.monotonic()
                    elif time.monotonic() - listed >= self.config.lease_ttl_s:
                        # A content record lives under the lease of the node that declared it first: when that node
                        # leaves, the record goes with it, and a holder's declare puts it back under its own lease.
                        self._hold_all()
                        listed = time.monotonic()
                    self.sync(entries)
                    if self._registry_down:
                        log.warning(
                            "weightcache: the fleet registry answers again; sharing %s", counted(len(self.shared), "entry")
                        )
                    self._registry_down = False
                except FleetUnavailable as exc:
                    if not self._registry_down:
                        log.warning("weightcache: %s", exc)
                    self._registry_down = True
                stop.wait(poll_s)
            return 0
        finally:
            finished.set()
            renewer.join(timeout=5)
            self.close()

    def _take_name(self) -> None:
        """Hold this node's name (``nodes/<node>``) under the lease; ValueError when another live agent holds it."""
        me = Agent(self.config.node, socket.gethostname() or "localhost", os.getpid(), str(self.socket_dir or "default"))
        other = self.registry.take_name(me, self.lease)
        if other is not None and other.host == me.host and not _alive(other.pid):
            self.registry.store.delete(self.config.key("nodes", me.node))  # (killed before its lease ran out)
            other = self.registry.take_name(me, self.lease)
        if other is not None:
            raise ValueError(
                f"node name {me.node!r} is taken by another sharing agent (pid {other.pid} on {other.host}, sharing "
                f"{other.socket_dir}); give each server's agent a name of its own (WEIGHTCACHE_FLEET_NODE)"
            )

    def _ran_out(self, lease: int) -> None:
        if lease == self.lease:
            self._lease_lost.set()  # its records are gone; the loop lists them under a new one

    def sync(self, entries: list) -> None:
        """Share every entry of ``entries`` (the server's status rows) not shared yet; unshare those gone."""
        held = {row["digest"] for row in entries if isinstance(row, dict) and isinstance(row.get("digest"), str)}
        for digest in [d for d in self.shared if d not in held]:
            self.unshare(digest)
        changed = False
        for digest in sorted(held - set(self.shared) - self.refused):
            try:
                changed |= self.share(digest)
            except (WeightCacheError, OSError, ValueError) as exc:
                if isinstance(exc, FleetUnavailable):
                    raise
                self.refused.add(digest)
                log.warning("weightcache: not sharing entry %s: %s", digest[:12], exc)
        if changed:
            self._hold_all()

    def share(self, digest: str) -> bool:
        """Attach entry ``digest``, register it and declare its content; False when it is not shared (refused)."""
        attachment = Attachment.by_digest(digest, self.socket_dir)
        try:
            if attachment.unverified:
                attachment.verify()  # back from a crash: checksummed before anyone pulls it
            data = canonical_json(attachment.manifest.to_json()).encode()
            buffer = ctypes.create_string_buffer(data, len(data))
            manifest_region = Region(ctypes.addressof(buffer), len(data))
            arenas = [region_of_arena(arena) for arena in attachment.arenas]
            reach = self.link.share([manifest_region, *arenas])
            sha = manifest_sha256(data)
            mine = Content(
                attachment.fingerprint,
                sha,
                len(data),
                tuple((spec.size, typing.cast(str, spec.checksum)) for spec in attachment.manifest.arenas),
                self.config.node,
            )
            in_force = self.registry.declare(mine, self.lease)
            if (in_force.manifest_sha256, in_force.arenas) != (mine.manifest_sha256, mine.arenas):
                self.link.unshare([manifest_region, *arenas])
                self.refused.add(digest)
                log.warning(
                    "weightcache: entry %s holds other arenas than the fleet's record of its content (declared by node "
                    "%s); not sharing it. Evict it and load it again",
                    digest[:12],
                    in_force.origin,
                )
                attachment.close()
                return False
        except BaseException:
            attachment.close()
            raise
        holding = Holding(self.config.node, attachment.fingerprint, sha, self.link.name, reach, manifest_region, tuple(arenas))
        self.shared[digest] = Shared(attachment, buffer, holding, in_force.origin)
        log.info("weightcache: sharing %s (%s, %d bytes)", digest[:12], attachment.label, mine.nbytes)
        return True

    def _hold_all(self) -> None:
        """(Re)write every holding with the transport's current reach (it grows with each registration)."""
        if not self.lease:
            return
        reach = self.link.share([])
        for digest, shared in self.shared.items():
            shared.holding = attrs.evolve(shared.holding, reach=reach)
            self.registry.hold(shared.holding, self.lease)
            content = Content(
                shared.attachment.fingerprint,
                shared.holding.manifest_sha256,
                shared.holding.manifest.length,
                tuple((spec.size, typing.cast(str, spec.checksum)) for spec in shared.attachment.manifest.arenas),
                shared.origin,
            )
            self.registry.declare(content, self.lease)  # its origin may have left: the record stays while a holder does
            log.debug("weightcache: listed %s in the fleet", digest[:12])

    def unshare(self, digest: str) -> None:
        shared = self.shared.pop(digest)
        with contextlib.suppress(FleetUnavailable):
            self.registry.drop(shared.holding.fingerprint.content_digest)
        self.link.unshare([shared.holding.manifest, *shared.holding.arenas])
        shared.attachment.close()
        log.info("weightcache: stopped sharing %s (gone from the server)", digest[:12])

    def close(self) -> None:
        """Revoke the lease (this node's records vanish), unregister everything, detach."""
        if self.lease:
            with contextlib.suppress(FleetUnavailable):
                self.registry.store.revoke(self.lease)
            self.lease = 0
        for digest in list(self.shared):
            shared = self.shared.pop(digest)
            self.link.unshare([shared.holding.manifest, *shared.holding.arenas])
            shared.attachment.close()
        self.link.close()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host (this PID namespace) still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True
