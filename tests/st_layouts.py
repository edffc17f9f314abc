"""sentence-transformers folders as sentence-transformers itself writes them (``SentenceTransformer.save``), for the tests
of multi-folder checkpoints: the root layout of today's versions and the older one with the body in ``0_Transformer/``."""

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
