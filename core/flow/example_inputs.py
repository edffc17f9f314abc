"""Example inputs for one forward pass, built from a model's ``forward`` signature and config.

The conformance kit runs a disk-loaded and a mapped model on the same inputs
and compares every output bit for bit. Inputs are fixed (a seeded generator),
so two processes build the same ones. Covered: token ids (decoder-only and
encoders), decoder ids (encoder-decoder such as T5 and BART), token types,
attention masks, pixel values (vision: the config's image size and channels, else 64 × 64 pixels and the
first convolution's channels), audio features and raw audio values.
Non-token inputs (pixels, audio) take the dtype of the model's weights (a bf16
Whisper gets bf16 features, as its processor would give them); ``run_with_inputs``
moves every input to the model's device.
"""

from __future__ import annotations

import inspect
import typing

from weightcache.core.request import ForwardUnavailable

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.device import Device

BATCH = 2
TOKENS = 16
DECODER_TOKENS = 8
IMAGE_SIZE = 64
"""Height and width of the pixels for an image model whose config names no ``image_size`` (a plain torch module)."""
SEED = 20261130


def inputs_from_signature(model: "torch.nn.Module", adapter: str | None = None) -> "dict | ForwardUnavailable":
    """Keyword inputs for ``model.forward``, or ForwardUnavailable saying which hook of ``adapter`` to write instead."""
    import torch

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return ForwardUnavailable(f"the forward signature of {type(model).__name__} cannot be read")
    config = getattr(model, "config", None)
    generator = torch.Generator().manual_seed(SEED)
    inputs: dict = {}
    vocab = _config_int(config, "vocab_size")
    if "input_ids" in parameters and vocab:
        inputs["input_ids"] = _token_ids(vocab, TOKENS)
        if "attention_mask" in parameters:
            mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
            mask[1, -3:] = 0  # a padded row, so a model that ignores the mask shows it
            inputs["attention_mask"] = mask
        types = _config_int(config, "type_vocab_size")
        if "token_type_ids" in parameters and types and types > 1:
            inputs["token_type_ids"] = (torch.arange(TOKENS) >= TOKENS // 2).long().expand(BATCH, TOKENS).contiguous()
        if "decoder_input_ids" in parameters and _is_encoder_decoder(config):
            inputs["decoder_input_ids"] = _token_ids(vocab, DECODER_TOKENS, salt=3)
    elif "pixel_values" in parameters:
        size = _config_int(config, "image_size") or IMAGE_SIZE
        channels = _config_int(config, "num_channels") or _image_channels(model)
        inputs["pixel_values"] = torch.randn(BATCH, channels, size, size, generator=generator)
    elif "input_features" in parameters and (bins := _config_int(config, "num_mel_bins")):
        frames = 2 * (_config_int(config, "max_source_positions") or 1500)
        inputs["input_features"] = torch.randn(BATCH, bins, frames, generator=generator)
        if "decoder_input_ids" in parameters and vocab:
            inputs["decoder_input_ids"] = _token_ids(vocab, DECODER_TOKENS, salt=3)
    elif "input_values" in parameters:
        inputs["input_values"] = torch.randn(BATCH, 16000, generator=generator)
    if inputs:
        dtype = weights_dtype(model)
        inputs = {name: value.to(dtype) if value.is_floating_point() else value for name, value in inputs.items()}
    if not inputs:
        wanted = ", ".join(name for name in parameters if name not in ("kwargs", "args")) or "nothing"
        where = f"adapter {adapter!r}" if adapter else "its adapter"
        return ForwardUnavailable(
            f"weightcache cannot build inputs for {type(model).__name__}.forward({wanted}); write the hook "
            f"weightcache_example_inputs(request, model) in {where}, returning the inputs (a dict of keyword "
            "arguments, a tuple of positional ones, or one tensor), or give the kit inputs (--inputs MODULE:FUNCTION)"
        )
    return inputs


def _image_channels(model: "torch.nn.Module") -> int:
    """The input channels of the model's first 2-D convolution (3 when it has none)."""
    import torch

    first = next((module for module in model.modules() if isinstance(module, torch.nn.Conv2d)), None)
    return first.in_channels if first is not None else 3


def weights_dtype(model: "torch.nn.Module") -> "torch.dtype":
    """The dtype most of ``model``'s floating-point weights have among float16, bfloat16, float32 and float64 (an FP8
    model's unquantized layers decide), float32 when it has none."""
    import torch

    counts: dict = {}
    for parameter in model.parameters():
        if parameter.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            counts[parameter.dtype] = counts.get(parameter.dtype, 0) + parameter.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _token_ids(vocab: int, length: int, salt: int = 0) -> "torch.Tensor":
    import torch

    return (torch.arange(BATCH * length, dtype=torch.long).reshape(BATCH, length) * 7919 + 11 + salt) % vocab


def _config_int(config, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _is_encoder_decoder(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def to_device(value: typing.Any, device: "torch.device | str") -> typing.Any:
    """``value`` (a tensor, or mappings, lists and tuples of them) with every tensor moved to ``device``."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, typing.Mapping):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value


def run_with_inputs(model: "torch.nn.Module", inputs: typing.Any, device: "Device | str | None" = None) -> typing.Any:
    """Call ``model`` on ``inputs`` (a dict as keywords, a tuple as positionals, else one argument) without grad.

    With ``device`` (anything ``Device.parse`` takes) the inputs move there first.
    """
    import torch

    from weightcache.core.device import Device

    if device is not None:
        inputs = to_device(inputs, Device.parse(device).torch())
    with torch.inference_mode():
        if isinstance(inputs, typing.Mapping):
            return model(**inputs)
        if isinstance(inputs, (list, tuple)):
            return model(*inputs)
        return model(inputs)
