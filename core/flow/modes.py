"""The one mode runner: ``off``, ``daemon`` and ``client`` for every adapter (hf, vllm, sglang and yours).

- ``off`` (default): the adapter's plain disk load (``weightcache_load`` + ``weightcache_post_process``).
- ``daemon``: make sure a server runs (start a detached one if none), attach the
  entry, or, if there is none, load from disk into arenas, publish, then attach
  like a client.
- ``client``: attach to a running server's entry. When the cache cannot be used —
  no server, a server that is not this user's, a busy server, no entry or a
  fingerprint mismatch, an entry this process cannot map — fall back to a disk
  load with one warning naming the reason, or raise with ``strict``.

Both cache modes check the headers of every checkpoint file the digest store does not remember
(``check_first_sight``: safetensors' own rules) before a first sight hashes it or anything is published. A checkpoint the cache cannot serve — one a disk load refuses
(overlapping offsets, a hole, a malformed header), a FIFO in a file's place, a dtype weightcache does not handle,
``.bin`` weights only — is never published: the load falls back to the adapter's disk load with one warning, and
that load succeeds or fails exactly as it would without weightcache.

Engine integrations (vLLM's and SGLang's loader classes) call ``run`` with a
request that carries the engine's own objects in ``request.state``; everything
else calls ``load_model``.
"""

from __future__ import annotations

import logging
import time
import typing

import attrs

from weightcache.core.client.attach import Attachment, fallback_kind, fallback_reason
from weightcache.core.client.client import Connection, server_is_running
from weightcache.core.errors import CheckpointNotFound, EntryNotFound, WeightCacheError
from weightcache.core.fingerprint import Fingerprint, ParallelSpec
from weightcache.core.flow.loader import Prepared, load_from_disk, prepare, publish, publish_from_node
from weightcache.core.identity import hub
from weightcache.core.request import LoadRequest
from weightcache.core.socket_dir import SocketDir, SocketDirLike, to_socket_dir

if typing.TYPE_CHECKING:
    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.identity.digests import ProgressLike

log = logging.getLogger(__name__)

MODES = ("off", "daemon", "client")
ATTACHMENT_ATTR = "_weightcache_attachment"
"""The model attribute holding its Attachment: the mapping lives as long as the model."""


def _mode(_instance, _attribute, value) -> None:
    if value not in MODES:
        raise ValueError(f"unknown weightcache mode {value!r}; use one of {', '.join(MODES)}")


def _boolean(_instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"weightcache option {attribute.name!r} must be true or false, not {value!r}")


def _positive(_instance, attribute, value) -> None:
    if not value > 0:
        raise ValueError(f"weightcache option {attribute.name!r} must be positive, not {value!r}")


@attrs.frozen
class CacheOptions:
    """How a load uses the cache; the same keys for ``load_model`` and an engine's ``--model-loader-extra-config``.

    :param mode: ``off`` (default), ``daemon`` or ``client``.
    :param socket_dir: the server's socket directory (a path; default: ``SocketDir.default()``).
    :param strict: raise instead of falling back to a disk load when the cache cannot be used.
    :param republish: publish the entry again from this process if the server restarts.
    :param timeout_s: deadline of each request to the server.
    """

    mode: str = attrs.field(default="off", validator=_mode)
    socket_dir: SocketDir = attrs.field(default=None, converter=to_socket_dir)
    strict: bool = attrs.field(default=False, validator=_boolean)
    republish: bool = attrs.field(default=True, validator=_boolean)
    timeout_s: float = attrs.field(default=30.0, converter=float, validator=_positive)

    @classmethod
    def from_mapping(cls, config: "typing.Mapping | None", where: str) -> "CacheOptions":
        """Options from a mapping (an engine's extra config); unknown keys raise ValueError naming ``where``."""
        config = dict(config or {})
        known = [field.name for field in attrs.fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"unknown keys {unknown} in {where}; weightcache reads only: {', '.join(known)}")
        return cls(**config)


