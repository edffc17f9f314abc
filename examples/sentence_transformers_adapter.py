"""A weightcache adapter for sentence-transformers model folders: one model kept in several folders.

A sentence-transformers folder (what ``SentenceTransformer.save`` writes) lists its modules in
``modules.json``: a transformers body (in the root, or in ``0_Transformer/`` in the older
layout), a pooling module (``1_Pooling/config.json``), Dense heads with weights of their own
(``2_Dense/model.safetensors``, ``2_Dense/config.json``) and a Normalize module. The model this
adapter builds computes the sentence embedding: body, pooling, heads, normalization.

What makes it a multi-folder adapter is ``weightcache_checkpoint_files``: it declares every
file the load reads, in the root and in each module's folder, so that the checkpoint identity
covers them (a new Dense head or another pooling mode is another entry) and the conformance
kit can check that nothing else is read. ``publish_version`` then takes the tensors of every
declared weight file, a subfolder's named ``folder/name`` (``2_Dense/linear.weight``).

Register it in-process (``weightcache.engine.Plugins.from_modules({"st": sentence_transformers_adapter})``) or
through an entry point in ``weightcache.adapters``. docs/adapter-guide.md walks through it.
"""

from __future__ import annotations

import importlib
import json
import typing
from pathlib import Path

import torch

from weightcache.adapter import (
    CheckpointConventions,
    CheckpointFiles,
    ModelDescription,
    UnsupportedQuantization,
    hookimpl,
    meta_parameters,
    rebind_module,
)

__version__ = "0.1.0"
TRANSFORMER, POOLING, DENSE, NORMALIZE = "Transformer", "Pooling", "Dense", "Normalize"


def read_json(checkpoint: str, name: str) -> typing.Any:
    return json.loads((Path(checkpoint) / name).read_text())


def folder_modules(checkpoint: str) -> list[tuple[str, str]]:
    """``(kind, folder)`` of each module ``modules.json`` lists, in order (``folder`` '' for the root)."""
    kinds = (TRANSFORMER, POOLING, DENSE, NORMALIZE)
    found = []
    for module in read_json(checkpoint, "modules.json"):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in kinds:
            raise ValueError(f"{checkpoint}: module type {module['type']!r} is not one of {', '.join(kinds)}")
        found.append((kind, module["path"].strip("/")))
    if not found or found[0][0] != TRANSFORMER:
        raise ValueError(f"{checkpoint}: modules.json must list a Transformer module first")
    return found


def _in(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


@hookimpl
def weightcache_checkpoint_files(request):
    """Every file the load reads: the body's weights and config, each Dense head's, the pooling config, modules.json."""
    modules = folder_modules(request.model)
    body = modules[0][1]
    heads = [folder for kind, folder in modules if kind == DENSE]
    pooling = [folder for kind, folder in modules if kind == POOLING]
    return CheckpointFiles(
        weights=(_in(body, "*.safetensors"), *(_in(folder, "*.safetensors") for folder in heads)),
        configs=("modules.json", _in(body, "config.json"), *(_in(folder, "config.json") for folder in pooling + heads)),
    )


def layout(checkpoint: str) -> dict:
    """Everything the model's shape and computation depend on, read from the declared configs."""
    modules = folder_modules(checkpoint)
    pooling = next((read_json(checkpoint, _in(f, "config.json")) for kind, f in modules if kind == POOLING), {})
    return {
        "body": read_json(checkpoint, _in(modules[0][1], "config.json")),
        "body_folder": modules[0][1],
        "pooling": pooling_mode(pooling),
        "heads": [{**read_json(checkpoint, _in(f, "config.json")), "folder": f} for kind, f in modules if kind == DENSE],
        "normalize": any(kind == NORMALIZE for kind, _ in modules),
    }


def pooling_mode(config: dict) -> str:
    """``mean``, ``cls`` or ``max``, from sentence-transformers' newer (``pooling_mode``) or older (flags) spelling."""
    if "pooling_mode" in config:
        return str(config["pooling_mode"])
    flags = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean"}
    return next((mode for flag, mode in flags.items() if config.get(flag)), "mean")


@hookimpl
def weightcache_describe(request):
    if request.quantization not in (None, "none"):
        raise UnsupportedQuantization(request.quantization, "the sentence-transformers example adapter loads unquantized")
    described = layout(request.model)
    stored = described["body"].get("dtype") or described["body"].get("torch_dtype") or "float32"
    return ModelDescription(
        architecture="SentenceTransformer",
        config=described,
        dtype=request.dtype or stored,
        adapter_version=__version__,
        engine="torch",
        engine_version=torch.__version__.split("+")[0],
    )


class DenseHead(torch.nn.Module):
    """sentence-transformers' Dense module: a linear layer and its activation."""

    def __init__(self, config: dict):
        super().__init__()
        self.linear = torch.nn.Linear(config["in_features"], config["out_features"], bias=config.get("bias", True))
        self.activation = activation(config.get("activation_function", "torch.nn.modules.linear.Identity"))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(features))


