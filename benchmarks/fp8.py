"""Block-FP8: disk load + quantize vs attach of the cached, already quantized weights.

    python benchmarks/fp8.py                            # CPU, a ~0.2 B-parameter Llama
    python benchmarks/fp8.py --device cuda:0 --hidden 4096 --layers 8

Each row runs in a fresh engine process that imports its libraries before the clock
starts. Quantization is work the cache saves beyond the disk reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINE = r"""
import json, sys, time, hashlib, torch, transformers
from weightcache.core.flow.modes import load_model
model_path, mode, device, socket_dir = sys.argv[1:5]
transformers.LlamaForCausalLM
if device.startswith("cuda"):
    torch.zeros(1, device=device); torch.cuda.synchronize()
start = time.perf_counter()
loaded = load_model(model_path, mode=mode, device=device, socket_dir=socket_dir, quantization="fp8-block", strict=True)
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
ids = (torch.arange(64).reshape(2, 32) * 31 % loaded.model.config.vocab_size).to(device)
with torch.no_grad():
    out = loaded.model(input_ids=ids)[0].float().cpu()
print(json.dumps({"seconds": seconds, "source": loaded.source, "timings": loaded.timings,
                  "sha256": hashlib.sha256(out.numpy().tobytes()).hexdigest()}))
"""


def engine(model, mode, device, socket_dir) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, str(model), mode, device, str(socket_dir)], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode:
        raise SystemExit(f"{mode} engine failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from weightcache.core.client.client import wait_for_server
    from weightcache.core.flow.loader import prepare, publish
    from weightcache.core.request import LoadRequest

    work = Path(tempfile.mkdtemp(prefix="wc-fp8-"))
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-fp8-sock-"))
    server = subprocess.Popen(
        [sys.executable, "-m", "weightcache.core.cli.cli", "serve", "--socket-dir", str(socket_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        config = transformers.LlamaConfig(
            vocab_size=32000,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 128,
            num_key_value_heads=max(1, args.hidden // 512),
            architectures=["LlamaForCausalLM"],
        )
        with torch.device(args.device if args.device.startswith("cuda") else "cpu"):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(work)
        params = sum(p.numel() for p in model.parameters())
        del model
        wait_for_server(socket_dir, 30)
        disk = engine(work, "off", args.device, socket_dir)
        published = publish(prepare(LoadRequest(model=str(work), device=args.device, quantization="fp8-block")), socket_dir)
        attached = engine(work, "client", args.device, socket_dir)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(socket_dir, ignore_errors=True)
    same = disk["sha256"] == attached["sha256"] and attached["source"] == "cache"
    rows = [
        ("measure", "time", "note"),
        ("disk load + FP8 quantize", f"{disk['seconds'] * 1000:,.1f} ms", f"of which quantize {_share(disk)}"),
        (
            "publish (once: load, quantize, export)",
            f"{sum(published.timings.values()) * 1000:,.1f} ms",
            f"{published.manifest.nbytes / 2**20:,.0f} MiB cached",
        ),
        (
            "attach (map + rebind, no quantize)",
            f"{attached['seconds'] * 1000:,.1f} ms",
            f"{disk['seconds'] / attached['seconds']:,.1f}x faster",
        ),
        ("outputs bit-identical", "yes" if same else "NO", attached["sha256"][:16]),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"\nLlama {params / 1e9:.2f} B parameters (bf16 -> block FP8) on {args.device}, torch {torch.__version__}")
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if args.json:
        Path(args.json).write_text(json.dumps({"disk": disk, "attached": attached, "params": params}, indent=2))
    return 0 if same else 1


def _share(result: dict) -> str:
    timings = result["timings"]
    return f"{timings['quantize_s'] * 1000:,.1f} ms ({timings['quantize_s'] / result['seconds']:.0%})"


if __name__ == "__main__":
    sys.exit(main())
