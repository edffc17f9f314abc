"""Building transformers models: from disk (plain, or stored quantized) and as meta skeletons."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import typing

from weightcache.adapter import RebindError, UnsupportedQuantization, check_no_meta, meta_parameters, to_dtype
from weightcache.adapters.hf import identity, layout, layout_process
from weightcache.adapters.hf.identity import load_dtype, model_class
from weightcache.adapters.hf.layout_key import layout_key

if typing.TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from weightcache.adapter import ArenaBuilder, LoadRequest, Manifest, ModelDescription

log = logging.getLogger(__name__)


PREQUANTIZED_ATTR = "_weightcache_prequantized"
"""Set on a model loaded from a block-FP8 checkpoint as it is stored (post-processing must not quantize it again)."""


def _hf_config(request, drop_quantization: bool):
    config = identity.transformers_module().AutoConfig.from_pretrained(request.model)
    if drop_quantization and hasattr(config, "quantization_config"):
        # the registered method's own layers replace transformers' quantizer.
        del config.quantization_config
    return config


def load(request: "LoadRequest", builder: "ArenaBuilder | None" = None) -> "torch.nn.Module":
    """The model from disk, on ``request.device``, in eval mode.

    With an arena ``builder`` and a checkpoint whose tensors are exactly the
    model's (names, shapes, dtypes), the bytes are read straight into the
    arenas; otherwise transformers loads the model and export copies it.
    """
    config = identity.read_config(request.model, request.revision)
    if _stored_quantized(config):
        return load_stored_quantized(request, config)
    if builder is not None and request.quantization in (None, "none"):
        model = load_into_arenas(request, config, builder)
        if model is not None:
            return model
    return _through_transformers(request, config)


def _through_transformers(
    request: "LoadRequest", config: dict, state: "dict[str, torch.Tensor] | None" = None
) -> "torch.nn.Module":
    """transformers' own load (its renaming, fused experts, casts) of the checkpoint's files, or of ``state`` named as
    they name their tensors."""
    cls = model_class(request, config)
    kwargs: dict[str, typing.Any] = {"dtype": load_dtype(request, config), "revision": request.revision}
    if request.is_cuda:
        kwargs["device_map"] = request.device.torch()
    if state is None:
        model = cls.from_pretrained(request.model, **kwargs)
    else:
        model = cls.from_pretrained(None, config=_hf_config(request, drop_quantization=False), state_dict=state, **kwargs)
    return model.eval()


def load_into_arenas(request: "LoadRequest", config: dict, builder: "ArenaBuilder") -> "torch.nn.Module | None":
    """The model with its weights read from the files straight into ``builder``'s arenas, or None.

    None means the checkpoint needs transformers' own loading (renamed keys,
    fused experts, a dtype cast): then ``builder`` is empty again. The meta
    skeleton is built (transformers imports the model's module, seconds on a
    cold interpreter) while the files are read, and its layout remembered; where
    this architecture's layout is remembered (``layout``), a plain module tree
    built from it stands in for the skeleton and transformers is not imported.
    A checkpoint that stores no floating tensor in the model's dtype is turned
    away before any weight is read.
    """
    import concurrent.futures

    from weightcache.adapter import checkpoint_tensors, default_store, importing, read_checkpoint

    dtype = load_dtype(request, config)
    wanted_dtype = identity.load_dtype_name(request, config)  # the dtype's name, as the warm-up names its layout entry
    floating = [info.dtype for info in checkpoint_tensors(request.model) if _is_floating(info.dtype)]
    if floating and wanted_dtype not in floating:  # a cast: a model kept partly in float32 still gets read
        log.debug("checkpoint stores %s, not %s; loading through transformers", floating[0], wanted_dtype)
        return None
    store = default_store()
    key = layout_key(request, config, wanted_dtype)
    known = layout.remembered(store, key)
    child = layout_process.take(key) if known is None else None  # the warm-up's process learning the layout
    began = time.monotonic()
    # Without a warm-up before (the Python API), the skeleton's thread imports transformers during the read.
    imports = known is None and child is None and "transformers.modeling_utils" not in sys.modules
    with (
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightcache-skeleton") as pool,
        importing() if imports else contextlib.nullcontext(),
    ):
        building = pool.submit(_model_for, known, request, dtype, child)
        placed = read_checkpoint(request.model, builder)
        read_s = time.monotonic() - began
        model, learned = building.result()
    log.debug(
        "read the files in %.2f s; the %s was ready %.2f s later",
        read_s,
        "remembered layout" if known else ("layout process's layout" if isinstance(model, layout.LayoutModel) else "skeleton"),
        time.monotonic() - began - read_s,
    )
    if known is not None:
        try:
            if _matches(model, placed):
                return _bound(model, placed, builder, request)
        except RebindError as exc:
            log.debug("the remembered layout left %s", exc)
        log.info("the remembered layout of %s does not fit this checkpoint; building its skeleton", known.class_name)
        model, learned = _model_for(None, request, dtype)
    if not _matches(model, placed):
        log.debug("checkpoint does not match the model one to one; loading through transformers")
        builder.reset()
        return None
    model = _bound(model, placed, builder, request)
    if learned is not None:
        store.write_entry(key, learned.to_json())  # the next load of this architecture needs no transformers
    return model


Model = typing.Union["PreTrainedModel", "layout.LayoutModel"]
"""What a one-to-one load binds the checkpoint's bytes into: the meta skeleton, or a module tree built from its layout."""


