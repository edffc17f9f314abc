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
    pending = attachment.fetch_version(version)
    if pending is not None:
        attachment.switch_to(pending)
    return attachment.version


def attachment_of(model: "torch.nn.Module") -> "Attachment":
    """The Attachment ``model`` maps; ValueError for a model loaded from disk."""
    attachment = getattr(model, ATTACHMENT_ATTR, None)
    if attachment is None:
        raise ValueError(
            "only a model attached from the cache switches versions: load it with --load-format weightcache and "
            "mode 'client' or 'daemon' in --model-loader-extra-config"
        )
    return attachment
