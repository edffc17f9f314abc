"""A tiny language model in plain torch, its checkpoint format, and (in ``plugin``) its weightcache adapter.

Checkpoint: a directory with ``config.json`` (``vocab_size``, ``dim``, ``hidden``,
``dtype``) and ``model.safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

__version__ = "0.1.0"


class TinyLM(nn.Module):
    """Embedding -> two-layer MLP -> head tied to the embedding; ``norm_scale`` is a buffer."""

    def __init__(self, vocab_size: int, dim: int, hidden: int, dtype=torch.float32, device=None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, dtype=dtype, device=device)
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype, device=device)
        self.head = nn.Linear(dim, vocab_size, bias=False, dtype=dtype, device=device)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("norm_scale", torch.ones(dim, dtype=dtype, device=device))

    @classmethod
    def from_config(cls, config: dict, device=None) -> "TinyLM":
        dtype = getattr(torch, config.get("dtype", "float32"))
        return cls(config["vocab_size"], config["dim"], config["hidden"], dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return self.head(x * self.norm_scale)


def read_config(checkpoint: str | Path) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def save_checkpoint(directory: str | Path, vocab_size: int = 64, dim: int = 32, hidden: int = 160, seed: int = 0) -> Path:
    """Write a random-weight TinyLM checkpoint to ``directory``."""
    import safetensors.torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"vocab_size": vocab_size, "dim": dim, "hidden": hidden, "dtype": "float32"}
    torch.manual_seed(seed)
    model = TinyLM.from_config(config)
    with torch.no_grad():
        model.norm_scale.uniform_(0.5, 1.5)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}  # tied: stored once
    safetensors.torch.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def example_inputs(model: TinyLM) -> dict:
    """Fixed inputs for the conformance kit (``--inputs tinylm_020:example_inputs``)."""
    vocab = model.embed.num_embeddings
    return {"input_ids": (torch.arange(24).reshape(2, 12) * 5 + 3) % vocab}