def _model_for(
    known: "layout.Layout | None",
    request: "LoadRequest",
    dtype: "torch.dtype",
    child: "layout_process.LayoutProcess | None" = None,
) -> "tuple[Model, layout.Layout | None]":
    """The module tree of ``known``; else that of the layout ``child`` learned; else the tied meta skeleton; with the
    layout to remember (taken before any slot is bound; None for ``known``)."""
    if known is not None:
        return known.build(), None
    learned = child.result() if child is not None else None
    if learned is not None:
        return learned.build(), learned
    return skeleton_and_layout(request, dtype)


def skeleton_and_layout(request: "LoadRequest", dtype: "torch.dtype") -> "tuple[PreTrainedModel, layout.Layout | None]":
    """The tied meta skeleton and its layout (None where a plain module tree would not rebuild it): what a load binds
    on first sight, and what the layout process prints."""
    model, ties = _tied_skeleton(request, dtype)
    return model, layout.Layout.of_model(model, ties)


def _matches(model: "torch.nn.Module", placed: dict) -> bool:
    """Whether the checkpoint's tensors are exactly the model's (names, shapes, dtypes; none missing, no tied name
    stored: a tied weight stored on its own is transformers' call, it unties the two when their values differ)."""
    wanted = dict(model.state_dict(keep_vars=True))
    stored = {name: info for name, (info, _slot) in placed.items()}
    ties = {name for name, p in model.named_parameters(remove_duplicate=False)} - {name for name, _ in model.named_parameters()}
    fits = set(stored) <= set(wanted) and all(
        tuple(wanted[n].shape) == info.shape and str(wanted[n].dtype).removeprefix("torch.") == info.dtype
        for n, info in stored.items()
    )
    missing = [n for n in wanted if n not in stored and n not in ties and wanted[n].device.type == "meta"]
    return fits and not missing and not ties & set(stored)


def _bound(model: Model, placed: dict, builder: "ArenaBuilder", request: "LoadRequest") -> Model:
    """``model`` with every stored tensor bound to its arena bytes, tied, its buffers on the device; RebindError if
    anything is left on meta."""
    import torch

    views = {name: builder.view(slot).view(getattr(torch, info.dtype)).view(info.shape) for name, (info, slot) in placed.items()}
    model = _bind(model, views, request)
    log.info("read %d tensors straight into arenas", len(placed))
    return model


def _bind(model: Model, tensors: "typing.Mapping[str, torch.Tensor]", request: "LoadRequest") -> Model:
    """``model`` with each of ``tensors`` (final dtype, on the device) as its parameter or buffer of that name, tied, its
    buffers on the device; RebindError if anything is left on meta."""
    import torch

    for name, tensor in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor
    model.tie_weights()
    _buffers_to(model, request.device.torch())
    check_no_meta(model)
    return model.eval()


