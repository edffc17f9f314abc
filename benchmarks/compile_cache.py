"""Compile artifacts beside the weights: a restarted engine's first compiled forward, cold vs restored.

    python benchmarks/compile_cache.py                                   # tiny Qwen3 on the CPU (inductor's C++ backend)
    python benchmarks/compile_cache.py --size 1b --device cuda:0 --json OUT.json

A server holds the model's entry. Then, for each run, two fresh engine processes, each with empty
inductor and Triton cache directories (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``):

- cold: attach, ``torch.compile``, first forward, then ``publish_artifacts`` (the bytes
  ``torch.compiler.save_cache_artifacts()`` returns, kept beside the entry as a sealed memfd);
- restored: attach, ``restore_artifacts`` (``torch.compiler.load_cache_artifacts``), ``torch.compile``,
  first forward;
- ahead: attach, ``compile_ahead`` (torch's ahead-of-time compile of ``model(**inputs)``), first forward, then
  ``publish_compiled`` (the compiled function, kept beside the entry as a sealed memfd);
- ahead-restored: attach, ``restore_compiled`` (``torch.compiler.load_compiled_function``: no tracing), first forward;
- launched and ahead-launched (``--launcher``): the restored and the ahead-restored engine forked from
  ``weightcache launcher`` (started beforehand with that run's empty cache directories, which the engine shares: the
  launcher runs an engine only in its own environment's values of names torch reads at import), timed from
  ``weightcache launch``'s spawn;
- on a GPU, also ahead-launched-cuda (the same through ``weightcache launcher --cuda-ready DEVICE``: the child forked
  ahead has its CUDA context) and ahead-relaunched (that, with the cache directories the ahead engine compiled into:
  a restart on the same machine, which finds inductor's and Triton's caches on its disk).

Each reports import, attach, restore, compile + first forward and publish times, inductor's
FX-graph cache hits and misses, the frames Dynamo traced, and a digest of the logits (all must be equal bit for bit).
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
import restart_runner  # the launcher's first line, its child forked ahead
import restart_table

ENGINE = r"""
import hashlib, json, sys, time
began = time.monotonic()
spawned_at, model, device, socket_dir, role = float(sys.argv[1]), *sys.argv[2:6]
import torch, transformers
from torch._dynamo.utils import counters
from weightcache.core.spare.compile_cache import publish_artifacts, restore_artifacts
from weightcache.core.spare.compiled_forward import compile_ahead, publish_compiled, restore_compiled
from weightcache.core.flow.modes import load_model
from weightcache.core.request import LoadRequest
from weightcache.core.spare.standby import fixed_prompt
report = {"imports_s": time.monotonic() - began}
start = time.perf_counter()
loaded = load_model(model, mode="client", device=device, socket_dir=socket_dir, strict=True)
report["attach_s"] = time.perf_counter() - start
ahead = role.startswith("ahead")
if role in ("restored", "launched"):
    restored = restore_artifacts(loaded, strict=True)
    report.update(restore_s=restored.seconds if restored else None, restored_bytes=restored.nbytes if restored else 0)
prompt = fixed_prompt(LoadRequest(model=model, device=device), loaded.model)
if role.startswith("ahead-"):
    start = time.perf_counter()
    compiled = restore_compiled(loaded, prompt, strict=True)
    report.update(restore_s=time.perf_counter() - start, restored=compiled is not None)
    if compiled is None:
        raise SystemExit("no compiled forward was restored")
start = time.perf_counter()
if role == "ahead":
    compiled = compile_ahead(loaded.model, prompt)
elif not ahead:
    compiled = torch.compile(loaded.model)
with torch.inference_mode():
    logits = compiled(**prompt).logits
    digest = hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()
report["compile_first_forward_s"] = time.perf_counter() - start
if role == "cold":
    published = publish_artifacts(loaded, strict=True)
    report.update(publish_s=published.seconds, artifact_bytes=published.nbytes, key=published.key)
if role == "ahead":
    published = publish_compiled(loaded, compiled, strict=True)
    report.update(publish_s=published.seconds, artifact_bytes=published.nbytes, key=published.key)
report["dynamo_frames"] = counters["frames"]["total"]
report.update(digest=digest, fx_hits=counters["inductor"]["fxgraph_cache_hit"], fx_misses=counters["inductor"]["fxgraph_cache_miss"],
              exec_to_first_forward_s=time.monotonic() - spawned_at)
