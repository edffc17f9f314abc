"""The fingerprint of a vLLM model rank, from VllmConfig and ModelConfig, before any weight is read.

It holds weightcache's own fields (checkpoint content, architecture, full
config, ranks, dtype, quantization, torch/CUDA versions, GPU UUID and compute
capability, protocol and adapter versions) and, in ``extra``, every field of
vLLM's own ``WeightCacheKey`` that the core fields do not already carry
(kv-cache dtype, RoPE parameters, kernel backends, draft role, DP rank, ...),
computed by vLLM's own ``WeightCacheKey.from_model_config``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing

import attrs

from weightcache.adapters import engine_quantization
from weightcache.core.fingerprint import ParallelSpec

if typing.TYPE_CHECKING:
    from weightcache.core.fingerprint import Fingerprint

ADAPTER = "vllm"

COVERED_BY_CORE = ("checkpoint", "model_arch", "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dtype", "vllm_version")
"""WeightCacheKey fields that the core fingerprint already holds (the checkpoint as a hash of every safetensors header)."""


@attrs.frozen
class Ranks:
    """This process's place in vLLM's parallel groups."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    @classmethod
    def current(cls) -> "Ranks":
        """The ranks of vLLM's initialised process groups (the worker has set them up before loading)."""
        from vllm.distributed import get_dp_group, get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.distributed import parallel_state

        pp, dp = get_pp_group(), get_dp_group()
        ep = parallel_state._EP  # created only for MoE models with expert parallelism
        return cls(
            tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank(),
            pp_size=pp.world_size, pp_rank=pp.rank_in_group,
            dp_size=dp.world_size, dp_rank=dp.rank_in_group,
            ep_size=ep.world_size if ep is not None else 1, ep_rank=ep.rank_in_group if ep is not None else 0,
        )

    @property
    def parallel(self) -> ParallelSpec:
        return ParallelSpec(tp_size=self.tp_size, tp_rank=self.tp_rank, pp_size=self.pp_size, pp_rank=self.pp_rank,
                            dp_size=self.dp_size, ep_size=self.ep_size, ep_rank=self.ep_rank)


def quantization(model_config) -> tuple[str, dict]:
    """The canonical method and config of ``model_config``; UnsupportedQuantization unless unquantized or 128x128 block FP8.

    Reads configs only: call it before anything touches the checkpoint's files.
    """
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    return engine_quantization.checked_method(model_config.quantization, hf_quant)


def is_draft(vllm_config, model_config) -> bool:
    """Whether ``model_config`` is the speculative draft (vLLM loads it through the same loader)."""
    spec = vllm_config.speculative_config
    return spec is not None and model_config is spec.draft_model_config


def checkpoint_dir(model_config, load_config) -> str:
    """The local directory of the checkpoint's safetensors files (vLLM downloads them first if the model is a hub name)."""
    if os.path.isdir(model_config.model):
        return model_config.model
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return download_weights_from_hf(
        model_config.model, load_config.download_dir, ["*.safetensors"], model_config.revision,
        ignore_patterns=load_config.ignore_patterns,
    )


def vllm_key_fields(vllm_config, model_config, ranks: Ranks, draft: bool) -> dict:
    """The fields of vLLM's own WeightCacheKey not covered by the core fingerprint, as JSON values."""
    from vllm.model_executor.model_loader.weight_cache.protocol import WeightCacheKey

    parallel_config = vllm_config.parallel_config
    key = WeightCacheKey.from_model_config(
        model_config, ranks.tp_size, ranks.tp_rank, cache_config=vllm_config.cache_config,
        pp_size=ranks.pp_size, pp_rank=ranks.pp_rank, is_draft=draft, dp_size=ranks.dp_size, dp_rank=ranks.dp_rank,
        enable_expert_parallel=parallel_config.enable_expert_parallel,
        expert_placement_strategy=parallel_config.expert_placement_strategy,
        kernel_config=vllm_config.kernel_config,
    )
    fields = {name: value for name, value in dataclasses.asdict(key).items() if name not in COVERED_BY_CORE}
    return json.loads(json.dumps(fields))  # tuples become lists, as they come back from the wire


def hf_config_json(model_config) -> dict:
    """The model's full Hugging Face config as JSON."""
    return json.loads(model_config.hf_config.to_json_string(use_diff=False))


def fingerprint(vllm_config, model_config, *, device: str, ranks: Ranks | None = None, draft: bool | None = None,
                checkpoint: str | None = None) -> "Fingerprint":
    """The fingerprint of one vLLM model rank; call it before loading (post-processing may mutate configs).

    :param device: ``cpu`` or ``cuda:N`` (the GPU's UUID, compute capability and CUDA version are read from it).
    :param ranks: default: vLLM's current process groups.
    :param draft: default: whether ``model_config`` is the speculative draft of ``vllm_config``.
    :param checkpoint: the local checkpoint directory (default: resolved from ``model_config``).
    """
    import vllm

    from weightcache.core import __version__
    from weightcache.core.identity import make_fingerprint

    method, quant_config = quantization(model_config)
    ranks = ranks or Ranks.current()
    draft = is_draft(vllm_config, model_config) if draft is None else draft
    architectures = getattr(model_config.hf_config, "architectures", None) or []
    return make_fingerprint(
        checkpoint or checkpoint_dir(model_config, vllm_config.load_config),
        architecture=",".join(architectures),
        config=hf_config_json(model_config),
        dtype=str(model_config.dtype).removeprefix("torch."),
        device=device,
        parallel=ranks.parallel,
        quantization=method,
        quantization_config=quant_config,
        adapter=ADAPTER,
        adapter_version=__version__,
        engine="vllm",
        engine_version=vllm.__version__,
        extra=vllm_key_fields(vllm_config, model_config, ranks, draft),
    )
