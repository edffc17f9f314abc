"""Every hook spec of weightcache: the one contract every adapter — hf, vllm, sglang and yours — implements.

Hooks are called with keyword arguments only, so a spec can gain arguments
without breaking adapters. The core calls one adapter's hooks through
``weightcache.core.flow.plugins.Adapter``, never ``pm.hook`` directly; each call
reaches the chosen adapter first and the core defaults (``core/flow/defaults.py``)
behind it, never another adapter.

Required: ``weightcache_describe``, ``weightcache_load``, ``weightcache_rebind``.
The core's mode runner (``core/flow/modes.py``) owns the flow; adapters fill in steps:

    describe -> allowlist check -> fingerprint -> [attach -> rebind]            (client)
                                              -> load -> post_process -> export (publish)

Return values are checked where they come back (``Adapter``): a wrong type is an
``InvalidAdapter`` naming the adapter and the hook. A retired hook name
(``RETIRED_HOOKS``) is refused at registration with the name of its successor.
"""

from __future__ import annotations

import typing

import pluggy

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.identity.declared import CheckpointFiles
    from weightcache.core.layout.manifest import Manifest
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.options import AdapterOption
    from weightcache.core.request import CheckpointConventions, ExampleInputs, LoadRequest, ModelDescription

PROJECT = "weightcache"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("weightcache_describe", "weightcache_load", "weightcache_rebind")

RETIRED_HOOKS: "typing.Final[dict[str, str]]" = {
    "weightcache_quantize": "weightcache_post_process (same arguments: request, model, description)",
}
"""Hook names an adapter may still carry from an older weightcache, and what replaced each (docs/adapter-guide.md, Migration)."""


@hookspec(firstresult=True)
def weightcache_options() -> "typing.Mapping[str, AdapterOption | str]":
    """The options this adapter reads from ``LoadRequest.options``, each typed (``AdapterOption``) or as a help text.

    ``load_model(**options)``, ``weightcache load --option KEY=VALUE`` and the
    conformance kit refuse any other name, and a value its declaration does not
    allow, before anything is loaded. The kit flips every typed option to its
    other values: each must change the fingerprint (``ModelDescription.extra``)
    or leave the published tensors alone (rebind re-applies it). Default: none.
    Stops at first non-None result.

    :returns: option name -> AdapterOption (or a one-line help, untyped).
    """


@hookspec(firstresult=True)
def weightcache_describe(request: "LoadRequest") -> "ModelDescription":
    """Describe the model from its configs alone, before any weight is read.

    It may read configs and safetensors headers, never weight bytes (the kit
    runs it on a copy whose weight bytes are cut off). The result feeds the
    fingerprint (architecture, config, resolved dtype, quantization method and
    its config, engine and adapter versions, ``extra``) and the allowlist
    check, and reaches post_process and rebind. Raise UnsupportedQuantization
    for a method the adapter cannot load. Stops at first non-None result.

    :param request: the engine's load request.
    :returns: a ModelDescription.
    """


@hookspec(firstresult=True)
def weightcache_checkpoint_files(request: "LoadRequest") -> "CheckpointFiles":
    """Which files of the checkpoint this adapter reads: weight files and config files, as patterns relative to it.

    The checkpoint identity covers the content of every file they match, subfolders included
    (``2_Dense/*.safetensors``, ``unet/*.safetensors``, ``1_Pooling/config.json``): one byte
    changed in any of them is another entry. The conformance kit records the files a load opens
    in a fresh process and fails an adapter that reads one it did not declare, naming it.
    ``publish_version`` takes the tensors of every declared weight file, a subfolder's named
    ``folder/name``. Default: ``CheckpointFiles()`` (the root's ``*.safetensors``, an index's
    shards where it has one, ``config.json`` and ``generation_config.json``). Stops at first non-None result.

    :param request: the engine's load request (``request.model`` is the checkpoint directory).
    :returns: a CheckpointFiles.
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
    (``builder.plan`` then ``builder.view``, or ``weightcache.core.load.reader.read_checkpoint``)
    instead of into private memory; export then copies nothing for them.
    Stops at first non-None result.

    :param request: the engine's load request.
    :param builder: arenas to load into, or None for a plain disk load.
    :returns: the model, weights on ``request.device``.
    """


@hookspec(firstresult=True)
def weightcache_load_tensors(
    request: "LoadRequest", tensors: "typing.Mapping[str, torch.Tensor]", builder: "ArenaBuilder"
) -> "torch.nn.Module":
    """Build the model for one rank from ``tensors`` held in memory instead of the checkpoint's files (a refit's version).

    ``tensors`` are named and shaped as the checkpoint stores them (a trainer's state dict); the model returned
    must be what ``weightcache_load`` returns for files holding these tensors, so that post-processing and export
    then run on it exactly as on files. Some tensors may already view ``builder``'s arenas (placed where the
    previous version keeps them): bind those without a copy. The caller's tensors must stay as they are (copy or
    view them, never free or resize them). An adapter without it cannot publish versions from memory.
    Stops at first non-None result.

    :param request: the engine's load request (``request.model`` is the checkpoint the tensors are a version of).
    :param tensors: the new weights by checkpoint name, on any device.
    :param builder: the arenas the version is published from.
    :returns: the model, weights on ``request.device``.
    """


