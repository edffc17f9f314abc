"""A weightcache adapter for diffusers pipeline folders: every model component of the pipeline, each in its folder.

A pipeline folder (what ``DiffusionPipeline.save_pretrained`` writes) lists its components in ``model_index.json``;
each model component keeps ``config.json`` and ``diffusion_pytorch_model.safetensors`` in a folder of its own
(``unet/``, ``vae/``, ``text_encoder/`` ...). This adapter loads the model components, diffusers' and transformers'
(the schedulers and tokenizers hold no weights, and it never reads them), into one ``torch.nn.ModuleDict`` whose
forward runs each once: the text encoder on token ids, the unet on a noisy sample, the autoencoder's decoder on
latents.

``weightcache_checkpoint_files`` declares each component's weights and config and ``model_index.json``: the identity
covers them, and a tensor of ``unet/diffusion_pytorch_model.safetensors`` is named ``unet/conv_in.weight`` (the
model's own name is ``unet.conv_in.weight``).
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


LIBRARIES = ("diffusers", "transformers")
"""The libraries whose model components this adapter loads (``model_index.json``'s first word of a component)."""


def components(checkpoint: str) -> dict[str, tuple[str, str]]:
    """Each model component ``model_index.json`` lists: folder -> (library, class name), ``unet`` -> ``("diffusers",
    "UNet2DModel")``, ``text_encoder`` -> ``("transformers", "CLIPTextModel")``."""
    index = json.loads((Path(checkpoint) / "model_index.json").read_text())
    return {
        name: (spec[0], spec[1])
        for name, spec in sorted(index.items())
        if isinstance(spec, list)
        and len(spec) == 2
        and spec[0] in LIBRARIES
        and (Path(checkpoint) / name / "config.json").is_file()
    }


@hookimpl
def weightcache_checkpoint_files(request):
    folders = components(request.model)
    return CheckpointFiles(
        weights=tuple(f"{folder}/*.safetensors" for folder in folders),
        configs=("model_index.json", *(f"{folder}/config.json" for folder in folders)),
    )


def layout(checkpoint: str) -> dict:
    return {
        folder: {"library": library, "class": cls, "config": json.loads((Path(checkpoint) / folder / "config.json").read_text())}
        for folder, (library, cls) in components(checkpoint).items()
    }


@hookimpl
def weightcache_describe(request):
    if request.quantization not in (None, "none"):
        raise UnsupportedQuantization(request.quantization, "the diffusers example adapter loads unquantized")
    import diffusers

    return ModelDescription(
        architecture="DiffusionPipeline",
        config=layout(request.model),
        dtype=request.dtype or "float32",
        adapter_version=__version__,
        engine="diffusers",
        engine_version=diffusers.__version__,
    )


class Pipeline(torch.nn.ModuleDict):
    """The pipeline's model components by folder; forward runs the text encoder, the unet and the autoencoder's decoder
    once each."""

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        latents: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> dict:
        outputs = {}
        if "text_encoder" in self and input_ids is not None:
            outputs["text_encoder"] = self["text_encoder"](input_ids=input_ids).last_hidden_state
        if "unet" in self:
            outputs["unet"] = self["unet"](sample, timestep).sample
        if "vae" in self and latents is not None:
            outputs["vae"] = self["vae"].decode(latents).sample
        return outputs


def build(described: dict) -> Pipeline:
    return Pipeline({folder: component(part) for folder, part in described.items()})


def component(part: dict) -> torch.nn.Module:
    """One model component, built from its config alone (its weights come after)."""
    library = importlib.import_module(part["library"])
    cls = getattr(library, part["class"])
    if part["library"] == "diffusers":
        return cls.from_config(part["config"])
    return cls(cls.config_class.from_dict(part["config"]))


def model_from(request, tensors: "typing.Mapping[str, torch.Tensor]") -> Pipeline:
    with meta_parameters():
        model = build(layout(request.model))
    model.load_state_dict({name.replace("/", ".", 1): t for name, t in tensors.items()}, strict=True, assign=True)
    dtype = getattr(torch, request.dtype) if request.dtype else None
    return model.to(device=request.device.torch(), dtype=dtype).eval()


@hookimpl
def weightcache_load(request, builder):
    import safetensors.torch

    declared = weightcache_checkpoint_files(request=request)
    tensors = {}
    for file in declared.weight_files(request.model):
        prefix = declared.tensor_prefix(request.model, file)
        # clone: each tensor in memory of its own, aligned as the cache's are. load_file's tensors are views into the
        # file at its offsets, and a small matmul (the time embedding's) picks another kernel for an unaligned weight:
        # the same bytes would give other last bits than the cached model.
        tensors.update({prefix + name: t.clone() for name, t in safetensors.torch.load_file(str(file)).items()})
    return model_from(request, tensors)


@hookimpl
def weightcache_load_tensors(request, tensors, builder):
    return model_from(request, tensors)


@hookimpl
def weightcache_rebind(request, tensors, manifest, description):
    with meta_parameters():
        model = build(description.config)
    return rebind_module(model, tensors, manifest, device=request.device.torch()).eval()


@hookimpl
def weightcache_example_inputs(request, model):
    generator = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    device = request.device.torch()
    inputs: dict[str, typing.Any] = {"timestep": torch.tensor([10], device=device)}
    unet = model["unet"].config if "unet" in model else None
    size = unet.sample_size if unet is not None else 8
    size = size[0] if isinstance(size, (list, tuple)) else size
    inputs["sample"] = torch.randn(1, unet.in_channels if unet else 3, size, size, generator=generator).to(device, dtype)
    if "text_encoder" in model:
        vocab = model["text_encoder"].config.vocab_size
        inputs["input_ids"] = torch.randint(0, vocab, (1, 7), generator=generator).to(device)
    if "vae" in model:
        vae = model["vae"].config
        latent = max(1, size // (2 ** (len(vae.block_out_channels) - 1)))
        inputs["latents"] = torch.randn(1, vae.latent_channels, latent, latent, generator=generator).to(device, dtype)
    return inputs


@hookimpl
def weightcache_checkpoint_conventions(request):
    return CheckpointConventions(quantization_declaration="none", consumed_tensors=(("([^/]+)/(.+)", r"\1.\2"),))
