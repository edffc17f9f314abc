"""The private SGLang names this adapter uses, in one place, each with why (checked against SGLang 0.5.23).

Everything else the adapter calls has a public name in SGLang (no leading
underscore), though several live in modules SGLang does not promise to keep
(``docs/engines.md`` lists them). A private name is looked up when used; one
that a newer SGLang dropped raises ImportError naming it, its use and the
version it was checked with. ``tests/engines/test_sglang.py`` looks each one up
and checks that the adapter's source names no other.

Replaced by public ones since weightcache 0.1: ``_initialize_model`` and
``_get_quantization_config`` (``DefaultModelLoader.initialize_model_for_startup``
with a meta DeviceConfig), ``HookRegistry._hooks`` (the plugin remembers its own
registration), ``LoadConfig._verify_load_format`` (the hook runs before
``LoadConfig.__post_init__``).
"""

from __future__ import annotations

from weightcache.adapters.engine_support import PrivateName

CHECKED_WITH = "0.5.23"
"""The SGLang version these names were read from."""

ALL_WEIGHTS = PrivateName(
    "sglang",
    CHECKED_WITH,
    "sglang.srt.model_loader.loader",
    "DefaultModelLoader._get_all_weights",
    "the checkpoint's weight iterator, so that reading weights (weightcache_load) and SGLang's post-processing "
    "(weightcache_post_process) run as the two steps DefaultModelLoader.load_model runs in one call",
)
REBUILD_STALE_VIEWS = PrivateName(
    "sglang",
    CHECKED_WITH,
    "sglang.srt.weight_cache.ipc_loader",
    "IpcModelLoader._rebuild_stale_views",
    "after rebinding a meta-built model, re-derive the tensor views some modules keep as plain attributes "
    "(RadixLinearAttention.conv_weights), as SGLang's own weight cache does",
)
ROPE_CACHE = PrivateName(
    "sglang",
    CHECKED_WITH,
    "sglang.srt.layers.rotary_embedding.factory",
    "_ROPE_DICT",
    "SGLang's process-wide cache of rotary embedding modules: each build of the adapter runs with it empty and puts "
    "it back afterwards, so that publishing one model (which frees its tensors) or rebinding another never changes a "
    "third (no public accessor)",
)

PRIVATE_NAMES = (ALL_WEIGHTS, REBUILD_STALE_VIEWS, ROPE_CACHE)
"""Every private SGLang name the adapter uses."""
