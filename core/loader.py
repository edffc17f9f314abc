"""The loader side: check a request before any weight is read, then load, post-process, place into arenas and publish."""

from __future__ import annotations

import gc
import logging
import time
import typing

import attrs

from weightcache.core import identity
from weightcache.core.client import Connection
from weightcache.core.digests import FileKey
from weightcache.core.errors import CheckpointChanged
from weightcache.core.export import DEFAULT_CHUNK_BYTES, ArenaBuilder
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.manifest import Manifest
from weightcache.core.plugins import Adapter, Plugins, installed_plugins
from weightcache.core.protocol import close_fds
from weightcache.core.quantization.allowlist import check_quantization
from weightcache.core.request import LoadRequest, ModelDescription
from weightcache.core.safetensors_io import checkpoint_files

if typing.TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@attrs.define
class Prepared:
    """A request checked before any weight is read: adapter found, options known, quantization allowed.

    The fingerprint is computed on first use (it reads the checkpoint's
    identity), so a plain disk load never pays for it.
    """

    request: LoadRequest
    adapter: Adapter = attrs.field(eq=False, repr=False)
    description: ModelDescription
    _fingerprint: Fingerprint | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def fingerprint(self) -> Fingerprint:
        if self._fingerprint is None:
            self._fingerprint = identity.fingerprint_for(self.request, self.description)
        return self._fingerprint

    @property
    def label(self) -> str:
        """How status and logs name this entry: the checkpoint directory's name, the architecture, the rank."""
        name = self.request.model.rstrip("/").rsplit("/", 1)[-1]
        quant = "" if self.description.quantization == "none" else f" {self.description.quantization}"
        return f"{name} ({self.description.architecture}{quant}, {self.request.parallel.label}, {self.request.adapter})"


@attrs.frozen
class Published:
    """What ``publish`` did: the entry's digest, whether this call created it, its manifest and the timings."""

    digest: str
    created: bool
    fingerprint: Fingerprint
    manifest: Manifest = attrs.field(eq=False)
    timings: dict = attrs.field(eq=False)


def prepare(request: LoadRequest, plugins: Plugins | None = None) -> Prepared:
    """Find the adapter, check the options, describe the model and check its quantization method.

    Reads configs only: an unknown option or an unsupported method fails here, before any weight
    byte is read. The fingerprint, computed on first use, needs each weight file's content digest
    (remembered per file version: hashed on first sight, a stat per file afterwards; see
    ``weightcache.core.digests``).
    """
    adapter = (plugins or installed_plugins()).adapter(request.adapter)
    adapter.check_options(request)
    description = adapter.describe(request)
    check_quantization(description.quantization, adapter.quantization_allowlist(request))
    return Prepared(request, adapter, description)


def load_from_disk(prepared: Prepared, builder: ArenaBuilder | None = None, timings: dict | None = None) -> "torch.nn.Module":
    """The adapter's load and post-processing: mode ``off``, and the first half of a publish.

    Adds ``load_s`` and ``post_process_s`` to ``timings`` when given.
    """
    timings = {} if timings is None else timings
    start = time.perf_counter()
    model = prepared.adapter.load(prepared.request, builder)
    loaded = time.perf_counter()
    model = prepared.adapter.post_process(prepared.request, model, prepared.description)
    timings.update(load_s=loaded - start, post_process_s=time.perf_counter() - loaded)
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
    request = prepared.request
    fingerprint = prepared.fingerprint  # the content identity, before a byte is loaded
    versions = file_versions(request.model)
    with ArenaBuilder(request.device, chunk_bytes=chunk_bytes, progress=progress) as builder:
        model = load_from_disk(prepared, builder, timings)
        check_unchanged(request.model, versions)  # else new bytes would be published under the old identity
        start = time.perf_counter()
        manifest = prepared.adapter.export(request, model, builder)
        extra = prepared.adapter.manifest_extra(request, model)
        manifest = attrs.evolve(manifest, extra={**manifest.extra, **extra})
        del model
        gc.collect()
        timings["export_s"] = time.perf_counter() - start
        builder.progress.close()
        start = time.perf_counter()
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label or prepared.label)
        timings["publish_s"] = time.perf_counter() - start
    log.info("published %s (%s) in %.2f s", reply["digest"][:12], label or prepared.label, sum(timings.values()))
    return Published(reply["digest"], bool(reply["created"]), fingerprint, manifest, timings)


def file_versions(model: str) -> "list[tuple[str, FileKey]]":
    """Each weight file of the checkpoint ``model`` with its version (device, inode, size, mtime, ctime)."""
    return [(str(file), FileKey.of(file)) for file in checkpoint_files(model)]


def check_unchanged(model: str, versions: "list[tuple[str, FileKey]]") -> None:
    """Raise CheckpointChanged if a weight file of ``model`` is not the version ``versions`` recorded."""
    for file, key in versions:
        try:
            now = FileKey.of(file)
        except FileNotFoundError:
            now = None
        if now != key:
            raise CheckpointChanged(model, file)


def publish_arenas(builder: ArenaBuilder, fingerprint: Fingerprint, manifest: Manifest, socket_dir=None, label: str = "") -> dict:
    """Seal ``builder``'s arenas and publish them with ``manifest`` in one frame; returns the server's reply.

    The one publish sequence: the loader above, the Python API and the engine adapters all end here.
    """
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
