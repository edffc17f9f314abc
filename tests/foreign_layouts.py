"""Checkpoints in several folders, written by the libraries users save them with, for the tests of multi-folder layouts:
sentence-transformers folders (``SentenceTransformer.save``: today's root layout, and the older one with the body in
``0_Transformer/``) and a diffusers pipeline folder (``DiffusionPipeline.save_pretrained``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.models import save_random_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def save_sentence_transformer(directory: Path, pooling: str = "mean", dense_out: int = 16, seed: int = 0) -> Path:
    """A tiny BERT body, pooling, one Dense head (tanh) and Normalize, saved by sentence-transformers in ``directory``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    body = save_random_model("bert", directory.parent / f"{directory.name}-body", seed=seed)
    transformer = Transformer(str(body))
    width = transformer.get_embedding_dimension()
    torch.manual_seed(seed)
    modules = [
        transformer,
        Pooling(width, pooling),
        Dense(width, dense_out, activation_function=torch.nn.Tanh()),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    shutil.rmtree(body)
    return directory


def to_old_layout(directory: Path) -> Path:
    """Move the body's files into ``0_Transformer/`` and point modules.json there: the layout sentence-transformers
    wrote before 3.0, which it still loads (moved by hand: today's ``save`` writes the root layout only)."""
    body = directory / "0_Transformer"
    body.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json"):
        if (directory / name).exists():
            (directory / name).rename(body / name)
    modules = json.loads((directory / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    return directory


def st_adapter():
    """The example adapter module (examples/sentence_transformers_adapter.py), imported from the examples folder."""
    import importlib
    import sys

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("sentence_transformers_adapter")


def diffusers_adapter():
    """The example adapter module (examples/diffusers_pipeline_adapter.py), imported from the examples folder."""
    import importlib
    import sys

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("diffusers_pipeline_adapter")


def save_diffusers_pipeline(directory: Path, seed: int = 0) -> Path:
    """A tiny pipeline (a UNet2DModel, an AutoencoderKL, a transformers CLIPTextModel and a DDPMScheduler) saved by
    diffusers' own ``save_pretrained``: ``model_index.json``, ``unet/``, ``vae/``, ``text_encoder/`` and ``scheduler/``."""
    import diffusers
    import torch
    import transformers

    torch.manual_seed(seed)
    text = transformers.CLIPTextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    text_encoder = transformers.CLIPTextModel(text)
    unet = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=2,
        norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        sample_size=8,
    )
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=50)
    _tiny_pipeline_class()(unet, vae, text_encoder, scheduler).save_pretrained(str(directory))
    return directory


def _tiny_pipeline_class():
    """A pipeline class of our own (diffusers' save_pretrained writes any ``DiffusionPipeline``'s registered modules)."""
    import diffusers

    class TinyPipeline(diffusers.DiffusionPipeline):
        def __init__(self, unet, vae, text_encoder, scheduler):
            super().__init__()
            self.register_modules(unet=unet, vae=vae, text_encoder=text_encoder, scheduler=scheduler)

    return TinyPipeline