def activation(name: str) -> torch.nn.Module:
    """The ``torch.nn`` activation a Dense config names (nothing outside ``torch.nn`` is imported)."""
    module, _, cls = name.rpartition(".")
    if not module.startswith("torch.nn"):
        raise ValueError(f"activation {name!r} is not a torch.nn module")
    return getattr(importlib.import_module(module), cls)()


class SentenceModel(torch.nn.Module):
    """Body, pooling, Dense heads and normalization: the sentence embedding, as ``SentenceTransformer.encode`` computes it."""

    def __init__(self, described: dict):
        super().__init__()
        import transformers

        body = dict(described["body"])
        self.body = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(body.pop("model_type"), **body))
        self.heads = torch.nn.ModuleList(DenseHead(head) for head in described["heads"])
        self.pooling = described["pooling"]
        self.normalize = described["normalize"]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "max":
            pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
        else:
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        for head in self.heads:
            pooled = head(pooled)
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled


class PublishedName:
    """The model's name for a checkpoint tensor (``CheckpointConventions.consumed_tensors``): ``body.`` before the body's
    tensors, ``heads.N.`` for the N-th Dense folder's."""

    def __init__(self, described: dict):
        self.body = described["body_folder"]
        self.heads = {head["folder"]: number for number, head in enumerate(described["heads"])}

    def __call__(self, name: str) -> str | None:
        folder, _, own = name.rpartition("/")
        if folder == self.body:
            return f"body.{own}"
        if folder in self.heads:
            return f"heads.{self.heads[folder]}.{own}"
        return None


def model_from(request, tensors: "typing.Mapping[str, torch.Tensor]") -> SentenceModel:
    """The model holding ``tensors`` (named as the checkpoint names them), in the request's dtype, on its device."""
    described = layout(request.model)
    rename = PublishedName(described)
    with meta_parameters():
        model = SentenceModel(described)
    state = {rename(name): tensor for name, tensor in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    dtype = getattr(torch, request.dtype) if request.dtype else None
    return model.to(device=request.device.torch(), dtype=dtype).eval()


@hookimpl
def weightcache_load(request, builder):
    import safetensors.torch

    declared = weightcache_checkpoint_files(request=request)
    tensors = {}
    for file in declared.weight_files(request.model):
        prefix = declared.tensor_prefix(request.model, file)
        tensors.update({prefix + name: t for name, t in safetensors.torch.load_file(str(file)).items()})
    return model_from(request, tensors)


@hookimpl
def weightcache_load_tensors(request, tensors, builder):
    return model_from(request, tensors)


@hookimpl
def weightcache_rebind(request, tensors, manifest, description):
    with meta_parameters():
        model = SentenceModel(description.config)
    return rebind_module(model, tensors, manifest, device=request.device.torch()).eval()


@hookimpl
def weightcache_example_inputs(request, model):
    generator = torch.Generator().manual_seed(0)
    vocab = model.body.config.vocab_size
    input_ids = torch.randint(0, vocab, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # a padded sentence: pooling must leave the padding out
    device = request.device.torch()
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


@hookimpl
def weightcache_checkpoint_conventions(request):
    return CheckpointConventions(quantization_declaration="none", consumed_tensors=PublishedName(layout(request.model)))
