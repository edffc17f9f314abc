"""Which quantization methods may be cached as raw bytes: the registered ones (``method.py``) and an adapter's own;
the others are refused with the reason the table of refusals (``methods.py``) gives."""

from __future__ import annotations

from collections.abc import Iterable

from weightcache.core.quantization import method as registry
from weightcache.core.quantization.methods import PER_TENSOR_FP8

__all__ = ["PER_TENSOR_FP8", "check_quantization"]


def check_quantization(method: str | None, adapter_allowlist: Iterable[str] = ()) -> None:
    """Raise UnsupportedQuantization unless ``method`` (None: unquantized) is registered or the adapter validated it."""
    method = (method or "none").lower()
    if method in registry.table() or method in tuple(adapter_allowlist):
        return
    registry.quantization_method(method)  # raises, with the reason