def load_tensors(request: "LoadRequest", tensors: "typing.Mapping[str, torch.Tensor]") -> "torch.nn.Module":
    """The model built from ``tensors`` named as the checkpoint's (a trainer's state dict), as ``load`` builds it from files.

    Each tensor is bound as it is where it already has the model's dtype and device (a view of the new version's
    arenas, or the trainer's own tensor: export copies that one), else a converted copy is bound; the caller's
    tensors are never changed. Tensors that do not fit the model one to one (renamed keys, experts transformers fuses,
    buffers it ignores) go through transformers' own loading, as the files would. A checkpoint stored quantized (block FP8) has its
    tensors bound as it stores them, never re-quantized.
    """
    config = identity.read_config(request.model, request.revision)
    if _stored_quantized(config):
        return _prequantized(request, config, dict(tensors))
    from weightcache.adapter import default_store

    dtype = load_dtype(request, config)
    store = default_store()
    key = layout_key(request, config, identity.load_dtype_name(request, config))
    known = layout.remembered(store, key)  # a plain module tree stands in for the skeleton (its Linear layers are Linear)
    if known is not None:
        try:
            return _bind_tensors(known.build(), tensors, request)
        except RebindError as exc:
            log.debug("the remembered layout left %s; building the skeleton", exc)
    try:
        model, learned = _model_for(None, request, dtype)
        bound = _bind_tensors(model, tensors, request)
        if known is None and learned is not None:
            store.write_entry(key, learned.to_json())  # the next version of this model needs no skeleton
        return bound
    except RebindError as exc:  # renamed keys, fused experts, ignored buffers: what transformers' loading resolves
        log.debug("the tensors do not fit the model one to one (%s); loading them through transformers", exc)
        return _through_transformers(request, config, dict(tensors))


