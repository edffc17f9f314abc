"""The quantization methods weightcache knows and refuses, in one table, each with the reason.

The methods it caches are plugins (``method.py``: the built-in ``none`` and ``fp8-block``, and what installed packages
register); this table says why each other is refused, so the error names the reason, not just the name. A method a
package registers is accepted whatever this table says of its name.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class KnownMethod:
    """One refused method: its canonical ``name``, why raw bytes of it cannot be cached, and its other spellings."""

    name: str
    refused: str
    aliases: tuple[str, ...] = ()


PER_TENSOR_FP8 = (
    "per-tensor FP8 keeps activation and weight scales whose meaning depends on the engine's kernels "
    "and may be re-derived after loading; only block-wise FP8 (128x128, weight_scale_inv) is validated"
)
UNKNOWN = (
    "it is unknown to weightcache: its effect may live partly outside the tensor bytes, so a raw-bytes map "
    "could give wrong numbers silently"
)

METHODS: tuple[KnownMethod, ...] = (
    KnownMethod("fp8", refused=PER_TENSOR_FP8, aliases=("fp8-tensor", "fp8-per-tensor")),
    KnownMethod(
        "marlin",
        refused="Marlin repacks and permutes weights for its kernel and keeps a workspace and permutation in Python; "
        "raw bytes mapped elsewhere would be read in the wrong order",
    ),
    KnownMethod(
        "awq",
        refused="AWQ packs int4 weights with zero points and scales whose layout the engine transposes or repacks after "
        "loading (and may hand to Marlin); the packing lives partly in Python-side metadata",
    ),
    KnownMethod(
        "gptq",
        refused="GPTQ stores packed int4 weights plus g_idx / act-order permutations that engines shuffle after loading "
        "and keep in Python-side state",
    ),
    KnownMethod(
        "bitsandbytes",
        refused="bitsandbytes keeps quant_state objects (absmax, code tables, blocksizes) in Python attached to "
        "each parameter; the raw bytes alone do not describe the weight",
    ),
)
"""The table of refusals."""

_BY_NAME = {name: method for method in METHODS for name in (method.name, *method.aliases)}


def method_named(name: str | None) -> KnownMethod:
    """The refused method ``name`` (case and ``_``/``-`` do not matter), or an unknown one, refused as unknown."""
    canonical = (name or "none").lower()
    return _BY_NAME.get(canonical.replace("_", "-")) or KnownMethod(canonical, refused=UNKNOWN)
