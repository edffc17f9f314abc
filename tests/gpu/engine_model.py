#!/usr/bin/env python3
"""A Qwen3-shaped checkpoint with random bf16 weights and a word tokenizer, for the engines on the GPU machine.

    python3 tests/gpu/engine_model.py DIR [--shape small|8b|moe] [--device cuda]

``8b`` is Qwen3-8B's shape (36 layers, hidden 4096, 32 query and 8 KV heads of 128, MLP 12288, vocabulary 151936:
8.19 billion parameters, 16.4 GB); ``small`` the same architecture at 8 layers and hidden 1024 (0.19 billion);
``moe`` a Qwen3-MoE of the small size with 8 experts, 2 a token. The weights are drawn on ``--device`` (fast on a
GPU) with a fixed seed and saved as safetensors shards by transformers; the tokenizer names token i ``t<i>``
(tests/engines/support.py's ``write_word_tokenizer``), so prompts are written as ``t5 t17 ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16),
    "moe": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16),
}
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, decoder_sparse_step=1, norm_topk_prob=True)


def write(directory: Path, shape: str, device: str) -> dict:
    import torch
    import transformers

    common = dict(num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False)
    if shape == "moe":
        config = transformers.Qwen3MoeConfig(**SHAPES[shape], **common, **MOE, architectures=["Qwen3MoeForCausalLM"])
    else:
        config = transformers.Qwen3Config(**SHAPES[shape], **common, architectures=["Qwen3ForCausalLM"])
    start = time.monotonic()
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, config.architectures[0])(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for param in model.parameters():  # every weight distinct and small: greedy tokens then vary with the input
            param.copy_(torch.randn_like(param, dtype=torch.float32).mul_(0.02).to(param.dtype))
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="4GB")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.engines.support import write_word_tokenizer

    write_word_tokenizer(directory, config.vocab_size)
    params = sum(param.numel() for param in model.parameters())
    return {"shape": shape, "parameters": params, "bytes": params * 2, "seconds": round(time.monotonic() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"model": str(args.directory), **write(args.directory, args.shape, args.device)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
