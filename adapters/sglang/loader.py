"""SGLang's model loader for weightcache: SGLang's own load, published; or SGLang's meta model, rebound.

``WeightcacheLoader`` subclasses SGLang's ``BaseModelLoader``; pass the class
itself as ``load_format`` or use ``--load-format weightcache`` (see
``weightcache.adapters.sglang.plugin``). SGLang is imported only when the
class is first looked up, so this module imports without SGLang. Options come
from ``--model-loader-extra-config`` (see ``weightcache.adapters.engine_modes.LoaderOptions``).

- ``off``: SGLang's loader for ``--load-format auto``, untouched.
- ``daemon``: if the server has no entry for this rank, load with that
  loader (reading, sharding, post-processing), publish every final parameter
  and buffer, then continue as a client.
- ``client``: build the model on the meta device as SGLang's ``IpcModelLoader``
  does, rebind it to the mapped tensors (nothing may stay on meta), skip
  post-processing as SGLang does for cached weights, and rebuild the tensor
  views some modules keep as plain attributes.

``preloaded_weights_bytes`` tells SGLang's memory profiler how much of the
weights was resident before it took its baseline (a mapped entry that this
process did not create).
"""

from __future__ import annotations

import dataclasses
import logging
import typing

from weightcache.adapters import engine_modes
from weightcache.adapters.sglang import identity

if typing.TYPE_CHECKING:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from torch import nn

log = logging.getLogger(__name__)

CLASS_NAME = "WeightcacheLoader"
LOAD_FORMAT = "weightcache"


def loader_class():
    """``WeightcacheLoader``, defined on first use (it subclasses SGLang's ``BaseModelLoader``)."""
    return engine_modes.lazy_class(globals(), CLASS_NAME, _build_class)


def __getattr__(name: str):
    if name == CLASS_NAME:
        return loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_class():
    # The annotations below are strings, spelled as in SGLang's BaseModelLoader, so the signatures compare equal.
    from sglang.srt.model_loader.loader import BaseModelLoader

    class WeightcacheLoader(BaseModelLoader):
        """Loads through weightcache; ``model_loader_extra_config`` takes ``mode`` (off, daemon, client), ``socket_dir``, ``strict``."""

        def __init__(self, load_config: LoadConfig):
            super().__init__(load_config)
            self.options = engine_modes.LoaderOptions.from_extra_config(load_config.model_loader_extra_config, LOAD_FORMAT)
            self.preloaded_weights_bytes = 0

        def download_model(self, model_config: ModelConfig) -> None:
            plain_loader(self.load_config, model_config).download_model(model_config)

        def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
            return load_model(self, model_config=model_config, device_config=device_config)

    WeightcacheLoader.__qualname__ = CLASS_NAME  # importable (and picklable: ServerArgs travels to the schedulers) by name
    return WeightcacheLoader


def plain_load_config(load_config):
    """``load_config`` for SGLang's ``auto`` format, without weightcache's keys."""
    from sglang.srt.configs.load_config import LoadFormat

    return dataclasses.replace(load_config, load_format=LoadFormat.AUTO, model_loader_extra_config={})


def plain_loader(load_config, model_config):
    """The loader SGLang picks for ``--load-format auto`` and this model."""
    from sglang.srt.model_loader.loader import get_model_loader

    return get_model_loader(plain_load_config(load_config), model_config)


def load_model(loader, *, model_config, device_config):
    """The body of ``WeightcacheLoader.load_model``; sets ``loader.preloaded_weights_bytes``."""
    options = loader.options
    loader.preloaded_weights_bytes = 0

    def disk_load():
        return plain_loader(loader.load_config, model_config).load_model(model_config=model_config, device_config=device_config)

    if options.mode == "off":
        return disk_load()
    identity.quantization(model_config)  # refuse before anything touches the checkpoint
    device = identity.device_name(device_config)
    fingerprint = identity.fingerprint(model_config, loader.load_config, device=device)
    registrations = engine_modes.Registrations(registered_tables())

    def publish_load():
        with registrations.recorded():
            return disk_load(), {}

    def rebuild(attachment):
        registrations.forget()  # the published model is gone: its rotary caches go with it
        return rebuild_model(loader.load_config, model_config, device, attachment)

    loaded = engine_modes.load(options, fingerprint, device=device, disk_load=disk_load, rebuild=rebuild,
                               publish_load=publish_load, label=label(model_config, fingerprint))
    loader.preloaded_weights_bytes = loaded.external_bytes
    log.info("weightcache: %s from %s in %s", model_config.model_path, loaded.source,
             ", ".join(f"{k} {v:.2f} s" for k, v in loaded.timings.items()))
    return loaded.model.eval()


def registered_tables() -> tuple[dict, ...]:
    """SGLang's process-wide table a model build adds to: cached rotary embeddings."""
    from sglang.srt.layers.rotary_embedding.factory import _ROPE_DICT

    return (_ROPE_DICT,)


def rebuild_model(load_config, model_config, device: str, attachment):
    """SGLang's model on the meta device, rebound to the attachment, as SGLang's IpcModelLoader rebuilds it."""
    import torch
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.weight_cache.ipc_loader import IpcModelLoader

    from weightcache.core.rebind import rebind_module

    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"):
            model = _initialize_model(model_config, load_config, quant_config)
    rebind_module(model, attachment.tensors, attachment.manifest, device=device)
    # SGLang skips post-processing for cached weights: the publisher ran it.
    IpcModelLoader._rebuild_stale_views(model)
    return model


def label(model_config, fingerprint) -> str:
    name = str(model_config.model_path).rstrip("/").rsplit("/", 1)[-1]
    quant = "" if fingerprint.quantization == "none" else f" {fingerprint.quantization}"
    return f"{name} ({fingerprint.architecture}{quant}, tp{fingerprint.tp_rank}/{fingerprint.tp_size} pp{fingerprint.pp_rank}/{fingerprint.pp_size}, sglang)"
