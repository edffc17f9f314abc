"""The engine side: the three modes ``off``, ``daemon`` and ``client``.

- ``off`` (default): a plain disk load through the adapter.
- ``daemon``: make sure a server runs, load from disk into arenas and publish
  (unless the entry exists already), then attach like a client.
- ``client``: attach to a running server's entry; a missing, untrusted or busy
  server, a fingerprint mismatch or an entry this process cannot map falls
  back to a disk load with one log line (``core.attach.fallback_reason``), or
  raises with ``strict=True``.
"""

from __future__ import annotations

import logging
import time

import attrs

from weightcache.core.attach import Attachment, fallback_reason
from weightcache.core.client import server_is_running, spawn_server
from weightcache.core.errors import EntryNotFound, WeightCacheError
from weightcache.core.fingerprint import Fingerprint, ParallelSpec
from weightcache.core.loader import Prepared, load_from_disk, prepare, publish
from weightcache.core.plugins import Plugins
from weightcache.core.request import MODES, LoadRequest

log = logging.getLogger(__name__)


@attrs.define
class LoadedModel:
    """A ready model and how it came to be.

    :param source: ``disk`` or ``cache``.
    :param attachment: the mapped entry (cache only); keep this object alive
        while the model runs, ``close()`` when done.
    :param fallback_reason: why a ``client`` fell back to disk, else None.
    """

    model: object
    source: str
    mode: str
    fingerprint: Fingerprint
    attachment: Attachment | None = None
    fallback_reason: str | None = None
    timings: dict = attrs.field(factory=dict)

    def close(self) -> None:
        """Drop the model and detach (the entry stays cached on the server)."""
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
    socket_dir=None,
    strict: bool = False,
    republish: bool = True,
    plugins: Plugins | None = None,
    progress=None,
    **options,
) -> LoadedModel:
    """Load ``model`` for one engine rank in ``mode``; see the module docstring.

    With ``republish`` an attached engine publishes its entry again to a restarted server.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    request = LoadRequest(
        model=model, adapter=adapter, dtype=dtype, device=device, quantization=quantization,
        parallel=parallel or ParallelSpec(), options=options,
    )
    start = time.perf_counter()
    prepared = prepare(request, plugins)
    timings = {"prepare_s": time.perf_counter() - start}
    if mode == "off":
        return _from_disk(prepared, mode, timings)
    if mode == "daemon":
        loaded = _daemon(prepared, socket_dir, progress, timings)
    else:
        loaded = _client(prepared, socket_dir, strict, timings)
    if republish and loaded.attachment is not None:
        loaded.attachment.watch()
    return loaded


def _client(prepared: Prepared, socket_dir, strict: bool, timings: dict) -> LoadedModel:
    request = prepared.request
    try:
        return attach_model(prepared, socket_dir, timings)
    except WeightCacheError as exc:
        reason = fallback_reason(exc)
        if strict or reason is None:
            raise
        log.warning("weightcache: loading %s from disk: %s", request.model, reason)
        loaded = _from_disk(prepared, "client", timings)
        loaded.fallback_reason = reason
        return loaded


def attach_model(prepared: Prepared, socket_dir=None, timings: dict | None = None) -> LoadedModel:
    """Attach ``prepared``'s entry and rebind a meta-device model to it."""
    timings = dict(timings or {})
    start = time.perf_counter()
    attachment = Attachment.open(prepared.fingerprint, socket_dir)
    timings["attach_s"] = time.perf_counter() - start
    try:
        start = time.perf_counter()
        model = prepared.adapter.rebind(prepared.request, attachment.tensors, attachment.manifest)
        timings["rebind_s"] = time.perf_counter() - start
    except BaseException:
        attachment.close()
        raise
    return LoadedModel(model, "cache", "client", prepared.fingerprint, attachment, timings=timings)


def _from_disk(prepared: Prepared, mode: str, timings: dict) -> LoadedModel:
    model = load_from_disk(prepared, timings=timings)
    return LoadedModel(model, "disk", mode, prepared.fingerprint, timings=timings)


def _daemon(prepared: Prepared, socket_dir, progress, timings: dict) -> LoadedModel:
    if not server_is_running(socket_dir):
        pid = spawn_server(socket_dir)
        log.info("weightcache: started a server (pid %d)", pid)
    try:
        loaded = attach_model(prepared, socket_dir, timings)
    except EntryNotFound:
        published = publish(prepared, socket_dir, progress=progress)
        timings.update(published.timings)
        loaded = attach_model(prepared, socket_dir, timings)
    loaded.mode = "daemon"
    return loaded
