"""A pull arena by arena, each from whoever serves it: the relay ahead of this node in the chain, else a holder.

The relays of a content (``relays/<content>/<node>``) are ordered by etcd's create
revision of their keys. A node's upstream is the relay listed just before its own (the
newest one, for a node that does not relay): it reads the manifest and arena i from it
once the relay lists them (``verified > i``), waiting while the relay works. A node
with no relay ahead reads from a full holder, taking one of its reader slots for the
rest of its pull. Whoever served it, every arena is sealed and checksummed here against
the content record before the next is read; a source that fails (gone, stalled, a read
that breaks, bytes that do not match) costs one warning and is never asked again by
this pull: the node asks again (the relay before it, a holder), and with nothing left
the caller reads the disk.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import random
import time
import typing

import attrs

from weightcache.core.errors import ChecksumMismatch, PullFailed, WeightCacheError
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.node.fleet.records import Content, Holding, Relay, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.node.fleet.relay import Relaying
from weightcache.core.node.fleet.transport import Region, Transport, region_of_arena, region_of_view
from weightcache.core.node.seeding import check_sizes

if typing.TYPE_CHECKING:
    from weightcache.core.arena.base import Arena
    from weightcache.core.load.export import ArenaBuilder

log = logging.getLogger(__name__)

POLL_S: typing.Final = 0.1
"""How often a node waiting for its upstream relay reads the relay's record again."""
MANIFEST: typing.Final = -1
"""The step that reads the manifest (arenas are steps 0, 1, ...)."""


@attrs.frozen
class ArenaSource:
    """Where one arena came from: the node, whether it served as a relay, and how many arenas it had checked then."""

    node: str
    relay: bool
    verified: int

    def describe(self, total: int) -> str:
        return f"relay {self.node} ({self.verified} of {total} checked)" if self.relay else f"node {self.node}"


@attrs.frozen
class Chained:
    """A chained pull's result: the manifest read, each arena's source, and how the bytes went."""

    manifest: Manifest = attrs.field(eq=False)
    sources: tuple[ArenaSource, ...]
    path: str
    read_s: float
    verify_s: float


