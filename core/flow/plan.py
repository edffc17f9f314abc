"""Where a publish's bytes come from, decided once: :func:`make_plan` asks the server one question (``status``) and
returns a :class:`Plan`; :func:`execute` carries it out.

A plan names, per tier a load keeps (the device's entry, the host tier's copy), whether the server holds it already,
and the :class:`Source` objects that can make the bytes, fastest first: this GPU's own entry (for a host-tier copy), a
peer GPU's entry or the host tier (``node.fill``), another node of the fleet (``node.fleet``), then the last resort the
caller brings: the disk (``loader.Disk``) or a trainer's tensors (``refit``). Execution tries them in that order and
stops at the first that fills; nothing reads a weight file before the plan reaches the disk. The CLI, ``load_model``
(through ``loader.publish``), refit and the fleet execute plans; none decides on its own.
"""

from __future__ import annotations

import abc
import logging
import time
import typing

import attrs

from weightcache.core.client.client import Connection
from weightcache.core.client.replies import ServerStatus
from weightcache.core.fingerprint import HOST_TIER, Fingerprint
from weightcache.core.identity.identity import Environment
from weightcache.core.layout.manifest import Manifest
from weightcache.core.load.export import DEFAULT_CHUNK_BYTES, ArenaBuilder
from weightcache.core.load.publish import publish_arenas, seal
from weightcache.core.node import fill
from weightcache.core.node.fleet.config import FleetConfig
from weightcache.core.node.fleet.pull import Filling
from weightcache.core.socket_dir import SocketDir

if typing.TYPE_CHECKING:
    from weightcache.core.device import Device
    from weightcache.core.identity.digests import ProgressLike

log = logging.getLogger(__name__)

ORIGINS = ("disk", "memory", "peer_gpu", "host_tier", "this_gpu", "node")
"""Where a publish's bytes may come from: the checkpoint, the caller's tensors, a peer GPU's entry, the host tier,
this GPU's own entry (a host-tier copy of it), another node of the fleet."""


@attrs.frozen
class Origin:
    """Where a publish's bytes came from: its ``kind`` (one of ``ORIGINS``) and what names the place (a GPU, a node).

    Compare ``kind``; ``str()`` is how messages say it (``peer GPU GPU-8f3e2a1b``).
    """

    kind: str = attrs.field(validator=attrs.validators.in_(ORIGINS))
    detail: str = ""

    def __str__(self) -> str:
        return {
            "disk": "disk",
            "memory": "this process's tensors",
            "peer_gpu": f"peer GPU {self.detail[:12]}",
            "host_tier": "the host tier",
            "this_gpu": "this GPU's entry",
            "node": f"node {self.detail}" if self.detail else "another node of the fleet",
        }[self.kind]


DISK = Origin("disk")


@attrs.frozen
class Published:
    """What a publish did, the one result type of every publish (``publish``, ``publish_model``, ``publish_state``,
    ``publish_checkpoint``, ``publish_version``): the entry's digest, whether this call created it, its fingerprint, its
    manifest, the timings and where its bytes came from."""

    digest: str
    created: bool
    fingerprint: Fingerprint
    manifest: Manifest = attrs.field(eq=False)
    timings: dict = attrs.field(eq=False, factory=dict)
    source: str = ""
    """How messages name ``origin`` (``disk``, ``peer GPU GPU-...``, ``the host tier``): prose, not to compare."""
    host_digest: str | None = None
    """The host-tier copy's digest when one was kept (``tier`` ``host`` or ``both``)."""
    origin: Origin = DISK
    """Where the bytes came from, typed: compare ``origin.kind``."""

    def __attrs_post_init__(self) -> None:
        if not self.source:
            object.__setattr__(self, "source", str(self.origin))

    @property
    def version(self) -> int:
        """The version published (0: from the checkpoint; a refit's number otherwise)."""
        return self.fingerprint.version


TIERS = ("device", "host", "both")
"""Where ``publish`` keeps a model: on its device (the default), on the host tier only, or both."""


