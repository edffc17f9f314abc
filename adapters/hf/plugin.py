"""The Hugging Face transformers adapter: any model class built from its config.

Registered under the name ``hf`` in the ``weightcache.adapters`` entry points.
transformers is imported inside the hooks, so weightcache imports without it.
"""

from __future__ import annotations

import logging
import typing

from weightcache.adapters.hf import config as hf_config
from weightcache.core import __version__
from weightcache.core.errors import UnsupportedQuantization
from weightcache.core.hookspecs import hookimpl
from weightcache.core.options import AdapterOption
from weightcache.core.request import ModelDescription

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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("the hf adapter needs transformers: `pip install 'weightcache[hf]'`") from None
    return transformers


@hookimpl
def weightcache_options():
    return OPTIONS


@hookimpl
def weightcache_describe(request):
    from weightcache.adapters.hf.loading import load_dtype, model_class

    transformers = _transformers()
    config = hf_config.read_config(request.model, request.revision)
    if request.option("model_class"):
        model_class(request, config)  # a class of another architecture is refused here, before any weight is read
    requested = request.quantization
    method = hf_config.checkpoint_quantization(config) if requested in (None, "none") else requested
    quant_config = {}
    if method in ("none", hf_config.FP8_BLOCK):
        fp8 = hf_config.fp8_config(config, requested, dict(request.options))
        quant_config = fp8.to_json() if fp8 else {}
    return ModelDescription(
        architecture=request.option("model_class") or hf_config.architecture(config),
        config=config,
        dtype=load_dtype(request, config),
        quantization=method,
        quantization_config=quant_config,
        adapter_version=__version__,
        engine="transformers",
        engine_version=transformers.__version__,
    )


@hookimpl
def weightcache_warm_up(request):
    from weightcache.adapters.hf.loading import model_class

    model_class(request, hf_config.read_config(request.model))  # imports transformers and the model's module


@hookimpl
def weightcache_load(request, builder):
    from weightcache.adapters.hf.loading import load

    return load(request, builder)


@hookimpl
def weightcache_post_process(request, model, description):
    from weightcache.adapters.hf.loading import PREQUANTIZED_ATTR

    if description.quantization != hf_config.FP8_BLOCK or getattr(model, PREQUANTIZED_ATTR, False):
        return model
    from weightcache.core.quantization.fp8_block import Fp8BlockConfig, quantize_model

    converted = quantize_model(model, Fp8BlockConfig.from_json(description.quantization_config))
    if not converted:
        raise UnsupportedQuantization(
            hf_config.FP8_BLOCK,
            f"no layer of {type(model).__name__} can be quantized: only untied nn.Linear layers outside the excluded "
            "modules hold block-FP8 weights (GPT-2's Conv1D layers do not)",
        )
    log.info("quantized %d linear layers to block-wise FP8", len(converted))
    return model


@hookimpl
def weightcache_manifest_extra(request, model):
    from weightcache.core.quantization.fp8_block import Fp8BlockLinear

    extra: dict[str, typing.Any] = {"model_class": type(model).__name__, "dtype": str(_param_dtype(model)).removeprefix("torch.")}
    fp8 = next((m for m in model.modules() if isinstance(m, Fp8BlockLinear)), None)
    if fp8 is not None:
        extra["fp8_block_size"] = list(fp8.block_size)
    return extra


def _param_dtype(model):
    import torch

    for param in model.parameters():
        if param.dtype.is_floating_point and param.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return param.dtype
    return torch.float32


@hookimpl
def weightcache_rebind(request, tensors, manifest):
    from weightcache.adapters.hf.loading import build_skeleton
    from weightcache.core.rebind import rebind_module

    model = build_skeleton(request, manifest)
    return rebind_module(model, tensors, manifest, device=request.device.torch())
