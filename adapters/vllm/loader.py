"""vLLM's model loader for ``--load-format weightcache``: vLLM's own load, published; or vLLM's meta model, rebound.

``WeightcacheModelLoader`` subclasses vLLM's ``BaseModelLoader``. vLLM is
imported only when the class is first looked up (``loader.WeightcacheModelLoader``),
so this module imports without vLLM. Options come from
``--model-loader-extra-config`` (see ``weightcache.adapters.engine_modes.LoaderOptions``).

- ``off``: vLLM's ``DefaultModelLoader``, untouched.
- ``daemon``: if the server has no entry for this rank, load exactly as
  vLLM's own weight-cache daemon does (``create_model``, ``load_weights``,
  ``process_weights_after_loading``), publish every final parameter and
  buffer, then continue as a client.
- ``client``: build the model on the meta device as vLLM's ``IpcModelLoader``
  does, rebind it to the mapped tensors, re-run ``process_weights_after_loading``
  under ``weights_already_processed()`` (quant methods rebuild only their
  Python-side state) and materialise what post-processing consumed, as vLLM does.
"""

import dataclasses
import logging

from weightcache.adapters import engine_modes
from weightcache.adapters.vllm import identity

log = logging.getLogger(__name__)

LOAD_FORMAT = "weightcache"
CLASS_NAME = "WeightcacheModelLoader"
MODEL_ATTRS_KEY = "vllm_model_attrs"
"""Manifest extra: Python-side flags vLLM's weight loading sets (EAGLE ownership), as vLLM's daemon ships them."""


def loader_class():
    """``WeightcacheModelLoader``, defined on first use (it subclasses vLLM's ``BaseModelLoader``)."""
    return engine_modes.lazy_class(globals(), CLASS_NAME, _build_class)


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

    class WeightcacheModelLoader(BaseModelLoader):
        """Loads through weightcache: ``--load-format weightcache --model-loader-extra-config '{"mode": "client"}'``."""

        def __init__(self, load_config: LoadConfig):
            super().__init__(load_config)
            self.options = engine_modes.LoaderOptions.from_extra_config(load_config.model_loader_extra_config, LOAD_FORMAT)

        def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
            """Bytes of this rank's weights (target and draft) the server already holds: mapped, not allocated here."""
            return external_weight_memory(self, vllm_config)

        def download_model(self, model_config: ModelConfig) -> None:
            plain_loader(self.load_config).download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
            """In-place reload through vLLM's default loader; refused for a model that maps a cached entry."""
            engine_modes.refuse_reload(model)
            plain_loader(self.load_config).load_weights(model, model_config)

        def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
            return load_model(self, vllm_config, model_config, prefix)

    WeightcacheModelLoader.__qualname__ = CLASS_NAME  # importable (and picklable) as loader.WeightcacheModelLoader
    return WeightcacheModelLoader


def plain_load_config(load_config):
    """``load_config`` for vLLM's default loader: format ``auto``, none of weightcache's keys."""
    return dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})


def plain_loader(load_config):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return DefaultModelLoader(plain_load_config(load_config))


