"""Hot standby: a second engine attached to the same weights takes over when the primary dies.

    python examples/hot_standby.py --model DIR [--device cuda:0]

The standby attaches in client mode (no second copy of the weights), runs one warm-up
forward, then waits on the primary's role lock. The kernel releases the lock the moment
the primary dies, however it dies, so the standby serves within milliseconds. The script
SIGKILLs the primary and prints how long the takeover took.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def forward_digest(model, device: str) -> str:
    import torch

    ids = (torch.arange(32).reshape(2, 16) * 31 % model.config.vocab_size).to(device)
    with torch.no_grad():
        out = model(input_ids=ids)[0]
    return hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()


def engine(role: str, model: str, device: str, socket_dir: str, lock_path: str) -> None:
    """Run as the primary (takes the role lock, serves until killed) or the standby (waits for the lock)."""
    from weightcache.core.modes import load_model

    loaded = load_model(model, mode="client", device=device, socket_dir=socket_dir, strict=True)
    digest = forward_digest(loaded.model, device)  # warm-up: kernels and caches ready before any takeover
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    if role == "primary":
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(json.dumps({"role": "primary", "serving": True, "pid": os.getpid(), "digest": digest}), flush=True)
        while True:
            time.sleep(1)
    print(json.dumps({"role": "standby", "waiting": True, "pid": os.getpid()}), flush=True)
    fcntl.flock(lock, fcntl.LOCK_EX)  # returns when the primary is gone
    took_over = time.monotonic()
    digest = forward_digest(loaded.model, device)
    print(json.dumps({"role": "standby", "serving": True, "took_over_at": took_over,
                      "first_output_at": time.monotonic(), "digest": digest}), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--role", choices=["primary", "standby"], help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    parser.add_argument("--lock", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        engine(args.role, args.model, args.device, args.socket_dir, args.lock)
        return 0

    from weightcache.core.server_process import ServerProcess
    from weightcache.core.loader import prepare, publish
    from weightcache.core.request import LoadRequest

    work = Path(tempfile.mkdtemp(prefix="wc-standby-"))
    socket_dir, lock = work / "sock", work / "primary.lock"
    server = ServerProcess.start(socket_dir)
    processes = []
    try:
        publish(prepare(LoadRequest(model=args.model, device=args.device)), socket_dir)
        base = [sys.executable, __file__, "--model", args.model, "--device", args.device, "--socket-dir", str(socket_dir), "--lock", str(lock)]
        primary = subprocess.Popen(base + ["--role", "primary"], stdout=subprocess.PIPE, text=True)
        processes.append(primary)
        primary_state = json.loads(primary.stdout.readline())
        standby = subprocess.Popen(base + ["--role", "standby"], stdout=subprocess.PIPE, text=True)
        processes.append(standby)
        json.loads(standby.stdout.readline())  # attached, warmed up and waiting
        killed_at = time.monotonic()
        primary.send_signal(signal.SIGKILL)
        state = json.loads(standby.stdout.readline())
        result = {
            "takeover_ms": (state["took_over_at"] - killed_at) * 1000,
            "first_output_ms": (state["first_output_at"] - killed_at) * 1000,
            "outputs_identical": state["digest"] == primary_state["digest"],
            "device": args.device,
        }
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        server.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"primary SIGKILLed; standby took over in {result['takeover_ms']:.1f} ms and produced its first output "
              f"{result['first_output_ms']:.1f} ms after the kill; outputs identical: {result['outputs_identical']}")
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
