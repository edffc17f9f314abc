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

A node that relays reads each arena in pieces and lists them as they land (``Relaying``);
the node behind it reads those pieces as they are listed, before its upstream has
checked the arena, so each hop lags its upstream by a piece, not by an arena. It still
checks the whole arena itself before it serves it as checked or publishes it. A read
(whatever is there to read) goes in pieces of at least ``FleetConfig.piece_bytes``, at
most ``MAX_PIECES`` of them, which the transport keeps in flight a few at a time
(``Transport.read_in_pieces``); each is listed as it lands.

A node waits for its upstream on an etcd watch of the relay's record (``EtcdStore.watch``),
woken when the relay lists more, and reads the record from the watch's last event; a read of
an arena landing there goes on as the relay lists more, without returning between pieces. A
watch that does not start or breaks costs a poll every ``POLL_S`` (and one warning), never a
hang; what the watch brings is checked like a record read.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import logging
import mmap
import random
import time
import typing

import attrs

from weightcache.core.errors import ChecksumMismatch, FleetUnavailable, PullFailed, WeightCacheError
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.node.fleet.etcd import Watch
from weightcache.core.node.fleet.records import Content, Holding, Relay, manifest_sha256
from weightcache.core.node.fleet.registry import FleetRegistry
from weightcache.core.node.fleet.relay import Relaying
from weightcache.core.node.fleet.transport import Region, Transport, region_of_arena, region_of_view
from weightcache.core.node.seeding import check_sizes
from weightcache.core.progress import counted

if typing.TYPE_CHECKING:
    from weightcache.core.arena.base import Arena
    from weightcache.core.load.export import ArenaBuilder

log = logging.getLogger(__name__)

POLL_S: typing.Final = 0.1
"""How often a node waiting for its upstream relay reads the relay's record again, where no etcd watch wakes it."""
WATCHED_POLL_S: typing.Final = 1.0
"""How often it reads the record again while a watch on it streams (the watch wakes it when the record changes)."""
MANIFEST: typing.Final = -1
"""The step that reads the manifest (arenas are steps 0, 1, ...)."""
MAX_PIECES: typing.Final = 64
"""A read is split into at most this many pieces (each at least ``FleetConfig.piece_bytes``)."""
_MORE = object()
"""What a read of part of an arena returns: more of it is still to come."""


