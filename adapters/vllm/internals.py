"""The private vLLM names this adapter uses, in one place, each with why (checked against vLLM 0.33.0).

Everything else the adapter calls has a public name in vLLM (no leading
underscore), though several live in modules vLLM does not promise to keep
(``docs/engines.md`` lists them). A private name is looked up when used; one
that a newer vLLM dropped raises ImportError naming it, its use and the version
it was checked with. ``tests/engines/test_vllm.py`` looks each one up and checks
that the adapter's source names no other.

Replaced by public ones since weightcache 0.1: ``_LOAD_FORMAT_TO_MODEL_LOADER``
(``get_model_loader`` says whether a format is registered), ``parallel_state._EP``
(``get_ep_group``), ``ipc_loader._materialize_remaining_meta_tensors`` (the
adapter's own ``drop_consumed``).
"""

from __future__ import annotations

from weightcache.adapters.engine_support import PrivateName

CHECKED_WITH = "0.33.0"
"""The vLLM version these names were read from."""

ROPE_CACHE = PrivateName(
    "vllm",
    CHECKED_WITH,
    "vllm.model_executor.layers.rotary_embedding",
    "_ROPE_DICT",
    "vLLM's process-wide cache of rotary embedding modules: each build of the adapter runs with it empty and puts it "
    "back afterwards, so that no model shares a rotary module built on meta or viewing an arena (no public accessor)",
)

TP_GROUP = PrivateName(
    "vllm",
    CHECKED_WITH,
    "vllm.distributed.parallel_state",
    "_TP",
    "vLLM's tensor-parallel group: a rank of a TP=N engine loaded in a process of its own (weightcache load --tp-size, "
    "load_model, publish_version) builds and loads with a stand-in there that is rank K of N (weightcache.adapters."
    "lone_rank), so vLLM's layers keep that rank's shard (vLLM has no public setter)",
)

PRIVATE_NAMES = (ROPE_CACHE, TP_GROUP)
