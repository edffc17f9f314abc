"""The method ``none``: weights stay as the checkpoint stores them."""

from __future__ import annotations

import typing

from weightcache.core.quantization.method import QuantizationMethod

if typing.TYPE_CHECKING:
    import torch


class NoQuantization(QuantizationMethod):
    """No quantization: nothing to configure, convert or rebuild."""

    name: typing.ClassVar[str] = "none"

    def accept(self, declared: typing.Mapping[str, typing.Any] | None, options: typing.Mapping[str, typing.Any]) -> dict:
        return {}

    def quantize(self, model: "torch.nn.Module", config: typing.Mapping[str, typing.Any]) -> list[str]:
        return []