@attrs.frozen
class ArenaSource:
    """Where one arena came from: the node, whether it served as a relay, how many arenas it had checked then, and how
    many pieces were read while it was still landing there (before it had checked the arena)."""

    node: str
    relay: bool
    verified: int
    landing_pieces: int = 0

    def describe(self, total: int) -> str:
        if not self.relay:
            return f"node {self.node}"
        landing = f", {self.landing_pieces} pieces as they landed" if self.landing_pieces else ""
        return f"relay {self.node} ({self.verified} of {total} checked{landing})"


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
        quarantine: "list[Arena | mmap.mmap]",
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
        self._progress: tuple[tuple[int, int], float] = ((-1, -1), 0.0)
        self._partial: _Partial | None = None
        """The arena read in part so far (pieces of it): from whom, into what, how far."""
        self._waiting_for_slot = False
        self._watch: Watch | None = None
        """The watch on the upstream relay's record (``_watch_node``'s), which wakes this node when the record changes."""
        self._watch_node = ""
        self._watched_record: tuple[int, Relay | None] = (0, None)
        """The record the watch last brought, parsed, by the watch's count of changes then."""
        self._watch_broke: str | None = None
        """Why a watch of this pull ended (then it polls, and says so once)."""
        self._watch_warned = False
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
            self._close_watch()
        path = f"host-staged ({self.path}, then host to GPU)" if self.staged else self.path
        return Chained(manifest, tuple(self.sources), path, self.read_s, self.verify_s)

    def _step(self, step: int, read: typing.Callable[["Served"], typing.Any]) -> typing.Any:
        what = "the manifest" if step == MANIFEST else f"arena {step}"
        while True:
            served = self._source(step)
            try:
                result = read(served)
            except FleetUnavailable:
                raise  # the registry is away: another node cannot be asked either; the pull reads the disk, one warning
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
                continue
            if result is not _MORE:
                return result

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
        watch = self._watching(upstream.node)
        seen = watch.changes if watch is not None else 0  # (noted before the read: no change after it is missed)
        if watch is not None and watch.live and seen:  # the record as its last event left it: no request to etcd
            fresh = self._watched(upstream.node)
        else:
            fresh = self.registry.relay_of(self.content.fingerprint.content_digest, upstream.node)
        if self._watch_broke is not None and not self._watch_warned:  # (etcd answered: the watch alone broke)
            self._watch_warned = True
            log.warning(
                "weightcache: the etcd watch on relay %s's record of %s ended (%s); reading the record every %.1f s",
                upstream.node,
                self.fingerprint.short,
                cut(self._watch_broke),
                POLL_S,
            )
        if fresh is None:
            log.info("weightcache: relay %s of %s left (published, or gone); asking again", upstream.node, self.fingerprint.short)
            self.left, self.current = upstream.node, None
            return None
        self.current = fresh
        if (fresh.manifest is not None) if step == MANIFEST else fresh.verified > step:
            return Served.of(fresh, step, self.content)
        landing = fresh.landing
        if self.relaying is not None and landing is not None and landing.arena == step:
            if landing.landed > self._done_from(fresh.node, landing.region, step):
                return Served.landing_of(fresh, step, self.content)
        now = time.monotonic()
        if self.relaying is not None:
            self.relaying.list_landed()  # (the node behind this one may wait for the pieces this one has)
        progress = (fresh.verified, -1 if landing is None else landing.landed)
        if progress != self._progress[0]:
            self._progress = (progress, now)
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
        if watch is None:
            time.sleep(POLL_S)
        else:  # woken when the record changes; an unconfirmed watch waits no longer than a poll
            watch.wait(seen, WATCHED_POLL_S if watch.live else POLL_S)
        return None

    def _watching(self, node: str) -> Watch | None:
        """The watch on relay ``node``'s record (a new one for a new upstream); None once a watch of this pull broke."""
        watch = self._watch
        if watch is not None and watch.broken is not None:
            self._watch_broke = watch.broken
            self._close_watch()
        if self._watch_broke is not None:
            return None
        if self._watch is None or self._watch_node != node:
            self._close_watch()
            self._watch = self.registry.watch_relay(self.content.fingerprint.content_digest, node)
            self._watch_node, self._watched_record = node, (0, None)
        return self._watch

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

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
            self.current, self._progress = ahead[-1], ((-1, -1), time.monotonic())
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
                "weightcache: every holder of %s serves %s already; waiting for a free slot",
                self.fingerprint.short,
                counted(self.registry.config.fanout, "node"),
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

    def _read_arena(
        self, served: "Served", index: int, slot: typing.Any, staging: "ArenaBuilder", landing: typing.Any
    ) -> typing.Any:
        """Read (more of) arena ``index``: all that ``served`` has of it; ``_MORE`` while some is still to come.

        It lands in this relay's landing buffer, or in ``landing`` (``slot`` of the builder, or of ``staging`` when
        staged). Once all of it is here it goes to ``slot``, is sealed and checksummed here, then served as a relay.
        """
        size, checksum = self.content.arenas[index]
        part = self._partial
        if part is None or not part.continues(index, served):
            part = self._partial = self._start(index, served, staging if self.staged else self.builder, landing, part)
        begin, more = part.done, None
        if served.landed is not None:  # read on as the relay lands more (its record, as the watch brings it)
            part.pieces_region = served.region
            part.available = max(part.available, served.landed)
            more = functools.partial(self._landed_at, served, part, begin)
        remote, local = served.region.part(begin, size - begin), part.target.part(begin, size - begin)
        start = time.perf_counter()
        try:
            if self.relaying is None and served.landed is None:
                path = self.link.read(served.reach, [remote], [local], read_deadline(remote.length))
                part.done = size
            else:  # listed as they land, for the node behind this one
                piece = max(self.registry.config.piece_bytes, -(-remote.length // MAX_PIECES))
                landed = functools.partial(self._landed, part, begin)
                path = self.link.read_in_pieces(served.reach, remote, local, piece, read_deadline(remote.length), landed, more)
        except BaseException:
            self._partial = None
            self._set_aside(part, index)
            raise
        elapsed = time.perf_counter() - start
        self.read_s += elapsed
        part.landing_pieces += served.landed is not None
        if part.done < size:
            return _MORE
        self._partial = None
        into = staging if self.staged else self.builder
        if part.in_landing_buffer:
            view = into.view(landing)
            ctypes.memmove(region_of_view(view).address, part.target.address, size)
            del view
        if self.staged:
            from weightcache.core.arena.transfer import Pair, host_to_device

            target = self.builder.view(slot)
            host_to_device([Pair(staging.arena(landing).fileno(), target)])
            del target
        self.read_s += time.perf_counter() - start - elapsed
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
            if part.in_landing_buffer and self.relaying is not None:
                self.relaying.landing_failed(index)  # (the node behind checks what it read of it, and fails it)
            raise ChecksumMismatch(
                index, served.name, checksum, str(spec.checksum), "nothing of it was kept; another node is asked"
            )
        self.path = path
        source = ArenaSource(served.node, served.relay, served.verified, part.landing_pieces)
        self.sources.append(source)
        log.debug("weightcache: arena %d of %s from %s", index, self.fingerprint.short, source.describe(len(self.content.arenas)))
        if self.relaying is not None:
            self.relaying.arena_checked(region_of_arena(self.builder.arena(slot)))
        return None

    def _landed(self, part: "_Partial", start: int, nbytes: int) -> None:
        """The first ``nbytes`` of this read (from ``start`` of the arena) are here: list them, in a landing buffer."""
        part.done = start + nbytes
        if part.in_landing_buffer and self.relaying is not None:
            self.relaying.landed(part.index, start + nbytes)

    def _landed_at(self, served: "Served", part: "_Partial", begin: int) -> int:
        """How many bytes from ``begin`` of the arena ``part`` reads have landed at relay ``served``, in the buffer being
        read: as its newest record that the watch brought says (read between two pieces; no request to etcd), else as
        far as was known. Only a hint for when to read: every byte read is checksummed with the whole arena."""
        record = self._watched(served.node)
        landing = record.landing if record is not None else None
        if landing is not None and landing.arena == part.index and landing.region == served.region:
            if typing.cast(Relay, record).reach == served.reach:
                part.available = max(part.available, landing.landed)
        return part.available - begin

    def _watched(self, node: str) -> Relay | None:
        """Relay ``node``'s record as the last event of the watch on it left it (None: none, or not valid)."""
        watch = self._watch
        if watch is None or self._watch_node != node:
            return None
        changes, item = watch.last()
        if self._watched_record[0] != changes:
            record = self.registry.relay_in(item, self.content.fingerprint.content_digest, node)
            self._watched_record = (changes, record)
        return self._watched_record[1]

    def _start(
        self, index: int, served: "Served", into: "ArenaBuilder", landing: typing.Any, before: "_Partial | None"
    ) -> "_Partial":
        """Begin arena ``index`` from ``served``: in a fresh landing buffer of this relay, else in the arena itself.

        ``before``, this arena's reading from another source (or from a landing buffer its relay gave up), is dropped:
        its bytes are read again.
        """
        if before is not None and before.index == index:
            self._set_aside(before, index, broke_off=False)
        size = self.content.arenas[index][0]
        if self.relaying is not None and not into.device.is_cuda:  # (a GPU arena is served once checked, whole)
            region = self.relaying.landing_buffer(index, size)
            if region is not None:
                return _Partial(index, served.node, region, None)
        view = into.view(landing)
        target = region_of_view(view)
        del view
        return _Partial(index, served.node, target, into)

    def _set_aside(self, part: "_Partial", index: int, broke_off: bool = True) -> None:
        """Drop what ``part`` read: a landing buffer is unlisted, an arena a read broke off in is replaced (a late write
        may still land in it: it is freed once the transport has closed)."""
        if part.into is None:
            if self.relaying is not None:
                self.relaying.landing_failed(index)
        elif broke_off:
            old = part.into.replace_arena(index)
            if old is not None:
                self.quarantine.append(old)

    def _done_from(self, node: str, region: Region, index: int) -> int:
        """How much of arena ``index`` was read already from ``node``'s landing ``region`` (0: none, or from elsewhere)."""
        part = self._partial
        if part is None or part.index != index or part.node != node or part.pieces_region not in (None, region):
            return 0
        return part.done


@attrs.define
class _Partial:
    """An arena read in part: from which node, into which region of this process, how many bytes so far."""

    index: int
    node: str
    target: Region
    into: "ArenaBuilder | None" = attrs.field(repr=False)
    """The builder whose arena it lands in (None: this relay's landing buffer)."""
    done: int = 0
    available: int = 0
    """How much of the relay's landing buffer has landed there, as far as this node knows (what it may read)."""
    pieces_region: Region | None = None
    """The landing buffer of the relay that served pieces of it (None: all from checked arenas)."""
    landing_pieces: int = 0

    @property
    def in_landing_buffer(self) -> bool:
        return self.into is None

    def continues(self, index: int, served: "Served") -> bool:
        """Whether ``served`` carries on this reading (the same node, the same landing buffer or the checked arena)."""
        if (self.index, self.node) != (index, served.node):
            return False
        return served.landed is None or self.pieces_region in (None, served.region)


@attrs.frozen
class Served:
    """One step's source: the node, whether it is a relay (and how many arenas it had checked), how to read it."""

    node: str
    relay: bool
    verified: int
    reach: str = attrs.field(repr=False)
    region: Region
    landed: int | None = None
    """For an arena still landing at a relay, the bytes of ``region`` that have landed (None: all of it is checked)."""

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

    @classmethod
    def landing_of(cls, relay: Relay, step: int, content: Content) -> "Served":
        """What has landed of arena ``step`` at ``relay`` so far; PullFailed when its buffer is not the arena's size."""
        landing = relay.landing
        size = content.arenas[step][0]
        if landing is None or landing.arena != step or landing.region.length != size:
            raise PullFailed(
                relay.node, f"its landing buffer for arena {step} does not hold the {size} bytes the fleet's record says"
            )
        return cls(relay.node, True, relay.verified, relay.reach, landing.region, landing.landed)


MIN_RATE_BYTES_S: typing.Final = 50 << 20
"""A read slower than this (plus ``READ_GRACE_S``) is abandoned: the source is gone or stalled."""
READ_GRACE_S: typing.Final = 10.0


def read_deadline(nbytes: int) -> float:
    return READ_GRACE_S + nbytes / MIN_RATE_BYTES_S


def cut(text: str, limit: int = 300) -> str:
    """``text`` for a log line, at most ``limit`` characters (a peer chooses what its errors say)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
