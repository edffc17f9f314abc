"""Every quantization method weightcache knows, in one table: those it caches as raw bytes, and why it refuses the others.

A validated method names the module that holds its code (``fp8_block`` for block-wise FP8); an adapter's hooks use it
(``describe`` declares the method and its config, ``post_process`` quantizes, ``rebind`` rebuilds the modules). A new
method is that module, a row here and the adapter's hooks; ``allowlist.check_quantization`` reads nothing else.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class QuantizationMethod:
    """One method: its canonical ``name``, the ``module`` holding its code (validated), or why it is ``refused``."""

    name: str
    module: str = ""
    refused: str = ""
    """Why raw bytes of this method cannot be cached (empty: validated)."""
    aliases: tuple[str, ...] = ()

    @property
    def validated(self) -> bool:
        return not self.refused


PER_TENSOR_FP8 = (
    "per-tensor FP8 keeps activation and weight scales whose meaning depends on the engine's kernels "
    "and may be re-derived after loading; only block-wise FP8 (128x128, weight_scale_inv) is validated"
)
UNKNOWN = (
    "it is unknown to weightcache: its effect may live partly outside the tensor bytes, so a raw-bytes map "
    "could give wrong numbers silently"
)

METHODS: tuple[QuantizationMethod, ...] = (
    QuantizationMethod("none"),
    QuantizationMethod("fp8-block", module="weightcache.core.quantization.fp8_block"),
    QuantizationMethod("fp8", refused=PER_TENSOR_FP8, aliases=("fp8-tensor", "fp8-per-tensor")),
    QuantizationMethod(
        "marlin",
        refused="Marlin repacks and permutes weights for its kernel and keeps a workspace and permutation in Python; "
        "raw bytes mapped elsewhere would be read in the wrong order",
    ),
    QuantizationMethod(
        "awq",
        refused="AWQ packs int4 weights with zero points and scales whose layout the engine transposes or repacks after "
        "loading (and may hand to Marlin); the packing lives partly in Python-side metadata",
    ),
    QuantizationMethod(
        "gptq",
        refused="GPTQ stores packed int4 weights plus g_idx / act-order permutations that engines shuffle after loading "
        "and keep in Python-side state",
    ),
    QuantizationMethod(
        "bitsandbytes",
        refused="bitsandbytes keeps quant_state objects (absmax, code tables, blocksizes) in Python attached to "
        "each parameter; the raw bytes alone do not describe the weight",
    ),
)
"""The table: the first two are validated, the rest refused with their reason."""

_BY_NAME = {name: method for method in METHODS for name in (method.name, *method.aliases)}


def method_named(name: str | None) -> QuantizationMethod:
    """The method ``name`` (None: unquantized; case and ``_``/``-`` do not matter), or an unknown one, refused."""
    canonical = (name or "none").lower()
    return _BY_NAME.get(canonical.replace("_", "-")) or QuantizationMethod(canonical, refused=UNKNOWN)
