"""The ``vllm.general_plugins`` entry point: registers the ``weightcache`` load format in each vLLM process."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register() -> None:
    """Register ``WeightcacheModelLoader`` as load format ``weightcache`` (idempotent: vLLM calls this in every process)."""
    from vllm.model_executor.model_loader import register_model_loader

    from weightcache.adapters.vllm.loader import LOAD_FORMAT, loader_class

    cls = loader_class()
    if registered_class(LOAD_FORMAT) is cls:
        return
    register_model_loader(LOAD_FORMAT)(cls)
    log.debug("weightcache: registered vLLM load format %r", LOAD_FORMAT)


def registered_class(load_format: str) -> type | None:
    """The loader class vLLM has for ``load_format``, or None, asked through vLLM's public ``get_model_loader``."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    try:
        return type(get_model_loader(LoadConfig(load_format=load_format)))
    except ValueError:  # "Load format ... is not supported"
        return None
