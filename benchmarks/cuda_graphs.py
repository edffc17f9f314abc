"""What capturing CUDA graphs costs an engine at start, and what a captured graph saves a step.

    python benchmarks/cuda_graphs.py --size 8b --device cuda:0 --json OUT.json
    python benchmarks/cuda_graphs.py --size tiny --device cpu              # the decode step only (no graphs on a CPU)

One process builds restart.py's Qwen3-shaped model with random bf16 weights on the device (the weights' origin does
not change what a capture costs: it records kernels and addresses, never weight values), then, as an engine does at
start, captures one decode step per batch size with ``torch.cuda.graph``, largest first, all graphs in one memory pool
(vLLM's default sizes: 1, 2, 4 and every multiple of 8 up to ``--max-batch``). Each batch size has its own static KV
cache (``transformers.StaticCache``, ``--cache-len`` slots) and static inputs.

Reported: CUDA's set-up and the first eager step (library handles, kernel loading), each size's warm-up and capture,
the total an engine pays before it serves, the pool's memory, and, for a few sizes, an eager step against a replay
(median of ``--steps``), with the replay's logits compared bit for bit with an eager step's on the same inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import restart  # benchmarks/restart.py: the model shapes and the machine facts


def vllm_sizes(max_batch: int) -> list[int]:
    """vLLM's default capture sizes up to ``max_batch``: 1, 2, 4, then every multiple of 8."""
    return [size for size in [1, 2, 4, *range(8, max_batch + 1, 8)] if size <= max_batch]


def build_model(size: str, device):
    import torch
    import transformers

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers
        from transformers.modeling_utils import no_init_weights
    config = transformers.Qwen3Config(**{"tie_word_embeddings": False, **restart.SIZES[size]})
    with device, no_init_weights():
        model = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


