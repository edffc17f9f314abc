"""The trainer's side of a refit: a new version of a published model, from tensors held in memory.

The adapter builds the model from the tensors (``weightcache_load_tensors``), post-processes and exports it exactly
as a load from files does, every tensor lands where the previous version keeps it (``layout``), the arenas get their
checksums, and the version is published in one frame under a fingerprint of its own: the model's, with the version's
number and a content identity derived from those checksums. Engines then switch to it between two steps.
"""

from __future__ import annotations

import time
import typing

import attrs

from weightcache.core.client.client import Connection, HeldVersion
from weightcache.core.errors import LayoutMismatch, VersionNotFound
from weightcache.core.fingerprint import Fingerprint, ParallelSpec, sha256_json
from weightcache.core.flow.loader import Prepared, exported, prepare, processed
from weightcache.core.flow.plan import Filled, Origin, Plan, Published, Source, Tier, TierPlan, fill_from, keep, make_plan
from weightcache.core.gc_pause import gc_paused
from weightcache.core.identity.safetensors_io import checkpoint_tensors
from weightcache.core.layout.manifest import Manifest
from weightcache.core.load.export import ArenaBuilder
from weightcache.core.load.publish import seal
from weightcache.core.refit.layout import conform, place_like, state_difference
from weightcache.core.request import LoadRequest
from weightcache.core.socket_dir import SocketDir, SocketDirLike
from weightcache.core.wire.protocol import close_fds

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.flow.plugins import Plugins


PublishedVersion = Published
"""Deprecated: the name 0.2.0 gave ``publish_version``'s result; it is ``Published`` now, the one type of a publish's
result (``version``, ``digest``, ``fingerprint``, ``created`` and ``timings`` as before; ``origin`` the trainer's tensors)."""

TRAINER = Origin("memory")


class StagedVersion:
    """A version built in arenas, checksummed and identified, not published yet: ``publish()`` or ``close()`` it.

    ``plan``: the refit's plan (``stage_version``: the trainer's tensors, on the device's tier), whose last step
    ``publish`` runs.
    """

    def __init__(
        self,
        fingerprint: Fingerprint,
        manifest: Manifest,
        builder: ArenaBuilder,
        socket_dir: SocketDir,
        label: str,
        plan: Plan | None = None,
    ):
        self.fingerprint = fingerprint
        self.manifest = manifest
        self.builder = builder
        self.socket_dir = socket_dir
        self.label = label
        self.timings: dict[str, float] = {}
        self.plan = plan if plan is not None else _device_plan(builder)

    @property
    def version(self) -> int:
        return self.fingerprint.version

    def publish(self) -> Published:
        """Publish the version in one frame (a trainer killed before it leaves nothing behind) and release the arenas here."""
        filled = Filled(self.manifest, self.fingerprint, TRAINER)
        try:
            return keep(self.plan, filled, self.builder, self.socket_dir, self.label, self.timings)
        finally:
            self.close()

    def close(self) -> None:
        self.builder.close()

    def __enter__(self) -> "StagedVersion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def publish_version(
    model: str,
    state: "typing.Mapping[str, torch.Tensor]",
    version: int,
    *,
    adapter: str = "hf",
    dtype: str | None = None,
    device: str = "cpu",
    quantization: str | None = None,
    parallel: ParallelSpec | None = None,
    revision: str | None = None,
    socket_dir: SocketDirLike = None,
    plugins: "Plugins | None" = None,
    **options: typing.Any,
) -> Published:
    """Publish ``state`` (tensors named, shaped and typed as the checkpoint ``model`` stores them, on any device) as
    version ``version`` of the entry ``load_model`` publishes for the same arguments.

    The adapter's load, post-processing (block-FP8 quantisation included) and export run on the tensors as on files.
    ``version`` must be newer than every version the server holds of the model (the one from disk is 0). Raises
    LayoutMismatch naming the first difference, VersionNotFound when the server holds no version of the model, before
    anything is published; ServerError ``over_budget`` when the budgets cannot hold this version beside the ones engines
    still map.
    """
    request = LoadRequest(
        model=model,
        adapter=adapter,
        dtype=dtype,
        device=device,
        quantization=quantization,
        parallel=parallel or ParallelSpec(),
        options=options,
        revision=revision,
    )
    with stage_version(prepare(request, plugins), state, version, socket_dir) as staged:
        return staged.publish()


