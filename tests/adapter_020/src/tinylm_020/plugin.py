"""The weightcache adapter for TinyLM: eight hooks, registered as ``tinylm-020`` in ``weightcache.adapters``.

- ``weightcache_describe``: read config.json only; say which quantization applies.
- ``weightcache_quantization_allowlist``: methods validated beyond the core's (none).
- ``weightcache_load``: build the model and read its weights from disk.
- ``weightcache_load_tensors``: build it from tensors in memory instead (a trainer's new version, for a refit).
- ``weightcache_post_process``: block-wise FP8 with the core's helpers (optional).
- ``weightcache_example_inputs``: inputs for the conformance kit's forward checks.
- ``weightcache_checkpoint_conventions``: what the kit must know of TinyLM checkpoints (the tied head).
- ``weightcache_rebind``: build the model on meta, as describe decided, and point it at the mapped tensors.

The core's defaults place every parameter and buffer into arenas
(``weightcache_export``); tied weights are stored once and restored as aliases.
"""

from __future__ import annotations

import safetensors.torch
import torch

from weightcache import (
    CheckpointConventions,
    Fp8BlockConfig,
    ModelDescription,
    convert_model_to_fp8_skeleton,
    hookimpl,
    quantize_model,
    rebind_module,
)
from tinylm_020 import TinyLM, __version__, example_inputs, read_config

FP8_BLOCK = "fp8-block"
FP8_CONFIG = Fp8BlockConfig(exclude=("embed", "head"))


@hookimpl
def weightcache_describe(request):
    config = read_config(request.model)
    # Report honestly what the checkpoint declares (the core refuses anything but none and fp8-block).
    declared = (config.get("quantization_config") or {}).get("quant_method")
    method = declared or request.quantization or "none"
    dtype = config.get("dtype", "float32")
    if request.dtype not in (None, dtype):
        raise ValueError(f"TinyLM loads the dtype its checkpoint stores ({dtype}), not {request.dtype}")
    return ModelDescription(
        architecture="TinyLM",
        config=config,
        dtype=dtype,
        quantization=method,
        quantization_config=FP8_CONFIG.to_json() if method == FP8_BLOCK else {},
        adapter_version=__version__,
        engine="torch",
        engine_version=torch.__version__.split("+")[0],
    )


@hookimpl
def weightcache_quantization_allowlist(request):
    return ()  # methods validated beyond the core's none and fp8-block: add one only once the kit passes on it


@hookimpl
def weightcache_load(request, builder):
    return _build(request, safetensors.torch.load_file(f"{request.model}/model.safetensors"))


@hookimpl
def weightcache_load_tensors(request, tensors, builder):
    return _build(request, tensors)


def _build(request, state):
    model = TinyLM.from_config(read_config(request.model))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != {"head.weight"} or unexpected:  # head.weight is tied to embed.weight, stored once
        raise ValueError(f"{request.model} does not fit TinyLM: missing {missing}, unexpected {unexpected}")
    return model.to(request.device.torch()).eval()


@hookimpl
def weightcache_post_process(request, model, description):
    if description.quantization == FP8_BLOCK:
        quantize_model(model, Fp8BlockConfig.from_json(description.quantization_config))
    return model


@hookimpl
def weightcache_example_inputs(request, model):
    return example_inputs(model)  # TinyLM has no transformers config to build inputs from


@hookimpl
def weightcache_checkpoint_conventions(request):
    # config.json's quantization_config declares a method (as describe reads it); the head is tied to the embedding.
    return CheckpointConventions(quantization_declaration="hf-config", tied=[("head.weight", "embed.weight")])


@hookimpl
def weightcache_rebind(request, tensors, manifest, description):
    with torch.device("meta"):
        model = TinyLM.from_config(read_config(request.model))
    if description.quantization == FP8_BLOCK:  # what describe decided, not worked out again
        convert_model_to_fp8_skeleton(model, Fp8BlockConfig.from_json(description.quantization_config))
    return rebind_module(model, tensors, manifest, device=request.device.torch())
