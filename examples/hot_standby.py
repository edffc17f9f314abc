"""Hot standby with `weightcache standby`: a warm spare takes over the moment the primary dies.

    python examples/hot_standby.py --model DIR [--device cuda:0] [--json]

It starts a server, publishes the model, starts a primary engine (client mode)
and, beside it, `weightcache standby --watch-pid PRIMARY` (attached to the same
entry: no second copy of the weights, imports and warm-up paid). Then it
SIGKILLs the primary and prints how long the standby took to notice and to
produce its first token, and whether that token is the primary's.
The command itself is documented in docs/operations.md ("Warm spare").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRIMARY = """
import json, os, sys, time
from weightcache import load_model
from weightcache.engine import LoadRequest
from weightcache.core.spare.standby import first_token, fixed_prompt  # the standby's own prompt and comparison

model, device, socket_dir = sys.argv[1:4]
loaded = load_model(model, mode="client", device=device, socket_dir=socket_dir, strict=True)
prompt = fixed_prompt(LoadRequest(model=model, device=device), loaded.model)  # the standby's prompt
print(json.dumps({"pid": os.getpid(), "token": first_token(loaded.model, prompt)}), flush=True)
while True:
    time.sleep(1)
"""


def _line(proc: subprocess.Popen) -> dict:
    text = proc.stdout.readline()
    if not text:
        raise SystemExit(f"a child exited with status {proc.wait()}; see its messages above")
    return json.loads(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--no-pidfd", action="store_true", help="make the standby poll /proc even where pidfds work")
    args = parser.parse_args(argv)

    from weightcache import ServerProcess
    from weightcache.adapter import LoadRequest
    from weightcache.engine import prepare, publish

    work = Path(tempfile.mkdtemp(prefix="wc-standby-"))
    server = ServerProcess.start(work / "sock")
    processes = []
    try:
        publish(prepare(LoadRequest(model=args.model, device=args.device)), server.socket_dir)
        primary = subprocess.Popen(
            [sys.executable, "-c", PRIMARY, args.model, args.device, str(server.socket_dir)], stdout=subprocess.PIPE, text=True
        )
        processes.append(primary)
        primary_state = _line(primary)
        standby = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weightcache.core.cli.cli",
                "standby",
                "--model",
                args.model,
                "--device",
                args.device,
                "--socket-dir",
                str(server.socket_dir),
                "--watch-pid",
                str(primary.pid),
                *(["--no-pidfd"] if args.no_pidfd else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        processes.append(standby)
        ready = _line(standby)  # attached, warmed up, waiting
        killed_at = time.monotonic()
        os.kill(primary.pid, signal.SIGKILL)
        took = _line(standby)
        result = {
            "takeover_ms": (took["trigger_at"] - killed_at) * 1000,
            "first_output_ms": (took["first_token_at"] - killed_at) * 1000,
            "outputs_identical": took["token"] == primary_state["token"],
            "watched_by": ready["watched_by"],
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
        print(
            f"primary SIGKILLed; the standby took over in {result['takeover_ms']:.1f} ms and produced its first token "
            f"{result['first_output_ms']:.1f} ms after the kill; same token as the primary: {result['outputs_identical']}; "
            f"primary watched by {result['watched_by']}"
        )
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