@gc_paused()  # a full collection of a trainer's heap takes longer than the whole refit on a GPU
def stage_version(
    prepared: Prepared, state: "typing.Mapping[str, torch.Tensor]", version: int, socket_dir: SocketDirLike = None
) -> StagedVersion:
    """Build version ``version`` of ``prepared``'s entry from ``state`` in arenas laid out as the newest version the server
    holds, checksum them and name the result; nothing is published (``StagedVersion.publish``). See ``publish_version``."""
    socket_dir = SocketDir.parse(socket_dir)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    request = prepared.request
    difference = state_difference(checkpoint_tensors(request.model, prepared.declared), state)
    if difference is not None:
        raise LayoutMismatch(f"version {version}", difference)
    base = prepared.fingerprint
    with Connection(socket_dir) as connection:
        newest, template = _newest(base, connection)
        if type(version) is not int or version <= newest.version:
            raise ValueError(
                f"version {version!r:.40} is not newer than version {newest.version} the server holds; publish {newest.version + 1}"
            )
        tensors = Tensors(prepared, state, template)  # a new version is nowhere else: no node copy, no fleet
        plan = make_plan(None, Tier("device", request.device), socket_dir, tensors, fleet=False, connection=connection)
    timings["template_s"] = time.perf_counter() - start
    builder = ArenaBuilder(request.device)
    try:
        filled = fill_from(plan, builder, timings)
        if filled is None:
            raise RuntimeError("a refit's plan filled nothing from the trainer's tensors")
        start = time.perf_counter()
        manifest, builder = conform(filled.manifest, builder, template)
        timings["conform_s"] = time.perf_counter() - start
        start = time.perf_counter()
        seal(builder)
        manifest = attrs.evolve(manifest, arenas=builder.specs())
        timings["seal_s"] = time.perf_counter() - start
    except BaseException:
        builder.close()
        raise
    fingerprint = base.as_version(version, content_identity(manifest))
    staged = StagedVersion(fingerprint, manifest, builder, socket_dir, f"{prepared.label} v{version}", plan)
    staged.timings.update(timings)
    return staged


class Tensors(Source):
    """A trainer's tensors, placed as ``template`` (the newest version held) keeps them, then through the adapter
    pipeline a load from the files runs (``loader.processed``, ``loader.exported``): the source of a refit's plan."""

    origin = TRAINER

    def __init__(self, prepared: Prepared, state: "typing.Mapping[str, torch.Tensor]", template: Manifest):
        self.prepared, self.state, self.template = prepared, state, template

    def fill(self, builder: ArenaBuilder, timings: dict) -> Filled:
        prepared, request = self.prepared, self.prepared.request
        start = time.perf_counter()
        placed = {"tensors": place_like(self.template, builder, self.state)}
        timings["place_s"] = time.perf_counter() - start
        # popped as the adapter takes them: the placed tensors are not held here beyond the load
        model = processed(prepared, lambda: prepared.adapter.load_tensors(request, placed.pop("tensors"), builder), timings)
        start = time.perf_counter()
        manifest = exported(prepared, model, builder)
        del model
        timings["export_s"] = time.perf_counter() - start
        return Filled(manifest, prepared.fingerprint, TRAINER)


def content_identity(manifest: Manifest) -> str:
    """What names a version's bytes: its layout and its arenas' checksums (two versions with equal bytes share it)."""
    import hashlib

    return sha256_json(
        {
            "table": hashlib.sha256(manifest.table.data).hexdigest(),
            "arenas": [spec.to_json() for spec in manifest.arenas],
            "aliases": manifest.aliases,
            "extra": manifest.extra,
        }
    )


def _newest(base: Fingerprint, connection: Connection) -> tuple[HeldVersion, Manifest]:
    """The newest version the server holds of ``base``'s lineage, and its manifest (attached and let go at once)."""
    held = connection.versions(base.lineage)
    if not held:
        raise VersionNotFound(base.lineage, None, [])
    newest = held[-1]
    reply = connection.attach(newest.fingerprint)
    close_fds(reply.fds)
    connection.detach(reply.digest)
    return newest, reply.manifest()


def _device_plan(builder: ArenaBuilder) -> Plan:
    """The plan of a version staged without ``stage_version``: its entry on the builder's device, from its tensors."""
    tier = Tier("device", builder.device)
    return Plan(None, tier, TierPlan("device", "", None, False), None, ())
