"""The Hugging Face transformers adapter's hooks: any model class built from its config.

Registered under the name ``hf`` in the ``weightcache.adapters`` entry points. The work lives in
``identity`` (describe: config.json alone) and ``loading`` (load, post_process, rebind), as in every
adapter package; transformers is imported inside functions, so weightcache imports without it.
"""

from __future__ import annotations

import logging
import typing

from weightcache.adapter import AdapterOption, hookimpl
from weightcache.adapters.hf import identity

log = logging.getLogger(__name__)

OPTIONS = {
    "model_class": AdapterOption(
        "the transformers class to build (default: the checkpoint's architectures[0]), e.g. AutoModel",
        type=str,
        alternatives=("AutoModel",),
    ),
    "block_size": AdapterOption(
        "fp8-block tile as [rows, cols] (default: [128, 128])", type=list, default=[128, 128], alternatives=([64, 64],)
    ),
    "exclude": AdapterOption(
        "fp8-block: module name patterns to leave unquantized (default: lm_head and embeddings)", type=list, alternatives=([],)
    ),
}


@hookimpl
def weightcache_options():
    return OPTIONS


@hookimpl
def weightcache_describe(request):
    return identity.describe(request)


@hookimpl
def weightcache_checkpoint_conventions(request):
    from weightcache.adapter import CheckpointConventions
    from weightcache.adapters.hf.checkpoint_names import TransformersNames

    # transformers renames keys while loading (legacy names, fused experts); the kit asks it which tensor holds each.
    return CheckpointConventions(consumed_tensors=TransformersNames(request))


@hookimpl
def weightcache_warm_up(request, for_publish):
    config = identity.read_config(request.model)
    if for_publish:
        from weightcache.adapters.hf import layout_process
        from weightcache.adapters.hf.layout_key import layout_key

        key = layout_key(request, config, identity.load_dtype_name(request, config))  # no torch import yet
        if _has_entry(key):
            return  # the publish builds the model from its remembered layout: transformers stays unimported
        if layout_process.wanted():
            layout_process.start(request, key)  # a child learns the layout on another core; the load awaits it
            return
    from weightcache.adapters.hf.loading import model_class

    model_class(request, config)  # imports transformers and the model's module


def _has_entry(key: str) -> bool:
    """Whether the store holds an entry ``key`` (the load parses and checks it; a damaged one makes it build the
    skeleton itself)."""
    from weightcache.adapter import default_store
    from weightcache.adapters.hf.layout_key import MAX_ENTRY_BYTES

    return default_store().read_entry(key, MAX_ENTRY_BYTES) is not None


@hookimpl
def weightcache_load(request, builder):
    from weightcache.adapters.hf.loading import load

    return load(request, builder)


@hookimpl
def weightcache_load_tensors(request, tensors, builder):
    from weightcache.adapters.hf.loading import load_tensors

    return load_tensors(request, tensors)


@hookimpl
def weightcache_post_process(request, model, description):
    from weightcache.adapters.hf.loading import post_process

    return post_process(request, model, description)


@hookimpl
def weightcache_manifest_extra(request, model):
    from weightcache.adapter import quantization_methods
    from weightcache.adapters.hf.layout import class_name_of

    class_name = class_name_of(model)
    extra: dict[str, typing.Any] = {"model_class": class_name, "dtype": str(_param_dtype(model)).removeprefix("torch.")}
    for method in quantization_methods().values():  # what a rebind needs of each method's layers (block FP8: the tile)
        extra.update(method.layout(model))
    return extra


def _param_dtype(model):
    import torch

    for param in model.parameters():
        if param.dtype.is_floating_point and param.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return param.dtype
    return torch.float32


@hookimpl
def weightcache_rebind(request, tensors, manifest):
    from weightcache.adapters.hf.loading import rebind

    return rebind(request, tensors, manifest)
