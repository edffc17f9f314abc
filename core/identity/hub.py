"""Hub ids (``org/name``, with an optional revision) resolved offline from the local Hugging Face cache.

A model named by a hub id is found the way transformers finds it: huggingface_hub's own
``snapshot_download(..., local_files_only=True)`` looks up ``refs/<revision>`` and the
snapshot folder under ``HF_HUB_CACHE`` (or ``HF_HOME/hub``). Nothing is downloaded here,
ever: a hub id the cache does not hold stays a hub id, and whoever loads it (the engine's
own loader, transformers) does what it would have done without weightcache.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import attrs

from weightcache.core.errors import ModelNotCached

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_like_hub_id(model: str) -> bool:
    """Whether ``model`` reads as ``org/name`` (or ``name``) and is no local path."""
    if os.path.exists(model) or model.startswith((".", "/", "~")) or model.endswith((".safetensors", ".bin")):
        return False
    return _REPO_ID.fullmatch(model) is not None and ".." not in model and "--" not in model


@attrs.frozen
class Resolved:
    """Where a model's files are: the directory to read, and the hub id and commit when it came from the cache.

    :param path: the checkpoint directory (a snapshot folder for a hub id the cache holds), or the
        hub id itself when the cache does not hold it (``cached`` is then False).
    :param repo_id: the hub id, None for a local path.
    :param revision: the revision asked for (None: ``main``).
    """

    path: str
    repo_id: str | None = None
    revision: str | None = None
    cached: bool = True

    @property
    def commit(self) -> str | None:
        """The snapshot's commit hash (the folder's name) for a resolved hub id."""
        return Path(self.path).name if self.repo_id and self.cached else None


def resolve(model: str, revision: str | None = None) -> Resolved:
    """``model`` as a directory to read: a local path as given, a hub id through the local cache only.

    A hub id the cache cannot serve (not downloaded, another revision, huggingface_hub not installed)
    comes back with ``cached=False`` and ``path`` the id itself. A revision with a local path is a mistake.
    """
    if not looks_like_hub_id(model):
        if revision:
            raise ValueError(f"--revision {revision!r} applies to hub ids (org/name), not to the local path {model!r}; drop it")
        return Resolved(model)
    try:
        import huggingface_hub
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        log.debug("huggingface_hub is not installed: %s stays a hub id", model)
        return Resolved(model, model, revision, cached=False)
    try:
        path = huggingface_hub.snapshot_download(model, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError) as exc:
        log.debug("%s@%s is not in the local hub cache: %s", model, revision or "main", exc)
        return Resolved(model, model, revision, cached=False)
    return Resolved(str(path), model, revision)


def cache_dir() -> str:
    """The hub cache directory huggingface_hub reads (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME", "~/.cache/huggingface"), "hub")
    return str(constants.HF_HUB_CACHE)


def require_cached(resolved: Resolved) -> Resolved:
    """``resolved`` when it is a local directory; a hub id the cache does not hold raises ModelNotCached."""
    if not resolved.cached:
        raise ModelNotCached(resolved.path, resolved.revision, cache_dir())
    return resolved
