"""Attach cost at trillion-parameter scale: the real tensor names, shapes and dtypes of DeepSeek-V3, a Kimi-K2-class 1 T
MoE and Qwen3-235B-A22B, per expert-parallel rank and whole, published from memory and attached by fresh engines.

    python benchmarks/scale.py --device cuda --max-gib 100          # on the H200
    python benchmarks/scale.py --device cpu --max-gib 0.25          # anywhere: the per-tensor costs are the CPU's

For each case it builds the tensors straight in arenas (nothing on disk), exports them with ``export_state`` (the
manifest build every publisher pays), publishes them with ``publish_arenas`` (the server checks every record), then a
fresh engine process attaches and rebinds them onto an ``nn.Module`` tree built on the meta device from the names
(timed by phase: request, manifest, map, views, rebind; views ~0: the dict is made on its first read), and a
second engine attaches while the first still holds the entry (the server must hold one entry, attached by both, and
both must read the same bytes).

Where a case's bytes exceed ``--max-gib``, every tensor keeps its shape and dtype but the records share a pool of
``--max-gib`` bytes (regions overlap; the server allows that, views of one storage do it): the tensor count, the
metadata and every view are real, only the bytes repeat. The table says which cases were pooled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

GIB = 1 << 30
EP = TP = 8

# Shapes from each model's public config.json (Hugging Face):
#   deepseek-ai/DeepSeek-V3/config.json: hidden_size 7168, intermediate_size 18432, moe_intermediate_size 2048,
#     n_routed_experts 256, n_shared_experts 1, num_hidden_layers 61 (+1 MTP layer, num_nextn_predict_layers 1),
#     first_k_dense_replace 3, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
#     qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280, quantization_config fp8 e4m3 weight_block_size [128, 128].
#   moonshotai/Kimi-K2-Instruct/config.json: the DeepSeek-V3 architecture with n_routed_experts 384,
#     first_k_dense_replace 1, num_attention_heads 64, vocab_size 163840 (no MTP layer); same block FP8.
#   Qwen/Qwen3-235B-A22B/config.json: hidden_size 4096, moe_intermediate_size 1536, num_experts 128,
#     num_hidden_layers 94 (every layer MoE), num_attention_heads 64, num_key_value_heads 4, head_dim 128,
#     vocab_size 151936, bf16, q_norm/k_norm per layer.
DEEPSEEK_V3 = dict(
    kind="deepseek", hidden=7168, inter=18432, moe_inter=2048, experts=256, layers=61, mtp=1, dense=3, heads=128,
    q_lora=1536, kv_lora=512, nope=128, rope=64, v_head=128, vocab=129280,
)  # fmt: skip
KIMI_K2 = {**DEEPSEEK_V3, "experts": 384, "dense": 1, "heads": 64, "vocab": 163840, "mtp": 0}
QWEN3_235B = dict(kind="qwen3", hidden=4096, moe_inter=1536, experts=128, layers=94, heads=64, kv_heads=4, head=128, vocab=151936)
MODELS = {"deepseek-v3-671b": DEEPSEEK_V3, "kimi-k2-1t": KIMI_K2, "qwen3-235b-a22b": QWEN3_235B}
FP8, BF16, F32 = "float8_e4m3fn", "bfloat16", "float32"


def _fp8_linear(name: str, rows: int, cols: int) -> list[tuple[str, tuple[int, ...], str]]:
    """A block-FP8 linear: its e4m3 weight and its float32 ``weight_scale_inv`` (one per 128x128 block)."""
    return [(f"{name}.weight", (rows, cols), FP8), (f"{name}.weight_scale_inv", (-(-rows // 128), -(-cols // 128)), F32)]


def deepseek_tensors(c: dict, rank: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """The Hugging Face checkpoint's tensors (unfused, ``model.layers.N.mlp.experts.E.*``), whole or one TP8/EP8 rank's."""
    tp = TP if rank else 1
    h, out = c["hidden"], []
    experts = range(c["experts"] // EP) if rank else range(c["experts"])
    out.append(("model.embed_tokens.weight", (c["vocab"] // tp, h), BF16))
    for layer in range(c["layers"] + c["mtp"]):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", (h,), BF16), (f"{p}.post_attention_layernorm.weight", (h,), BF16)]
        a = f"{p}.self_attn"
        out += _fp8_linear(f"{a}.q_a_proj", c["q_lora"], h)
        out.append((f"{a}.q_a_layernorm.weight", (c["q_lora"],), BF16))
        out += _fp8_linear(f"{a}.q_b_proj", c["heads"] * (c["nope"] + c["rope"]) // tp, c["q_lora"])
        out += _fp8_linear(f"{a}.kv_a_proj_with_mqa", c["kv_lora"] + c["rope"], h)
        out.append((f"{a}.kv_a_layernorm.weight", (c["kv_lora"],), BF16))
        out += _fp8_linear(f"{a}.kv_b_proj", c["heads"] * (c["nope"] + c["v_head"]) // tp, c["kv_lora"])
        out += _fp8_linear(f"{a}.o_proj", h, c["heads"] * c["v_head"] // tp)
        m = f"{p}.mlp"
        if layer < c["dense"]:
            out += _mlp(m, h, c["inter"] // tp)
            continue
        out += [(f"{m}.gate.weight", (c["experts"], h), BF16), (f"{m}.gate.e_score_correction_bias", (c["experts"],), F32)]
        for e in experts:
            out += _mlp(f"{m}.experts.{e + (c['experts'] // EP) * (EP - 1) if rank else e}", h, c["moe_inter"])
        out += _mlp(f"{m}.shared_experts", h, c["moe_inter"] // tp)
        if layer >= c["layers"]:  # the MTP module's own tensors
            out += [(f"{p}.enorm.weight", (h,), BF16), (f"{p}.hnorm.weight", (h,), BF16)]
            out += _fp8_linear(f"{p}.eh_proj", h, 2 * h)
            out += [(f"{p}.shared_head.norm.weight", (h,), BF16), (f"{p}.shared_head.head.weight", (c["vocab"] // tp, h), BF16)]
    out += [("model.norm.weight", (h,), BF16), ("lm_head.weight", (c["vocab"] // tp, h), BF16)]
    return out


def _mlp(name: str, hidden: int, inter: int) -> list:
    return [
        *_fp8_linear(f"{name}.gate_proj", inter, hidden),
        *_fp8_linear(f"{name}.up_proj", inter, hidden),
        *_fp8_linear(f"{name}.down_proj", hidden, inter),
    ]


def qwen3_tensors(c: dict, rank: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3-MoE's Hugging Face tensors (bf16), whole or one TP8/EP8 rank's (4 KV heads: each rank keeps one)."""
    tp = TP if rank else 1
    h = c["hidden"]
    out = [("model.embed_tokens.weight", (c["vocab"] // tp, h), BF16)]
    kv_rows = max(c["kv_heads"] // tp, 1) * c["head"]
    experts = range(c["experts"] // EP) if rank else range(c["experts"])
    for layer in range(c["layers"]):
        p = f"model.layers.{layer}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        out += [
            (f"{p}.input_layernorm.weight", (h,), BF16),
            (f"{p}.post_attention_layernorm.weight", (h,), BF16),
            (f"{a}.q_proj.weight", (c["heads"] * c["head"] // tp, h), BF16),
            (f"{a}.k_proj.weight", (kv_rows, h), BF16),
            (f"{a}.v_proj.weight", (kv_rows, h), BF16),
            (f"{a}.o_proj.weight", (h, c["heads"] * c["head"] // tp), BF16),
            (f"{a}.q_norm.weight", (c["head"],), BF16),
            (f"{a}.k_norm.weight", (c["head"],), BF16),
            (f"{m}.gate.weight", (c["experts"], h), BF16),
        ]
        for e in experts:
            out += [
                (f"{m}.experts.{e}.gate_proj.weight", (c["moe_inter"], h), BF16),
                (f"{m}.experts.{e}.up_proj.weight", (c["moe_inter"], h), BF16),
                (f"{m}.experts.{e}.down_proj.weight", (h, c["moe_inter"]), BF16),
            ]
    return [*out, ("model.norm.weight", (h,), BF16), ("lm_head.weight", (c["vocab"] // tp, h), BF16)]


def tensors_of(model: str, rank: bool, layout: str = "hf") -> list[tuple[str, tuple[int, ...], str]]:
    config = MODELS[model]
    tensors = (deepseek_tensors if config["kind"] == "deepseek" else qwen3_tensors)(config, rank)
    return fused(tensors) if layout == "fused" else tensors


_EXPERT = re.compile(
    r"^(?P<moe>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<leaf>weight|weight_scale_inv)$"
)
_PAIR = re.compile(
    r"^(?P<mlp>.+)\.(?P<proj>gate_proj|up_proj|q_proj|k_proj|v_proj|q_a_proj|kv_a_proj_with_mqa)\.(?P<leaf>weight|weight_scale_inv)$"
)
# What vLLM's and SGLang's model classes hold after loading (their parameter names, one tensor for what the checkpoint
# splits): a MoE layer's experts as FusedMoE's ``w13_weight`` (E, 2*inter, hidden) and ``w2_weight`` (E, hidden, inter)
# with their block scales; dense and shared MLPs' ``gate_up_proj``; attention's ``qkv_proj`` (Qwen3) and DeepSeek's
# ``fused_qkv_a_proj`` (q_a_proj + kv_a_proj_with_mqa). Sources: vllm/model_executor/models/{deepseek_v2,qwen3_moe}.py and
# layers/fused_moe/layer.py (FusedMoE.create_weights), vllm 0.33.0; sglang/srt/models/deepseek_v2.py, sglang 0.5.23.
_FUSED = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "q_proj": "qkv_proj", "k_proj": "qkv_proj",
          "v_proj": "qkv_proj", "q_a_proj": "fused_qkv_a_proj", "kv_a_proj_with_mqa": "fused_qkv_a_proj"}  # fmt: skip


def fused(tensors: list[tuple[str, tuple[int, ...], str]]) -> list[tuple[str, tuple[int, ...], str]]:
    """``tensors`` (the Hugging Face layout) as the engines hold them after loading: stacked experts, fused projections."""
    order: list = []  # a tensor kept as it is, or the name of a fused one (where its first part stood)
    parts: dict[str, list[tuple[tuple[int, ...], str]]] = {}
    per_expert: dict[str, int] = {}  # a stacked expert tensor: how many checkpoint tensors each expert adds to it
    for name, shape, dtype in tensors:
        if match := _EXPERT.match(name):
            gate_up = match["proj"] != "down_proj"
            target = f"{match['moe']}.{'w13' if gate_up else 'w2'}_{match['leaf']}"
            per_expert[target] = 2 if gate_up else 1
        elif match := _PAIR.match(name):
            target = f"{match['mlp']}.{_FUSED[match['proj']]}.{match['leaf']}"
        else:
            order.append((name, shape, dtype))
            continue
        if target not in parts:
            parts[target] = []
            order.append(target)
        parts[target].append((shape, dtype))
    result = []
    for item in order:
        if not isinstance(item, str):
            result.append(item)
            continue
        pieces, per = parts[item], per_expert.get(item)
        (first_shape, dtype) = pieces[0]
        columns = first_shape[1]
        if per is None:  # projections concatenated along their rows
            result.append((item, (sum(shape[0] for shape, _ in pieces), columns), dtype))
        else:  # experts stacked: (experts, rows of one expert's parts, columns)
            result.append((item, (len(pieces) // per, sum(shape[0] for shape, _ in pieces[:per]), columns), dtype))
    return result


def publish_case(specs, device: str, max_bytes: int, socket_dir, anchor: Path, label: str) -> dict:
    """Build ``specs`` straight in arenas (pooled past ``max_bytes``), export and publish them; the timings."""
    import torch

    from weightcache.core.dtypes import ITEM_SIZES
    from weightcache.core.flow import api
    from weightcache.core.load.export import ALIGNMENT, ArenaBuilder, export_state
    from weightcache.core.load.publish import publish_arenas

    sizes = [max(1, _numel(shape) * ITEM_SIZES[dtype]) for _, shape, dtype in specs]
    total = sum(-(-s // ALIGNMENT) * ALIGNMENT for s in sizes)
    pooled = total > max_bytes
    fingerprint = api.fingerprint(anchor, architecture=label, dtype="bfloat16", device=device)
    timings = {"tensors": len(specs), "bytes": total, "pooled": pooled}
    arena_bytes = min(GIB, max_bytes)
    with ArenaBuilder(device, chunk_bytes=arena_bytes) as builder:
        start = time.perf_counter()
        placements = pool_placements(sizes, arena_bytes, max(1, max_bytes // GIB)) if pooled else []
        pool = [builder.view(builder.plan(arena_bytes)) for _ in range(1 + max((p.arena for p in placements), default=-1))]
        for bytes_ in pool:
            bytes_.random_(0, 256) if bytes_.is_cuda else bytes_.copy_(torch.randint(0, 256, bytes_.shape, dtype=torch.uint8))
        # Every slot is planned before the first arena exists: an arena, once created, never grows, so planning and
        # creating in turn would give each tensor an arena of its own on a GPU (its granularity is 2 MiB).
        slots = [] if pooled else [builder.plan(nbytes) for nbytes in sizes]
        state = {}
        for index, (name, shape, dtype) in enumerate(specs):
            if not pooled:
                region = builder.view(slots[index])
                region.random_(0, 256) if region.is_cuda else region.copy_(torch.randint(0, 256, region.shape, dtype=torch.uint8))
                state[name] = region[: _numel(shape) * ITEM_SIZES[dtype]].view(getattr(torch, dtype)).view(shape)
                continue
            place = placements[index]
            if place.squeezed:  # larger than a pool arena: its rows overlap (real shape, fewer bytes)
                state[name] = _squeezed(pool[place.arena].view(getattr(torch, dtype)), shape)
                continue
            region = pool[place.arena][place.offset : place.offset + sizes[index]]
            state[name] = region[: _numel(shape) * ITEM_SIZES[dtype]].view(getattr(torch, dtype)).view(shape)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timings["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        manifest = export_state(state, builder)
        timings["manifest_s"] = time.perf_counter() - start
        del state
        published: dict = {}
        reply = publish_arenas(builder, fingerprint, manifest, socket_dir, label, timings=published)
        timings.update(seal_s=published["seal_s"], publish_s=published["request_s"])
        pool, region, bytes_ = [], None, None  # no view outlives the arenas (a CUDA arena closed under one warns)
        del manifest
    timings["digest"] = reply.digest
    return {"fingerprint": fingerprint.to_json(), **timings}


@attrs.frozen
class Placement:
    """Where a pooled tensor's bytes go: an arena of the pool and an offset in it, or the whole arena, rows overlapping."""

    arena: int
    offset: int = 0
    squeezed: bool = False


def pool_placements(sizes: list[int], arena_bytes: int, most: int) -> list[Placement]:
    """Place tensors of ``sizes`` bytes in a pool of at most ``most`` arenas of ``arena_bytes``, every arena reached.

    The server refuses an arena its tensors do not reach to the end, so each arena is closed by a tensor that ends at
    its end (the one that no longer fits is placed there, overlapping its neighbours), and a tensor larger than an
    arena fills one of its own, rows overlapping. The pool has as many arenas as one pass over the tensors closes
    (at most ``most``); past the last one the placements wrap round to the first, overlapping what is there.
    """
    from weightcache.core.load.export import ALIGNMENT

    def walk(count: int) -> tuple[list[Placement], int]:
        placements, arena, cursor, closed = [], 0, 0, 0
        for nbytes in sizes:
            padded = -(-nbytes // ALIGNMENT) * ALIGNMENT
            if nbytes > arena_bytes or cursor + nbytes > arena_bytes:
                squeezed = nbytes > arena_bytes
                placements.append(Placement(arena, 0 if squeezed else arena_bytes - padded, squeezed))
                arena, cursor, closed = (arena + 1) % count, 0, closed + 1
                continue
            placements.append(Placement(arena, cursor))
            cursor += padded
        return placements, closed

    _, closed = walk(len(sizes) + 1)
    count = max(1, min(most, closed))
    placements, closed = walk(count)
    if closed < count:
        raise ValueError(f"{len(sizes)} tensors of {sum(sizes):,} bytes do not reach the end of a {arena_bytes:,}-byte arena")
    return placements


def _squeezed(typed, shape):
    """A view of ``shape`` inside ``typed`` whose leading rows overlap so that it fits (the trailing dims stay contiguous)."""
    tail = _numel(shape[1:])
    step = (typed.numel() - tail) // max(shape[0] - 1, 1)
    strides, size = [], 1
    for dim in reversed(shape[1:]):
        strides.append(size)
        size *= dim
    return typed.as_strided(shape, (min(step, tail), *reversed(strides)))


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


ENGINE = r"""
import json, statistics, sys, time, torch
from weightcache.core.flow import api
from weightcache.core.fingerprint import Fingerprint
from weightcache.core.load.rebind import rebind_module
fp = Fingerprint.from_json(json.loads(sys.argv[1])); socket_dir = sys.argv[2]; device = sys.argv[3]; repeat = int(sys.argv[4])
if device.startswith("cuda"):
    torch.zeros(1, device=device); torch.cuda.synchronize()
def skeleton(manifest):
    # An nn.Module tree from the dotted names, parameters on the meta device: what an engine's model looks like to rebind.
    root, modules = torch.nn.Module(), {"": None}
    modules[""] = root
    for record in manifest.tensors:
        path, _, leaf = record.name.rpartition(".")
        parts, owner, walked = path.split(".") if path else [], root, ""
        for part in parts:
            walked = f"{walked}.{part}" if walked else part
            child = modules.get(walked)
            if child is None:
                child = modules[walked] = torch.nn.Module(); owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(record.shape, dtype=getattr(torch, record.dtype), device="meta"), requires_grad=False))
    return root
first = api.attach(fp, socket_dir); manifest = first.manifest; first.close()
runs = []
for index in range(repeat):
    model = skeleton(manifest)
    start = time.perf_counter()
    attachment = api.attach(fp, socket_dir)
    attached = time.perf_counter()
    rebind_module(model, attachment.tensors, attachment.manifest)
    done = time.perf_counter()
    runs.append({**{k: v for k, v in attachment.timings.items()}, "rebind_s": done - attached, "total_s": done - start})
    if index < repeat - 1:
        del model; attachment.close()
names = attachment.manifest.names
probe = [attachment.tensors[n].reshape(-1)[:64].view(torch.uint8).long().sum().item() for n in (names[0], names[len(names) // 2], names[-1])]
print(json.dumps({"phases_ms": {k: 1000 * statistics.median(r[k] for r in runs) for k in runs[0]}, "tensors": len(names),
                  "arenas": len(attachment.manifest.arenas), "probe": probe}), flush=True)
sys.stdin.readline()  # hold the attachment until told to go
del model
attachment.close()
"""


def run_engine(fingerprint: dict, socket_dir, device: str, repeat: int) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, json.dumps(fingerprint), str(socket_dir), device, str(repeat)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line:
        proc.wait(60)
        raise SystemExit(f"the engine failed (exit status {proc.returncode})")
    return proc, json.loads(line)


def measure(model: str, rank: bool, args, socket_dir, anchor: Path) -> dict:
    from weightcache.core.client.client import Connection

    specs = tensors_of(model, rank, args.layout)
    label = f"{model} {'EP8 rank 7' if rank else 'whole'}{', engine layout' if args.layout == 'fused' else ''}"
    print(f"{label}: {len(specs):,} tensors ...", flush=True)
    published = publish_case(specs, args.device, int(args.max_gib * GIB), socket_dir, anchor, label)
    first, figures = run_engine(published["fingerprint"], socket_dir, args.device, args.repeat)
    try:
        second, again = run_engine(published["fingerprint"], socket_dir, args.device, 1)
        try:
            with Connection(socket_dir) as conn:
                [entry] = conn.status()["entries"]
            one_copy = entry["digest"] == published["digest"] and {first.pid, second.pid} <= set(entry["attached_pids"])
            same_bytes = again["probe"] == figures["probe"]
        finally:
            second.communicate("\n", timeout=120)
    finally:
        first.communicate("\n", timeout=120)
    with Connection(socket_dir) as conn:
        conn.evict(published["digest"], force=True)
    return {"case": label, **published, **figures, "one_copy": one_copy, "same_bytes": same_bytes}


def wait_for_free_memory(device: str, timeout: float = 30.0) -> None:
    """Wait until the evicted case's GPU memory is back (the server and the engines release it as they close)."""
    if not device.startswith("cuda"):
        return
    import torch

    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if free == last:
            return
        last = free
        time.sleep(0.5)


def print_table(results: list[dict], device: str) -> None:
    phases = ["request_s", "manifest_s", "map_s", "views_s", "rebind_s", "total_s"]
    head = ["case", "tensors", "GiB", "manifest build", "seal", "publish (server check)"] + [p.removesuffix("_s") for p in phases]
    rows = [head]
    for r in results:
        n = r["tensors"]

        def per(seconds: float, n: int = n) -> str:
            return f"{seconds * 1000:,.1f} ms ({seconds * 1e6 / n:.2f})"

        rows.append(
            [
                r["case"] + (" (pooled)" if r["pooled"] else ""),
                f"{n:,}",
                f"{r['bytes'] / GIB:,.1f}",
                per(r["manifest_s"]),
                per(r["seal_s"]),
                per(r["publish_s"]),
                *(per(r["phases_ms"][p] / 1000) for p in phases),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print(f"\nattach -> ready model (rebound), {device}; each cell: median time (µs per tensor)")
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"one entry attached by both engines: {all(r['one_copy'] for r in results)}; "
          f"both read the same bytes: {all(r['same_bytes'] for r in results)}")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-gib", type=float, default=0.25, help="most bytes a case holds (more: records share a pool)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--cases", nargs="*", default=["rank", "whole"], choices=["rank", "whole"])
    parser.add_argument(
        "--layout",
        default="hf",
        choices=["hf", "fused"],
        help="hf: the checkpoint's tensors (transformers holds these); fused: as vLLM and SGLang hold them after loading",
    )
    parser.add_argument("--repeat", type=int, default=3, help="attaches per engine (the median is shown)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    from weightcache.core.client.client import wait_for_server

    socket_dir = Path(tempfile.mkdtemp(prefix="wc-scale-sock-"))
    anchor = Path(tempfile.mkdtemp(prefix="wc-scale-"))  # a checkpoint identity for the fingerprints (nothing is read)
    import torch
    from safetensors.torch import save_file

    save_file({"anchor": torch.zeros(1)}, anchor / "model.safetensors")
    server = subprocess.Popen(
        [sys.executable, "-m", "weightcache.core.cli.cli", "serve", "--socket-dir", str(socket_dir)], start_new_session=True
    )
    results = []
    try:
        wait_for_server(socket_dir, 30)
        for model in args.models:
            for case in args.cases:
                results.append(measure(model, case == "rank", args, socket_dir, anchor))
                print_table(results[-1:], args.device)  # each case as it ends: a run cut short keeps what it measured
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=2))
                wait_for_free_memory(args.device)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print_table(results, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    os.rmdir(socket_dir) if not any(socket_dir.iterdir()) else None
    return 0


if __name__ == "__main__":
    sys.exit(main())
