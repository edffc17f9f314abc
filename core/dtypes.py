"""Names of torch dtypes on the wire, their item sizes, and back."""

from __future__ import annotations

import functools
import typing

if typing.TYPE_CHECKING:
    import torch

ITEM_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Bytes per element of every dtype the wire carries (torch-free: the server validates manifests with it)."""


@functools.cache
def _by_name() -> dict:
    import torch

    return {name: getattr(torch, name) for name in ITEM_SIZES if hasattr(torch, name)}


def to_dtype(value: "torch.dtype | str") -> "torch.dtype":
    """A torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``)."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    try:
        return _by_name()[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {value!r}; use one of {', '.join(sorted(_by_name()))}") from None


def dtype_name(value: "torch.dtype | str") -> str:
    """The wire name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``); needs no torch for names."""
    name = str(value).removeprefix("torch.")
    if name not in ITEM_SIZES:
        raise ValueError(f"unsupported dtype {value!r:.80}; use one of {', '.join(sorted(ITEM_SIZES))}")
    return name


def item_size(name: str) -> int:
    """Bytes per element of the dtype called ``name`` (a wire name, as :func:`dtype_name` returns)."""
    return ITEM_SIZES[dtype_name(name)]
