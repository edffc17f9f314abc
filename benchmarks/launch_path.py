"""The launched path before the first forward: ``weightcache launch`` → the engine's first line → ``load_model``.

    python benchmarks/launch_path.py --model DIR [--checkout NAME=DIR ...] [--runs 9] [--holder]

For each checkout (default: this one; ``git archive COMMIT | tar -x -C DIR`` makes another) a launcher is started
beforehand; then, run by run and checkout by checkout in turn (so that the machine's load falls on all alike), an
engine is started through ``weightcache launch --strict`` and one by exec. The engine reports two spans: from the
``launch`` command's spawn (or the interpreter's) to its first line, and from there to the point where an engine calls
``load_model``: torch and transformers imported, the installed adapters loaded, the model's module imported through
the adapter's warm-up hook. ``--holder`` starts, as the engine's first act, a thread that runs Python for 0.7 s (it
stands for the early CUDA thread, which takes the interpreter between its ops): what that does to the route.
``DIR`` is a checkpoint directory (``benchmarks/restart.py --keep-checkpoint DIR`` leaves one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = r"""
import time
first_line = time.monotonic()
import sys, threading
if sys.argv[2] == "holder":
    def hold(until):
        while time.monotonic() < until:
            sum(range(1000))
    threading.Thread(target=hold, args=(first_line + 0.7,), daemon=True).start()
from weightcache.core.spare.warm import start_cuda_early
start_cuda_early("cpu")
import torch, transformers
from weightcache.core.flow.plugins import installed_plugins
from weightcache.core.request import LoadRequest
request = LoadRequest(model=sys.argv[1], device="cpu")
installed_plugins().adapter(request.adapter).warm_up(request)
print(first_line, time.monotonic())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint directory")
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR", help="a checkout to compare")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--holder", action="store_true", help="a thread that runs Python for 0.7 s beside the route")
    args = parser.parse_args()
    checkouts = dict(c.split("=", 1) for c in args.checkout) or {"this checkout": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="wc-launch-path-"))
    engine = work / "engine.py"
    engine.write_text(ENGINE)
    launchers = {}
    try:
        for name, checkout in checkouts.items():
            env = {**os.environ, "PYTHONPATH": checkout, "HF_HUB_OFFLINE": "1"}
            socket_dir = work / f"sock-{len(launchers)}"
            socket_dir.mkdir(mode=0o700)
            command = [sys.executable, "-m", "weightcache.core.cli.cli", "launcher", "--socket-dir", str(socket_dir)]
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=work)
            if not proc.stdout.readline().startswith("{"):
                raise SystemExit(f"the launcher of {name} did not start")
            launchers[name] = (proc, socket_dir, env)
        target = [str(engine), str(Path(args.model).resolve()), "holder" if args.holder else "-"]
        spans: dict[str, list[tuple[float, float]]] = {name: [] for name in [*launchers, "exec"]}
        for _ in range(args.runs):
            for name in spans:
                if name == "exec":
                    env, command = launchers[next(iter(launchers))][2], [sys.executable, *target]
                else:
                    _, socket_dir, env = launchers[name]
                    command = [sys.executable, "-m", "weightcache.core.cli.cli", "launch", "--socket-dir", str(socket_dir)]
                    command += ["--strict", "--", *target]
                began = time.monotonic()
                done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, check=True)
                first_line, route_end = map(float, done.stdout.split()[-2:])
                spans[name].append((first_line - began, route_end - first_line))
    finally:
        for proc, _, _ in launchers.values():
            proc.terminate()
            proc.wait()
            proc.stdout.close()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"medians of {args.runs} (min), seconds; load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print(f"{'':16}{'to the first line':>20}{'route to load_model':>22}{'together':>18}")
    for name, rows in spans.items():
        together = [a + b for a, b in rows]
        columns = [[a for a, _ in rows], [b for _, b in rows], together]
        print(f"{name:16}" + "".join(f"{statistics.median(c):>12.3f} ({min(c):.3f})" for c in columns))


if __name__ == "__main__":
    main()
