"""The SGLang adapter's hooks (SGLang 0.5.23): registered as ``sglang`` in the ``weightcache.adapters`` entry points.

Inside SGLang, ``WeightcacheLoader`` (``--load-format weightcache``) runs these
through the core's mode runner with SGLang's own configuration objects in
``request.state``; elsewhere (the conformance kit, ``weightcache load --adapter
sglang``) they build those objects for a single-process load (see ``engine``).

- describe: the fingerprint facts from ModelConfig, ServerArgs and the ranks (``identity``);
- load, load_tensors / post_process: SGLang's ``DefaultModelLoader`` in its two steps (``loading``);
- export: the core's copy of every parameter, buffer and tensor attribute,
  after refusing a model whose post-processing emptied parameters;
- rebind: SGLang's model on meta, rebound, stale views rebuilt (``loading``);
- example_inputs: none: SGLang's forward needs its scheduler's batch;
- checkpoint_conventions: SGLang's loader accounts for the checkpoint's tensors (``ENGINE_LOADED_TENSORS``);
- warm_up: imports SGLang's loader and the model's class.

SGLang is imported inside the hooks only.
"""

from __future__ import annotations

from weightcache.adapter import CheckpointConventions, ForwardUnavailable, hookimpl
from weightcache.adapters.engine_support import ENGINE_LOADED_TENSORS, check_publishable
from weightcache.adapters.sglang import engine, identity, loading

ENGINE_PACKAGES = ("sglang",)
"""Without sglang installed this adapter is not usable (``weightcache.core.flow.plugins.missing_engines``)."""

NO_FORWARD = (
    "SGLang's model forward takes a ForwardBatch built by its scheduler and runs through an attention backend "
    "that its ModelRunner sets up; a model loaded alone cannot be called with token ids (the tensor checks still run)"
)


@hookimpl
def weightcache_describe(request):
    identity.check_requested_quantization(request)
    return identity.describe(request, engine.start_load(request))


@hookimpl
def weightcache_load(request, builder):
    return loading.load(engine.engine_objects(request))


@hookimpl
def weightcache_load_tensors(request, tensors, builder):
    return loading.load_tensors(engine.engine_objects(request), tensors)


@hookimpl
def weightcache_post_process(request, model, description):
    return loading.post_process(engine.engine_objects(request), model)


@hookimpl
def weightcache_export(request, model, builder):
    check_publishable(model)
    # None: the core's default export copies every parameter, buffer and tensor attribute.


@hookimpl
def weightcache_rebind(request, tensors, manifest):
    return loading.rebind(engine.engine_objects(request), tensors, manifest, request.device.torch())


@hookimpl
def weightcache_example_inputs(request, model):
    return ForwardUnavailable(NO_FORWARD)


@hookimpl
def weightcache_checkpoint_conventions(request):
    return CheckpointConventions(unused_tensors=ENGINE_LOADED_TENSORS)


@hookimpl
def weightcache_warm_up(request):
    from sglang.srt.model_loader import get_model_architecture

    get_model_architecture(engine.engine_objects(request).model_config)
