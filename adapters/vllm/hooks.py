"""The vLLM adapter's hooks: vLLM 0.33's own loading, post-processing and meta-device build behind weightcache's contract.

Registered as ``vllm`` in the ``weightcache.adapters`` entry points. Inside vLLM,
``WeightcacheModelLoader`` (``--load-format weightcache``) passes the engine's
objects in ``LoadRequest.state``; without them (``weightcache conformance
--adapter vllm``, ``weightcache load --adapter vllm``) the adapter builds a
plain single-process load itself (``weightcache.adapters.vllm.engine``).
vLLM is imported inside the hooks only.
"""

from __future__ import annotations

import importlib

from weightcache.adapter import CheckpointConventions, ForwardUnavailable, hookimpl
from weightcache.adapters.engine_support import ENGINE_LOADED_TENSORS, check_publishable
from weightcache.adapters.vllm import identity, loading
from weightcache.adapters.vllm.engine import engine_objects

ENGINE_PACKAGES = ("vllm",)
"""Without vllm installed this adapter is not usable (``weightcache.core.flow.plugins.missing_engines``)."""

WARM_UP_MODULES = (
    "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.model_loader.utils",
    "vllm.model_executor.model_loader.weight_cache.protocol",
)
NO_FORWARD = (
    "vLLM's model forward runs only inside its model runner (forward context, attention metadata and KV cache "
    "set up by a worker), so the kit compares every parameter, buffer and tensor attribute instead"
)


@hookimpl
def weightcache_describe(request):
    return identity.describe(request)


@hookimpl
def weightcache_warm_up(request):
    """Import vLLM's loader, layers and post-processing (the model's own module loads when it is built)."""
    for module in WARM_UP_MODULES:
        importlib.import_module(module)


@hookimpl
def weightcache_load(request, builder):
    return loading.load(engine_objects(request))


@hookimpl
def weightcache_load_tensors(request, tensors, builder):
    return loading.load_tensors(engine_objects(request), tensors)


@hookimpl
def weightcache_post_process(request, model, description):
    return loading.post_process(engine_objects(request), model)


@hookimpl
def weightcache_export(request, model, builder):
    """The core's export (every parameter, buffer and tensor attribute), after refusing emptied parameters."""
    from weightcache.adapter import export_module

    check_publishable(model)
    manifest = export_module(model, builder)
    loading.forget_published(engine_objects(request))
    return manifest


@hookimpl
def weightcache_manifest_extra(request, model):
    from vllm.model_executor.model_loader.weight_cache.utils import export_model_attrs

    return {loading.MODEL_ATTRS_KEY: export_model_attrs(model)}


@hookimpl
def weightcache_rebind(request, tensors, manifest):
    return loading.rebind(engine_objects(request), tensors, manifest)


@hookimpl
def weightcache_example_inputs(request, model):
    return ForwardUnavailable(NO_FORWARD)


@hookimpl
def weightcache_checkpoint_conventions(request):
    return CheckpointConventions(unused_tensors=ENGINE_LOADED_TENSORS)
