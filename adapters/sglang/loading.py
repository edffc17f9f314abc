"""SGLang's own load, in two steps, and SGLang's meta-device model rebound to mapped tensors.

- ``load``: what ``DefaultModelLoader.load_model`` (the loader SGLang picks for
  ``--load-format auto``) does before post-processing: build the model on the
  target device and read the checkpoint into it (``model.load_weights``, where
  models run their own fix-ups, e.g. DeepSeek's MLA ``w_kc``/``w_vc``).
- ``post_process``: the rest of it, ``DefaultModelLoader.postprocess_weights``
  (every quant method's ``process_weights_after_loading``). The two together are
  SGLang's plain load, call for call.
- ``rebuild``: as SGLang's ``IpcModelLoader`` rebuilds a cached model: the model
  on the meta device, every tensor pointed at the mapped ones, no
  post-processing (the publisher ran it), stale views rebuilt, and the
  references modules keep in helper objects (MoE ``TopKConfig``'s
  correction bias) pointed at the bound tensors (``HeldReferences``).

Each model built here gets rotary-embedding modules of its own (see ``own_rope_cache``).
"""

from __future__ import annotations

import contextlib
import copy
import typing

from weightcache.adapters.engine_support import HeldReferences, isolated
from weightcache.adapters.sglang import internals

if typing.TYPE_CHECKING:
    import torch

    from weightcache.adapter import Manifest
    from weightcache.adapters.sglang.engine import EngineObjects

ModelLoader = typing.Any  # sglang.srt.model_loader.loader.DefaultModelLoader; SGLang is imported inside functions only


def own_rope_cache() -> contextlib.AbstractContextManager[None]:
    """Build with an empty rotary-embedding cache, then put SGLang's back as it was.

    SGLang caches rotary-embedding modules process-wide and hands the same
    module to every model that asks for the same parameters. Two models
    sharing one would share its ``cos_sin_cache``: publishing one (its tensors
    are freed as they are copied into arenas) or rebinding the other (the
    buffer is pointed at an arena) would change both.
    """
    return isolated(internals.ROPE_CACHE.lookup())


def default_loader(configs: "EngineObjects") -> ModelLoader:
    """The loader SGLang picks for ``--load-format auto``; RuntimeError unless it is ``DefaultModelLoader``.

    For the allowlisted methods (unquantized, block FP8) SGLang always picks
    it; others (ModelOpt, AutoRound, bitsandbytes) are refused before this.
    """
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    loader = get_model_loader(configs.load_config, configs.model_config)
    if type(loader) is not DefaultModelLoader:
        raise RuntimeError(
            f"SGLang picked {type(loader).__qualname__} for --load-format auto; weightcache's SGLang adapter loads "
            "through DefaultModelLoader only: load this model with mode 'off' (or without --load-format weightcache)"
        )
    return loader


def load(configs: "EngineObjects") -> "torch.nn.Module":
    """SGLang's model on its device with the checkpoint read into it, not yet post-processed."""
    return _build(configs, lambda loader, model: internals.ALL_WEIGHTS.lookup()(loader, configs.model_config, model))


def load_tensors(configs: "EngineObjects", tensors: "typing.Mapping[str, torch.Tensor]") -> "torch.nn.Module":
    """SGLang's model on its device holding ``tensors`` (named as the checkpoint's), not yet post-processed: the
    model's own ``load_weights`` takes them as it takes the checkpoint's (sharding, fusing, its fix-ups)."""
    return _build(configs, lambda loader, model: iter(tensors.items()))


def _build(
    configs: "EngineObjects", weights: "typing.Callable[[ModelLoader, torch.nn.Module], typing.Iterable]"
) -> "torch.nn.Module":
    """SGLang's model built on its device, ``weights(loader, model)`` (name, tensor) pairs loaded into it."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    loader = default_loader(configs)
    model_config, device_config = configs.model_config, configs.device_config
    with configs.as_rank():
        with own_rope_cache():
            model = loader.initialize_model_for_startup(model_config=model_config, device_config=device_config)
        with set_default_torch_dtype(model_config.dtype):
            loader.load_weights_only(model, weights(loader, model), _target_device(device_config))
    return model


def post_process(configs: "EngineObjects", model: "torch.nn.Module") -> "torch.nn.Module":
    """SGLang's post-processing of a loaded model (quant methods repack, quantize or derive scales), in eval mode."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with configs.as_rank(), set_default_torch_dtype(configs.model_config.dtype):
        DefaultModelLoader.postprocess_weights(model, _target_device(configs.device_config))
    return model.eval()


def rebind(
    configs: "EngineObjects", tensors: "dict[str, torch.Tensor]", manifest: "Manifest", device: "torch.device"
) -> "torch.nn.Module":
    """SGLang's model built on the meta device, every parameter, buffer and tensor attribute pointed at ``tensors``."""
    import torch

    from weightcache.adapter import rebind_module

    loader = default_loader(configs)
    on_meta = copy.copy(configs.device_config)  # SGLang's DeviceConfig accepts no "meta"; its loader reads only .device
    on_meta.device = torch.device("meta")
    with configs.as_rank():
        with own_rope_cache():
            model = loader.initialize_model_for_startup(model_config=configs.model_config, device_config=on_meta)
        held = HeldReferences.of(model)
        rebind_module(model, tensors, manifest, device=device)
        internals.REBUILD_STALE_VIEWS.lookup()(model)
        held.point_at_bound(model)
    return model.eval()


def _target_device(device_config) -> "torch.device":
    import torch

    return torch.device(device_config.device)
