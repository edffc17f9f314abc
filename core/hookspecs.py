"""Every hook spec of weightcache; adapters implement them with ``hookimpl``.

Hooks are called with keyword arguments only. The core calls an adapter's
hooks through ``weightcache.core.plugins.Adapter``, never ``pm.hook`` directly;
each call reaches the chosen adapter and the core defaults, adapter first.
"""

from __future__ import annotations

import typing

import pluggy

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.export import ArenaBuilder
    from weightcache.core.manifest import Manifest
    from weightcache.core.request import LoadRequest, ModelDescription

PROJECT = "weightcache"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def weightcache_describe(request: "LoadRequest") -> "ModelDescription":
    """Describe the model from its configs alone, before any weight is read.

    The result feeds the fingerprint (architecture, config, quantization method
    and its config, engine and adapter versions). Stops at first non-None result.

    :param request: the engine's load request.
    :returns: a ModelDescription.
    """


@hookspec(firstresult=True)
def weightcache_quantization_allowlist(request: "LoadRequest") -> "typing.Iterable[str]":
    """Quantization methods this adapter has validated beyond the core's own (``none``, ``fp8-block``).

    A method belongs here only once the conformance kit passes on it (see
    docs/quantization.md). Stops at first non-None result.

    :param request: the engine's load request.
    :returns: method names.
    """


@hookspec(firstresult=True)
def weightcache_load(request: "LoadRequest", builder: "ArenaBuilder | None") -> "torch.nn.Module":
    """Read the checkpoint for one rank (TP/PP/EP shard) and return the model holding its weights.

    With a ``builder`` the adapter may read tensors straight into its arenas
    (``builder.allocate``) instead of into private memory; export then copies
    nothing for them. Stops at first non-None result.

    :param request: the engine's load request.
    :param builder: arenas to load into, or None for a plain disk load.
    :returns: the model, weights on ``request.device``, in eval mode.
    """


@hookspec(firstresult=True)
def weightcache_quantize(request: "LoadRequest", model: "torch.nn.Module", description: "ModelDescription") -> "torch.nn.Module":
    """Post-process the loaded model: quantize (block-wise FP8) or repack, in place or anew.

    Called only for allowlisted methods. Stops at first non-None result.

    :param request: the engine's load request.
    :param model: the model ``weightcache_load`` returned.
    :param description: what ``weightcache_describe`` said.
    :returns: the final model.
    """


@hookspec(firstresult=True)
def weightcache_export(request: "LoadRequest", model: "torch.nn.Module", builder: "ArenaBuilder") -> "Manifest":
    """Place the final model's parameters and buffers into arenas and describe them.

    The core's default copies every parameter and buffer (tied weights once,
    with aliases) and rebinds the model to the arena copies as it goes, so the
    peak is the weights plus one arena. Stops at first non-None result.

    :param request: the engine's load request.
    :param model: the final model.
    :param builder: the arenas to fill.
    :returns: the manifest (``builder.finish(...)``).
    """


@hookspec(firstresult=True)
def weightcache_manifest_extra(request: "LoadRequest", model: "torch.nn.Module") -> dict:
    """Small JSON-able state the engine side needs to rebuild the model (stored in the manifest).

    Stops at first non-None result.

    :param request: the engine's load request.
    :param model: the final model.
    :returns: a JSON-able dict.
    """


@hookspec(firstresult=True)
def weightcache_rebind(
    request: "LoadRequest", tensors: "dict[str, torch.Tensor]", manifest: "Manifest"
) -> "torch.nn.Module":
    """Build the model without memory (meta device) and point every parameter and buffer at ``tensors``.

    Parameters created by post-processing (``weight_scale_inv``) must be
    registered; afterwards no tensor may remain on meta and tied weights must
    be one tensor. Stops at first non-None result.

    :param request: the engine's load request.
    :param tensors: mapped tensors by name (aliases included), zero-copy.
    :param manifest: the entry's manifest (its ``extra`` holds adapter state).
    :returns: the ready model, in eval mode.
    """
