"""vLLM's own steps behind the adapter's hooks.

- load: ``DefaultModelLoader.create_model`` on the target device, vLLM's
  per-layer gate for pre-processed weights, ``load_weights`` (as vLLM's
  ``DefaultModelLoader.load_model`` and its weight-cache daemon do);
- post-process: vLLM's ``process_weights_after_loading``;
- rebind: as vLLM's ``IpcModelLoader``: ``initialize_model`` on the meta device,
  the mapped tensors it has a place for bound in, ``process_weights_after_loading``
  again under ``weights_already_processed()`` (quant methods rebuild only
  Python-side state), then every cached tensor bound. Tensors that
  post-processing makes or stamps even for pre-processed weights (MLA's
  ``W_UV``/``W_UK_T``, which it recomputes and ``copy_``s into place; the
  attention scales) are private while it runs and mapped afterwards: no
  engine writes into the shared, read-only arenas (``no_writes_into`` turns
  any other attempt into an error naming the tensor).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import typing

from weightcache.adapters.engine_support import HeldReferences, isolated, no_writes_into

if typing.TYPE_CHECKING:
    import torch

    from weightcache.adapter import Manifest
    from weightcache.adapters.vllm.engine import EngineObjects, LoadConfig, ModelConfig

log = logging.getLogger(__name__)

# vllm.model_executor.model_loader.default_loader.DefaultModelLoader; vLLM is imported inside functions only.
DefaultModelLoader = typing.Any

MODEL_ATTRS_KEY = "vllm_model_attrs"
"""Manifest extra: Python-side flags vLLM's weight loading sets on the model (EAGLE ownership), as vLLM's daemon ships them."""


def plain_load_config(load_config: "LoadConfig") -> "LoadConfig":
    """``load_config`` for vLLM's default loader: format ``auto``, none of weightcache's keys."""
    return dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})


def plain_loader(load_config: "LoadConfig") -> DefaultModelLoader:
    """vLLM's ``DefaultModelLoader`` for ``load_config`` (the ``auto`` load format)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    return DefaultModelLoader(plain_load_config(load_config))


def rope_table() -> dict:
    """vLLM's process-wide cache of rotary embeddings (a private name: ``internals.ROPE_CACHE``)."""
    from weightcache.adapters.vllm.internals import ROPE_CACHE

    return ROPE_CACHE.lookup()


def load(objects: "EngineObjects") -> "torch.nn.Module":
    """vLLM's model on the target device with the checkpoint's weights, before post-processing."""
    plain = plain_loader(objects.vllm_config.load_config)
    with objects.registrations.recorded():
        return _build(objects, plain, lambda model: plain.load_weights(model, objects.model_config))


def load_tensors(objects: "EngineObjects", tensors: "typing.Mapping[str, torch.Tensor]") -> "torch.nn.Module":
    """vLLM's model on the target device holding ``tensors`` (named as the checkpoint's), before post-processing.

    The model's own ``load_weights`` takes them as it takes the checkpoint's (sharding for this rank, fusing q/k/v and
    gate/up), so post-processing runs on exactly what a load from files gives it. The build registers nothing in the
    config's forward context: it may run beside the engine's running model, whose layers hold those names.
    """
    forward_context = objects.vllm_config.compilation_config.static_forward_context
    with isolated(forward_context):
        return _build(
            objects, plain_loader(objects.vllm_config.load_config), lambda model: _load_all(model, tensors, objects.model_config)
        )


def _load_all(model: "torch.nn.Module", tensors: "typing.Mapping[str, torch.Tensor]", model_config: "ModelConfig") -> None:
    """``model.load_weights`` of ``tensors``; as vLLM's default loader, an unquantized model must get every parameter."""
    loaded = typing.cast(typing.Any, model).load_weights(iter(tensors.items()))  # every vLLM model defines it
    if loaded is None or model_config.quantization is not None:
        return
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        raise ValueError(f"{len(missing)} parameters got no tensor, e.g. {missing[0]!r}; give every tensor the checkpoint has")


def _build(
    objects: "EngineObjects", plain: DefaultModelLoader, fill: "typing.Callable[[torch.nn.Module], None]"
) -> "torch.nn.Module":
    """vLLM's model created by ``plain`` on the target device (vLLM's per-layer gate for pre-processed weights
    passed), ``fill``ed. One loader per load: the drift check counts the loaders the replay makes."""
    import torch
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = objects.model_config
    with objects.current(), isolated(rope_table()):
        with set_default_torch_dtype(model_config.dtype):
            with torch.device(objects.device):
                model = plain.create_model(vllm_config=objects.vllm_config, model_config=model_config, prefix=objects.prefix)
            check_pre_processed_support(model, model_config)
            fill(model)
    gc.collect()
    if objects.device.type != "cpu":
        torch.accelerator.empty_cache()  # as vLLM does before post-processing
    return model


