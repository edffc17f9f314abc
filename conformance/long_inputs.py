"""The kit's second, longer input: the example's token sequences lengthened as far as the model's context allows, capped.

Code a short input never reaches (positions past a threshold, a long-context
rope scaling, a sliding window) may read tensors the short forward does not: a
tensor left behind by export fails only there. The kit repeats each token
sequence of the example inputs (token ids, masks, token types; positions count
on) up to ``LONG_TOKENS`` or the model's context, whichever is shorter, and
compares the mapped model's outputs with the disk load's on it too. Inputs with
no token sequence (pixels, audio features alone) have no longer form.
"""

from __future__ import annotations

import typing

from weightcache.core.request import ForwardUnavailable

if typing.TYPE_CHECKING:
    import torch

LONG_TOKENS = 128
"""The longest input the kit runs (a forward on the CPU stays quick on the small models the kit is meant for)."""

SEQUENCE_KEYS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "decoder_input_ids",
    "decoder_attention_mask",
)
"""Keyword inputs that are token sequences, shaped (batch, tokens)."""

CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_target_positions", "max_seq_len", "seq_length", "n_ctx")
"""Config fields that bound a model's sequence length; the shortest one present wins."""


def context_length(model: "torch.nn.Module") -> int:
    """How many tokens the kit's long input has: ``LONG_TOKENS``, or fewer when a config allows fewer: the model's, or
    any submodule's (a pipeline's text encoder inside a ``ModuleDict``)."""
    configs = {id(config): config for module in model.modules() if (config := getattr(module, "config", None)) is not None}
    limits = [
        value
        for config in configs.values()
        for field in CONTEXT_FIELDS
        if isinstance(value := getattr(config, field, None), int) and not isinstance(value, bool) and value > 0
    ]
    return min([LONG_TOKENS, *limits])


def lengthen(inputs: typing.Any, length: int) -> typing.Any:
    """``inputs`` with every token sequence ``length`` long, or ForwardUnavailable saying why there is none to lengthen."""
    import torch

    if isinstance(inputs, ForwardUnavailable):
        return inputs
    if isinstance(inputs, torch.Tensor):
        longer = _longer(inputs, length) if _is_sequence(inputs) else None
        return longer if longer is not None else _nothing(inputs)
    if isinstance(inputs, typing.Mapping):
        changed = {key: _longer(value, length, key) for key, value in inputs.items() if key in SEQUENCE_KEYS}
        changed = {key: value for key, value in changed.items() if value is not None}
        return {**inputs, **changed} if changed else _nothing(inputs)
    if isinstance(inputs, (list, tuple)):
        items = [_longer(item, length) if _is_sequence(item) else None for item in inputs]
        if all(item is None for item in items):
            return _nothing(inputs)
        return type(inputs)(item if item is not None else original for item, original in zip(items, inputs, strict=True))
    return _nothing(inputs)


def _is_sequence(value: typing.Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point()


def _longer(value: typing.Any, length: int, key: str = "") -> "torch.Tensor | None":
    """``value`` (batch, tokens) repeated up to ``length`` tokens; positions count on. None if it is no longer so."""
    import torch

    if not _is_sequence(value) or value.shape[-1] == 0 or value.shape[-1] >= length:
        return None
    if key == "position_ids":
        return torch.arange(length, dtype=value.dtype, device=value.device).expand(value.shape[0], length).contiguous()
    repeats = -(-length // value.shape[-1])
    return value.repeat(1, repeats)[:, :length].contiguous()


def _nothing(inputs: typing.Any) -> ForwardUnavailable:
    kind = ", ".join(sorted(inputs)) if isinstance(inputs, typing.Mapping) else type(inputs).__name__
    return ForwardUnavailable(
        f"the example inputs ({kind}) hold no token sequence shorter than the model's context to lengthen "
        f"({', '.join(SEQUENCE_KEYS)}, or a (batch, tokens) integer tensor)"
    )