print(json.dumps(report), flush=True)
"""


LAUNCHED = ("launched", "ahead-launched", "ahead-launched-cuda", "ahead-relaunched")
AHEAD_RESTORED = ("ahead-restored", "ahead-launched", "ahead-launched-cuda", "ahead-relaunched")
CUDA_READY = ("ahead-launched-cuda", "ahead-relaunched")


def engine(role: str, model: Path, device: str, socket_dir: Path, env: dict, caches: Path) -> dict:
    caches.mkdir(parents=True, exist_ok=True)
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")}
    prefix = [sys.executable]
    launcher = None
    if role in LAUNCHED:
        ready = ["--cuda-ready", device] if role in CUDA_READY else []
        launcher = subprocess.Popen(
            [sys.executable, "-m", "weightcache.core.cli.cli", "launcher", "--socket-dir", str(caches / "launcher"), *ready],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        restart_runner.json_line(launcher, "launcher")
        restart_runner.wait_ahead_ready(caches / "launcher")
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
            roles = ["cold", "restored", "ahead", "ahead-restored"] + (["launched", "ahead-launched"] if args.launcher else [])
            if args.launcher and args.device.startswith("cuda"):
                roles += list(CUDA_READY)
            caches = {role: work / f"caches-{run}-{role}" for role in roles}
            caches["ahead-relaunched"] = caches["ahead"]  # the caches the ahead engine compiled into, kept on this disk
            runs.append({role: engine(role, model, args.device, server.socket_dir, env, caches[role]) for role in roles})
            report = runs[-1]
            print(
                f"run {run + 1}/{args.runs}: compile + first forward cold {report['cold']['compile_first_forward_s']:.1f} s, "
                f"restored {report['restored']['restore_s']:.2f} + {report['restored']['compile_first_forward_s']:.1f} s, "
                f"ahead-restored {report['ahead-restored']['restore_s']:.2f} + "
                f"{report['ahead-restored']['compile_first_forward_s']:.2f} s"
                + "".join(
                    f"; {role}: exec -> first compiled forward {report[role]['exec_to_first_forward_s']:.2f} s"
                    for role in LAUNCHED
                    if role in report
                ),
                flush=True,
            )
        result = {
            "size": args.size,
            "runs": runs,
            "machine": restart.machine(args.device, env),
            "model": json.loads((model / restart.MARKER).read_text()),
            "outputs_identical": all(r["cold"]["digest"] == r[role]["digest"] for r in runs for role in r if role != "cold"),
            "restored_from_the_cache": all(r["restored"]["fx_hits"] > 0 and r["restored"]["fx_misses"] == 0 for r in runs),
            "ahead_restored_without_tracing": all(
                r[role]["dynamo_frames"] == 0 and r[role]["fx_misses"] == 0 for r in runs for role in AHEAD_RESTORED if role in r
            ),
        }
        result["table"] = table(result)
        print("\n" + result["table"])
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        ok = result["outputs_identical"] and result["restored_from_the_cache"] and result["ahead_restored_without_tracing"]
        return 0 if ok else 1
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)


def table(result: dict) -> str:
    def median(role: str, key: str) -> float:
        return statistics.median(run[role].get(key) or 0.0 for run in result["runs"])

    def cells(key: str, roles: tuple[str, ...] = ("cold", "restored", "ahead", "ahead-restored")) -> list[str]:
        return [f"{median(role, key):.2f}" if role in roles else "—" for role in ("cold", "restored", "ahead", "ahead-restored")]

    def after_attach(role: str) -> float:
        return median(role, "restore_s") + median(role, "compile_first_forward_s")

    cold_total = after_attach("cold")
    rows = [
        ["(s, median)", "cold", "restored", "ahead (cold)", "ahead restored"],
        ["imports (torch, transformers)", *cells("imports_s")],
        ["attach", *cells("attach_s")],
        ["restore (artifacts / compiled forward)", *cells("restore_s", ("restored", "ahead-restored"))],
        ["compile + first forward (restored ahead: forward only)", *cells("compile_first_forward_s")],
        [
            "attach done -> first compiled forward",
            *(
                f"{after_attach(role):.2f}" + ("" if role == "cold" else f" ({cold_total / after_attach(role):.1f}x)")
                for role in ("cold", "restored", "ahead", "ahead-restored")
            ),
        ],
        ["exec -> first compiled forward", *cells("exec_to_first_forward_s")],
        ["publish (once, after the cold compile)", *cells("publish_s", ("cold", "ahead"))],
    ]
    for role, column in (("launched", 2), ("ahead-launched", 4), ("ahead-launched-cuda", 4), ("ahead-relaunched", 4)):
        if role in result["runs"][0]:
            row = ["", "", "", "", ""]
            row[0], row[column] = f"{role} (launch -> first compiled forward)", f"{median(role, 'exec_to_first_forward_s'):.2f}"
            rows.append(row)
            row = ["", "", "", "", ""]
            row[0] = f"{role}: imports / attach / restore / forward"
            row[column] = " / ".join(
                f"{median(role, key):.2f}" for key in ("imports_s", "attach_s", "restore_s", "compile_first_forward_s")
            )
            rows.append(row)
    first = result["runs"][0]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    head = (
        f"torch.compile, Qwen3 {result['size']} ({restart_table.parameter_count(result['model']['parameters'])} parameters), "
        f"{result['machine']['device']}, median of {len(result['runs'])} run(s); "
        f"artifacts {first['cold']['artifact_bytes'] / 2**20:.1f} MiB, compiled forward {first['ahead']['artifact_bytes'] / 2**20:.1f} MiB"
    )
    tail = (
        f"outputs identical bit for bit: {result['outputs_identical']}; restored compiles hit inductor's cache "
        f"(FX graph hits {first['restored']['fx_hits']}, misses {first['restored']['fx_misses']}): {result['restored_from_the_cache']}; "
        f"restored ahead-of-time forwards traced nothing (Dynamo frames {first['ahead-restored']['dynamo_frames']}): "
        f"{result['ahead_restored_without_tracing']}"
    )
    return "\n".join([head, *lines, tail])


if __name__ == "__main__":
    sys.exit(main())
