"""Which quantization methods may be cached as raw bytes, and why the others may not."""

from __future__ import annotations

from collections.abc import Iterable

from weightcache.core.errors import UnsupportedQuantization

VALIDATED = ("none", "fp8-block")

PER_TENSOR_FP8 = (
    "per-tensor FP8 keeps activation and weight scales whose meaning depends on the engine's kernels "
    "and may be re-derived after loading; only block-wise FP8 (128x128, weight_scale_inv) is validated"
)

REFUSED = {
    "fp8": PER_TENSOR_FP8,
    "fp8-tensor": PER_TENSOR_FP8,
    "fp8-per-tensor": PER_TENSOR_FP8,
    "marlin": "Marlin repacks and permutes weights for its kernel and keeps a workspace and permutation in Python; "
    "raw bytes mapped elsewhere would be read in the wrong order",
    "awq": "AWQ packs int4 weights with zero points and scales whose layout the engine transposes or repacks after "
    "loading (and may hand to Marlin); the packing lives partly in Python-side metadata",
    "gptq": "GPTQ stores packed int4 weights plus g_idx / act-order permutations that engines shuffle after loading "
    "and keep in Python-side state",
    "bitsandbytes": "bitsandbytes keeps quant_state objects (absmax, code tables, blocksizes) in Python attached to "
    "each parameter; the raw bytes alone do not describe the weight",
}


def check_quantization(method: str | None, adapter_allowlist: Iterable[str] = ()) -> None:
    """Raise UnsupportedQuantization unless ``method`` (None: unquantized) is validated (by the core or the adapter)."""
    method = (method or "none").lower()
    if method in VALIDATED or method in tuple(adapter_allowlist):
        return
    reason = REFUSED.get(method.replace("_", "-")) or (
        "it is unknown to weightcache: its effect may live partly outside the tensor bytes, so a raw-bytes map "
        "could give wrong numbers silently"
    )
    raise UnsupportedQuantization(method, reason)
