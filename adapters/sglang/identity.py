"""What an SGLang model rank is, from ModelConfig, the published ServerArgs and the parallel context, before any weight is read.

``describe`` gives the core its ModelDescription; the core builds the
fingerprint from it (checkpoint content, architecture, full config, ranks,
dtype, quantization, torch/CUDA versions, GPU, protocol and adapter versions).
``extra`` holds every field of SGLang's own weight-cache ``CacheConfig`` that
the core's fields do not carry (MoE and attention data/context-parallel ranks,
SGLang's quantization name and config hash, revision), plus the server
arguments that choose a post-processed weight layout (kernel backends,
kv-cache dtype). SGLang's own key names the model by its path; this one by its content.
"""

from __future__ import annotations

import typing

from weightcache.adapter import ModelDescription, UnsupportedQuantization
from weightcache.adapters import engine_quantization, engine_support
from weightcache.adapters.engine_support import engine_description
from weightcache.adapters.sglang.engine import DeviceConfig, EngineObjects, LoadConfig, ModelConfig, Ranks, ServerArgs

if typing.TYPE_CHECKING:
    from weightcache.adapter import LoadRequest


FP8_BLOCK = engine_quantization.FP8_BLOCK

SERVER_ARGS = ("quantization", "kv_cache_dtype", "attention_backend", "moe_runner_backend", "moe_a2a_backend")
"""ServerArgs fields that choose how post-processing lays out the final weights."""


def describe(request: "LoadRequest", configs: "EngineObjects") -> ModelDescription:
    """The model rank ``configs`` describe; UnsupportedQuantization (before any weight is read) unless allowlisted."""
    import sglang

    model_config = configs.model_config
    method, quant_config = quantization(model_config)
    check_fp8_block_request(request, method)
    return engine_description(
        model_config,
        engine="sglang",
        engine_version=sglang.__version__,
        method=method,
        quant_config=quant_config,
        extra=sglang_key_fields(model_config, configs.ranks, configs.server_args),
    )


def check_requested_quantization(request: "LoadRequest") -> None:
    """Refuse a requested method SGLang cannot load as validated, before anything is built or read.

    ``fp8-block`` passes here; ``describe`` then checks that the checkpoint is stored so
    (SGLang quantizes online only per tensor).
    """
    if request.quantization not in (None, "none", FP8_BLOCK):
        engine_quantization.checked_method(request.quantization, {})


def check_fp8_block_request(request: "LoadRequest", method: str) -> None:
    """``fp8-block`` requested: the checkpoint must be block FP8 itself."""
    if request.quantization == FP8_BLOCK and method != FP8_BLOCK:
        raise UnsupportedQuantization(
            FP8_BLOCK,
            "SGLang quantizes online only per tensor (--quantization fp8); block-wise FP8 loads from a checkpoint that "
            "is stored so (quantization_config with weight_block_size [128, 128]): request no quantization for it",
        )


def quant_method_name(model_config: ModelConfig) -> str:
    """SGLang's name for the model's quantization method ("" when unquantized), as its weight cache resolves it."""
    from sglang.srt.weight_cache.protocol import get_quant_method_name

    method = get_quant_method_name(model_config.quantization)
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    if not method and hf_quant is not None:
        method = get_quant_method_name(engine_quantization.as_dict(hf_quant).get("quant_method") or hf_quant)
    return method


def quantization(model_config: ModelConfig) -> tuple[str, dict]:
    """The canonical method and config; UnsupportedQuantization unless unquantized or 128x128 block FP8.

    Reads configs only: call it before anything touches the checkpoint's files.
    """
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    return engine_quantization.checked_method(quant_method_name(model_config), hf_quant)


def checkpoint_dir(model_config: ModelConfig, load_config: LoadConfig) -> str:
    """The local directory of the checkpoint's safetensors files (SGLang downloads them first for a hub name)."""
    from sglang.srt.model_loader.weight_utils import download_weights_from_hf

    return engine_support.checkpoint_dir(model_config.model_path, model_config.revision, load_config, download_weights_from_hf)


def server_args_fields(server_args: ServerArgs | None) -> dict:
    """The weight-layout fields of ``server_args`` (empty for None)."""
    if server_args is None:
        return {}
    return {name: _json(getattr(server_args, name, None)) for name in SERVER_ARGS}


def sglang_key_fields(model_config: ModelConfig, ranks: Ranks, server_args: ServerArgs | None = None) -> dict:
    """SGLang's CacheConfig fields not covered by the core fingerprint, as JSON values."""
    from sglang.srt.weight_cache.protocol import hash_quant_config

    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    fields = {
        "moe_dp_size": ranks.moe_dp_size,
        "moe_dp_rank": ranks.moe_dp_rank,
        "moe_ep_rank": ranks.moe_ep_rank,
        "attn_dp_size": ranks.attn_dp_size,
        "enable_dp_lm_head": bool(ranks.enable_dp_lm_head),
        "attn_cp_size": ranks.attn_cp_size,
        "moe_dense_tp_size": ranks.moe_dense_tp_size,
        "quant_method": quant_method_name(model_config),
        "quant_config_hash": hash_quant_config(hf_quant),
        "revision": model_config.revision or "",
        "is_draft_model": bool(getattr(model_config, "is_draft_model", False)),
    }
    return {**fields, **{f"server_args.{name}": value for name, value in server_args_fields(server_args).items()}}


def _json(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "value", value))


def device_name(device_config: DeviceConfig) -> str:
    """``cpu`` or ``cuda:N`` for SGLang's DeviceConfig (``gpu_id`` is the process's CUDA index)."""
    device = str(device_config.device)
    if device == "cpu":
        return "cpu"
    return f"{device}:{int(device_config.gpu_id)}"
