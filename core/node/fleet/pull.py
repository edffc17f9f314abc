"""Filling an entry from another node of the fleet before reading the disk, and claiming the disk read otherwise.

A node that misses locally asks the registry for holders of the content it wants
(``Fingerprint.content_digest``). It reads a holder's manifest and arenas with the
transport's one-sided reads into arenas of its own, and keeps them only when

- the holder's record and the content record are signed with the fleet's secret;
- the manifest it read has the sha256 the content record declares, and declares the
  content record's arena sizes and checksums;
- every arena, checksummed here (on this GPU for a GPU's arenas), matches.

Anything else costs one warning line and the next holder is tried; nothing is
published before every byte arrived and matched. A holder serves ``config.fanout``
readers at once (reader slots under each reader's lease): a node that finds every slot
taken waits for one, and a node that has finished pulling holds the entry and serves in
turn, so many new nodes fill as a tree, not all from one. With no holder, the node claims the
disk read (one claim per content, under a lease): the first claimant reads, the others
wait for a holder to appear (its claimant, once it has published and shared the entry)
and pull from it. A claimant that dies loses its claim with its lease; a waiter then
claims in turn. The registry unreachable or slow: one warning line, and the disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import secrets
import threading
import time
import typing

import attrs

from weightcache.core.errors import BackendUnavailable, FleetUnavailable, PullFailed, WeightCacheError
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.records import Content, Holding, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry, renew_lease
from weightcache.core.node.fleet.transport import Region, Transport, transport
from weightcache.core.node.seeding import check_sizes

if typing.TYPE_CHECKING:
    from weightcache.core.load.export import ArenaBuilder

log = logging.getLogger(__name__)

POLL_S: typing.Final = 0.25
"""How often a node waiting for a claimant looks for a holder again."""
SHARED_WAIT_S: typing.Final = 10.0
"""How long a claimant that published waits for its node's sharing agent to list the entry before it lets go (an
agent on a loaded 2-core machine took more than 5 s to register and list an entry)."""
MIN_RATE_BYTES_S: typing.Final = 50 << 20
"""A read slower than this (plus ``READ_GRACE_S``) is abandoned: the holder is gone or stalled."""
READ_GRACE_S: typing.Final = 10.0
WAIT_SLOT: typing.Final = "a slot"
WAIT_RECORD: typing.Final = "the content record"


@attrs.frozen
class Pulled:
    """An entry pulled from ``node``: the manifest of this node's arenas, how the bytes went, and the seconds taken."""

    node: str
    path: str
    manifest: Manifest = attrs.field(eq=False)
    timings: dict = attrs.field(eq=False)

    @property
    def source(self) -> str:
        """How logs and ``Published.source`` name it: ``node b over host memory to host memory (NIXL/UCX)``."""
        return f"node {self.node} over {self.path}"