@attrs.frozen
class Tier:
    """Where a publish keeps a model (``name``, one of ``TIERS``), checked once, when made, against the ``device`` it
    loads on: the host tier keeps a GPU's weights, so ``host`` and ``both`` need a CUDA device (ValueError)."""

    name: str
    device: "Device" = attrs.field(eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.name not in TIERS:
            raise ValueError(f"unknown tier {self.name!r}; expected one of {', '.join(TIERS)}")
        if self.name != "device" and not self.device.is_cuda:
            raise ValueError(
                f"the host tier keeps a GPU's weights in host memory: --tier {self.name} needs a CUDA --device, not {self.device}"
            )

    @property
    def on_device(self) -> bool:
        """Whether the entry on the device is published (``device``, ``both``)."""
        return self.name != "host"

    @property
    def on_host(self) -> bool:
        """Whether a host-tier copy is kept (``host``, ``both``)."""
        return self.name != "device"


@attrs.frozen
class Filled:
    """A builder filled by a source: the manifest of its arenas, the fingerprint of its bytes, where they came from."""

    manifest: Manifest = attrs.field(eq=False)
    fingerprint: Fingerprint
    origin: Origin


class Source(abc.ABC):
    """A place the bytes of one entry can come from. ``fill`` an empty builder (None: it could not, try the next);
    ``done`` once the entry is published, ``close`` always (a fleet pull holds a lease until then)."""

    origin: Origin

    @abc.abstractmethod
    def fill(self, builder: ArenaBuilder, timings: dict) -> Filled | None:
        """Fill ``builder`` (empty) and say what it holds, or None (``builder`` left empty) for the next source."""

    def done(self) -> None:
        """The entry is published, whichever source filled it (a fleet pull's claim of the disk read ends here)."""
        return None  # most sources have nothing to let go of

    def close(self) -> None:
        """The plan is over (published or not)."""
        return None

    def __str__(self) -> str:
        return str(self.origin)


class NodeCopy(Source):
    """Another entry of this node with the same content: a peer GPU's, or the host tier's (``node.fill``)."""

    def __init__(self, fingerprint: Fingerprint, found: fill.Source, socket_dir: SocketDir):
        self.fingerprint, self.found, self.socket_dir = fingerprint, found, socket_dir
        self.origin = Origin("host_tier") if found.tier == HOST_TIER else Origin("peer_gpu", found.tier)

    def fill(self, builder: ArenaBuilder, timings: dict) -> Filled | None:
        start = time.perf_counter()
        copied = fill.copy_from_node(self.fingerprint, builder, self.socket_dir, [self.found])
        if copied is None:
            return None
        timings["fill_s"] = time.perf_counter() - start  # copied.timings has its steps
        return Filled(copied.manifest, self.fingerprint, self.origin)


class FleetPull(Source):
    """Another node of the fleet (``node.fleet.pull.Filling``): a holder's copy, or a claimant's once it has read it.

    Made only where the environment names a fleet; ``may_claim`` False: never claim the disk read (no disk follows).
    """

    origin = Origin("node")

    def __init__(self, fingerprint: Fingerprint, config: FleetConfig, may_claim: bool):
        self.fingerprint, self.config, self.may_claim = fingerprint, config, may_claim
        self.filling: Filling | None = None  # made when the plan comes to it: a plan held already asks no registry

    def fill(self, builder: ArenaBuilder, timings: dict) -> Filled | None:
        start = time.perf_counter()
        self.filling = Filling(self.fingerprint, self.config, self.may_claim)
        pulled = self.filling.pull(builder)
        if pulled is None:
            return None
        timings["pull_s"] = time.perf_counter() - start  # pulled.timings has its steps
        return Filled(pulled.manifest, self.fingerprint, Origin("node", f"{pulled.node} over {pulled.path}"))

    def done(self) -> None:
        if self.filling is not None:
            self.filling.published()  # a claimant lets the waiting nodes pull from here now

    def close(self) -> None:
        if self.filling is not None:
            self.filling.close()


@attrs.frozen
class TierPlan:
    """One tier of a plan: ``name`` (``device`` or ``host``), what its bytes count against (``kept_on``: a GPU's UUID,
    or ``HOST_TIER`` for the host tier and a CPU's entries), the entry's digest (None on a first sight, when the content
    is known only once read) and whether the server holds it already."""

    name: str
    kept_on: str
    digest: str | None
    held: bool


@attrs.frozen
class Plan:
    """Where a publish's bytes come from, decided from one server exchange (:func:`make_plan`).

    ``device`` and ``host`` are the tiers ``tier`` keeps (None for one it does not); ``sources`` make the bytes that
    are not held, fastest first; ``copy_entry``: the host tier's copy is made from this GPU's own entry, no source
    needed; ``status``: the server's reply the plan was made from (its budgets check the room).
    """

    fingerprint: Fingerprint | None
    tier: Tier
    device: TierPlan | None
    host: TierPlan | None
    sources: tuple[Source, ...] = attrs.field(eq=False)
    status: ServerStatus | None = attrs.field(eq=False, default=None)
    copy_entry: bool = False

    @property
    def tiers(self) -> tuple[TierPlan, ...]:
        return tuple(plan for plan in (self.device, self.host) if plan is not None)

    @property
    def settled(self) -> bool:
        """Whether the server holds every tier asked for: nothing to load."""
        return all(plan.held for plan in self.tiers)

    @property
    def first(self) -> Source | None:
        """The source tried first, None where nothing is read (held, or copied from this GPU's entry)."""
        if self.copy_entry or (self.host is not None and self.host.held and self.device is None):
            return None
        return self.sources[0] if self.sources else None

    @property
    def reads_disk_first(self) -> bool:
        """Whether the disk is the first source: only then may a caller read the weight files ahead."""
        return self.first is not None and self.first.origin.kind == "disk"

    def describe(self) -> str:
        """One line for a person: ``from peer GPU GPU-8f3e2a1b, else another node of the fleet, else disk``."""
        if self.settled:
            return "held already: nothing to load"
        if self.copy_entry:
            return "the host tier's copy from this GPU's entry"
        if self.first is None:
            return "held already: nothing to load"
        return "from " + ", else ".join(str(source) for source in self.sources)

    def close(self) -> None:
        for source in self.sources:
            source.close()


def make_plan(
    fingerprint: Fingerprint | None,
    tier: Tier,
    socket_dir: SocketDir,
    last: Source | None,
    fleet: bool = True,
    connection: Connection | None = None,
) -> Plan:
    """The plan for the entry ``fingerprint`` names (None on a first sight) on ``tier``, from one ``status`` exchange.

    ``last``: what makes the bytes when nothing the node or the fleet holds does (the disk, a trainer's tensors; None:
    nothing, a client that never reads the disk). ``fleet`` False leaves the fleet out (a trainer's new version is
    nowhere else). ``connection``: one the caller holds open already (refit asks it for the versions too), else one is
    opened. A server that does not answer raises ServerUnavailable.
    """
    if connection is None:
        with Connection(socket_dir) as opened:
            status = ServerStatus.from_json(opened.status())
    else:
        status = ServerStatus.from_json(connection.status())
    kept_on = Environment.of(tier.device).gpu_uuid or HOST_TIER  # a CPU's entries count against the host's budget
    held = {entry.digest for entry in status.entries}
    wanted = fingerprint.digest if fingerprint is not None else None
    on_host = fingerprint.on_device(HOST_TIER).digest if fingerprint is not None else None
    device = TierPlan("device", kept_on, wanted, wanted in held) if tier.on_device else None
    host = TierPlan("host", HOST_TIER, on_host, on_host in held) if tier.on_host else None
    if fingerprint is None:
        return Plan(None, tier, device, host, (last,) if last is not None else (), status)
    copy_entry = host is not None and not host.held and fingerprint.digest in held
    sources: list[Source] = [NodeCopy(fingerprint, found, socket_dir) for found in _copies(fingerprint, status)]
    config = _fleet_config() if fleet else None
    if config is not None:
        sources.append(FleetPull(fingerprint, config, may_claim=last is not None))
    if last is not None:
        sources.append(last)
    return Plan(fingerprint, tier, device, host, tuple(sources), status, copy_entry)


def _copies(fingerprint: Fingerprint, status: ServerStatus) -> list[fill.Source]:
    """The node's other entries of ``fingerprint``'s very content, GPUs first: a row is one only where the fingerprint
    moved to its tier has the row's digest (the server's word on the content is not needed)."""
    if not fingerprint.gpu_uuid:
        return []  # a CPU's entry is made from the disk or the fleet (the host tier holds a GPU's weights)
    found = []
    for entry in status.entries:
        if entry.tier in ("", fingerprint.gpu_uuid) or "+" in entry.tier:
            continue
        there = fingerprint.on_device(entry.tier)
        if there.digest == entry.digest and 0 < entry.nbytes <= fill.MAX_SOURCE_BYTES:
            found.append(fill.Source(there, entry.tier, entry.nbytes))
    return sorted(found, key=lambda source: source.tier == HOST_TIER)


def _fleet_config() -> FleetConfig | None:
    """The fleet the environment names; a bad setting costs a warning and no fleet."""
    try:
        return FleetConfig.from_env()
    except ValueError as exc:
        log.warning("weightcache: not using the fleet: %s", exc)
        return None


def no_other_source(first_sight: bool) -> bool:
    """Whether the disk is certain before any server is asked: a first sight (the content is not known until read, so
    nothing can be found under it) where no fleet is named (one may know the content; it is asked in the plan)."""
    return first_sight and _fleet_config() is None


def execute(
    plan: Plan,
    socket_dir: SocketDir,
    label: str,
    device: "Device",
    progress: "ProgressLike | None" = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Published | None:
    """Carry ``plan`` out: fill arenas from its first source that can, keep the tiers it asks for, publish.

    None where no source could fill (a plan with no disk, whose copies failed); nothing is published then.
    """
    timings: dict[str, float] = {}
    fingerprint = plan.fingerprint
    if fingerprint is not None and plan.host is not None:
        done = _host_copy_of_what_is_held(plan, fingerprint, socket_dir, label, timings)
        if done is not None:
            plan.close()
            return done
    with ArenaBuilder(device, chunk_bytes=chunk_bytes, progress=progress) as builder:
        try:  # the sources let go before the arenas do: a fleet pull may still serve them to another node
            filled = fill_from(plan, builder, timings)
            if filled is None:
                return None
            builder.progress.close()
            published = keep(plan, filled, builder, socket_dir, label, timings)
            for source in plan.sources:
                source.done()  # a fleet pull that claimed the disk read waits for this node to share what it read
        finally:
            plan.close()
    state = "published" if published.created else "loaded, but the server already held"
    log.info("%s %s (%s) from %s in %.2f s", state, published.digest[:12], label, published.origin, sum(timings.values()))
    return published


def fill_from(plan: Plan, builder: ArenaBuilder, timings: dict) -> Filled | None:
    """The first step of ``execute``: fill ``builder`` from ``plan``'s first source that can (None: none could)."""
    for source in plan.sources:
        filled = source.fill(builder, timings)
        if filled is not None:
            return filled
    return None


def keep(plan: Plan, filled: Filled, builder: ArenaBuilder, socket_dir: SocketDir, label: str, timings: dict) -> Published:
    """The last step of ``execute``: publish ``builder``'s arenas on the tiers ``plan`` keeps, the host tier's copy first
    (it is checked against the device's checksums), then the device's entry. Refit runs ``fill_from`` and ``keep`` apart:
    its version is laid out and named between the two, and published when the trainer says so."""
    manifest, fingerprint = filled.manifest, filled.fingerprint
    host_held = plan.host.digest if plan.host is not None and plan.host.held else None
    host_digest, host_created = host_held, False
    if plan.host is not None and not host_held:
        seal(builder)  # the GPU arenas' checksums: the host copy is checked against them
        manifest = attrs.evolve(manifest, arenas=builder.specs())
        start = time.perf_counter()
        kept = fill.keep_on_host(fingerprint, manifest, builder.arenas, socket_dir, label)
        host_digest, host_created = kept.digest, kept.created
        timings["host_copy_s"] = time.perf_counter() - start
    if plan.device is None:
        if host_digest is None:
            raise RuntimeError("the host tier's copy was neither found nor kept")
        digest, created, published_as = host_digest, host_created, fingerprint.on_device(HOST_TIER)
    else:
        start = time.perf_counter()
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label)
        timings["publish_s"] = time.perf_counter() - start
        digest, created, published_as = reply.digest, reply.created, fingerprint
    return Published(digest, created, published_as, manifest, timings, host_digest=host_digest, origin=filled.origin)


def _host_copy_of_what_is_held(
    plan: Plan, fingerprint: Fingerprint, socket_dir: SocketDir, label: str, timings: dict
) -> Published | None:
    """A plan that keeps the host tier, where the node holds what is asked: the host copy, or this GPU's entry to copy."""
    host = fingerprint.on_device(HOST_TIER)
    if plan.host is not None and plan.host.held and plan.device is None:
        log.info("the host tier already holds %s (%s)", host.digest[:12], label)
        return Published(host.digest, False, host, Manifest([], []), timings, host_digest=host.digest, origin=Origin("host_tier"))
    if not plan.copy_entry:
        return None
    start = time.perf_counter()
    kept = fill.keep_entry_on_host(fingerprint, socket_dir, label)  # this GPU's entry exists: copy it, not the disk
    if kept is None:
        return None  # evicted since the plan was made: the sources make it
    reply, manifest = kept
    timings["host_copy_s"] = time.perf_counter() - start
    this_gpu = Origin("this_gpu")
    if plan.device is None:
        return Published(reply.digest, reply.created, host, manifest, timings, host_digest=reply.digest, origin=this_gpu)
    return Published(fingerprint.digest, False, fingerprint, manifest, timings, host_digest=reply.digest, origin=this_gpu)