@hookspec(firstresult=True)
def weightcache_post_process(
    request: "LoadRequest", model: "torch.nn.Module", description: "ModelDescription"
) -> "torch.nn.Module":
    """Turn the loaded model into its final form: quantize (block-wise FP8), repack, or run the engine's own post-processing.

    ``weightcache_load`` followed by this hook is the plain disk load (mode
    ``off``); its result is what gets published. An engine's
    ``process_weights_after_loading`` belongs here. Default: the model unchanged.
    Stops at first non-None result.

    :param request: the engine's load request.
    :param model: the model ``weightcache_load`` returned.
    :param description: what ``weightcache_describe`` said.
    :returns: the final model, in eval mode.
    """


@hookspec(firstresult=True)
def weightcache_export(request: "LoadRequest", model: "torch.nn.Module", builder: "ArenaBuilder") -> "Manifest":
    """Place the final model's tensors into arenas and describe them.

    The core's default copies every parameter and buffer (tied weights once,
    with aliases), freeing each original as it goes, so the peak is the
    weights plus one arena. Stops at first non-None result.

    :param request: the engine's load request.
    :param model: the final model.
    :param builder: the arenas to fill.
    :returns: the manifest.
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
    request: "LoadRequest", tensors: "dict[str, torch.Tensor]", manifest: "Manifest", description: "ModelDescription"
) -> "torch.nn.Module":
    """Build the model without memory (meta device) and point every tensor it computes with at ``tensors``.

    Tensors created by post-processing (``weight_scale_inv``) must be
    registered; afterwards no tensor may remain on meta and tied weights must
    be one tensor. Re-apply here every runtime-only option (one that is not in
    the fingerprint). Put tensors on ``request.device.torch()`` (a torch.device;
    ``request.device`` itself is weightcache's ``Device``). Stops at first non-None result.

    :param request: the engine's load request.
    :param tensors: mapped tensors by name (aliases included), zero-copy.
    :param manifest: the entry's manifest (its ``extra`` holds adapter state).
    :param description: what ``weightcache_describe`` said for this request (quantization, its config, dtype).
    :returns: the ready model, in eval mode.
    """


@hookspec(firstresult=True)
def weightcache_example_inputs(request: "LoadRequest", model: "torch.nn.Module") -> "ExampleInputs":
    """Inputs for one deterministic forward pass of ``model``, for the conformance kit's output checks.

    A dict is passed as keywords, a tuple as positionals, anything else as one
    argument. Return ``ForwardUnavailable(reason)`` when the model cannot run a
    forward here (e.g. an engine's model needs its own kernels and scheduler):
    the kit then skips its forward checks with that reason. The core's default
    builds inputs from the model's ``forward`` signature and config (token ids,
    decoder ids, token types, attention masks, pixel values, audio features).
    Stops at first non-None result.

    :param request: the engine's load request.
    :param model: the loaded model.
    :returns: the inputs, or ForwardUnavailable.
    """


@hookspec(firstresult=True)
def weightcache_checkpoint_conventions(request: "LoadRequest") -> "CheckpointConventions":
    """How this adapter's checkpoints declare a quantization method and which tensors they tie, for the conformance kit.

    ``weightcache conformance --adapter NAME --model PATH`` then needs no
    ``--declare-quantization`` or ``--tied`` flag. It also says which checkpoint tensors a
    published tensor of another name holds or the model never reads (``consumed_tensors``,
    ``unused_tensors``) and which config.json fields cannot change the weights (``unused_config``).
    Default: ``CheckpointConventions()`` (transformers' ``quantization_config`` in config.json,
    no tied group required, nothing declared).
    Stops at first non-None result.

    :param request: the kit's load request (``request.model`` is the checkpoint).
    :returns: a CheckpointConventions.
    """


@hookspec
def weightcache_warm_up(request: "LoadRequest", for_publish: bool) -> None:
    """Import now what loading and running this model will need (the engine, the model's module).

    Called before timing starts (the demo, the benchmarks) and by a warm spare,
    so that the moment it takes over costs no import; and by ``weightcache load``
    while it reads. Every implementation runs.

    :param request: the engine's load request.
    :param for_publish: True when the process will only load and publish the model
        (``weightcache load``), never run it: what only running needs may be skipped.
    :returns: nothing.
    """
