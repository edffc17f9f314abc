"""What the engine adapters (vLLM, SGLang) share: their loader options and the three modes around an engine's own load.

An engine plugs weightcache in as a model loader. The adapter hands this
module the engine's own ways to load a model from disk and to rebuild one on
the meta device around mapped tensors; this module runs the mode around them:

- ``off``: the engine's own disk load, untouched.
- ``daemon``: make sure a ``weightcache serve`` runs; attach the entry, or, if
  there is none, load through the engine's own loader and post-processing,
  publish the final tensors, then attach like a client.
- ``client``: attach; a missing, untrusted or busy server, a missing entry or
  one this process cannot map falls back to the disk load with one warning
  (naming mismatched fingerprint fields; ``strict``: raise), by the same rule
  as the core's client mode (``core.attach.fallback_reason``).

No engine is imported here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import typing

import attrs

from weightcache.core.errors import EntryNotFound, ServerUnavailable, WeightCacheError
from weightcache.core.export import DEFAULT_CHUNK_BYTES
from weightcache.core.request import MODES

if typing.TYPE_CHECKING:
    from weightcache.core.attach import Attachment
    from weightcache.core.fingerprint import Fingerprint

log = logging.getLogger(__name__)

ATTACHMENT_ATTR = "_weightcache_attachment"
"""The model attribute holding its Attachment: it keeps the mapping alive as long as the model."""


def _mode(_instance, _attribute, value) -> None:
    if value not in MODES:
        raise ValueError(f"unknown weightcache mode {value!r}; use one of {', '.join(MODES)}")


def _boolean(_instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"weightcache option {attribute.name!r} must be true or false, not {value!r}")


@attrs.frozen
class LoaderOptions:
    """The ``--model-loader-extra-config`` keys an engine adapter reads.

    :param mode: ``off`` (default), ``daemon`` or ``client``.
    :param socket_dir: the server's socket directory (default: weightcache's own default).
    :param strict: raise instead of falling back to a disk load when the cache cannot be used.
    :param republish: publish the entry again from this engine if the server restarts.
    :param timeout_s: deadline for each request to the server.
    """

    mode: str = attrs.field(default="off", validator=_mode)
    socket_dir: str | None = attrs.field(default=None, converter=attrs.converters.optional(str))
    strict: bool = attrs.field(default=False, validator=_boolean)
    republish: bool = attrs.field(default=True, validator=_boolean)
    timeout_s: float = attrs.field(default=30.0, converter=float)

    @classmethod
    def from_extra_config(cls, config, load_format: str) -> "LoaderOptions":
        """Options from an engine's ``model_loader_extra_config`` (a dict, or None); unknown keys raise ValueError."""
        config = dict(config or {})
        known = [field.name for field in attrs.fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(
                f"unknown keys {unknown} in --model-loader-extra-config for load format {load_format!r}; "
                f"weightcache reads only: {', '.join(known)}"
            )
        return cls(**config)


@attrs.define
class EngineLoad:
    """What a mode produced: the model and how it came to be.

    :param source: ``disk`` or ``cache``.
    :param attachment: the mapped entry (cache only).
    :param created: whether this process published the entry (daemon mode, first start).
    :param fallback_reason: why a ``client`` loaded from disk, else None.
    """

    model: object
    source: str
    attachment: "Attachment | None" = None
    created: bool = False
    fallback_reason: str | None = None
    timings: dict = attrs.field(factory=dict)

    @property
    def external_bytes(self) -> int:
        """Bytes of weights this process maps but did not allocate itself (for the engine's memory accounting)."""
        if self.attachment is None or self.created:
            return 0
        return self.attachment.manifest.nbytes


def load(
    options: LoaderOptions,
    fingerprint: "Fingerprint",
    *,
    device: str,
    disk_load: typing.Callable[[], object],
    rebuild: typing.Callable[["Attachment"], object],
    publish_load: typing.Callable[[], tuple[object, dict]] | None = None,
    label: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> EngineLoad:
    """Run ``options.mode`` around an engine's own load.

    :param disk_load: the engine's plain load (mode ``off`` and the client's fallback).
    :param rebuild: build the model on meta and rebind it to an attachment (its ``tensors`` and ``manifest``).
    :param publish_load: the load whose final model daemon mode publishes, and the
        manifest extra to store with it (default: ``disk_load``, no extra).
    :param device: where arenas are created when publishing (``cpu``, ``cuda:N``).
    """
    if options.mode == "off":
        return _disk(disk_load, {})
    if options.mode == "daemon":
        loaded = _daemon(options, fingerprint, device, publish_load or (lambda: (disk_load(), {})), rebuild, label, chunk_bytes)
    else:
        loaded = _client(options, fingerprint, disk_load, rebuild)
    if options.republish and loaded.attachment is not None:
        loaded.attachment.watch()
    return loaded


def _disk(disk_load, timings: dict, reason: str | None = None) -> EngineLoad:
    start = time.perf_counter()
    model = disk_load()
    timings["disk_load_s"] = time.perf_counter() - start
    return EngineLoad(model, "disk", fallback_reason=reason, timings=timings)


def _client(options: LoaderOptions, fingerprint, disk_load, rebuild) -> EngineLoad:
    from weightcache.core import api
    from weightcache.core.attach import fallback_reason

    timings: dict[str, float] = {}
    start = time.perf_counter()
    try:
        attachment = api.attach(fingerprint, options.socket_dir, timeout=options.timeout_s)
    except WeightCacheError as exc:
        reason = fallback_reason(exc)
        if options.strict or reason is None:
            raise
        log.warning("weightcache: loading from disk: %s", reason)
        return _disk(disk_load, timings, reason)
    timings["attach_s"] = time.perf_counter() - start
    return _rebuilt(attachment, rebuild, created=False, timings=timings)


def _daemon(options: LoaderOptions, fingerprint, device: str, publish_load, rebuild, label: str, chunk_bytes: int) -> EngineLoad:
    from weightcache.core import api
    from weightcache.core.client import server_is_running, spawn_server

    timings: dict[str, float] = {}
    if not server_is_running(options.socket_dir):
        pid = spawn_server(options.socket_dir)
        log.info("weightcache: started a server (pid %d)", pid)
    created = False
    start = time.perf_counter()
    try:
        attachment = api.attach(fingerprint, options.socket_dir, timeout=options.timeout_s)
    except EntryNotFound:
        model, extra = publish_load()
        timings["disk_load_s"] = time.perf_counter() - start
        start = time.perf_counter()
        reply = publish_model(model, fingerprint, device=device, socket_dir=options.socket_dir, label=label, extra=extra,
                              chunk_bytes=chunk_bytes)
        del model
        gc.collect()
        created = bool(reply.get("created"))
        timings["publish_s"] = time.perf_counter() - start
        log.info("weightcache: published %s (%s)", reply["digest"][:12], label)
        start = time.perf_counter()
        attachment = api.attach(fingerprint, options.socket_dir, timeout=options.timeout_s)
    timings["attach_s"] = time.perf_counter() - start
    return _rebuilt(attachment, rebuild, created=created, timings=timings)


def _rebuilt(attachment: "Attachment", rebuild, created: bool, timings: dict) -> EngineLoad:
    start = time.perf_counter()
    try:
        model = rebuild(attachment)
    except BaseException:
        attachment.close()
        raise
    setattr(model, ATTACHMENT_ATTR, attachment)
    timings["rebuild_s"] = time.perf_counter() - start
    return EngineLoad(model, "cache", attachment, created=created, timings=timings)


def check_publishable(model) -> None:
    """Refuse a model whose post-processing emptied parameters (their weight now lives in a kernel handle held in Python).

    vLLM's CPU backend, for one, repacks linear weights into oneDNN handles and
    leaves an empty parameter behind: mapped elsewhere, it would compute with nothing.
    """
    empty = [name for name, param in model.named_parameters() if param.numel() == 0]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise RuntimeError(
            f"post-processing left {len(empty)} parameters empty ({shown}): the engine moved these weights into "
            "Python-side kernel state that weightcache cannot share; load this model with mode 'off'"
        )


def publish_model(model, fingerprint: "Fingerprint", *, device: str, socket_dir=None, label: str = "", extra: dict | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """Copy a loaded model's parameters and buffers (kinds, persistence and tied aliases kept) into arenas and publish them.

    Each original is freed once copied, so the model is empty afterwards.
    Returns the server's reply (``digest``, ``created``).
    """
    from weightcache.core.export import ArenaBuilder, export_module
    from weightcache.core.loader import publish_built

    check_publishable(model)
    builder = ArenaBuilder(device, chunk_bytes=chunk_bytes)
    try:
        manifest = export_module(model, builder, extra=extra)
        return publish_built(builder, fingerprint, manifest, socket_dir, label)
    finally:
        builder.close()


class Registrations:
    """Keys a model build adds to an engine's process-wide tables (layer names, cached rotary embeddings).

    Daemon mode builds the model twice in one process: once to load and
    publish, once on meta to rebind. The published model's entries must go
    before the second build (the engines clear these tables themselves when
    they drop a model), or it would reuse a rotary cache whose buffers were
    freed once copied into the arenas, or refuse a duplicate layer name.
    """

    def __init__(self, tables: "typing.Iterable[dict]"):
        self.tables = tuple(tables)
        self.added: list[tuple[dict, object]] = []

    @contextlib.contextmanager
    def recorded(self):
        """Record the keys added while the block runs."""
        before = [set(table) for table in self.tables]
        try:
            yield
        finally:
            for table, keys in zip(self.tables, before):
                self.added += [(table, key) for key in table if key not in keys]

    def forget(self) -> None:
        """Remove the recorded keys."""
        for table, key in self.added:
            table.pop(key, None)
        self.added = []


def entry_bytes(fingerprint: "Fingerprint", socket_dir=None, timeout_s: float = 5.0) -> int:
    """Bytes the server holds for ``fingerprint`` (0 when it holds no such entry or does not answer)."""
    from weightcache.core.client import Connection
    from weightcache.core.errors import AccessDenied

    digest = fingerprint.digest
    try:
        with Connection(socket_dir, timeout=timeout_s) as connection:
            entries = connection.status().get("entries", [])
    except (ServerUnavailable, AccessDenied) as exc:
        log.info("weightcache: no entry size from the server: %s", exc)
        return 0
    return sum(int(entry.get("bytes", 0)) for entry in entries if entry.get("digest") == digest)


def refuse_reload(model) -> None:
    """Raise if ``model`` maps a cached entry: writing weights in place would change them for every engine attached."""
    if getattr(model, ATTACHMENT_ATTR, None) is not None:
        raise RuntimeError(
            "this model's weights are mapped from weightcache and shared read-only with other engines; "
            "reload weights in place only in a model loaded with mode 'off'"
        )


def lazy_class(namespace: dict, name: str, build):
    """``namespace[name]``, built by ``build()`` on first use: the engine is imported only then."""
    cls = namespace.get(name)
    if cls is None:
        cls = namespace[name] = build()
    return cls
