"""SGLang's model loader for weightcache: the way users turn it on, and a thin door into the core's mode runner.

``WeightcacheLoader`` subclasses SGLang's ``BaseModelLoader``; pass the class
itself as ``load_format`` or use ``--load-format weightcache`` (see
``weightcache.adapters.sglang.plugin``). SGLang is imported only when the
class is first looked up, so this module imports without SGLang.

``load_model`` puts SGLang's configuration objects into a LoadRequest and
calls ``weightcache.core.flow.modes.run`` with the options of
``--model-loader-extra-config`` (``mode``, ``socket_dir``, ``strict``,
``republish``, ``timeout_s``); the steps are the adapter's hooks
(``weightcache.adapters.sglang.hooks``). ``preloaded_weights_bytes`` tells
SGLang's memory profiler how much of the weights was resident before it took
its baseline (a mapped entry that this process did not create).
"""

from __future__ import annotations

import logging
import typing

from weightcache.adapters.engine_support import lazy_class

if typing.TYPE_CHECKING:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from torch import nn

    from weightcache.adapter import LoadRequest

log = logging.getLogger(__name__)

ADAPTER = "sglang"
CLASS_NAME = "WeightcacheLoader"
LOAD_FORMAT = "weightcache"
OPTIONS_WHERE = "--model-loader-extra-config"


def loader_class() -> type:
    """``WeightcacheLoader``, defined on first use (it subclasses SGLang's ``BaseModelLoader``)."""
    return lazy_class(globals(), CLASS_NAME, _build_class)


def __getattr__(name: str):
    if name == CLASS_NAME:
        return loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_class():
    # The annotations below are strings, spelled as in SGLang's BaseModelLoader, so the signatures compare equal.
    from sglang.srt.model_loader.loader import BaseModelLoader

    class WeightcacheLoader(BaseModelLoader):
        """Loads through weightcache; ``model_loader_extra_config`` takes ``mode`` (off, daemon, client), ``socket_dir``, ``strict``, ``republish``, ``timeout_s``."""

        def __init__(self, load_config: LoadConfig):
            from weightcache.engine import CacheOptions

            super().__init__(load_config)
            self.options = CacheOptions.from_mapping(load_config.model_loader_extra_config, OPTIONS_WHERE)
            self.preloaded_weights_bytes = 0

        def download_model(self, model_config: ModelConfig) -> None:
            from sglang.srt.model_loader.loader import get_model_loader

            from weightcache.adapters.sglang.engine import plain_load_config

            get_model_loader(plain_load_config(self.load_config), model_config).download_model(model_config)

        def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
            return load_model(self, model_config=model_config, device_config=device_config)

    WeightcacheLoader.__qualname__ = CLASS_NAME  # importable (and picklable: ServerArgs travels to the schedulers) by name
    return WeightcacheLoader


def load_request(load_config: LoadConfig, model_config: ModelConfig, device_config: DeviceConfig) -> "LoadRequest":
    """The LoadRequest for SGLang's objects, which travel in its ``state``; refuses an unvalidated method first.

    ``model`` is the local checkpoint directory: for a hub name SGLang's
    downloader fetches the safetensors files first (the fingerprint reads them),
    after that refusal.
    """
    from weightcache.adapter import LoadRequest
    from weightcache.adapters.sglang import identity
    from weightcache.adapters.sglang.engine import STATE_KEY, EngineObjects

    identity.quantization(model_config)  # refuse before anything else (describe checks again, in the core's flow)
    configs = EngineObjects.of_engine(load_config, model_config, device_config)
    return LoadRequest(
        model=identity.checkpoint_dir(model_config, configs.load_config),
        adapter=ADAPTER,
        dtype=str(model_config.dtype),
        device=identity.device_name(device_config),
        parallel=configs.ranks.parallel,
        state={STATE_KEY: configs},
    )


def load_model(loader: typing.Any, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
    """The body of ``WeightcacheLoader.load_model``: the core's mode runner; sets ``loader.preloaded_weights_bytes``.

    ``loader`` is typed Any: its class is defined on first use (``loader_class``).
    """
    from weightcache.engine import run

    loader.preloaded_weights_bytes = 0
    from weightcache.adapters import engine_refit, engine_state

    request = load_request(loader.load_config, model_config, device_config)
    loaded = run(request, loader.options)
    engine_refit.remember(loaded.model, request)  # the refit's weight loader builds versions for this rank with it
    loader.preloaded_weights_bytes = loaded.external_bytes
    engine_state.keep(loaded.fingerprint, ADAPTER)  # before SGLang compiles (--enable-torch-compile)
    log.info(
        "weightcache: %s from %s in %s",
        model_config.model_path,
        loaded.source,
        ", ".join(f"{key} {value:.2f} s" for key, value in loaded.timings.items()),
    )
    return loaded.model
