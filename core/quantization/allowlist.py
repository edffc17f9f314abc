"""Which quantization methods may be cached as raw bytes, and why the others may not (the table: ``methods``)."""

from __future__ import annotations

from collections.abc import Iterable

from weightcache.core.errors import UnsupportedQuantization
from weightcache.core.quantization.methods import METHODS, PER_TENSOR_FP8, method_named

VALIDATED = tuple(method.name for method in METHODS if method.validated)

REFUSED = {name: method.refused for method in METHODS if not method.validated for name in (method.name, *method.aliases)}

__all__ = ["PER_TENSOR_FP8", "REFUSED", "VALIDATED", "check_quantization"]


def check_quantization(method: str | None, adapter_allowlist: Iterable[str] = ()) -> None:
    """Raise UnsupportedQuantization unless ``method`` (None: unquantized) is validated (by the core or the adapter)."""
    method = (method or "none").lower()
    if method in VALIDATED or method in tuple(adapter_allowlist):
        return
    raise UnsupportedQuantization(method, method_named(method).refused)
