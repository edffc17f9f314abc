"""The store entry name of a model's remembered layout, and its size bound: neither imports torch or transformers.

``weightcache load``'s warm-up names the entry before its process has imported torch (seconds), so that the
layout process starts at once where the entry is missing.
"""

from __future__ import annotations

import hashlib
import json
import typing

if typing.TYPE_CHECKING:
    from weightcache.adapter import LoadRequest

FORMAT = 2
"""The layout format's version: part of every key, so a change of format never reads an old entry (2: which modules
are exactly ``torch.nn.Linear``)."""
MAX_ENTRY_BYTES = 256 << 20
"""The largest layout entry read back (a 200,000-tensor model's names and shapes, with room)."""


def layout_key(request: "LoadRequest", config: dict, dtype: str) -> str:
    """The store entry name of the layout of this checkpoint's model: a digest of everything the layout depends on
    (config.json's content, the class, the dtype, transformers' and torch's versions, the format's version)."""
    from weightcache.adapters.hf.identity import architecture, installed_version

    parts = {
        "format": FORMAT,
        "config": config,
        "class": request.option("model_class") or architecture(config),
        "dtype": dtype,
        "transformers": installed_version("transformers"),
        "torch": installed_version("torch"),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"layout-{digest[:48]}.json"
