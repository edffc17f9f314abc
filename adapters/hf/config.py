"""What the hf adapter reads from a checkpoint's config.json: model class and quantization."""

from __future__ import annotations

import json
import typing
from pathlib import Path

from weightcache.core.errors import UnsupportedQuantization
from weightcache.core.hub import looks_like_hub_id

if typing.TYPE_CHECKING:
    from weightcache.core.quantization.fp8_block import Fp8BlockConfig

FP8_BLOCK = "fp8-block"


def read_config(model: str, revision: str | None = None) -> dict:
    """The checkpoint's config.json as a dict; for a hub id the local cache does not hold, transformers fetches it
    (and raises what it raises without weightcache, e.g. offline)."""
    if Path(model).is_file():
        raise ValueError(
            f"{model} is a file; the hf adapter takes the checkpoint directory that holds config.json and the weights "
            f"(here: {Path(model).parent})"
        )
    path = Path(model) / "config.json"
    if not Path(model).exists() and looks_like_hub_id(model):
        from transformers.utils import cached_file

        found = cached_file(model, "config.json", revision=revision)
        if found is None:
            raise FileNotFoundError(
                f"{model} has no config.json in the local hub cache; download it, or pass a checkpoint directory"
            )
        path = Path(found)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: the hf adapter needs a transformers checkpoint directory (save_pretrained writes config.json)"
        ) from None
    except ValueError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); the checkpoint's config is damaged: copy or download it again"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; the checkpoint's config is damaged")
    return config


def architecture(config: dict) -> str:
    """The model class named by the checkpoint (``architectures[0]``), else its model_type."""
    names = config.get("architectures") or []
    return names[0] if names else str(config.get("model_type", "unknown"))


def checkpoint_quantization(config: dict) -> str:
    """The method a checkpoint declares in ``quantization_config`` (``none`` if it declares none)."""
    qc = config.get("quantization_config")
    if not qc:
        return "none"
    method = str(qc.get("quant_method", "unknown")).lower()
    if method == "fp8":
        return FP8_BLOCK if qc.get("weight_block_size") else "fp8"
    return method


def fp8_config(config: dict, requested: str | None, options: dict) -> "Fp8BlockConfig | None":
    """The Fp8BlockConfig this load uses, or None when the model stays unquantized.

    Raises UnsupportedQuantization for a method other than block FP8.
    """
    from weightcache.core.quantization.fp8_block import Fp8BlockConfig

    stored = checkpoint_quantization(config)
    if stored == FP8_BLOCK:
        return Fp8BlockConfig.from_hf_quantization_config(config["quantization_config"])
    if stored != "none":
        raise UnsupportedQuantization(stored, "checkpoint quantized with a method weightcache has not validated")
    if requested in (None, "none"):
        return None
    if requested != FP8_BLOCK:
        raise UnsupportedQuantization(requested, "only block-wise FP8 is validated")
    kwargs: dict[str, typing.Any] = {}
    if options.get("block_size"):
        kwargs["block_size"] = tuple(options["block_size"])
    if options.get("exclude") is not None:
        kwargs["exclude"] = tuple(options["exclude"])
    return Fp8BlockConfig(**kwargs)
