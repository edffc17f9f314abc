"""Filling a GPU's entry from a copy the node already holds: a peer GPU's entry, then the host tier, before the disk.

The CUDA-free server says where a content lives (``locate``: entries whose
fingerprint differs only in ``gpu_uuid``); the copy runs here, in the loader's
CUDA process. The new arenas get the same sizes and the manifest the same
offsets, so the entry is the source's bytes, byte for byte, published under this
GPU's own fingerprint. The copy is checksummed on this GPU and compared with the
checksums the source declared. A source that fails (no peer access, evicted
meanwhile, a copy that breaks, bytes that do not match: ChecksumMismatch) costs
one log line and the next source is tried; nothing is published until every byte
has arrived and matched.

The host tier (``keep_on_host``) holds a GPU-made entry in sealed host memfds, so
a GPU can be filled again after its entry was evicted (model swapping).
"""

from __future__ import annotations

import logging
import time
import typing

import attrs

from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import ProtocolError, ServerError, ServerUnavailable, WeightCacheError
from weightcache.core.fingerprint import HOST_TIER, Fingerprint
from weightcache.core.layout.manifest import Manifest
from weightcache.core.load.export import ArenaBuilder
from weightcache.core.node.backends import TierCopy, backend_class
from weightcache.core.node.host_tier import HostTierCopy
from weightcache.core.socket_dir import SocketDir
from weightcache.core.wire.protocol import MAX_SOURCES

if typing.TYPE_CHECKING:
    from weightcache.core.client.replies import PublishReply

log = logging.getLogger(__name__)

MAX_SOURCE_BYTES = 1 << 50
"""Most bytes a believed source may hold (1 PiB: more than any node's memory)."""
MAX_TIER_CHARS = 256
_ROW_KEYS = ("fingerprint", "tier", "bytes")


@attrs.frozen
class Source:
    """An entry of the node that holds the wanted content: its fingerprint, its tier (``host`` or a GPU UUID), bytes."""

    fingerprint: Fingerprint
    tier: str
    nbytes: int

    @property
    def name(self) -> str:
        """``the host tier`` or ``peer GPU GPU-8f3e2a1b``: how logs and reports name it."""
        return "the host tier" if self.tier == HOST_TIER else f"peer GPU {self.tier[:12]}"

    @property
    def backend(self) -> str:
        """The ``BACKENDS`` entry that copies from it: ``host_tier`` or ``peer_gpu``."""
        return "host_tier" if self.tier == HOST_TIER else "peer_gpu"

    @classmethod
    def from_row(cls, row: object, wanted: Fingerprint) -> "Source":
        """The source one row of a ``locate`` reply for ``wanted`` names; ValueError saying what is wrong with it.

        A row is believed only when it is another entry of ``wanted``'s very content
        (same ``content_digest``, another fingerprint), its tier a string and its
        bytes a count from 1 to ``MAX_SOURCE_BYTES``: a server that names anything
        else is broken or lying, and copying from it would publish other bytes.
        """
        if not isinstance(row, dict):
            raise ValueError(f"a row is a JSON {_json_kind(row)}, not an object")
        missing = [name for name in _ROW_KEYS if name not in row]
        if missing:
            raise ValueError(f"a row lacks {', '.join(missing)}")
        if not isinstance(row["fingerprint"], dict):
            raise ValueError(f"a row's fingerprint is a JSON {_json_kind(row['fingerprint'])}, not an object")
        try:
            fingerprint = Fingerprint.from_json(row["fingerprint"])
        except ValueError as exc:
            raise ValueError(f"a row's fingerprint is malformed: {str(exc).removeprefix('malformed fingerprint: ')}") from None
        if fingerprint.content_digest != wanted.content_digest:
            fields = ", ".join(name for name in fingerprint.mismatched_fields(wanted) if name != "gpu_uuid")
            raise ValueError(f"a row names another content (it differs in {fields})")
        if fingerprint.digest == wanted.digest:
            raise ValueError("a row names the requested fingerprint itself")
        tier, nbytes = row["tier"], row["bytes"]
        if not isinstance(tier, str) or not 0 < len(tier) <= MAX_TIER_CHARS:
            raise ValueError(f"a row's tier is {_shown(tier)}, not a name of 1 to {MAX_TIER_CHARS} characters")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= MAX_SOURCE_BYTES:
            raise ValueError(f"a row's bytes are {_shown(nbytes)}, not a count from 1 to {MAX_SOURCE_BYTES}")
        return cls(fingerprint, tier, nbytes)


@attrs.frozen
class Copied:
    """A builder filled from ``source``: the manifest of its arenas, and the seconds each step took."""

    source: Source
    manifest: Manifest = attrs.field(eq=False)
    timings: dict = attrs.field(eq=False)


def sources(fingerprint: Fingerprint, socket_dir: SocketDir | None = None) -> list[Source]:
    """The node's other copies of ``fingerprint``'s content, fastest first (peer GPUs, then the host tier).

    Empty when no server answers: then there is nothing to copy from. Only rows of
    the same content are kept (``Source.from_row``); a reply with anything else in
    it costs one warning line, however many rows are wrong, and the rest is used.
    """
    try:
        with Connection(socket_dir) as connection:
            rows = connection.locate(fingerprint)
    except ServerUnavailable:
        return []
    except (ProtocolError, ServerError) as exc:
        log.warning("weightcache: ignoring the server's locate reply for %s: %s", fingerprint.short, _cut(str(exc)))
        return []
    found: list[Source] = []
    problems = [f"it names {len(rows)} rows; at most {MAX_SOURCES} are read"] if len(rows) > MAX_SOURCES else []
    for row in rows[:MAX_SOURCES]:
        try:
            source = Source.from_row(row, fingerprint)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if source.fingerprint in (known.fingerprint for known in found):
            problems.append(f"a row names {source.fingerprint.short} twice")
            continue
        found.append(source)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        log.warning(
            "weightcache: ignoring %d of the %d sources the server named for %s: %s%s; run the same weightcache "
            "version on both sides",
            len(rows) - len(found),
            len(rows),
            fingerprint.short,
            _cut(problems[0]),
            more,
        )
    return found


