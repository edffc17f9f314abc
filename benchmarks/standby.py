"""Hot-standby takeover time: SIGKILL the primary engine, time until the standby's first output.

    python benchmarks/standby.py [--device cuda:0] [--runs 5] [--no-pidfd]

Runs examples/hot_standby.py several times on a random-weight Llama and prints the figures.
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
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
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


if __name__ == "__main__":
    sys.exit(main())