class DecodeStep:
    """One batch size's static inputs, static KV cache and decode step (one token per sequence)."""

    def __init__(self, model, batch: int, cache_len: int, device) -> None:
        import torch
        import transformers

        self.model = model
        self.cache = transformers.StaticCache(
            config=model.config, max_cache_len=cache_len, max_batch_size=batch, device=device, dtype=torch.bfloat16
        )
        generator = torch.Generator(device="cpu").manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=generator)
        self.input_ids = ids.to(device)
        self.position = cache_len // 2
        self.cache_position = torch.tensor([self.position], device=device)
        self.position_ids = torch.full((batch, 1), self.position, device=device)
        # transformers 5 renamed the forward's cache argument; older releases take past_key_values
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def rewind(self) -> None:
        """Put the cache's write position back (transformers 5's static layers count it on the device; a graph replay
        advances it like an eager step), so every step and replay writes the same slot."""
        for layer in getattr(self.cache, "layers", ()):
            counter = getattr(layer, "cumulative_length", None)
            if hasattr(counter, "fill_"):
                counter.fill_(self.position)

    def __call__(self):
        return self.model(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            cache_position=self.cache_position,
            **{self.cache_argument: self.cache},
            use_cache=True,
        ).logits


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(torch, device, call, steps: int, before=lambda: None) -> float:
    times = []
    for _ in range(steps):
        before()
        _sync(torch, device)
        start = time.perf_counter()
        call()
        _sync(torch, device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(args) -> dict:
    import torch

    device = torch.device(args.device)
    result: dict = {"size": args.size, "cache_len": args.cache_len}
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
        _sync(torch, device)
    result["cuda_context_s"] = time.perf_counter() - start
    start = time.perf_counter()
    model = build_model(args.size, device)
    _sync(torch, device)
    result["build_s"] = time.perf_counter() - start
    result["parameters"] = sum(p.numel() for p in model.parameters())
    sizes = sorted(vllm_sizes(args.max_batch) if args.sizes == "vllm" else map(int, args.sizes.split(",")), reverse=True)
    with torch.inference_mode():
        first = DecodeStep(model, 1, args.cache_len, device)
        start = time.perf_counter()
        first()
        _sync(torch, device)
        result["first_eager_step_s"] = time.perf_counter() - start
        if device.type != "cuda":
            result["eager_step_ms"] = median_ms(torch, device, first, args.steps)
            return result
        result["captures"], result["pool_and_caches_bytes"] = capture_all(torch, device, model, sizes, args)
    captures = result["captures"]
    result["capture_total_s"] = sum(c["warmup_s"] + c["capture_s"] for c in captures.values())
    result["graphs"] = len(captures)
    return result


def capture_all(torch, device, model, sizes: list[int], args) -> tuple[dict, int]:
    """Capture each size's decode step (largest first, one pool); compare eager and replay for ``--compare`` sizes."""
    pool = None
    captures: dict = {}
    steps: dict = {}
    compare = {int(size) for size in args.compare.split(",")} | {sizes[0], sizes[-1]}
    reserved_before = torch.cuda.memory_reserved(device)
    for batch in sizes:
        step = DecodeStep(model, batch, args.cache_len, device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(2):  # as torch.cuda.graphs asks: warm up on a side stream (lazy init, autotuning)
                step.rewind()
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        _sync(torch, device)
        warmup_s = time.perf_counter() - start
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        step.rewind()
        with torch.cuda.graph(graph, pool=pool):
            output = step()
        _sync(torch, device)
        capture_s = time.perf_counter() - start
        pool = graph.pool() if pool is None else pool
        captures[batch] = {"warmup_s": warmup_s, "capture_s": capture_s}
        steps[batch] = (step, graph, output)
    captures_bytes = torch.cuda.memory_reserved(device) - reserved_before
    for batch in sorted(compare & set(steps)):
        step, graph, output = steps[batch]
        step.rewind()
        graph.replay()
        _sync(torch, device)
        replayed = output.clone()
        step.rewind()
        eager = step()  # the same static inputs, the same cache slot: the same logits
        captures[batch].update(
            eager_ms=median_ms(torch, device, step, args.steps, before=step.rewind),
            replay_ms=median_ms(torch, device, graph.replay, args.steps, before=step.rewind),
            replay_equals_eager=bool(torch.equal(replayed, eager)),
        )
    return captures, captures_bytes


def table(result: dict) -> str:
    lines = [
        f"CUDA graphs of a decode step: {result['size']} ({result['parameters'] / 1e9:.2f} B parameters), "
        f"{result['machine'].get('gpu', result['machine']['device'])}, {result['machine']['date']}",
        f"  CUDA context {result['cuda_context_s']:.2f} s; first eager step {result['first_eager_step_s']:.3f} s",
    ]
    captures = result.get("captures")
    if not captures:
        return "\n".join([*lines, f"  eager step {result['eager_step_ms']:.1f} ms (no graphs on {result['machine']['device']})"])
    sizes = list(captures)
    lines.append(
        f"  {result['graphs']} graphs (batch {min(sizes)}..{max(sizes)}): {result['capture_total_s']:.2f} s to warm up and "
        f"capture, {result['pool_and_caches_bytes'] / 2**30:.2f} GiB for the pool and the {result['cache_len']}-slot "
        "static KV caches"
    )
    lines.append(
        f"  {'batch':>5} {'warm-up s':>10} {'capture s':>10} {'eager ms':>9} {'replay ms':>10} {'replay/eager':>13}  bit-equal"
    )
    for size in sorted(sizes):
        row = captures[size]
        timing = (
            f"{row['eager_ms']:>9.2f} {row['replay_ms']:>10.2f} {row['replay_ms'] / row['eager_ms']:>13.2f}  "
            f"{row['replay_equals_eager']}"
            if "eager_ms" in row
            else ""
        )
        lines.append(f"  {size:>5} {row['warmup_s']:>10.3f} {row['capture_s']:>10.3f} {timing}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=restart.SIZES, default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="vllm", help="'vllm' (1, 2, 4, 8, 16, ... --max-batch) or a list: 1,8,64")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--cache-len", type=int, default=32, help="static KV cache slots per sequence")
    parser.add_argument("--compare", default="1,8,64", help="batch sizes whose eager step and replay are timed")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(args)
    result["machine"] = restart.machine(args.device, {**__import__("os").environ})
    result = json.loads(json.dumps(result))  # the batch sizes as JSON keys, as the file has them
    with contextlib.suppress(KeyError):
        result["captures"] = {int(k): v for k, v in result["captures"].items()}
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
