"""Compile artifacts beside the weights: a restarted engine's first compiled forward, cold vs restored.

    python benchmarks/compile_cache.py                                   # tiny Qwen3 on the CPU (inductor's C++ backend)
    python benchmarks/compile_cache.py --size 1b --device cuda:0 --json OUT.json

A server holds the model's entry. Then, for each run, two fresh engine processes, each with empty
inductor and Triton cache directories (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``):

- cold: attach, ``torch.compile``, first forward, then ``publish_artifacts`` (the bytes
  ``torch.compiler.save_cache_artifacts()`` returns, kept beside the entry as a sealed memfd);
- restored: attach, ``restore_artifacts`` (``torch.compiler.load_cache_artifacts``), ``torch.compile``,
  first forward;
- launched (``--launcher``): the restored engine forked from ``weightcache launcher`` (started beforehand with that
  run's empty cache directories, which the engine shares: the launcher runs an engine only in its own environment's
  values of names torch reads at import), timed from ``weightcache launch``'s spawn.

Both report import, attach, restore, compile + first forward and publish times, inductor's
FX-graph cache hits and misses, and a digest of the logits (the two must be equal bit for bit).
Checkpoints come from ``benchmarks/restart.py`` (``--size``: tiny, small, 1b, 8b).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import restart  # benchmarks/restart.py: checkpoints, the child environment, the machine facts

ENGINE = r"""
import hashlib, json, sys, time
began = time.monotonic()
spawned_at, model, device, socket_dir, role = float(sys.argv[1]), *sys.argv[2:6]
import torch, transformers
from torch._dynamo.utils import counters
from weightcache.core.spare.compile_cache import publish_artifacts, restore_artifacts
from weightcache.core.flow.modes import load_model
from weightcache.core.request import LoadRequest
from weightcache.core.spare.standby import fixed_prompt
report = {"imports_s": time.monotonic() - began}
start = time.perf_counter()
loaded = load_model(model, mode="client", device=device, socket_dir=socket_dir, strict=True)
report["attach_s"] = time.perf_counter() - start
if role in ("restored", "launched"):
    restored = restore_artifacts(loaded, strict=True)
    report.update(restore_s=restored.seconds if restored else None, restored_bytes=restored.nbytes if restored else 0)
prompt = fixed_prompt(LoadRequest(model=model, device=device), loaded.model)
compiled = torch.compile(loaded.model)
start = time.perf_counter()
with torch.inference_mode():
    logits = compiled(**prompt).logits
    digest = hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()
report["compile_first_forward_s"] = time.perf_counter() - start
if role == "cold":
    published = publish_artifacts(loaded, strict=True)
    report.update(publish_s=published.seconds, artifact_bytes=published.nbytes, key=published.key)
report.update(digest=digest, fx_hits=counters["inductor"]["fxgraph_cache_hit"], fx_misses=counters["inductor"]["fxgraph_cache_miss"],
              exec_to_first_forward_s=time.monotonic() - spawned_at)
