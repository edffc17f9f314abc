"""Hot-standby takeover time: SIGKILL the primary engine, time until the standby's first output.

    python benchmarks/standby.py [--device cuda:0] [--runs 5] [--no-pidfd]
    python benchmarks/standby.py --detection [--runs 5] [--no-pidfd]

Runs examples/hot_standby.py several times on a random-weight Llama and prints the figures. ``--detection`` times
only the watcher: SIGKILL a primary that holds 1 GiB, time until the standby sees its exit (and until the zombie).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-pidfd", action="store_true", help="make the standby poll /proc even where pidfds work")
    parser.add_argument("--detection", action="store_true", help="time only the watcher's view of a killed primary")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.detection:
        return detection(args.runs, use_pidfd=not args.no_pidfd)
    from tests.models import save_random_model

    model = save_random_model("llama", Path(tempfile.mkdtemp(prefix="wc-standby-model-")), dtype="bfloat16")
    results = []
    for _ in range(args.runs):
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "hot_standby.py"), "--model", str(model), "--device", args.device, "--json"]
            + (["--no-pidfd"] if args.no_pidfd else []),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    takeover = [r["takeover_ms"] for r in results]
    first = [r["first_output_ms"] for r in results]
    print(f"\nhot standby on {args.device}, {args.runs} runs (primary SIGKILLed)")
    print(f"kill -> standby holds the role   : median {statistics.median(takeover):.1f} ms, max {max(takeover):.1f} ms")
    print(f"kill -> standby's first output   : median {statistics.median(first):.1f} ms, max {max(first):.1f} ms")
    print(f"outputs identical to the primary : {all(r['outputs_identical'] for r in results)}")
    print(f"primary watched by               : {', '.join(sorted({r['watched_by'] for r in results}))}")
    return 0


SLOW_EXIT = "import mmap, time; m = mmap.mmap(-1, 1 << 30); m.write(b'x' * (1 << 30)); print(flush=True); time.sleep(60)"
"""A primary that takes long to die: 1 GiB of host memory to free after the kill (as a GPU primary's mappings)."""


def detection(runs: int, use_pidfd: bool) -> int:
    """Kill -> seen and kill -> zombie, in milliseconds, over ``runs`` primaries."""
    import os
    import time

    from weightcache.core.spare.standby import _Triggers

    seen, zombie = [], []
    for _ in range(runs):
        primary = subprocess.Popen([sys.executable, "-c", SLOW_EXIT], stdout=subprocess.PIPE)
        primary.stdout.readline()
        triggers = _Triggers(primary.pid, None, use_pidfd=use_pidfd)
        try:
            killed = time.monotonic()
            primary.kill()
            seen.append((triggers.wait(timeout=10).at - killed) * 1000)
            os.waitid(os.P_PID, primary.pid, os.WEXITED | os.WNOWAIT)
            zombie.append((time.monotonic() - killed) * 1000)
        finally:
            triggers.close()
            primary.wait()
            primary.stdout.close()
    print(f"\nwatcher ({'pidfd and polling' if use_pidfd else 'polling'}), {runs} primaries of 1 GiB SIGKILLed")
    print(f"kill -> exit seen : median {statistics.median(seen):.1f} ms, max {max(seen):.1f} ms")
    print(f"kill -> zombie    : median {statistics.median(zombie):.1f} ms, max {max(zombie):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
