"""What the layout child costs, as it started before decision 59 and as it starts now, side by side.

    python benchmarks/layout_child.py CHECKPOINT_DIR [--runs 5]

Each round runs every variant once, in turn, each in a fresh interpreter: ``before`` (the child's code before decision
59: build the skeleton, print its layout, exit normally), ``gc-off``, ``refused`` (scikit-learn and scipy missing) and ``os-exit`` (one of the
three measures alone) and ``now`` (``python -m weightcache.adapters.hf.layout_child``, all three). Columns: seconds
from exec to the layout's first byte on the pipe (printed) and to the pipes' end (what the load waits for), medians
and the fastest of ``--runs``; then the modules each variant had imported once its layout was built (one more run
each). Every variant's layout must be the same bytes, or the benchmark stops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LEARN = """
import json, os, sys
{setup}
from weightcache.adapters.hf import identity, loading
from weightcache.core.request import LoadRequest
arguments = json.loads(sys.argv[1])
request = LoadRequest(model=arguments["model"], dtype=None, quantization=None, options=())
_, learned = loading.skeleton_and_layout(request, identity.load_dtype(request, identity.read_config(request.model)))
if os.environ.get("COUNT_MODULES"):
    print(len(sys.modules))
else:
    sys.stdout.buffer.write(learned.to_json())
sys.stdout.flush()
{end}
"""
VARIANTS = {
    "before": ("", ""),
    "gc-off": ("import gc; gc.disable()", ""),
    "refused": ("from weightcache.adapters.hf.layout_child import REFUSED\nfor name in REFUSED: sys.modules[name] = None", ""),
    "os-exit": ("", "os._exit(0)"),
}


def _command(variant: str, model: str) -> list[str]:
    arguments = json.dumps({"model": model, "dtype": None, "quantization": None, "options": []})
    if variant == "now":
        return [sys.executable, "-m", "weightcache.adapters.hf.layout_child", arguments]
    setup, end = VARIANTS[variant]
    return [sys.executable, "-c", LEARN.format(setup=setup, end=end), arguments]


def _run(command: list[str]) -> tuple[float, float, bytes]:
    """Seconds from exec to the first byte on stdout and to its end, and the bytes."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as a service runs it
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert child.stdout is not None
    chunks, first = [], None
    while chunk := os.read(child.stdout.fileno(), 1 << 20):
        first = first or time.perf_counter()
        chunks.append(chunk)
    end = time.perf_counter()
    if child.wait() != 0 or first is None:
        raise SystemExit(f"{command[:3]} failed with status {child.returncode}")
    return first - start, end - start, b"".join(chunks)


def _modules(command: list[str]) -> int:
    if command[1] == "-m":  # the child as it runs now, counted by the same code after its own prepare()
        command = [
            command[0],
            "-c",
            LEARN.format(setup="from weightcache.adapters.hf import layout_child; layout_child.prepare()", end=""),
            command[-1],
        ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "COUNT_MODULES": "1"}, check=True)
    return int(done.stdout.split()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    variants = [*VARIANTS, "now"]
    printed: dict[str, list[float]] = {v: [] for v in variants}
    ended: dict[str, list[float]] = {v: [] for v in variants}
    layouts = set()
    for _ in range(args.runs):
        for variant in variants:
            first, end, out = _run(_command(variant, args.model))
            printed[variant].append(first)
            ended[variant].append(end)
            layouts.add(out)
    if len(layouts) != 1:
        raise SystemExit("the variants printed different layouts")
    import transformers

    print(f"transformers {transformers.__version__}, {args.runs} runs, {os.cpu_count()} CPUs: median (fastest) seconds")
    print(f"{'variant':12} {'printed':>14} {'ended':>14} {'modules':>8}")
    for v in variants:
        row = [f"{statistics.median(t):.2f} ({min(t):.2f})" for t in (printed[v], ended[v])]
        print(f"{v:12} {row[0]:>14} {row[1]:>14} {_modules(_command(v, args.model)):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