@attrs.define
class LoadedModel:
    """A ready model and how it came to be.

    :param source: ``disk`` or ``cache``.
    :param fingerprint: the entry's fingerprint (None for a plain ``off`` load, which needs none).
    :param attachment: the mapped entry (cache only); the model holds it too, so the
        mapping lives as long as the model. ``close()`` detaches.
    :param created: whether this process published the entry (daemon mode, first start).
    :param fallback_reason: why a ``client`` or ``daemon`` load came from disk, else None.
    """

    model: typing.Any
    source: str
    mode: str
    fingerprint: Fingerprint | None = None
    attachment: Attachment | None = None
    created: bool = False
    fallback_reason: str | None = None
    timings: dict = attrs.field(factory=dict)

    @property
    def external_bytes(self) -> int:
        """Bytes of weights this process maps but did not allocate (an engine's memory profiler must not count them)."""
        if self.attachment is None or self.created:
            return 0
        return self.attachment.manifest.nbytes

    @property
    def version(self) -> int:
        """The version of the weights the model runs on (0: as published from disk; a refit switches it)."""
        return self.attachment.version if self.attachment is not None else 0

    def refit(self, version: int | None = None) -> bool:
        """Switch the model to version ``version`` of its weights (None: the newest the server holds), in place.

        Every parameter keeps its address, so CUDA graphs and compiled code run on the new weights as they are; the
        new version's checksums are verified first. Call it between two steps. False when the model runs on that version
        already. Raises ValueError for a model loaded from disk, VersionNotFound, EntryCorrupt or LayoutMismatch (the
        model then runs on as before).
        """
        if self.attachment is None:
            raise ValueError("only a model attached from the cache switches versions: load it with mode='client' or 'daemon'")
        pending = self.attachment.fetch_version(version)
        if pending is None:
            return False
        self.attachment.switch_to(pending)
        self.fingerprint = self.attachment.fingerprint
        self.timings["refit_switch_s"] = self.attachment.timings["switch_s"]
        return True

    def close(self) -> None:
        """Drop the model and detach (the entry stays cached on the server)."""
        if self.model is not None and getattr(self.model, ATTACHMENT_ATTR, None) is not None:
            setattr(self.model, ATTACHMENT_ATTR, None)
        self.model = None
        if self.attachment is not None:
            self.attachment.close()
            self.attachment = None


def load_model(
    model: str,
    *,
    adapter: str = "hf",
    mode: str = "off",
    dtype: str | None = None,
    device: str = "cpu",
    quantization: str | None = None,
    parallel: ParallelSpec | None = None,
    revision: str | None = None,
    socket_dir: SocketDirLike = None,
    strict: bool = False,
    republish: bool = True,
    timeout_s: float = 30.0,
    plugins: "Plugins | None" = None,
    progress: "ProgressLike | None" = None,
    **options: typing.Any,
) -> LoadedModel:
    """Load ``model`` (a checkpoint directory or a hub id, ``revision`` its hub revision) for one engine rank in
    ``mode`` (see the module docstring).

    A hub id is looked up in the local hub cache only, as ``weightcache load`` does: one the cache does not hold
    raises ModelNotCached at once (nothing is downloaded). ``options`` are the adapter's own (``model_class`` for hf);
    an option the adapter does not declare is refused before anything is read.
    """
    where = hub.require_cached(hub.resolve(model, revision))
    request = LoadRequest(
        model=where.path,
        adapter=adapter,
        dtype=dtype,
        device=device,
        quantization=quantization,
        parallel=parallel or ParallelSpec(),
        options=options,
    )
    cache = CacheOptions(mode=mode, socket_dir=socket_dir, strict=strict, republish=republish, timeout_s=timeout_s)
    return run(request, cache, plugins=plugins, progress=progress)


def run(
    request: LoadRequest, cache: CacheOptions, plugins: "Plugins | None" = None, progress: "ProgressLike | None" = None
) -> LoadedModel:
    """Run ``cache.mode`` for ``request``: the flow every adapter and engine integration goes through."""
    start = time.perf_counter()
    prepared = prepare(request, plugins)
    timings = {"prepare_s": time.perf_counter() - start}
    if cache.mode == "off":
        return _from_disk(prepared, "off", timings)
    if cache.mode == "daemon":
        loaded = _or_disk(lambda: _daemon(prepared, cache, progress, timings), prepared, cache, timings)
    else:
        loaded = _or_disk(lambda: _client(prepared, cache, timings), prepared, cache, timings)
    if cache.republish and loaded.attachment is not None:
        loaded.attachment.watch()
    return loaded


def _client(prepared: Prepared, cache: CacheOptions, timings: dict) -> LoadedModel:
    prepared.check_first_sight()  # before a first sight hashes it: a file the disk load refuses falls back
    try:
        return attach(prepared, cache, timings)
    except EntryNotFound:
        if not _fill_from_node(prepared, cache, timings):
            raise
        return attach(prepared, cache, timings)