print(json.dumps(report), flush=True)
"""


def engine(role: str, model: Path, device: str, socket_dir: Path, env: dict, caches: Path) -> dict:
    caches.mkdir(parents=True)
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    prefix = [sys.executable]
    launcher = None
    if role == "launched":
        launcher = subprocess.Popen(
            [sys.executable, "-m", "weightcache.core.cli.cli", "launcher", "--socket-dir", str(caches / "launcher")],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        restart._json_line(launcher, "launcher")
        prefix = [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "launch",
            "--socket-dir",
            str(caches / "launcher"),
            "--strict",
            "--",
        ]
    try:
        proc = subprocess.run(
            [*prefix, "-c", ENGINE, repr(time.monotonic()), str(model), device, str(socket_dir), role],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            timeout=1800,
        )
    finally:
        if launcher is not None:
            launcher.terminate()
            launcher.wait(timeout=60)
            launcher.stdout.close()
    if proc.returncode:
        raise SystemExit(f"the {role} engine failed with status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(restart.SIZES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--keep-checkpoint", metavar="DIR", help="build the checkpoint here and keep it (reused when it is there)"
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--launcher", action="store_true", help="also run the restored engine forked from a launcher")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="wc-compile-"))
    server = None
    try:
        env, model = restart.checkpoint_here(args.size, args.device, args.keep_checkpoint, work)
        from weightcache.core.server.server_process import ServerProcess

        server = ServerProcess.start(work / "sock")
        restart.publish_with_cli(model, args.device, server.socket_dir, env)
        runs = []
        for run in range(args.runs):
            cold = engine("cold", model, args.device, server.socket_dir, env, work / f"caches-{run}-cold")
            restored = engine("restored", model, args.device, server.socket_dir, env, work / f"caches-{run}-restored")
            runs.append({"cold": cold, "restored": restored})
            if args.launcher:
                runs[-1]["launched"] = engine(
                    "launched", model, args.device, server.socket_dir, env, work / f"caches-{run}-launched"
                )
                print(
                    f"run {run + 1}/{args.runs}: launched, exec -> first compiled forward {runs[-1]['launched']['exec_to_first_forward_s']:.2f} s",
                    flush=True,
                )
            print(
                f"run {run + 1}/{args.runs}: compile + first forward cold {cold['compile_first_forward_s']:.1f} s, "
                f"restored {restored['restore_s']:.2f} + {restored['compile_first_forward_s']:.1f} s",
                flush=True,
            )
        result = {
            "size": args.size,
            "runs": runs,
            "machine": restart.machine(args.device, env),
            "model": json.loads((model / restart.MARKER).read_text()),
            "outputs_identical": all(r["cold"]["digest"] == r[role]["digest"] for r in runs for role in r if role != "cold"),
            "restored_from_the_cache": all(r["restored"]["fx_hits"] > 0 and r["restored"]["fx_misses"] == 0 for r in runs),
        }
        result["table"] = table(result)
        print("\n" + result["table"])
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return 0 if result["outputs_identical"] and result["restored_from_the_cache"] else 1
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)


def table(result: dict) -> str:
    def median(role: str, key: str) -> float:
        return statistics.median(run[role][key] or 0.0 for run in result["runs"])

    cold_total = median("cold", "compile_first_forward_s")
    restored_total = median("restored", "restore_s") + median("restored", "compile_first_forward_s")
    rows = [
        ("(s, median)", "cold", "restored"),
        ("imports (torch, transformers)", f"{median('cold', 'imports_s'):.2f}", f"{median('restored', 'imports_s'):.2f}"),
        ("attach", f"{median('cold', 'attach_s'):.2f}", f"{median('restored', 'attach_s'):.2f}"),
        ("restore artifacts (get + load_cache_artifacts)", "—", f"{median('restored', 'restore_s'):.2f}"),
        ("torch.compile + first forward", f"{cold_total:.2f}", f"{median('restored', 'compile_first_forward_s'):.2f}"),
        (
            "attach done -> first compiled forward",
            f"{cold_total:.2f}",
            f"{restored_total:.2f} ({cold_total / restored_total:.1f}x faster)",
        ),
        (
            "exec -> first compiled forward",
            f"{median('cold', 'exec_to_first_forward_s'):.2f}",
            f"{median('restored', 'exec_to_first_forward_s'):.2f}",
        ),
        ("publish artifacts (once, after the cold compile)", f"{median('cold', 'publish_s'):.2f}", "—"),
    ]
    if "launched" in result["runs"][0]:
        rows.append(("launched (launch -> first compiled forward)", "", f"{median('launched', 'exec_to_first_forward_s'):.2f}"))
        rows.append(
            (
                "launched: imports / attach / restore / compile + forward",
                "",
                " / ".join(
                    f"{median('launched', key):.2f}" for key in ("imports_s", "attach_s", "restore_s", "compile_first_forward_s")
                ),
            )
        )
    first = result["runs"][0]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    head = (
        f"torch.compile, Qwen3 {result['size']} ({restart.parameter_count(result['model']['parameters'])} parameters), "
        f"{result['machine']['device']}, median of {len(result['runs'])} run(s); "
        f"artifacts {first['cold']['artifact_bytes'] / 2**20:.1f} MiB"
    )
    tail = (
        f"outputs identical bit for bit: {result['outputs_identical']}; restored compiles hit inductor's cache "
        f"(FX graph hits {first['restored']['fx_hits']}, misses {first['restored']['fx_misses']}): {result['restored_from_the_cache']}"
    )
    return "\n".join([head, *lines, tail])


if __name__ == "__main__":
    sys.exit(main())
