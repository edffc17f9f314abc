#!/usr/bin/env python3
"""vLLM's ``vllm.LLM`` on the GPU: its own load, then ``load_format="weightcache"`` (daemon, then strict client).

    python3 tests/gpu/engine_llm.py MODEL OUT.json [--socket-dir DIR] [--eager] [--variants plain,daemon,client]

Each variant runs in a process of its own (the engine's CUDA state and its core process end with it): it builds
``vllm.LLM`` on the checkpoint, times construction to ready and to the first token, then takes greedy tokens for
``PROMPTS``. The daemon variant loads, publishes and maps the weights through the weightcache server it starts in
``--socket-dir``; the client variant maps that entry (strict: a miss is an error). The tokens of every variant must
equal the plain load's; OUT.json holds each variant's record and the comparison. Exit status: 0 all equal, 1 a
variant differs or failed, 2 the plain load itself gave no tokens. WC_VARIANT_TIMEOUT_S bounds each variant (300 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[11, 250, 3999, 42, 7, 18, 900], [5, 6, 7, 8], [31000, 2, 77, 1500, 123, 9, 64, 4096, 12]]
MAX_TOKENS = 24
VARIANT_TIMEOUT_S = int(os.environ.get("WC_VARIANT_TIMEOUT_S", "300"))  # one engine start and its tokens


def build_llm(model: str, variant: str, socket_dir: str, eager: bool, memory: float):
    """``vllm.LLM`` on MODEL: its own load (``plain``) or weightcache's (``daemon``, or ``client``: strict)."""
    from vllm import LLM

    options: dict = {}
    if variant != "plain":
        mode = {"mode": variant, "socket_dir": socket_dir, "strict": variant == "client"}
        options = {"load_format": "weightcache", "model_loader_extra_config": mode}
    if eager:
        options["enforce_eager"] = True
    else:  # CUDA graphs over the (mapped) weights, without torch.compile's minutes
        options["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}
    return LLM(model=model, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=memory, **options)


def child(args: argparse.Namespace) -> None:
    t0 = time.time()
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    imported = time.time()
    llm = build_llm(args.model, args.variant, args.socket_dir, args.eager, args.memory)
    ready = time.time()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS], params, use_tqdm=False)
    report = {
        "variant": args.variant,
        "import_s": round(imported - t0, 2),
        "ready_s": round(ready - t0, 2),
        "first_token_s": round(first - t0, 2),
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "gpu_bytes_in_use": torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0],
    }
    print("ENGINE_LLM " + json.dumps(report), flush=True)
    del llm


def identical(variants: dict) -> dict:
    """Per variant but the plain load: its tokens equal the plain load's (never where either has none)."""
    plain = variants.get("plain", {}).get("tokens")
    return {name: plain is not None and record.get("tokens") == plain for name, record in variants.items() if name != "plain"}


def parent(args: argparse.Namespace) -> int:
    results: dict = {"model": args.model, "variants": {}}
    Path(args.socket_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, args.model, args.out, "--variant", variant, "--socket-dir", args.socket_dir]
        command += ["--memory", str(args.memory)] + (["--eager"] if args.eager else [])
        start = time.monotonic()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=VARIANT_TIMEOUT_S, env=os.environ)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE_LLM ")]
            record = json.loads(lines[-1][len("ENGINE_LLM ") :]) if lines else {"error": proc.stderr[-4000:]}
        except subprocess.TimeoutExpired as exc:
            record = {"error": f"timed out after {VARIANT_TIMEOUT_S} s", "stderr": str(exc.stderr)[-3000:]}
        record["wall_s"] = round(time.monotonic() - start, 1)
        results["variants"][variant] = record
        print(f"vllm.LLM {variant}: " + json.dumps({k: v for k, v in record.items() if k != "tokens"})[:3000], flush=True)
    plain = results["variants"].get("plain", {}).get("tokens")
    results["identical"] = identical(results["variants"])
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("vllm.LLM tokens identical to the plain load: " + json.dumps(results["identical"]), flush=True)
    if plain is None:
        return 2  # the engine's own load gave no tokens: nothing to compare with (engine_gpu.sh tries eager then)
    return 0 if all(results["identical"].values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--socket-dir", default="/tmp/wc-engine-llm")
    parser.add_argument("--variants", default="plain,daemon,client")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization")
    args = parser.parse_args()
    if args.variant:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
