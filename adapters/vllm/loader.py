"""``--load-format weightcache``: vLLM's model loader, through weightcache's one mode runner.

``WeightcacheModelLoader.load_model`` turns vLLM's objects into a
``LoadRequest`` for the ``vllm`` adapter (the checkpoint directory, dtype,
device, this rank's parallel groups; the objects themselves in
``request.state``) and calls ``weightcache.core.flow.modes.run`` with the
``CacheOptions`` read from ``--model-loader-extra-config``: off, daemon and
client, fallback, strict, server start, publish and re-publish are the core's.
What each step does inside vLLM is in ``weightcache.adapters.vllm.hooks``.
"""

import logging
import typing

from weightcache.adapters import engine_refit, engine_state, engine_support
from weightcache.adapters.vllm import identity
from weightcache.adapters.vllm.engine import STATE_KEY, EngineObjects, LoadConfig, ModelConfig, Ranks, VllmConfig

if typing.TYPE_CHECKING:
    import torch

    from weightcache.adapter import LoadRequest
    from weightcache.adapters.vllm.loading import DefaultModelLoader

log = logging.getLogger(__name__)

LOAD_FORMAT = "weightcache"
ADAPTER = "vllm"
CLASS_NAME = "WeightcacheModelLoader"
OPTIONS_WHERE = "--model-loader-extra-config"


def loader_class() -> type:
    """``WeightcacheModelLoader``, defined on first use (it subclasses vLLM's ``BaseModelLoader``)."""
    return engine_support.lazy_class(globals(), CLASS_NAME, _build_class)


def __getattr__(name: str):
    if name == CLASS_NAME:
        return loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_class():
    # No `from __future__ import annotations` in this module: the annotations below are the classes
    # themselves, as in vLLM's BaseModelLoader, so the signatures compare equal.
    from torch import nn
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from weightcache.engine import CacheOptions

    class WeightcacheModelLoader(BaseModelLoader):
        """Loads through weightcache: ``--load-format weightcache --model-loader-extra-config '{"mode": "client"}'``."""

        def __init__(self, load_config: LoadConfig):
            super().__init__(load_config)
            self.options = CacheOptions.from_mapping(load_config.model_loader_extra_config, OPTIONS_WHERE)

        def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
            """Bytes of this rank's weights (target and draft) the server already holds: mapped, not allocated here."""
            return external_weight_memory(self, vllm_config)

        def download_model(self, model_config: ModelConfig) -> None:
            plain_loader(self.load_config).download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
            """In-place reload through vLLM's default loader; refused for a model that maps a cached entry."""
            engine_support.refuse_reload(model)
            plain_loader(self.load_config).load_weights(model, model_config)

        def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
            return load_model(self, vllm_config, model_config, prefix)

    WeightcacheModelLoader.__qualname__ = CLASS_NAME  # importable (and picklable) as loader.WeightcacheModelLoader
    return WeightcacheModelLoader


def plain_loader(load_config: LoadConfig) -> "DefaultModelLoader":
    from weightcache.adapters.vllm.loading import plain_loader as build

    return build(load_config)


def target_device(load_config: LoadConfig, vllm_config: VllmConfig) -> "torch.device":
    """The device vLLM loads onto, with its index (``cuda:N``)."""
    import torch

    device = torch.device(vllm_config.device_config.device if load_config.device is None else load_config.device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    return device


def load_request(load_config: LoadConfig, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> "LoadRequest":
    """The ``LoadRequest`` of this rank: what the ``vllm`` adapter's hooks load, with vLLM's objects in its state."""
    from weightcache.adapter import LoadRequest

    device = target_device(load_config, vllm_config)
    ranks = Ranks.current()
    objects = EngineObjects(
        vllm_config, model_config, device, ranks, prefix=prefix, draft=identity.is_draft(vllm_config, model_config)
    )
    return LoadRequest(
        model=identity.checkpoint_dir(model_config, load_config),
        adapter=ADAPTER,
        dtype=str(model_config.dtype).removeprefix("torch."),
        device=str(device),
        parallel=ranks.parallel,
        state={STATE_KEY: objects},
    )


def load_model(loader: typing.Any, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> "torch.nn.Module":
    """The body of ``WeightcacheModelLoader.load_model``: the request through ``weightcache.core.flow.modes.run``.

    ``loader`` is typed Any: its class is defined on first use (``loader_class``).
    """
    from weightcache.engine import run

    request = load_request(loader.load_config, vllm_config, model_config, prefix)
    loaded = run(request, loader.options)
    engine_refit.remember(loaded.model, request)  # the worker extension builds versions for this rank with it
    engine_state.keep(loaded.fingerprint, ADAPTER)  # before vLLM's warm-up compiles
    log.info(
        "weightcache: %s from %s (%s) in %s",
        model_config.model,
        loaded.source,
        loaded.mode,
        ", ".join(f"{k} {v:.2f} s" for k, v in loaded.timings.items()),
    )
    return loaded.model.eval()


def external_weight_memory(loader: typing.Any, vllm_config: VllmConfig) -> int:
    """Bytes the server holds for this rank's target model and, if it loads through weightcache too, its draft."""
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.model_executor.model_loader.weight_cache.utils import is_draft_model_cacheable

    total = _entry_bytes(loader, vllm_config, vllm_config.model_config)
    spec = vllm_config.speculative_config
    if is_draft_model_cacheable(spec):
        draft_config = get_draft_load_config(vllm_config)
        if draft_config.load_format == LOAD_FORMAT:
            total += _entry_bytes(loader_class()(draft_config), vllm_config, spec.draft_model_config)
    return total


def _entry_bytes(loader, vllm_config, model_config) -> int:
    from weightcache.engine import prepare

    if loader.options.mode == "off":
        return 0
    fingerprint = prepare(load_request(loader.load_config, vllm_config, model_config)).fingerprint
    return engine_support.entry_bytes(fingerprint, loader.options.socket_dir, timeout_s=min(loader.options.timeout_s, 5.0))
