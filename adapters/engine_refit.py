"""A refit inside a running engine (vLLM's workers, SGLang's schedulers): the model it serves switches to a new
version of its weights in place, each rank on its own, between two steps.

The engines' loaders (``--load-format weightcache``, mode ``client`` or ``daemon``) leave on the model the request of
its rank (``remember``); ``update_weights`` then either switches the model to a version the server holds already
(published by a trainer, or by another replica of the same rank), or first builds that version for this rank from a
full state dict in the checkpoint's naming: the engine's own ``load_weights`` shards and fuses it, its
post-processing runs, the version is checksummed and published (``stage_version``), and every other replica of the
rank can switch to it too. No engine is imported here.
"""

from __future__ import annotations

import concurrent.futures
import typing

from weightcache.engine import ATTACHMENT_ATTR

if typing.TYPE_CHECKING:
    import torch

    from weightcache.adapter import LoadRequest
    from weightcache.engine import Attachment

REQUEST_ATTR = "_weightcache_request"
"""The model attribute holding the LoadRequest its rank was loaded with (engine objects in its state)."""

NamedTensors = typing.Union["typing.Mapping[str, torch.Tensor]", "typing.Iterable[tuple[str, torch.Tensor]]"]


def remember(model: "torch.nn.Module", request: "LoadRequest") -> None:
    """Keep ``request`` on ``model``, so that ``update_weights`` can build versions for this rank later."""
    setattr(model, REQUEST_ATTR, request)


def update_weights(model: "torch.nn.Module", named_tensors: NamedTensors | None = None, version: int | None = None) -> int:
    """Switch ``model`` in place to version ``version`` of its weights; returns the version it runs on now.

    With ``named_tensors`` (every tensor of the checkpoint, named, shaped and typed as it stores them), the version is
    first built for this rank from them and published; ``version`` None then means the one after the version it runs
    on (a version the server holds already is refused, naming the next free one). Without them (None or empty), the model switches to ``version`` as published already (None: the
    newest). Every parameter keeps its address (CUDA graphs and compiled code stay valid) and the new version's
    checksums are verified before the switch. Call it between two steps; drop cached keys and values (prefix caches)
    afterwards, as after any weight update.

    Raises ValueError for a model not attached from the cache, VersionNotFound, LayoutMismatch or EntryCorrupt
    (the model then runs on its old version).
    """
    attachment = attachment_of(model)
    state = dict(named_tensors or {})
    if state:
        from weightcache.engine import prepare
        from weightcache.refit import stage_version

        request: LoadRequest | None = getattr(model, REQUEST_ATTR, None)
        if request is None:
            raise ValueError(
                "this model does not say how its rank was loaded, so it cannot build a version from tensors; "
                "load it through the engine's weightcache loader, or publish the version with publish_version"
            )
        if version is None:
            version = attachment.version + 1
        with stage_version(prepare(request), state, version, attachment.socket_dir) as staged:
            staged.publish()
    pending = _prefetched(model, version)
    if pending is _NOT_PREFETCHED:
        pending = attachment.fetch_version(version)
    if pending is not None:
        attachment.switch_to(pending)
    return attachment.version


PREFETCH_ATTR = "_weightcache_prefetch"
"""The model attribute holding the fetch ``prefetch`` started: (the version asked for, its Future)."""

_NOT_PREFETCHED = object()


def prefetch(model: "torch.nn.Module", version: int | None = None) -> int:
    """Start fetching version ``version`` (None: the newest) beside the running one, in a thread of its own: it is
    mapped and every arena checksummed while the engine keeps stepping, so the ``update_weights`` that switches to it
    later stalls the engine for the swap alone. Returns the version the model runs on now.

    A version that fails its checksums or layout check is reported by that ``update_weights`` (the model then runs
    on its old version); a second ``prefetch`` drops the fetch of the first.
    """
    import threading

    attachment = attachment_of(model)
    _drop_prefetch(model)
    future: concurrent.futures.Future = concurrent.futures.Future()

    def fetch() -> None:
        try:
            future.set_result(attachment.fetch_version(version))
        except BaseException as exc:  # the switch raises it, in the engine's thread
            future.set_exception(exc)

    setattr(model, PREFETCH_ATTR, (version, future))
    threading.Thread(target=fetch, name="weightcache-prefetch", daemon=True).start()
    return attachment.version


def _prefetched(model: "torch.nn.Module", version: int | None):
    """The version ``prefetch`` fetched for ``version`` (waiting for the fetch to end), or _NOT_PREFETCHED."""
    started = getattr(model, PREFETCH_ATTR, None)
    if started is None or started[0] != version:
        _drop_prefetch(model)
        return _NOT_PREFETCHED
    delattr(model, PREFETCH_ATTR)
    return started[1].result()


def _drop_prefetch(model: "torch.nn.Module") -> None:
    """Forget a prefetch (closing what it attached, once it ends)."""
    started = getattr(model, PREFETCH_ATTR, None)
    if started is None:
        return
    delattr(model, PREFETCH_ATTR)

    def close(future: concurrent.futures.Future) -> None:
        if future.exception() is None and future.result() is not None:
            future.result().close()

    started[1].add_done_callback(close)


def attachment_of(model: "torch.nn.Module") -> "Attachment":
    """The Attachment ``model`` maps; ValueError for a model loaded from disk."""
    attachment = getattr(model, ATTACHMENT_ATTR, None)
    if attachment is None:
        raise ValueError(
            "only a model attached from the cache switches versions: load it with --load-format weightcache and "
            "mode 'client' or 'daemon' in --model-loader-extra-config"
        )
    return attachment
