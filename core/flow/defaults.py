"""The core's default hook implementations; an adapter's own implementation runs first."""

from __future__ import annotations

import typing

from weightcache.core.hookspecs import hookimpl

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.identity.declared import CheckpointFiles
    from weightcache.core.layout.manifest import Manifest
    from weightcache.core.load.export import ArenaBuilder
    from weightcache.core.request import CheckpointConventions, ExampleInputs, LoadRequest, ModelDescription


@hookimpl(trylast=True)
def weightcache_options() -> dict:
    return {}


@hookimpl(trylast=True)
def weightcache_quantization_allowlist(request: "LoadRequest") -> tuple:
    return ()


@hookimpl(trylast=True)
def weightcache_post_process(request: "LoadRequest", model: "torch.nn.Module", description: "ModelDescription"):
    return model


@hookimpl(trylast=True)
def weightcache_export(request: "LoadRequest", model: "torch.nn.Module", builder: "ArenaBuilder") -> "Manifest":
    """Copy every parameter and buffer into the builder's arenas (tied weights once)."""
    from weightcache.core.load.export import export_module

    return export_module(model, builder)


@hookimpl(trylast=True)
def weightcache_manifest_extra(request: "LoadRequest", model: "torch.nn.Module") -> dict:
    return {}


@hookimpl(trylast=True)
def weightcache_example_inputs(request: "LoadRequest", model: "torch.nn.Module") -> "ExampleInputs":
    """Inputs built from the model's forward signature and config (see ``core/flow/example_inputs.py``)."""
    from weightcache.core.flow.example_inputs import inputs_from_signature

    return inputs_from_signature(model, request.adapter)


@hookimpl(trylast=True)
def weightcache_checkpoint_conventions(request: "LoadRequest") -> "CheckpointConventions":
    """transformers' ``quantization_config`` in config.json; no tied group required."""
    from weightcache.core.request import CheckpointConventions

    return CheckpointConventions()


@hookimpl(trylast=True)
def weightcache_checkpoint_files(request: "LoadRequest") -> "CheckpointFiles":
    """The root's safetensors files (an index's shards where it has one), config.json and generation_config.json."""
    from weightcache.core.identity.declared import CheckpointFiles

    return CheckpointFiles()
