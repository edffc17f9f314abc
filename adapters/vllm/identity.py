"""What a vLLM model rank is, from VllmConfig and ModelConfig, before any weight is read (``weightcache_describe``).

The description feeds the core's fingerprint (checkpoint content, ranks,
torch/CUDA versions, GPU and protocol come from the core): architecture, the
full HF config, dtype, quantization and, in ``extra``, every field of vLLM's
own ``WeightCacheKey`` that the core fields do not already carry (kv-cache
dtype, RoPE parameters, kernel backends, draft role, DP rank, ...), computed
by vLLM's own ``WeightCacheKey.from_model_config``.
"""

from __future__ import annotations

import dataclasses
import json
import typing

from weightcache.adapter import ModelDescription, UnsupportedQuantization, check_quantization
from weightcache.adapters import engine_quantization, engine_support
from weightcache.adapters.engine_support import engine_description
from weightcache.adapters.vllm.engine import STATE_KEY, EngineObjects, LoadConfig, ModelConfig, VllmConfig, engine_objects

if typing.TYPE_CHECKING:
    from weightcache.adapter import LoadRequest

COVERED_BY_CORE = ("checkpoint", "model_arch", "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dtype", "vllm_version")
"""WeightCacheKey fields that the core fingerprint already holds (the checkpoint as a hash of every safetensors header)."""


def quantization(model_config: ModelConfig) -> tuple[str, dict]:
    """The canonical method and config of ``model_config``; UnsupportedQuantization unless unquantized or 128x128 block FP8.

    Reads configs only: call it before anything touches the checkpoint's files.
    """
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    return engine_quantization.checked_method(model_config.quantization, hf_quant)


def is_draft(vllm_config: VllmConfig, model_config: ModelConfig) -> bool:
    """Whether ``model_config`` is the speculative draft (vLLM loads it through the same loader)."""
    spec = vllm_config.speculative_config
    return spec is not None and model_config is spec.draft_model_config


def checkpoint_dir(model_config: ModelConfig, load_config: LoadConfig) -> str:
    """The local directory of the checkpoint's safetensors files (vLLM downloads them first if the model is a hub name)."""
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return engine_support.checkpoint_dir(model_config.model, model_config.revision, load_config, download_weights_from_hf)


def vllm_key_fields(objects: EngineObjects) -> dict:
    """The fields of vLLM's own WeightCacheKey not covered by the core fingerprint, as JSON values.

    vLLM 0.32's key lacks the kv-cache dtype, expert placement and kernel
    backends, which choose the post-processed layout too: ``layout_fields``
    adds them under the names vLLM 0.33's key gives them, so one checkpoint
    and configuration has the same fingerprint facts on either version.
    """
    import inspect

    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    vllm_config, ranks = objects.vllm_config, objects.ranks
    layout = layout_fields(vllm_config)
    arguments = dict(
        cache_config=vllm_config.cache_config,
        pp_size=ranks.pp_size,
        pp_rank=ranks.pp_rank,
        is_draft=objects.draft,
        dp_size=ranks.dp_size,
        dp_rank=ranks.dp_rank,
        enable_expert_parallel=layout["enable_expert_parallel"],
        expert_placement_strategy=layout["expert_placement_strategy"],
        kernel_config=vllm_config.kernel_config,
    )
    accepted = inspect.signature(WeightCacheKey.from_model_config).parameters
    key = WeightCacheKey.from_model_config(
        objects.model_config,
        ranks.tp_size,
        ranks.tp_rank,
        **{name: value for name, value in arguments.items() if name in accepted},
    )
    fields = {name: value for name, value in dataclasses.asdict(key).items() if name not in COVERED_BY_CORE}
    return json.loads(json.dumps({**layout, **fields}))  # tuples become lists, as they come back from the wire


def layout_fields(vllm_config: VllmConfig) -> dict:
    """The configuration that picks the post-processed layout, named as in vLLM 0.33's WeightCacheKey.

    vLLM's ``rope_parameters_hash`` (0.33) is not restated: the core's
    fingerprint holds the full HF config, RoPE parameters included.
    """
    cache, parallel, kernel = vllm_config.cache_config, vllm_config.parallel_config, vllm_config.kernel_config
    return {
        "kv_cache_dtype": cache.cache_dtype,
        "kv_cache_dtype_skip_layers": sorted(set(getattr(cache, "kv_cache_dtype_skip_layers", None) or ())),
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "expert_placement_strategy": parallel.expert_placement_strategy,
        "moe_backend": kernel.moe_backend,
        "linear_backend": kernel.linear_backend,
        "linear_backend_per_quant": sorted((kernel.linear_backend_per_quant or {}).items()),
    }


def describe(request: "LoadRequest") -> ModelDescription:
    """The description of ``request``'s model; UnsupportedQuantization (or ValueError for EPLB) before any weight is read."""
    import vllm

    requested = request.quantization if request.quantization not in (None, "none") else None
    if requested is not None:
        check_quantization(requested)  # every method outside the allowlist, by the name asked for
    if STATE_KEY not in request.state:
        engine_quantization.declared_method(request.model)  # config.json alone, before vLLM reads the checkpoint
    objects = engine_objects(request)
    if objects.vllm_config.parallel_config.enable_eplb:
        raise ValueError("weightcache does not support EPLB: it moves experts between ranks at run time; use --load-format auto")
    method, quant_config = quantization(objects.model_config)
    if requested is not None and requested != method:
        raise UnsupportedQuantization(
            requested,
            "the vllm adapter quantizes nothing itself, it loads the checkpoint's own method: save a "
            "block-FP8 checkpoint (quantization_config with weight_block_size [128, 128]) and load it as it is",
        )
    model_config = objects.model_config
    return engine_description(
        model_config,
        engine="vllm",
        engine_version=vllm.__version__,
        method=method,
        quant_config=quant_config,
        extra=vllm_key_fields(objects),
    )