class ChainedPull:
    """One content pulled into ``builder`` (empty) arena by arena; ``relaying`` serves each arena as it is checked."""

    def __init__(
        self,
        builder: "ArenaBuilder",
        registry: FleetRegistry,
        fingerprint: Fingerprint,
        content: Content,
        link: Transport,
        lease: int,
        relaying: Relaying | None,
        failed: set[str],
        quarantine: "list[Arena]",
        use_relays: bool = True,
        staged: bool = False,
    ):
        self.builder = builder
        self.registry = registry
        self.fingerprint = fingerprint
        self.content = content
        self.link = link
        self.lease = lease
        self.relaying = relaying
        self.failed = failed
        """Nodes that failed this node: never asked again (the caller's ``tried``)."""
        self.quarantine = quarantine
        """Arenas a read into which broke off: freed only once the transport is closed (a late write may land)."""
        self.use_relays = use_relays
        self.staged = staged
        """The transport cannot register this GPU's memory: each arena lands in host memory, then goes to the GPU."""
        self.current: Relay | Holding | None = None
        self.slot: bytes | None = None
        self.left: str | None = None
        """The last relay that left: it published, and its holding is the first one asked."""
        self._progress = (-1, 0.0)
        self._waiting_for_slot = False
        self._deadline = time.monotonic() + registry.config.wait_s
        self.sources: list[ArenaSource] = []
        self.path = ""
        self.read_s = 0.0
        self.verify_s = 0.0

    def run(self) -> Chained:
        """Read and check the manifest, then every arena; PullFailed when no relay or holder is left to read from."""
        from weightcache.core.load.export import ArenaBuilder

        try:
            with ArenaBuilder("cpu") as staging:
                manifest = self._step(MANIFEST, self._read_manifest)
                slots = [self.builder.add_arena(spec.size) for spec in manifest.arenas]
                landing = [staging.add_arena(spec.size) for spec in manifest.arenas] if self.staged else slots
                for index, slot in enumerate(slots):
                    self._step(
                        index,
                        functools.partial(self._read_arena, index=index, slot=slot, staging=staging, landing=landing[index]),
                    )
        finally:
            self._free_slot()
        path = f"host-staged ({self.path}, then host to GPU)" if self.staged else self.path
        return Chained(manifest, tuple(self.sources), path, self.read_s, self.verify_s)

    def _step(self, step: int, read: typing.Callable[["Served"], typing.Any]) -> typing.Any:
        what = "the manifest" if step == MANIFEST else f"arena {step}"
        while True:
            served = self._source(step)
            try:
                return read(served)
            except (WeightCacheError, OSError, ValueError, RuntimeError) as exc:
                log.warning(
                    "weightcache: reading %s of %s from %s failed (%s); asking another node",
                    what,
                    self.fingerprint.short,
                    served.name,
                    cut(str(exc)),
                )
                self.failed.add(served.node)
                self.current = None
                self._free_slot()

    # Where each step's bytes come from.

    def _source(self, step: int) -> "Served":
        while True:
            current = self.current
            try:
                if isinstance(current, Holding):
                    return Served.of(current, step, self.content)
                if isinstance(current, Relay):
                    served = self._from_relay(current, step)
                    if served is not None:
                        return served
                    continue
            except PullFailed as exc:  # its record does not fit the content record
                log.warning("weightcache: not reading %s from node %s: %s", self.fingerprint.short, exc.node, exc.reason)
                self.failed.add(exc.node)
                self.current = None
                self._free_slot()
                continue
            self._resolve(step)

    def _from_relay(self, upstream: Relay, step: int) -> "Served | None":
        """``step`` from ``upstream`` once it lists it; None after one wait, or when it left or stalled."""
        relays, _ = self.registry.relays(self.content.fingerprint.content_digest)
        fresh = next((r for r in relays if r.node == upstream.node), None)
        if fresh is None:
            log.info("weightcache: relay %s of %s left (published, or gone); asking again", upstream.node, self.fingerprint.short)
            self.left, self.current = upstream.node, None
            return None
        self.current = fresh
        if (fresh.manifest is not None) if step == MANIFEST else fresh.verified > step:
            return Served.of(fresh, step, self.content)
        now = time.monotonic()
        if fresh.verified != self._progress[0]:
            self._progress = (fresh.verified, now)
        elif now - self._progress[1] > self._stall_s(step):
            log.warning(
                "weightcache: relay %s checked no arena of %s for %.0f s; asking another node",
                upstream.node,
                self.fingerprint.short,
                now - self._progress[1],
            )
            self.failed.add(upstream.node)
            self.current = None
            return None
        time.sleep(POLL_S)
        return None

    def _stall_s(self, step: int) -> float:
        """How long a relay may check nothing: its own read of the arena from a source that fails, then another."""
        size = self.content.arenas[max(step, 0)][0]
        return 2 * read_deadline(size) + self.registry.config.lease_ttl_s

    def _resolve(self, step: int) -> None:
        """Pick the next source: the relay listed just before this node's own, else a holder with a free slot."""
        content_digest = self.content.fingerprint.content_digest
        node = self.registry.config.node
        mine = self.relaying.revision if self.relaying is not None else None
        relays = self.registry.relays(content_digest)[0] if self.use_relays else []
        ahead = [r for r in relays if r.node != node and r.node not in self.failed and (mine is None or r.revision < mine)]
        if ahead:
            self.current, self._progress = ahead[-1], (-1, time.monotonic())
            log.debug("weightcache: reading %s from relay %s", self.fingerprint.short, ahead[-1].node)
            return
        holdings, _ = self.registry.holdings(content_digest)
        holdings = [h for h in holdings if h.node not in self.failed]
        if not holdings:
            raise PullFailed("?", "no relay or holder of it is left to read from")
        random.shuffle(holdings)
        holdings.sort(key=lambda h: h.node != self.left)  # the relay that just published serves the rest
        for holding in holdings:
            slot = self.registry.take_slot(content_digest, holding.node, self.lease)
            if slot is not None:
                self.current, self.slot = holding, slot
                log.debug("weightcache: reading %s from node %s", self.fingerprint.short, holding.node)
                return
        if not self._waiting_for_slot:
            self._waiting_for_slot = True
            log.info(
                "weightcache: every holder of %s serves %d nodes already; waiting for a free slot",
                self.fingerprint.short,
                self.registry.config.fanout,
            )
        if time.monotonic() > self._deadline:
            raise PullFailed("?", f"no holder had a free slot for {self.registry.config.wait_s:.0f} s")
        time.sleep(POLL_S)

    def _free_slot(self) -> None:
        if self.slot is not None:
            try:
                self.registry.free_slot(self.slot)
            except WeightCacheError as exc:  # else it goes with the lease
                log.debug("weightcache: freeing a reader slot: %s", exc)
            self.slot = None

    # Reading and checking.

    def _read_manifest(self, served: "Served") -> Manifest:
        size = self.content.manifest_bytes
        buffer = ctypes.create_string_buffer(size)
        start = time.perf_counter()
        self.link.read(served.reach, [served.region], [Region(ctypes.addressof(buffer), size)], read_deadline(size))
        self.read_s += time.perf_counter() - start
        data = buffer.raw
        if manifest_sha256(data) != self.content.manifest_sha256:
            raise PullFailed(served.node, "the manifest it served is not the one the fleet's record declares (sha256 differs)")
        manifest = Manifest.from_json(json.loads(data))
        if [(spec.size, spec.checksum) for spec in manifest.arenas] != list(self.content.arenas):
            raise PullFailed(served.node, "its manifest declares other arenas than the fleet's record")
        check_sizes(manifest, self.fingerprint.digest)
        if self.relaying is not None:
            self.relaying.manifest_checked(data)
        return manifest

    def _read_arena(self, served: "Served", index: int, slot: typing.Any, staging: "ArenaBuilder", landing: typing.Any) -> None:
        """Read arena ``index`` into ``landing`` (``slot`` of the builder, or of ``staging`` when staged), seal and
        checksum it here; then serve it as a relay."""
        size, checksum = self.content.arenas[index]
        into = staging if self.staged else self.builder
        view = into.view(landing)
        local = region_of_view(view)
        start = time.perf_counter()
        try:
            path = self.link.read(served.reach, [served.region], [local], read_deadline(size))
        except BaseException:
            del view
            old = into.replace_arena(index)
            if old is not None:
                self.quarantine.append(old)
            raise
        del view
        if self.staged:
            from weightcache.core.arena.transfer import Pair, host_to_device

            target = self.builder.view(slot)
            host_to_device([Pair(staging.arena(landing).fileno(), target)])
            del target
        self.read_s += time.perf_counter() - start
        start = time.perf_counter()
        try:
            spec = self.builder.seal_arena(index)
        except OSError:  # a reference cycle may still hold a view of the writable mapping
            gc.collect()
            spec = self.builder.seal_arena(index)
        self.verify_s += time.perf_counter() - start
        if spec.checksum != checksum:
            old = self.builder.replace_arena(index)
            if old is not None:
                old.close()  # the read finished: nothing writes into it any more
            raise ChecksumMismatch(
                index, served.name, checksum, str(spec.checksum), "nothing of it was kept; another node is asked"
            )
        self.path = path
        source = ArenaSource(served.node, served.relay, served.verified)
        self.sources.append(source)
        log.debug("weightcache: arena %d of %s from %s", index, self.fingerprint.short, source.describe(len(self.content.arenas)))
        if self.relaying is not None:
            self.relaying.arena_checked(region_of_arena(self.builder.arena(slot)))


