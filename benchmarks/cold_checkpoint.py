"""benchmarks/cold.py's checkpoint: a Llama-shaped one written on the device (or restart.py's Qwen3), its tensors' byte ranges, its
tensorizer conversion."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import restart  # benchmarks/restart.py: the Qwen3 sizes and builder, the child environment, page-cache helpers

MARKER = "weightcache-cold-benchmark.json"


SHARDS = 4


# Llama-3-8B's shape: 8.03 B parameters, 291 tensors, 16.06 GB in bf16 (``--gib 16``).
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its bytes are ``file[begin:end]``."""

    file: str
    name: str
    dtype: str
    shape: tuple
    begin: int
    end: int


def read_entries(files: list[str]) -> list[Entry]:
    """Every tensor of ``files``, from their headers (no torch)."""
    entries = []
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                entries.append(Entry(file, name, info["dtype"], tuple(info["shape"]), 8 + length + begin, 8 + length + end))
    return entries


def llama_shape(gib: float) -> dict:
    """Llama-3-8B's shape at ``gib`` 16; otherwise its width scaled so the bf16 weights take about gib/16 x 16.06 GB."""
    if gib <= 0:
        raise ValueError(f"--gib must be positive, not {gib}")
    if gib == 16:
        return dict(LLAMA_8B)
    hidden = max(64, round(4096 * math.sqrt(gib / 16) / 64) * 64)
    head_dim = 128 if hidden >= 1024 and hidden % 128 == 0 else 64
    heads = hidden // head_dim
    return dict(
        vocab_size=max(256, round(hidden * 128256 / 4096 / 64) * 64),
        hidden_size=hidden,
        intermediate_size=round(hidden * 3.5 / 64) * 64,
        num_hidden_layers=32,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4 if heads % 4 == 0 else 1,
        head_dim=head_dim,
    )


def llama_tensors(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a LlamaForCausalLM of ``shape`` (untied head), in the order its ``state_dict`` lists them."""
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    tensors = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors += [
            (f"{prefix}.self_attn.q_proj.weight", (q, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, q)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
        ]
    return [*tensors, ("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def shard_of(tensors: list[tuple[str, tuple[int, ...]]], shards: int = SHARDS) -> list[int]:
    """Which of ``shards`` files each tensor goes to: consecutive runs of about equal bytes, in order."""
    sizes = [math.prod(shape) for _, shape in tensors]
    total, start, out = sum(sizes), 0, []
    for size in sizes:
        out.append(min(shards - 1, start * shards // total))
        start += size
    return out


def make_llama(directory: Path, gib: float, device: str) -> dict:
    """Write the Llama checkpoint of ``gib`` into ``directory`` as ``save_pretrained`` lays it out (random bf16 weights)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    shape = llama_shape(gib)
    tensors = llama_tensors(shape)
    shards = shard_of(tensors)
    names = [f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors"):
        stale.unlink()
    (directory / MARKER).unlink(missing_ok=True)
    on = torch.device(device if device.startswith("cuda") else "cpu")
    generator = torch.Generator(device=on).manual_seed(0)
    start = time.perf_counter()
    total = 0
    for index, name in enumerate(names):
        part = {}
        for (tensor, dims), shard in zip(tensors, shards, strict=True):
            if shard == index:
                mean = 1.0 if tensor.endswith("norm.weight") else 0.0
                part[tensor] = torch.empty(dims, dtype=torch.bfloat16, device=on).normal_(mean, 0.02, generator=generator).cpu()
                total += part[tensor].nbytes
        save_file(part, str(directory / name), metadata={"format": "pt"})
        del part
    weight_map = {tensor: names[shard] for (tensor, _), shard in zip(tensors, shards, strict=True)}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="bfloat16",  # as save_pretrained records a bf16 model
    )
    config.save_pretrained(directory)
    os.sync()
    marker = {
        "kind": "llama",
        "gib": gib,
        "bytes": total,
        "tensors": len(tensors),
        "write_s": round(time.perf_counter() - start, 2),
    }
    (directory / MARKER).write_text(json.dumps(marker) + "\n")
    return marker


def ensure_checkpoint(args, env: dict) -> Path:
    """``--make-checkpoint DIR``: the checkpoint of ``--gib`` or ``--size`` there, reused when its marker matches."""
    directory = Path(args.make_checkpoint).resolve()
    if args.size:
        return restart.ensure_checkpoint(args.size, args.device, directory, env)
    marker = directory / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("gib") == args.gib:
        print(f"reusing the checkpoint in {directory}", flush=True)
        return directory
    print(f"writing a Llama checkpoint of about {args.gib * 16.06 / 16:.2f} GB into {directory} ...", flush=True)
    command = [
        *this_script(),
        "--role",
        "make",
        "--make-checkpoint",
        str(directory),
        "--gib",
        repr(args.gib),
        "--device",
        args.device,
    ]
    subprocess.run(command, env=env, check=True)
    return directory


def tensorizer_path(model: Path) -> Path:
    """Where the tensorizer copy of ``model`` lives: beside it, so that weightcache never sees it in the checkpoint."""
    return Path(str(model) + ".tensorizer") / "model.tensors"


def convert_to_tensorizer(model: Path) -> dict:
    """Serialize the checkpoint with tensorizer (untimed); reused while the checkpoint's files are unchanged."""
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    path = tensorizer_path(model)
    source = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in restart.checkpoint_files(model)}
    marker = path.parent / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("source") == source:
        return {"reused": str(path)}
    path.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    serializer = TensorSerializer(str(path))
    for file in restart.checkpoint_files(model):
        serializer.write_state_dict(load_file(str(file)))
    serializer.close()
    os.sync()
    marker.write_text(json.dumps({"source": source}) + "\n")
    return {"converted": str(path), "seconds": round(time.perf_counter() - start, 2)}


def restart_name(model: Path) -> str:
    marker = model / MARKER
    if marker.exists():
        return f"Llama-shaped bf16 checkpoint {model.name}"
    if (model / restart.MARKER).exists():
        return f"Qwen3 {json.loads((model / restart.MARKER).read_text())['size']} bf16 checkpoint {model.name}"
    return model.name


def this_script() -> list[str]:
    """The command that runs benchmarks/cold.py again (its helper processes are roles of it)."""
    return [sys.executable, str(Path(__file__).resolve().with_name("cold.py"))]