def _bind_tensors(model: Model, tensors: "typing.Mapping[str, torch.Tensor]", request: "LoadRequest") -> Model:
    """``model`` (on meta, tied) holding ``tensors``, each converted to its parameter's dtype and device where it differs."""
    wanted = dict(model.state_dict(keep_vars=True))
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {name for name, _ in model.named_parameters()}
    unknown = [name for name in tensors if name not in wanted or name in tied]
    missing = [name for name, t in wanted.items() if name not in tensors and name not in tied and t.device.type == "meta"]
    if unknown or missing:
        what = f"tensor {unknown[0]!r} is not one of the model's" if unknown else f"tensor {missing[0]!r} is missing"
        raise RebindError(f"{type(model).__name__}: {what}; give the tensors as the checkpoint names them")
    device = request.device.torch()
    bound = {}
    for name, tensor in tensors.items():
        target = wanted[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise RebindError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model's {tuple(target.shape)}")
        value = tensor.detach()
        if value.dtype != target.dtype or value.device != device:
            value = value.to(device=device, dtype=target.dtype if value.dtype.is_floating_point else value.dtype, copy=True)
        bound[name] = value
    return _bind(model, bound, request)


def _tied_skeleton(request: "LoadRequest", dtype: "torch.dtype") -> "tuple[PreTrainedModel, list[tuple[str, str]]]":
    """The meta skeleton, tied on meta (that shows which names tying would overwrite), and the ties ``tie_weights``
    made: (parameter name, the name whose parameter it now is)."""
    model = skeleton(request, drop_quantization=False, dtype=dtype)
    before = {name: id(param) for name, param in model.named_parameters(remove_duplicate=False)}
    model.tie_weights()
    first: dict[int, str] = {}
    ties = []
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
        if id(param) != before.get(name) and first[id(param)] != name:
            ties.append((name, first[id(param)]))
    return model, ties


def _is_floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _stored_quantized(config: dict) -> bool:
    """Whether the checkpoint stores its weights in a registered method (block FP8: weights and ``weight_scale_inv``)."""
    from weightcache.adapter import quantization_names

    stored = identity.checkpoint_quantization(config)
    return stored != "none" and stored in quantization_names()


def load_stored_quantized(request: "LoadRequest", config: dict) -> "torch.nn.Module":
    """A checkpoint stored quantized (block FP8: weights and ``weight_scale_inv``): bind its tensors, never quantize."""
    import safetensors.torch

    from weightcache.adapter import checkpoint_files

    device = request.device.torch()
    tensors = {}
    for file in checkpoint_files(request.model):
        tensors.update(safetensors.torch.load_file(file, device=str(device)))  # this safetensors takes a name, not a torch.device
    return _prequantized(request, config, tensors)


def _prequantized(request: "LoadRequest", config: dict, tensors: "dict[str, torch.Tensor]") -> "torch.nn.Module":
    """The model holding a quantized checkpoint's ``tensors`` as they are stored (block FP8: weights and
    ``weight_scale_inv``), bound by the method the checkpoint declares."""
    from weightcache.adapter import quantization_method

    method = quantization_method(identity.checkpoint_quantization(config))
    method_config = identity.quantization_config(config, None, dict(request.options))
    model = skeleton(request, drop_quantization=True, dtype=load_dtype(request, config))
    device = request.device.torch()
    tensors = {name: tensor.detach().to(device) for name, tensor in tensors.items()}  # never the caller's own objects
    converted = method.load_stored(model, tensors, method_config)
    rest = {k: v for k, v in tensors.items() if not any(k.startswith(m + ".") for m in converted) or k.endswith(".bias")}
    rest = {k: (v.to(load_dtype(request, config)) if v.dtype.is_floating_point else v) for k, v in rest.items()}
    _missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    if unexpected:
        log.warning("checkpoint tensors the model does not use: %s", ", ".join(unexpected[:8]))
    model.tie_weights()
    _buffers_to(model, device)
    check_no_meta(model)
    setattr(model, PREQUANTIZED_ATTR, True)
    log.info("loaded %d pre-quantized %s layers without re-quantizing", len(converted), method.name)
    return model.eval()


def _buffers_to(model, device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)


def skeleton(
    request: "LoadRequest", drop_quantization: bool, dtype: "torch.dtype", class_name: str | None = None
) -> "PreTrainedModel":
    """The model built from its config with parameters on meta and real buffers.

    Weight initialisation is skipped (every parameter is replaced before use):
    on meta tensors it does nothing but costs ~0.1 s for a 3 B model. Tied
    weights are not tied here; callers tie them (``tie_weights``) or rebind
    them from the manifest's aliases.
    """
    config = _hf_config(request, drop_quantization)
    cls = identity.class_named(class_name) if class_name else model_class(request, identity.read_config(request.model))
    with meta_parameters(), _no_init_weights():
        model = cls._from_config(config, dtype=dtype)
    return model.eval()


def _no_init_weights():
    """transformers' own switch that turns weight initialisation off (a no-op where it is missing)."""
    import contextlib

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def build_skeleton(request: "LoadRequest", manifest: "Manifest") -> "torch.nn.Module":
    """The meta-device model a client rebinds to the mapped tensors of ``manifest``.

    Each registered quantization method turns the modules whose quantized tensors the manifest holds into its layers
    (block FP8: those with a ``weight_scale_inv``).
    """
    from weightcache.adapter import quantization_methods

    extra = manifest.extra
    model = skeleton(request, drop_quantization=True, dtype=to_dtype(extra["dtype"]), class_name=extra.get("model_class"))
    for method in quantization_methods().values():
        method.rebind(model, manifest.names, extra)
    return model


def post_process(request: "LoadRequest", model: "torch.nn.Module", description: "ModelDescription") -> "torch.nn.Module":
    """Quantization while loading, by the method the description names, unless the checkpoint was stored so."""
    if description.quantization in (None, "none") or getattr(model, PREQUANTIZED_ATTR, False):
        return model
    from weightcache.adapter import quantization_method

    method = quantization_method(description.quantization)
    converted = method.quantize(model, description.quantization_config)
    if not converted:
        raise UnsupportedQuantization(
            method.name, f"no layer of {layout.class_name_of(model)} can be quantized: {method.convertible}"
        )
    log.info("quantized %d layers with %s", len(converted), method.name)
    return model


def rebind(request: "LoadRequest", tensors: "dict[str, torch.Tensor]", manifest: "Manifest") -> "torch.nn.Module":
    """The meta-device model for ``manifest``, its parameters and buffers pointed at the mapped ``tensors``."""
    from weightcache.adapter import rebind_module

    model = build_skeleton(request, manifest)
    return rebind_module(model, tensors, manifest, device=request.device.torch())
