"""The private SGLang names this adapter uses, in one place, each with why (checked against SGLang 0.5.23).

Everything else the adapter calls is public in SGLang (no leading underscore).
Each name is looked up when used; one that a newer SGLang dropped or renamed
raises ImportError naming it, the version it was checked with and what to do.
``tests/engines/test_sglang.py`` looks every one of them up, and
docs/engines.md lists them.
"""

from __future__ import annotations

import importlib
import typing

import attrs

CHECKED_WITH = "0.5.23"
"""The SGLang version these names were read from."""


@attrs.frozen
class PrivateName:
    """A private SGLang attribute (``module`` then a dotted ``path`` inside it) and what the adapter uses it for."""

    module: str
    path: str
    why: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.path}"

    def lookup(self) -> typing.Any:
        """The object; ImportError naming it when this SGLang lacks it."""
        try:
            found: typing.Any = importlib.import_module(self.module)
            for part in self.path.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"SGLang {_installed_version()} lacks {self.dotted}, a private name weightcache's "
                f"SGLang adapter uses ({self.why}); it was checked with SGLang {CHECKED_WITH}: install "
                f"sglang=={CHECKED_WITH} or update weightcache/adapters/sglang/internals.py ({type(exc).__name__}: {exc})"
            ) from None
        return found


ALL_WEIGHTS = PrivateName(
    "sglang.srt.model_loader.loader",
    "DefaultModelLoader._get_all_weights",
    "the checkpoint's weight iterator, so that reading weights (weightcache_load) and SGLang's post-processing "
    "(weightcache_post_process) run as the two steps DefaultModelLoader.load_model runs in one call",
)
REBUILD_STALE_VIEWS = PrivateName(
    "sglang.srt.weight_cache.ipc_loader",
    "IpcModelLoader._rebuild_stale_views",
    "after rebinding a meta-built model, re-derive the tensor views some modules keep as plain attributes "
    "(RadixLinearAttention.conv_weights), as SGLang's own weight cache does",
)
ROPE_CACHE = PrivateName(
    "sglang.srt.layers.rotary_embedding.factory",
    "_ROPE_DICT",
    "SGLang shares rotary-embedding modules process-wide; each model the adapter builds gets its own, so that "
    "publishing one model (which frees its tensors) or rebinding another never changes a third",
)

PRIVATE_NAMES = (ALL_WEIGHTS, REBUILD_STALE_VIEWS, ROPE_CACHE)
"""Every private SGLang name the adapter uses."""


def _installed_version() -> str:
    try:
        import sglang

        return str(sglang.__version__)
    except ImportError:
        return "not importable"