class Filling:
    """One entry's fill from the fleet (inert without a fleet): ``pull``, else read the disk, then ``published``.

    Use as a context manager: leaving it revokes its lease, which releases a claim.
    """

    def __init__(self, fingerprint: Fingerprint | None, config: FleetConfig | None, may_claim: bool = True):
        self.fingerprint = fingerprint
        self.config = config
        self.may_claim = may_claim
        self.registry = FleetRegistry(config) if config is not None else None
        self.claimed = False
        self._lease = 0
        self._transport: Transport | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._warned: set[str] = set()
        self._recordless_since: float | None = None

    @classmethod
    def from_env(cls, fingerprint: Fingerprint | None, may_claim: bool = True) -> "Filling":
        """The fleet the environment names (``FleetConfig.from_env``); a bad setting costs a warning and no fleet."""
        try:
            config = FleetConfig.from_env()
        except ValueError as exc:
            log.warning("weightcache: not using the fleet: %s", exc)
            config = None
        return cls(fingerprint, config, may_claim)

    def __enter__(self) -> "Filling":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pull(self, builder: "ArenaBuilder") -> Pulled | None:
        """Fill ``builder`` (empty) from a holder, waiting for a claimant where one reads the disk; None: read the disk.

        After None, ``claimed`` says whether this node holds the claim (then call ``published`` once it has published).
        """
        if self.registry is None or self.fingerprint is None:
            return None
        try:
            return self._pull(builder, self.registry, self.fingerprint)
        except FleetUnavailable as exc:
            log.warning("weightcache: %s", exc)
        except BackendUnavailable as exc:
            log.warning("weightcache: not pulling from the fleet: %s", exc)
        builder.reset()
        return None

    def _pull(self, builder: "ArenaBuilder", registry: FleetRegistry, fingerprint: Fingerprint) -> Pulled | None:
        content_digest = fingerprint.content_digest
        config = registry.config
        tried: set[str] = set()
        deadline = time.monotonic() + config.wait_s
        waiting_for = None
        while True:
            pulled, wait = self._from_holders(builder, registry, fingerprint, tried)
            if pulled is not None:
                return pulled
            if wait is not None:  # holders that will serve soon: a slot frees, or the content record is listed again
                if waiting_for != wait:
                    waiting_for = wait
                    if wait == WAIT_SLOT:
                        log.info(
                            "weightcache: every holder of %s serves %d nodes already; waiting for a free slot",
                            fingerprint.short,
                            config.fanout,
                        )
                    else:
                        log.info(
                            "weightcache: the fleet's record of %s left with the node that wrote it; waiting while "
                            "a holder lists it again",
                            fingerprint.short,
                        )
                if time.monotonic() > deadline:
                    log.warning(
                        "weightcache: no holder of %s had a free slot for %.0f s; reading the disk (%s)",
                        fingerprint.short,
                        config.wait_s,
                        "WEIGHTCACHE_FLEET_WAIT_S sets the wait, WEIGHTCACHE_FLEET_FANOUT the readers per holder",
                    )
                    return None
                time.sleep(POLL_S)
                continue
            if not self.may_claim:
                return None
            other = registry.claim(content_digest, self._leased(registry))
            if other is None:
                self.claimed = True
                log.info("weightcache: no node of the fleet holds %s; this node reads it from the disk", fingerprint.short)
                return None
            if waiting_for != other.node:
                waiting_for = other.node
                log.info("weightcache: node %s is reading %s from the disk; waiting to pull it", other.node, fingerprint.short)
            if time.monotonic() > deadline:
                log.warning(
                    "weightcache: node %s still reads %s after %.0f s; reading the disk here too (%s)",
                    other.node,
                    fingerprint.short,
                    config.wait_s,
                    "WEIGHTCACHE_FLEET_WAIT_S sets the wait",
                )
                return None
            time.sleep(POLL_S)

    def _leased(self, registry: FleetRegistry) -> int:
        """This fill's lease (granted on first use, renewed until ``close``): its claim and its reader slots."""
        if not self._lease:
            self._lease = registry.store.grant(registry.config.lease_ttl_s)
            self._keeper = threading.Thread(
                target=renew_lease, args=(registry, lambda: self._lease, self._stop), name="weightcache-fleet-lease", daemon=True
            )
            self._keeper.start()
        return self._lease

    def _from_holders(
        self, builder: "ArenaBuilder", registry: FleetRegistry, fingerprint: Fingerprint, tried: set[str]
    ) -> tuple[Pulled | None, str | None]:
        """A pull from the first untried holder with a free slot; else None, and what to wait for before asking again
        (``WAIT_SLOT``, ``WAIT_RECORD``; None: no holder will serve)."""
        content_digest = fingerprint.content_digest
        holdings, problems = registry.holdings(content_digest)
        holdings = [h for h in holdings if h.node not in tried]
        new = [problem for problem in problems if problem not in self._warned]
        if new:
            self._warned.update(new)
            _warn_left_out(fingerprint, new)
        if not holdings:
            return None, None
        try:
            content = registry.content(content_digest)
        except ValueError as exc:
            log.warning("weightcache: ignoring the fleet's record of %s: %s", fingerprint.short, exc)
            content = None
        if content is None:
            if self._recordless_since is None:  # its declarer left: a holder declares it again within a lease's TTL
                self._recordless_since = time.monotonic()
            if time.monotonic() - self._recordless_since < 2 * registry.config.lease_ttl_s:
                return None, WAIT_RECORD
            log.warning(
                "weightcache: %d nodes list %s but the fleet has no valid record of its arenas; not pulling it",
                len(holdings),
                fingerprint.short,
            )
            tried.update(h.node for h in holdings)
            return None, None
        random.shuffle(holdings)  # spread the new nodes over every holder: each one that finishes serves too
        busy: str | None = None
        for holding in holdings:
            slot = registry.take_slot(content_digest, holding.node, self._leased(registry))
            if slot is None:
                busy = WAIT_SLOT
                continue
            tried.add(holding.node)
            try:
                return self._pull_one(builder, holding, content), None
            except (WeightCacheError, OSError, ValueError, RuntimeError) as exc:
                failure = _cut(str(exc))
                self._drop_link()  # first: a read past its deadline may still be landing in the builder's arenas
                builder.reset()
            finally:
                with contextlib.suppress(FleetUnavailable):  # else it goes with the lease
                    registry.free_slot(slot)
            log.warning(
                "weightcache: pulling %s from node %s failed (%s); trying the next holder",
                fingerprint.short,
                holding.node,
                failure,
            )
        return None, busy

    def _pull_one(self, builder: "ArenaBuilder", holding: Holding, content: Content) -> Pulled:
        node = holding.node
        timings: dict[str, float] = {}
        if holding.manifest_sha256 != content.manifest_sha256:
            raise PullFailed(node, "it declares another manifest than the fleet's record of this content")
        if len(holding.arenas) != len(content.arenas) or holding.manifest.length != content.manifest_bytes:
            raise PullFailed(node, "its regions do not match the fleet's record of this content")
        for index, (region, (size, _)) in enumerate(zip(holding.arenas, content.arenas, strict=True)):
            if region.length != size:
                raise PullFailed(node, f"its region for arena {index} holds {region.length} bytes, the record says {size}")
        link = self._link(holding.transport)
        start = time.perf_counter()
        buffer = ctypes.create_string_buffer(content.manifest_bytes)
        local = Region(ctypes.addressof(buffer), content.manifest_bytes)
        link.read(holding.reach, [holding.manifest], [local], _deadline(content.manifest_bytes))
        data = buffer.raw
        if manifest_sha256(data) != content.manifest_sha256:
            raise PullFailed(node, "the manifest it served is not the one the fleet's record declares (sha256 differs)")
        manifest = Manifest.from_json(json.loads(data))
        declared = [(spec.size, spec.checksum) for spec in manifest.arenas]
        if declared != list(content.arenas):
            raise PullFailed(node, "its manifest declares other arenas than the fleet's record")
        check_sizes(manifest, holding.fingerprint.digest)
        timings["manifest_s"] = time.perf_counter() - start
        start = time.perf_counter()
        path = self._read_arenas(builder, link, holding, manifest)
        timings["read_s"] = time.perf_counter() - start
        start = time.perf_counter()
        specs = builder.check_copy(manifest.arenas, f"node {node}")  # checksummed here; a mismatch tries the next holder
        timings["verify_s"] = time.perf_counter() - start
        log.info(
            "weightcache: pulled %s from node %s over %s (%d bytes in %.2f s, verified in %.2f s)",
            holding.fingerprint.short,
            node,
            path,
            content.nbytes,
            timings["read_s"],
            timings["verify_s"],
        )
        return Pulled(node, path, attrs.evolve(manifest, arenas=specs), timings)

    def _read_arenas(self, builder: "ArenaBuilder", link: Transport, holding: Holding, manifest: Manifest) -> str:
        """Read every arena into ``builder``: straight into its memory, or through host arenas for a GPU that the
        transport cannot register (then copied to the GPU: host-staged)."""
        from weightcache.core.load.export import ArenaBuilder

        gpu = builder.device.is_cuda
        if gpu and "VRAM" not in link.memory_kinds():
            with ArenaBuilder("cpu") as staging:
                path = self._read_into(staging, link, holding, manifest)
                from weightcache.core.arena.transfer import Pair, host_to_device

                slots = [builder.add_arena(spec.size) for spec in manifest.arenas]
                targets = [builder.view(slot) for slot in slots]
                host_to_device([Pair(arena.fileno(), target) for arena, target in zip(staging.arenas, targets, strict=True)])
                del targets
            return f"host-staged ({path}, then host to GPU)"
        return self._read_into(builder, link, holding, manifest)

    def _read_into(self, builder: "ArenaBuilder", link: Transport, holding: Holding, manifest: Manifest) -> str:
        slots = [builder.add_arena(spec.size) for spec in manifest.arenas]
        views = [builder.view(slot) for slot in slots]
        try:
            local = [_region_of(view) for view in views]
            path = ""
            for source, target in zip(holding.arenas, local, strict=True):  # one read per arena: progress is visible
                path = link.read(holding.reach, [source], [target], _deadline(target.length))
            return path
        finally:
            del views

    def _link(self, name: str) -> Transport:
        if self._transport is None:
            node, devices = (self.config.node, self.config.devices) if self.config is not None else ("node", "")
            self._transport = transport(name, f"{node}-pull-{os.getpid()}-{secrets.token_hex(4)}", devices)
        elif self._transport.name != name:
            raise PullFailed("?", f"it speaks transport {name!r}, this node {self._transport.name!r}")
        return self._transport

    def _drop_link(self) -> None:
        """Close the transport, which stops its transfers, before the memory they wrote into is released."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def published(self) -> None:
        """After this node published what it claimed: wait (briefly) until its sharing agent lists it, then let go."""
        if not self.claimed or self.registry is None or self.fingerprint is None:
            return
        content_digest = self.fingerprint.content_digest
        deadline = time.monotonic() + SHARED_WAIT_S
        try:
            while time.monotonic() < deadline:
                key = self.registry.config.key("holders", content_digest, self.registry.config.node)
                if self.registry.store.get(key) is not None:
                    break
                time.sleep(POLL_S)
            else:
                log.info(
                    "weightcache: no sharing agent listed %s within %.0f s (run `weightcache fleet share` beside the "
                    "server); the other nodes read the disk themselves",
                    self.fingerprint.short,
                    SHARED_WAIT_S,
                )
        except FleetUnavailable as exc:
            log.warning("weightcache: %s", exc)
        self.close()

    def close(self) -> None:
        """Stop renewing and revoke the lease (releasing a claim); close the transport."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
            self._keeper = None
        if self._lease and self.registry is not None:
            with contextlib.suppress(FleetUnavailable):
                self.registry.store.revoke(self._lease)  # else it runs out by itself
        self._lease = 0
        self.claimed = False
        self._drop_link()


def _region_of(view: typing.Any) -> Region:
    """The region of a builder's arena view (a flat uint8 tensor on the CPU or a GPU)."""
    if view.is_cuda:
        return Region(view.data_ptr(), view.numel(), view.device.index, "VRAM")
    return Region(view.data_ptr(), view.numel())


def _deadline(nbytes: int) -> float:
    return READ_GRACE_S + nbytes / MIN_RATE_BYTES_S


def _warn_left_out(fingerprint: Fingerprint, problems: list[str]) -> None:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    log.warning("weightcache: left out a holder of %s: %s%s", fingerprint.short, _cut(problems[0]), more)


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