def target_device(load_config, vllm_config):
    """The device vLLM loads onto, with its index (``cuda:N``)."""
    import torch

    device = torch.device(vllm_config.device_config.device if load_config.device is None else load_config.device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    return device


def load_model(loader, vllm_config, model_config, prefix: str = ""):
    """The body of ``WeightcacheModelLoader.load_model``."""
    options = loader.options
    plain = plain_loader(loader.load_config)

    def disk_load():
        return plain.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

    if options.mode == "off":
        return disk_load()
    identity.quantization(model_config)  # refuse before anything touches the checkpoint
    if vllm_config.parallel_config.enable_eplb:
        raise ValueError("weightcache does not support EPLB: it moves experts between ranks at run time")
    device = target_device(loader.load_config, vllm_config)
    fingerprint = identity.fingerprint(vllm_config, model_config, device=str(device))
    registrations = engine_modes.Registrations(registered_tables(vllm_config))

    def publish_load():
        with registrations.recorded():
            return daemon_load(plain, vllm_config, model_config, prefix, device)

    def rebuild(attachment):
        registrations.forget()  # the published model is gone: its layers and rotary caches go with it
        return rebuild_model(vllm_config, model_config, prefix, device, attachment)

    loaded = engine_modes.load(options, fingerprint, device=str(device), disk_load=disk_load, rebuild=rebuild,
                               publish_load=publish_load, label=label(model_config, fingerprint))
    log.info("weightcache: %s from %s in %s", model_config.model, loaded.source,
             ", ".join(f"{k} {v:.2f} s" for k, v in loaded.timings.items()))
    return loaded.model.eval()


def registered_tables(vllm_config) -> tuple[dict, ...]:
    """vLLM's process-wide tables a model build adds to: attention layers by name, cached rotary embeddings."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    return (vllm_config.compilation_config.static_forward_context, _ROPE_DICT)


def daemon_load(plain, vllm_config, model_config, prefix, device):
    """Load from disk exactly as vLLM's own weight-cache daemon does; returns the model and the manifest extra."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.utils import export_model_attrs
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(model_config.dtype):
        with torch.device(device):
            model = plain.create_model(vllm_config, model_config, prefix)
        check_pre_processed_support(model, model_config)
        plain.load_weights(model, model_config)
        process_weights_after_loading(model, model_config, device)
    return model.eval(), {MODEL_ATTRS_KEY: export_model_attrs(model)}


def rebuild_model(vllm_config, model_config, prefix, device, attachment):
    """vLLM's model on the meta device, rebound to the attachment, post-processed as pre-processed weights."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import _materialize_remaining_meta_tensors
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weightcache.core.rebind import check_no_meta, rebind_module

    with set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        check_pre_processed_support(model, model_config)
        rebind_module(model, attachment.tensors, attachment.manifest, device=device, check=False)
        privatize_scalar_buffers(model)
        for name, value in attachment.manifest.extra.get(MODEL_ATTRS_KEY, {}).items():
            setattr(model, name, value)
        with weights_already_processed():
            process_weights_after_loading(model, model_config, device)
        _materialize_remaining_meta_tensors(model, device)
    check_no_meta(model)
    return model


def privatize_scalar_buffers(model) -> int:
    """Give this engine its own copy of every one-element buffer; returns how many.

    The arenas are mapped read-only: no engine may write weights others share.
    vLLM's attention post-processing stamps its q/k/v/prob scales in place
    (``set_default_quant_scales``) even for pre-processed weights, so those
    scalars become private (a few bytes per layer) before it runs.
    """
    count = 0
    for module in model.modules():
        for leaf, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != "meta" and buffer.numel() <= 1:
                module._buffers[leaf] = buffer.clone()
                count += 1
    return count


def check_pre_processed_support(model, model_config) -> None:
    """vLLM's own per-layer gate: every quant method must accept pre-processed weights."""
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError, check_ipc_quant_support

    from weightcache.core.errors import UnsupportedQuantization

    try:
        check_ipc_quant_support(model)
    except UnsupportedQuantForIPCError as exc:
        raise UnsupportedQuantization(model_config.quantization or "none", str(exc)) from None


def external_weight_memory(loader, vllm_config) -> int:
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
    if loader.options.mode == "off":
        return 0
    device = target_device(loader.load_config, vllm_config)
    fingerprint = identity.fingerprint(vllm_config, model_config, device=str(device))
    return engine_modes.entry_bytes(fingerprint, loader.options.socket_dir, timeout_s=min(loader.options.timeout_s, 5.0))


def label(model_config, fingerprint) -> str:
    name = str(model_config.model).rstrip("/").rsplit("/", 1)[-1]
    quant = "" if fingerprint.quantization == "none" else f" {fingerprint.quantization}"
    draft = " draft" if fingerprint.extra.get("is_draft") else ""
    return f"{name} ({fingerprint.architecture}{quant}{draft}, tp{fingerprint.tp_rank}/{fingerprint.tp_size} pp{fingerprint.pp_rank}/{fingerprint.pp_size}, vllm)"
