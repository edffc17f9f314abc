"""Names of torch dtypes on the wire, and back."""

from __future__ import annotations

import functools

_NAMES = (
    "float32", "float16", "bfloat16", "float64",
    "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool",
)


@functools.cache
def _by_name() -> dict:
    import torch

    return {name: getattr(torch, name) for name in _NAMES if hasattr(torch, name)}


def to_dtype(value):
    """A torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``)."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    try:
        return _by_name()[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {value!r}; use one of {', '.join(sorted(_by_name()))}") from None


def dtype_name(value) -> str:
    """The wire name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``); needs no torch for names."""
    name = str(value).removeprefix("torch.")
    if name not in _NAMES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {', '.join(sorted(_NAMES))}")
    return name
