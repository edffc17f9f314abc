"""The loader side: read a checkpoint, post-process it, place it into arenas and publish it."""

from __future__ import annotations

import gc
import logging
import time

import attrs

from weightcache.core.client import Connection
from weightcache.core.export import ArenaBuilder, DEFAULT_CHUNK_BYTES
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.identity import fingerprint_for
from weightcache.core.manifest import Manifest
from weightcache.core.plugins import Adapter, Plugins
from weightcache.core.progress import NoProgress
from weightcache.core.protocol import close_fds
from weightcache.core.quantization.allowlist import check_quantization
from weightcache.core.request import LoadRequest

log = logging.getLogger(__name__)


@attrs.frozen
class Prepared:
    """A request checked and fingerprinted before any weight is read."""

    request: LoadRequest
    adapter: Adapter = attrs.field(eq=False)
    description: object = attrs.field(eq=False)
    fingerprint: Fingerprint


@attrs.frozen
class Published:
    """What ``publish`` did: the entry's digest, whether it was new, its manifest and the timings."""

    digest: str
    created: bool
    fingerprint: Fingerprint
    manifest: Manifest = attrs.field(eq=False)
    timings: dict = attrs.field(eq=False)


def prepare(request: LoadRequest, plugins: Plugins | None = None) -> Prepared:
    """Describe the model, check its quantization method against the allowlist and fingerprint it.

    The allowlist check reads configs only, so an unsupported method fails here before any weight byte
    is read; the fingerprint then needs each weight file's content digest (remembered per file version:
    hashed on first sight, a stat per file afterwards; see ``weightcache.core.digests``).
    """
    adapter = (plugins or Plugins()).adapter(request.adapter)
    description = adapter.describe(request)
    check_quantization(description.quantization, adapter.quantization_allowlist(request))
    return Prepared(request, adapter, description, fingerprint_for(request, description))


def load_from_disk(prepared: Prepared, builder: ArenaBuilder | None = None, timings: dict | None = None):
    """The adapter's plain load plus post-processing (mode ``off``, and the loader's first half).

    Adds ``load_s`` and ``quantize_s`` to ``timings`` when given.
    """
    timings = {} if timings is None else timings
    start = time.perf_counter()
    model = prepared.adapter.load(prepared.request, builder)
    loaded = time.perf_counter()
    model = prepared.adapter.quantize(prepared.request, model, prepared.description)
    timings.update(load_s=loaded - start, quantize_s=time.perf_counter() - loaded)
    return model


def publish(
    prepared: Prepared,
    socket_dir=None,
    progress=None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    label: str | None = None,
) -> Published:
    """Load ``prepared`` into arenas and publish it in one frame (atomic: a crash before leaves nothing)."""
    timings: dict[str, float] = {}
    progress = progress or NoProgress()
    builder = ArenaBuilder(prepared.request.device, chunk_bytes=chunk_bytes)
    builder.progress = progress
    try:
        model = load_from_disk(prepared, builder, timings)
        start = time.perf_counter()
        manifest = prepared.adapter.export(prepared.request, model, builder)
        extra = prepared.adapter.manifest_extra(prepared.request, model)
        manifest = attrs.evolve(manifest, extra={**manifest.extra, **extra})
        del model
        timings["export_s"] = time.perf_counter() - start
        progress.close()
        start = time.perf_counter()
        reply = publish_built(builder, prepared.fingerprint, manifest, socket_dir, label or _label(prepared))
        timings["publish_s"] = time.perf_counter() - start
    finally:
        builder.close()
    log.info("published %s in %.2f s", reply["digest"][:12], sum(timings.values()))
    return Published(reply["digest"], bool(reply["created"]), prepared.fingerprint, manifest, timings)


def publish_built(builder: ArenaBuilder, fingerprint: Fingerprint, manifest: Manifest, socket_dir=None, label: str = "") -> dict:
    """Seal ``builder``'s arenas and publish them with ``manifest`` in one frame; returns the server's reply."""
    _seal(builder)
    fds = [arena.export_fd() for arena in builder.arenas]
    try:
        with Connection(socket_dir) as connection:
            return connection.publish(fingerprint, manifest.to_json(), fds, label=label)
    finally:
        close_fds(fds)


def _seal(builder: ArenaBuilder) -> None:
    """Seal the arenas; a reference cycle may still hold a view, so collect once and retry."""
    try:
        builder.seal()
    except OSError:
        gc.collect()
        builder.seal()


def _label(prepared: Prepared) -> str:
    request = prepared.request
    name = request.model.rstrip("/").rsplit("/", 1)[-1]
    quant = "" if prepared.description.quantization == "none" else f" {prepared.description.quantization}"
    return f"{name} ({prepared.description.architecture}{quant}, {request.parallel.label})"
