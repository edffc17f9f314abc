"""The quantization allowlist in the engines' terms: their method names mapped onto weightcache's validated methods.

Only unquantized models and block-wise FP8 with 128x128 blocks pass; every
other method raises UnsupportedQuantization, before any weight is read. The
engines' own names (vLLM's ``model_config.quantization``, SGLang's
``quant_method``) are grouped into the families the core's allowlist explains.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

from weightcache.adapter import UnsupportedQuantization, check_quantization

FP8_BLOCK = "fp8-block"
VALIDATED_BLOCK = [128, 128]

FAMILIES = {
    "awq": "awq",
    "auto_awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "auto_gptq": "gptq",
    "gptq_marlin": "gptq",
    "gptq_marlin_24": "gptq",
    "marlin": "marlin",
    "fp8_per_tensor": "fp8-tensor",
    "bitsandbytes": "bitsandbytes",
}
"""Engine method name -> the family whose refusal reason applies (others are refused as unknown)."""

QuantConfig = typing.Any
"""A checkpoint's ``quantization_config``: a dict, an engine's config object with ``to_dict()``, or None."""


def as_dict(quant_config: QuantConfig) -> dict:
    """A checkpoint's ``quantization_config`` (a dict, or an object with ``to_dict``) as a plain dict."""
    if quant_config is None:
        return {}
    if isinstance(quant_config, dict):
        return dict(quant_config)
    if hasattr(quant_config, "to_dict"):
        return dict(quant_config.to_dict())
    return {}


def checked_method(method: str | None, quant_config: QuantConfig) -> tuple[str, dict]:
    """The canonical method (``none`` or ``fp8-block``) and its config, for the fingerprint.

    :param method: the engine's method name (None or "" when unquantized).
    :param quant_config: the checkpoint's ``quantization_config``.
    Raises UnsupportedQuantization for every other method.
    """
    config = as_dict(quant_config)
    method = str(method or "none").lower()
    if method == "none":
        return "none", {}
    if method == "fp8":
        block = list(config.get("weight_block_size") or ())
        if not block:
            check_quantization("fp8")  # per-tensor: refused with its reason
        if [int(b) for b in block] != VALIDATED_BLOCK:
            raise UnsupportedQuantization(
                "fp8", f"block size {list(block)}: only block-wise FP8 with 128x128 blocks (weight_scale_inv) is validated"
            )
        if str(config.get("fmt", "e4m3")).lower() != "e4m3":
            raise UnsupportedQuantization("fp8", f"format {config.get('fmt')!r}: only e4m3 block-wise FP8 is validated")
        return FP8_BLOCK, config
    check_quantization(FAMILIES.get(method, method))
    raise AssertionError(f"quantization method {method!r} passed the allowlist without being validated")  # pragma: no cover


def declared_method(checkpoint: str) -> tuple[str, dict]:
    """The method a local checkpoint's config.json declares, checked as ``checked_method`` does, before the engine parses it.

    A hub name, a directory without config.json or a config without ``quantization_config`` gives ``("none", {})``.
    """
    path = Path(checkpoint) / "config.json"
    declared = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    if not isinstance(declared, dict) or not declared:
        return "none", {}
    return checked_method(declared.get("quant_method"), declared)
