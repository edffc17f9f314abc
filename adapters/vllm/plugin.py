"""The ``vllm.general_plugins`` entry point: registers the ``weightcache`` load format in each vLLM process."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """Register ``WeightcacheModelLoader`` as load format ``weightcache`` (idempotent: vLLM calls this in every process)."""
    from vllm.model_executor import model_loader

    from weightcache.adapters.vllm.loader import LOAD_FORMAT, loader_class

    cls = loader_class()
    registered = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if registered.get(LOAD_FORMAT) is cls:
        return
    model_loader.register_model_loader(LOAD_FORMAT)(cls)
    log.debug("weightcache: registered vLLM load format %r", LOAD_FORMAT)