def _shown(value: object) -> str:
    """``repr(value)`` for a log line, cut short: a lying server chooses its length."""
    return _cut(repr(value), 40)


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_kind(value: object) -> str:
    """What JSON calls the kind of ``value``: object, array, string, number, boolean or null."""
    kinds = ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"), ((int, float), "number"))
    return next((kind for types, kind in kinds if isinstance(value, types)), "null")


def copy_from_node(
    fingerprint: Fingerprint,
    builder: ArenaBuilder,
    socket_dir: SocketDir | None = None,
    candidates: typing.Sequence[Source] | None = None,
) -> Copied | None:
    """Fill ``builder`` (empty, on a GPU) with ``fingerprint``'s content from the fastest source that works, or None.

    ``candidates`` defaults to what the server names now (``sources``). Each source is
    attached, copied arena by arena into new arenas of the same sizes, and detached.
    """
    if not builder.device.is_cuda:
        return None
    from weightcache.core.device import cuda_index, gpu_uuid

    index = cuda_index(builder.device)
    own_uuid = gpu_uuid(index)
    for source in sources(fingerprint, socket_dir) if candidates is None else candidates:
        if source.tier == own_uuid:
            continue  # this GPU's own entry of another fingerprint: not a copy to make
        copier: TierCopy = backend_class(source.backend, TierCopy)()
        why_not = copier.unusable(source.tier, index)
        if why_not is not None:
            log.info("weightcache: %s: %s; trying the next source", source.name, why_not)
            continue
        try:
            return _copy(source, copier, builder, socket_dir, index)
        except (WeightCacheError, OSError, ValueError, RuntimeError) as exc:
            log.warning("weightcache: filling cuda:%d from %s failed (%s); trying the next source", index, source.name, exc)
            builder.reset()
    return None


def _copy(source: Source, copier: TierCopy, builder: ArenaBuilder, socket_dir: SocketDir | None, index: int) -> Copied:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    # An unverified source (back from a crash) is not checksummed where it lies: its copy is, below, on this GPU.
    attachment = Attachment.open(source.fingerprint, socket_dir, map_on=index, checked_by_caller=True)
    try:
        timings["map_s"] = time.perf_counter() - start
        slots = [builder.add_arena(spec.size) for spec in attachment.manifest.arenas]
        targets = [builder.view(slot) for slot in slots]
        start = time.perf_counter()
        copier.fill(attachment.arenas, targets, index)
        timings["copy_s"] = time.perf_counter() - start
        del targets
        start = time.perf_counter()
        specs = builder.check_copy(attachment.manifest.arenas, source.name)  # on this GPU; a mismatch tries the next source
        attachment.confirm_verified()  # its bytes, copied, matched: the source is verified too
        timings["verify_s"] = time.perf_counter() - start
        manifest = attrs.evolve(attachment.manifest, arenas=specs)
    finally:
        attachment.close()
    log.info("weightcache: filled cuda:%d from %s (%d bytes)", index, source.name, sum(s.size for s in manifest.arenas))
    return Copied(source, manifest, timings)


def keep_on_host(
    fingerprint: Fingerprint,
    manifest: Manifest,
    arenas: typing.Sequence,
    socket_dir: SocketDir | None = None,
    label: str = "",
) -> "PublishReply":
    """Publish a host-tier copy of ``arenas`` (sealed GPU arenas holding ``manifest``'s bytes: a builder's or an attachment's).

    The copy's fingerprint is ``fingerprint.on_device(HOST_TIER)``; returns the server's reply.
    ``manifest.arenas`` carry the GPU arenas' checksums: the host copy is published only if
    its bytes, checksummed on the CPU, match them (ChecksumMismatch otherwise).
    """
    from weightcache.core.load.publish import publish_arenas

    with ArenaBuilder("cpu") as host:
        slots = [host.add_arena(arena.spec.size) for arena in arenas]
        transfer = backend_class("host_tier", HostTierCopy)().keep(arenas, [host.arena(slot) for slot in slots])
        start = time.perf_counter()
        reply = publish_arenas(host, fingerprint.on_device(HOST_TIER), manifest, socket_dir, label, copied_from="the GPU entry")
        verify_s = time.perf_counter() - start  # the host copy's checksum, on the CPU, compared with the GPU's; and the publish
    log.info(
        "weightcache: kept %s on the host tier (%d bytes in %.2f s, checked and published in %.2f s)",
        reply.digest[:12],
        transfer.nbytes,
        transfer.copy_s,
        verify_s,
    )
    return reply


def keep_entry_on_host(
    fingerprint: Fingerprint, socket_dir: SocketDir | None = None, label: str = ""
) -> "tuple[PublishReply, Manifest] | None":
    """Publish a host-tier copy of ``fingerprint``'s own GPU entry, if the server holds it (else None).

    Returns the server's reply and the entry's manifest.
    """
    from weightcache.core.errors import EntryNotFound

    try:
        attachment = Attachment.open(fingerprint, socket_dir)
    except EntryNotFound:
        return None
    try:
        reply = keep_on_host(fingerprint, attachment.manifest, attachment.arenas, socket_dir, label or attachment.label)
        return reply, attachment.manifest
    finally:
        attachment.close()
