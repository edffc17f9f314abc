"""Filling an entry from other nodes of the fleet before reading the disk, and claiming the disk read otherwise.

A node that misses locally asks the registry for holders of the content it wants
(``Fingerprint.content_digest``). It reads the manifest and then each arena with the
transport's one-sided reads into arenas of its own (``chain``), and keeps them only when

- every record it used (holding, relay, content) is signed with the fleet's secret;
- the manifest it read has the sha256 the content record declares, and declares the
  content record's arena sizes and checksums;
- every arena, checksummed here (on this GPU for a GPU's arenas), matches.

Anything else costs one warning line and another source is asked; nothing is published
before every byte arrived and matched. While it pulls, the node is a relay (``relay``):
it serves each arena it has checked to the node listed after it, so many new nodes
asking at once form a chain behind one holder and fill about one arena apart, not one
after another. A holder serves ``config.fanout`` readers at once (reader slots under each
reader's lease); a relay serves the one node behind it. With no holder, the node claims
the disk read (one claim per content, under a lease): the first claimant reads, the others
wait for a holder to appear (its claimant, once it has published and shared the entry)
and pull from it, their transport started meanwhile. A claimant that dies loses its claim with its lease; a waiter then
claims in turn. The registry unreachable or slow: one warning line, and the disk.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
import time
import typing

import attrs

from weightcache.core.errors import BackendUnavailable, FleetUnavailable, WeightCacheError
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.node.fleet import files
from weightcache.core.node.fleet.chain import ArenaSource, ChainedPull, cut
from weightcache.core.node.fleet.config import SHARED_WAIT_S, FleetConfig
from weightcache.core.node.fleet.registry import FleetRegistry, renew_lease
from weightcache.core.node.fleet.relay import Relaying
from weightcache.core.node.fleet.transport import DEFAULT_TRANSPORT, Transport, transport
from weightcache.core.progress import counted

if typing.TYPE_CHECKING:
    from weightcache.core.arena.base import Arena
    from weightcache.core.load.export import ArenaBuilder

log = logging.getLogger(__name__)

POLL_S: typing.Final = 0.25
"""How often a node waiting for a claimant looks for a holder again."""


@attrs.frozen
class Pulled:
    """An entry pulled from ``node`` (the nodes, where several served it: ``b (relay, 6 arenas), a (2 arenas)``): the
    manifest of this node's arenas, how the bytes went, the seconds taken, and where each arena came from."""

    node: str
    path: str
    manifest: Manifest = attrs.field(eq=False)
    timings: dict = attrs.field(eq=False)
    sources: tuple[ArenaSource, ...] = ()

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
        self._relaying: Relaying | None = None
        self._quarantine: list[Arena | mmap.mmap] = []
        self._away = False
        """Whether this fill found the registry away (and said so: once is enough)."""

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
            self._away = True
            files.registry_away.set()  # (the fleet's records of the files are not written either: one line says so)
            log.warning("weightcache: %s; reading the disk instead", exc)
        except BackendUnavailable as exc:
            log.warning("weightcache: not pulling from the fleet: %s", exc)
        self._abandon(builder)
        return None

    def _pull(self, builder: "ArenaBuilder", registry: FleetRegistry, fingerprint: Fingerprint) -> Pulled | None:
        content_digest = fingerprint.content_digest
        config = registry.config
        tried: set[str] = set()
        deadline = time.monotonic() + config.wait_s
        waiting_for = None
        while True:
            pulled, record_wait = self._from_holders(builder, registry, fingerprint, tried)
            if pulled is not None:
                return pulled
            if record_wait:  # holders whose content record left with the node that wrote it: one lists it again soon
                if waiting_for != "the record":
                    waiting_for = "the record"
                    log.info(
                        "weightcache: the fleet's record of %s left with the node that wrote it; waiting while a "
                        "holder lists it again",
                        fingerprint.short,
                    )
                time.sleep(POLL_S)
                continue
            if not self.may_claim:
                return None
            try:
                other = registry.claim(content_digest, self._leased(registry))
            except ValueError as exc:  # nobody to wait for: a forged or foreign claim must not hold the load
                log.warning(
                    "weightcache: the claim on %s's disk read is not valid (%s); reading the disk without waiting",
                    fingerprint.short,
                    cut(str(exc)),
                )
                self._drop_link()
                return None
            if other is None:
                self.claimed = True
                log.info("weightcache: no node of the fleet holds %s; this node reads it from the disk", fingerprint.short)
                self._drop_link()  # (one started ahead: UCX's worker and thread need not live through the disk read)
                return None
            if waiting_for != other.node:
                waiting_for = other.node
                log.info("weightcache: node %s is reading %s from the disk; waiting to pull it", other.node, fingerprint.short)
                self._link_ahead()
            if time.monotonic() > deadline:
                log.warning(
                    "weightcache: node %s still reads %s after %.0f s; reading the disk here too (%s)",
                    other.node,
                    fingerprint.short,
                    config.wait_s,
                    "WEIGHTCACHE_FLEET_WAIT_S sets the wait",
                )
                self._drop_link()
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
    ) -> tuple[Pulled | None, bool]:
        """A pull from the holders and relays of the content (``ChainedPull``); else None, and whether to ask again
        soon (the content record is being listed again)."""
        content_digest = fingerprint.content_digest
        holdings, problems = registry.holdings(content_digest)
        holdings = [h for h in holdings if h.node not in tried]
        new = [problem for problem in problems if problem not in self._warned]
        if new:
            self._warned.update(new)
            _warn_left_out(fingerprint, new)
        if not holdings:
            return None, False
        try:
            content = registry.content(content_digest)
        except ValueError as exc:
            log.warning("weightcache: ignoring the fleet's record of %s: %s", fingerprint.short, exc)
            content = None
        if content is None:
            if self._recordless_since is None:  # its declarer left: a holder declares it again within a lease's TTL
                self._recordless_since = time.monotonic()
            if time.monotonic() - self._recordless_since < 2 * registry.config.lease_ttl_s:
                return None, True
            log.warning(
                "weightcache: %s list %s but the fleet has no valid record of its arenas; not pulling it",
                counted(len(holdings), "node"),
                fingerprint.short,
            )
            tried.update(h.node for h in holdings)
            return None, False
        try:
            link = self._link(holdings[0].transport)
            staged = builder.device.is_cuda and "VRAM" not in link.memory_kinds()
            lease = self._leased(registry)
            relay = registry.config.relay
            if relay and not staged and self._relaying is None:
                self._relaying = Relaying(registry, fingerprint, link, lease)
                self._relaying.list()
            chained = ChainedPull(
                builder, registry, fingerprint, content, link, lease, self._relaying, tried, self._quarantine, relay, staged
            )
            done = chained.run()
        except (FleetUnavailable, BackendUnavailable):
            raise  # pull() says so once and reads the disk
        except (WeightCacheError, OSError, ValueError, RuntimeError) as exc:
            log.info("weightcache: not pulling %s from the fleet: %s", fingerprint.short, cut(str(exc)))
            self._abandon(builder)
            tried.update(h.node for h in holdings)
            return None, False
        nodes = _nodes_of(done.sources)
        log.info(
            "weightcache: pulled %s from %s over %s (%d bytes in %.2f s, verified in %.2f s)",
            fingerprint.short,
            nodes,
            done.path,
            content.nbytes,
            done.read_s,
            done.verify_s,
        )
        specs = [arena.spec for arena in builder.arenas]
        timings = {"read_s": done.read_s, "verify_s": done.verify_s}
        return Pulled(nodes, done.path, attrs.evolve(done.manifest, arenas=specs), timings, done.sources), False

    def _link(self, name: str) -> Transport:
        """This fill's transport ``name``. One that exists here was started ahead and has read nothing (a pull that
        fails drops its own), so one of another name is replaced."""
        if self._transport is not None and self._transport.name != name:
            self._drop_link()
        if self._transport is None:
            node, devices = (self.config.node, self.config.devices) if self.config is not None else ("node", "")
            self._transport = transport(name, f"{node}-pull-{os.getpid()}-{secrets.token_hex(4)}", devices)
        return self._transport

    def _link_ahead(self) -> None:
        """Start the default transport while another node reads the disk, so that the pull after it does not wait for
        it (NIXL's UCX backend starts its transports first, most of a small pull's time: docs/decisions.md). A transport that is not
        installed or cannot start raises BackendUnavailable: nothing could be pulled, and ``pull`` reads the disk; any
        other failure here is left to the pull, which starts it again and handles what it raises."""
        if self._transport is not None:
            return
        start = time.perf_counter()
        try:
            self._link(DEFAULT_TRANSPORT)
        except BackendUnavailable:
            raise
        except Exception as exc:  # (only a head start: the pull's own start reports it)
            log.debug("weightcache: starting the %s transport ahead failed: %s: %s", DEFAULT_TRANSPORT, type(exc).__name__, exc)
            return
        log.debug("weightcache: %s transport started while waiting, in %.2f s", DEFAULT_TRANSPORT, time.perf_counter() - start)

    def _drop_link(self) -> None:
        """Close the transport, which stops its transfers, before the memory they wrote into is released."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def published(self) -> None:
        """After this node published: wait (briefly) until its sharing agent lists the entry, then let go.

        A claimant waits so that the waiting nodes pull instead of reading the disk; a relay keeps serving until the
        node behind it has read every arena from it (its relay record says how many it checked), listed or not: a
        relay that let go as soon as it was listed broke that node's read off mid-arena.
        """
        relaying = self._relaying
        if self.registry is None or self.fingerprint is None or not (self.claimed or relaying is not None):
            return
        content_digest = self.fingerprint.content_digest
        deadline = time.monotonic() + SHARED_WAIT_S
        key = self.registry.config.key("holders", content_digest, self.registry.config.node)
        listed = False
        try:
            while time.monotonic() < deadline:
                listed = listed or self.registry.store.get(key) is not None
                if relaying is None or relaying.downstream_done():
                    if listed or not self.claimed:
                        break
                time.sleep(POLL_S)
            else:
                if not listed:  # (listed, with the node behind this relay still reading: it goes on from a holder)
                    log.info(
                        "weightcache: no sharing agent listed %s within %.0f s (run `weightcache fleet share` beside "
                        "the server); the other nodes read it elsewhere",
                        self.fingerprint.short,
                        SHARED_WAIT_S,
                    )
        except FleetUnavailable as exc:
            if not self._away:
                log.warning("weightcache: %s", exc)
        self.close()

    def _stop_relaying(self) -> None:
        """Unlist this node's relay record and unregister its memory; then close the transport (no read lands later)."""
        if self._relaying is not None:
            self._quarantine += self._relaying.close()
            self._relaying = None
        self._drop_link()
        for memory in self._quarantine:
            memory.close()
        self._quarantine.clear()

    def _abandon(self, builder: "ArenaBuilder") -> None:
        """A pull that will not be published: stop serving it and stop every transfer, then empty ``builder``."""
        self._stop_relaying()
        builder.reset()

    def close(self) -> None:
        """Stop relaying, stop renewing and revoke the lease (releasing a claim and reader slots); close the transport."""
        self._stop_relaying()
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
            self._keeper = None
        if self._lease and self.registry is not None:
            with contextlib.suppress(FleetUnavailable):
                self.registry.store.revoke(self._lease)  # else it runs out by itself
        self._lease = 0
        self.claimed = False


def _nodes_of(sources: typing.Sequence[ArenaSource]) -> str:
    """The nodes that served ``sources``, in order: ``a``, or ``b (relay, 6 arenas), a (2 arenas)``."""
    counts: dict[tuple[str, bool], int] = {}
    for source in sources:
        counts[(source.node, source.relay)] = counts.get((source.node, source.relay), 0) + 1
    if len(counts) == 1 and not next(iter(counts))[1]:
        return next(iter(counts))[0]
    return ", ".join(f"{node} ({'relay, ' if relay else ''}{n} arenas)" for (node, relay), n in counts.items())


def _warn_left_out(fingerprint: Fingerprint, problems: list[str]) -> None:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    log.warning("weightcache: left out a holder of %s: %s%s", fingerprint.short, cut(problems[0]), more)