def post_process(objects: "EngineObjects", model: "torch.nn.Module") -> "torch.nn.Module":
    """vLLM's ``process_weights_after_loading``: the final tensors an engine computes with."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    with objects.current(), set_default_torch_dtype(objects.model_config.dtype):
        process_weights_after_loading(model, objects.model_config, objects.device)
    return model.eval()


def forget_published(objects: "EngineObjects") -> None:
    """Drop the published model's entries from vLLM's per-config tables (its tensors are gone to the arenas)."""
    objects.registrations.forget()


def rebind(objects: "EngineObjects", tensors: "dict[str, torch.Tensor]", manifest: "Manifest") -> "torch.nn.Module":
    """vLLM's model on the meta device, bound to the mapped tensors and post-processed as pre-processed weights."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.model_executor.utils import weights_already_processed
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weightcache.adapter import check_no_meta, rebind_module

    model_config, device = objects.model_config, objects.device
    with objects.current(), isolated(rope_table()), set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"):
            model = initialize_model(vllm_config=objects.vllm_config, model_config=model_config, prefix=objects.prefix)
        check_pre_processed_support(model, model_config)
        held = HeldReferences.of(model)
        rebind_module(model, tensors, skeleton_part(model, manifest), device=device, check=False)
        privatize_scalar_buffers(model)
        for name, value in manifest.extra.get(MODEL_ATTRS_KEY, {}).items():
            setattr(model, name, value)
        with no_writes_into(tensors, manifest, "vLLM's process_weights_after_loading"), weights_already_processed():
            process_weights_after_loading(model, model_config, device)
        # Now every tensor the cache holds, including those post-processing just made or stamped in private memory.
        rebind_module(model, tensors, manifest, device=device, check=False)
        drop_consumed(model)
        held.point_at_bound(model)
    check_no_meta(model)
    return model.eval()


def skeleton_part(model: "torch.nn.Module", manifest: "Manifest") -> "Manifest":
    """The part of the manifest the freshly built model has a place for; the rest is what post-processing makes
    (bound only after it ran, so that it never writes into mapped memory)."""
    import attrs

    from weightcache.adapter import tensor_attributes

    present = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    present |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    present |= {name for name, _, _, _ in tensor_attributes(model)}
    records = [record for record in manifest.tensors if record.name in present]
    names = {record.name for record in records}
    aliases = {alias: target for alias, target in manifest.aliases.items() if target in names}
    return attrs.evolve(manifest, tensors=records, aliases=aliases)


def privatize_scalar_buffers(model: "torch.nn.Module") -> int:
    """Give this engine its own copy of every one-element buffer; returns how many.

    The arenas are mapped read-only: no engine may write weights others share.
    vLLM's attention post-processing stamps its q/k/v/prob scales in place
    (``set_default_quant_scales``) even for pre-processed weights, so those
    scalars are private while it runs (they are bound to the mapped ones afterwards).
    """
    count = 0
    for module in model.modules():
        for leaf, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type != "meta" and buffer.numel() <= 1:
                module._buffers[leaf] = buffer.clone()
                count += 1
    return count


def drop_consumed(model: "torch.nn.Module") -> list[str]:
    """Set to None the parameters and buffers still on meta: the cache lacks them because the publishing side's
    post-processing consumed them (as the disk load does); returns their names.

    vLLM's own ``IpcModelLoader`` fills them with uninitialised memory instead;
    None matches what the disk-loaded model holds and is never read by mistake.
    """
    dropped = []
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for leaf, tensor in list(table.items()):
                if tensor is not None and tensor.device.type == "meta":
                    table[leaf] = None
                    dropped.append(f"{module_name}.{leaf}" if module_name else leaf)
    if dropped:
        log.debug("weightcache: %d tensors consumed by post-processing are not cached: %s", len(dropped), ", ".join(dropped[:8]))
    return dropped


def check_pre_processed_support(model: "torch.nn.Module", model_config: "ModelConfig") -> None:
    """vLLM's own per-layer gate: every quant method must accept pre-processed weights."""
    from vllm.model_executor.model_loader.weight_cache.protocol import UnsupportedQuantForIPCError, check_ipc_quant_support

    from weightcache.adapter import UnsupportedQuantization

    try:
        check_ipc_quant_support(model)
    except UnsupportedQuantForIPCError as exc:
        raise UnsupportedQuantization(model_config.quantization or "none", str(exc)) from None
