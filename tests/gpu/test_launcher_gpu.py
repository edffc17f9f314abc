"""The launcher on a GPU machine: it imports torch's CUDA build and holds no CUDA context, and every engine forked
from it creates its own and computes on the GPU (the CPU half: tests/core/test_launcher.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.core.test_launcher import LauncherProcess, launch_command
from weightcache.core.arena.cuda import unavailable_reason

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no CUDA GPU: {_REASON}")

_ENGINE = """
import json, time
began = time.perf_counter()
import torch
context = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
context = time.perf_counter() - context
start = time.perf_counter()
a = torch.ones(4096, 4096, device="cuda", dtype=torch.bfloat16)
value = float((a @ a)[0, 0])
torch.cuda.synchronize()
print(json.dumps({"context_s": context, "first_matmul_s": time.perf_counter() - start, "value": value}))
"""


def test_engines_forked_from_a_cuda_free_launcher_create_their_own_context():
    directory = Path(tempfile.mkdtemp(prefix="wc-launcher-gpu-"))
    launcher = LauncherProcess(directory / "sock")
    try:
        assert launcher.ready is not None, launcher.output()
        reports = []
        for _ in range(3):
            done = subprocess.run(launch_command(launcher.socket_dir, "-c", _ENGINE), capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            reports.append(json.loads(done.stdout))
        assert all(r["value"] == 4096.0 for r in reports), reports
        print(
            "forked engines, CUDA context / first bf16 4096² matmul (s):",
            [(r["context_s"], r["first_matmul_s"]) for r in reports],
        )
        maps = Path(f"/proc/{launcher.pid}/maps").read_text()
        fds = [os.readlink(f"/proc/{launcher.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{launcher.pid}/fd")]
        assert "/dev/nvidia" not in maps and not [fd for fd in fds if "nvidia" in fd], "the launcher opened the GPU"
        fresh = subprocess.run([sys.executable, "-c", _ENGINE], capture_output=True, text=True, timeout=300)
        print("exec'd engine, CUDA context / first matmul (s):", fresh.stdout.strip())
    finally:
        launcher.stop()
        subprocess.run(["rm", "-rf", str(directory)], check=False)


_EARLY = """
import json, time
import torch
from weightcache.core.spare.warm import start_cuda_early
early = start_cuda_early("cuda:0")
waited = early.wait(timeout=120)
for _ in range(600):  # the kernels' warm-up goes on after the set-up
    if early.warm_seconds is not None:
        break
    time.sleep(0.05)
a = torch.full((64, 64), 0.5, device="cuda", dtype=torch.bfloat16)
print(json.dumps({"warm_s": early.warm_seconds, "value": float((a @ a)[0, 0]), "set_up_s": early.seconds}))
"""


def test_early_cuda_warms_the_devices_kernels_after_its_set_up_and_computes_right():
    done = subprocess.run([sys.executable, "-c", _EARLY], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["warm_s"] is not None, f"the kernels' warm-up did not finish: {done.stderr[-2000:]}"
    assert report["value"] == 16.0, report  # 64 products of 0.5 × 0.5


def test_a_preload_that_asks_cuda_for_its_devices_stops_the_launcher_with_one_line(tmp_path):
    """torch.cuda.is_available() creates no context (the launcher's own check sees nothing) but makes every forked child
    refuse CUDA ("Cannot re-initialize CUDA in forked subprocess"): the canary sees that and the launcher stops."""
    (tmp_path / "wc_cuda_asking_preload.py").write_text("import torch\nassert torch.cuda.is_available()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    started = LauncherProcess(tmp_path / "sock", "--preload", "torch,wc_cuda_asking_preload", "--no-warm", env=env)
    try:
        assert started.ready is None and started.proc.wait(timeout=300) == 1, started.output()
        lines = [line for line in started.output().splitlines() if line.startswith("weightcache: error:")]
        assert len(lines) == 1 and "asked CUDA for its devices" in lines[0], started.output()
    finally:
        started.stop()


_AT_ENTRY = """
import json, sys, time
began = time.perf_counter()
import torch
initialized = torch.cuda.is_initialized()  # before anything of the engine's own asks CUDA
a = torch.ones(4096, 4096, device="cuda", dtype=torch.bfloat16)
value = float((a @ a)[0, 0])
torch.cuda.synchronize()
print(json.dumps({"initialized_at_entry": initialized, "value": value, "to_first_matmul_s": time.perf_counter() - began}))
"""


def test_a_cuda_ready_child_starts_its_engine_with_a_context_and_a_request_of_another_cuda_environment_gets_none(tmp_path):
    """``--cuda-ready cuda:0``: the child forked ahead makes its context while it waits; the launcher itself opens no
    GPU file. A caller whose CUDA_VISIBLE_DEVICES differs from the launcher's gets a child forked without a context."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    launcher = LauncherProcess(tmp_path / "sock", "--cuda-ready", "cuda:0", env=env)
    try:
        assert launcher.ready is not None and launcher.ready["cuda_ready"] == "cuda:0", launcher.output()
        from tests.core.test_launcher import _hello

        reports = []
        for caller_env in (env, env, {**env, "CUDA_VISIBLE_DEVICES": "0"}):
            deadline = time.monotonic() + 120
            while not _hello(launcher.socket_dir)["ahead_ready"] and time.monotonic() < deadline:
                time.sleep(0.05)
            done = subprocess.run(
                launch_command(launcher.socket_dir, "-c", _AT_ENTRY), capture_output=True, text=True, timeout=300, env=caller_env
            )
            assert done.returncode == 0, done.stderr
            reports.append(json.loads(done.stdout))
        print("launched with --cuda-ready (ready, ready, another CUDA_VISIBLE_DEVICES):", reports)
        assert [r["initialized_at_entry"] for r in reports] == [True, True, False], reports
        assert all(r["value"] == 4096.0 for r in reports), reports
        maps = Path(f"/proc/{launcher.pid}/maps").read_text()
        fds = [os.readlink(f"/proc/{launcher.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{launcher.pid}/fd")]
        assert "/dev/nvidia" not in maps and not [fd for fd in fds if "nvidia" in fd], "the launcher opened the GPU"
    finally:
        launcher.stop()