@attrs.frozen
class Served:
    """One step's source: the node, whether it is a relay (and how many arenas it had checked), how to read it."""

    node: str
    relay: bool
    verified: int
    reach: str = attrs.field(repr=False)
    region: Region

    @property
    def name(self) -> str:
        return f"relay {self.node}" if self.relay else f"node {self.node}"

    @classmethod
    def of(cls, source: Relay | Holding, step: int, content: Content) -> "Served":
        """``step``'s region of ``source``; PullFailed when its size is not the content record's."""
        relay = isinstance(source, Relay)
        if step == MANIFEST:
            region, size = source.manifest, content.manifest_bytes
        else:
            region, size = source.arenas[step] if step < len(source.arenas) else None, content.arenas[step][0]
        if region is None or region.length != size:
            what = "the manifest" if step == MANIFEST else f"arena {step}"
            raise PullFailed(source.node, f"its region for {what} does not hold the {size} bytes the fleet's record says")
        if not relay and typing.cast(Holding, source).manifest_sha256 != content.manifest_sha256:
            raise PullFailed(source.node, "it declares another manifest than the fleet's record of this content")
        verified = source.verified if isinstance(source, Relay) else len(content.arenas)
        return cls(source.node, relay, verified, source.reach, region)


MIN_RATE_BYTES_S: typing.Final = 50 << 20
"""A read slower than this (plus ``READ_GRACE_S``) is abandoned: the source is gone or stalled."""
READ_GRACE_S: typing.Final = 10.0


def read_deadline(nbytes: int) -> float:
    return READ_GRACE_S + nbytes / MIN_RATE_BYTES_S


def cut(text: str, limit: int = 300) -> str:
    """``text`` for a log line, at most ``limit`` characters (a peer chooses what its errors say)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