def _or_disk(work: typing.Callable[[], LoadedModel], prepared: Prepared, cache: CacheOptions, timings: dict) -> LoadedModel:
    """``work`` (a ``client`` or ``daemon`` load), or the adapter's own disk load with one warning when the cache
    cannot serve the request (``fallback_reason``); ``strict`` raises instead."""
    try:
        return work()
    except WeightCacheError as exc:
        reason = fallback_reason(exc)  # None: not a reason to load from disk (a rebind that does not fit, a bug)
        if cache.strict or reason is None:
            raise
        log.warning("weightcache: loading %s from disk: %s", prepared.request.model, reason)
        _report_fallback(exc, cache)
        identified = not isinstance(exc, CheckpointNotFound)  # else the checkpoint has no content identity
        loaded = _from_disk(prepared, cache.mode, timings, identified=identified)
        loaded.fallback_reason = reason
        return loaded


def _report_fallback(exc: WeightCacheError, cache: CacheOptions) -> None:
    """Tell the server (when one answers) why this load came from disk, for its ``fallbacks`` metric; best effort."""
    kind = fallback_kind(exc)
    if kind in (None, "no_server", "access_denied"):
        return  # nobody to tell, or a server this process does not trust
    try:
        with Connection(cache.socket_dir, timeout=min(cache.timeout_s, 2.0)) as connection:
            connection.report_fallback(kind)
    except WeightCacheError as failure:  # an older server, a busy one: the disk load goes on regardless
        log.debug("weightcache: could not report the fallback to the server: %s", failure)


def _fill_from_node(prepared: Prepared, cache: CacheOptions, timings: dict) -> bool:
    """On a GPU, publish this rank's entry from a copy the node holds (peer GPU, host tier); False when there is none.

    A client never reads the disk into the cache, but a copy of bytes already cached is a cache hit
    by another road. Whatever goes wrong here leaves the disk load to the caller.
    """
    if not prepared.request.device.is_cuda:
        return False
    try:
        published = publish_from_node(prepared, cache.socket_dir)
    except WeightCacheError as exc:
        log.warning("weightcache: could not fill %s from the node's copies: %s", prepared.request.device, exc)
        return False
    if published is not None:
        timings.update(published.timings)
    return published is not None


def attach(prepared: Prepared, cache: CacheOptions, timings: dict | None = None) -> LoadedModel:
    """Attach ``prepared``'s entry and let the adapter rebind a meta-device model to it."""
    timings = {} if timings is None else timings
    fingerprint = prepared.fingerprint
    start = time.perf_counter()
    attachment = Attachment.open(fingerprint, cache.socket_dir, timeout=cache.timeout_s)
    timings["attach_s"] = time.perf_counter() - start
    try:
        start = time.perf_counter()
        model = prepared.adapter.rebind(prepared.request, attachment.tensors, attachment.manifest, prepared.description)
        timings["rebind_s"] = time.perf_counter() - start
        setattr(model, ATTACHMENT_ATTR, attachment)
    except BaseException:
        attachment.close()
        raise
    return LoadedModel(model, "cache", cache.mode, fingerprint, attachment, timings=timings)


def _from_disk(prepared: Prepared, mode: str, timings: dict, identified: bool = True) -> LoadedModel:
    start = time.perf_counter()
    model = load_from_disk(prepared, timings=timings)
    timings["disk_load_s"] = time.perf_counter() - start
    fingerprint = prepared.fingerprint if mode != "off" and identified else None
    return LoadedModel(model, "disk", mode, fingerprint, timings=timings)


def _daemon(prepared: Prepared, cache: CacheOptions, progress, timings: dict) -> LoadedModel:
    from weightcache.core.server.server_process import spawn_detached

    if not server_is_running(cache.socket_dir):
        spawn_detached(cache.socket_dir)  # first: a checkpoint the cache cannot serve is a fallback the server counts
    prepared.check_first_sight()  # before a first sight hashes it: a file the disk load refuses falls back
    if prepared.remembered() is not None:  # first sight: no identity yet, the publish reads and digests in one pass
        try:
            return attach(prepared, cache, timings)
        except EntryNotFound:
            pass
    published = publish(prepared, cache.socket_dir, progress=progress)
    timings.update(published.timings)
    loaded = attach(prepared, cache, timings)
    loaded.created = published.created
    return loaded
