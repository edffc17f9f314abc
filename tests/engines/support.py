"""Helpers of the engine suite: a tiny checkpoint, engine child processes, the server a daemon-mode engine spawned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ENGINE_WARNINGS = (
    "ignore::Warning:vllm",
    "ignore::Warning:sglang",
    "ignore::Warning:transformers",
    "ignore::Warning:torch",
    "ignore::Warning:torchvision",
    "ignore::Warning:pydantic",
    "ignore::Warning:triton",
    "ignore::Warning:xgrammar",
    "ignore::Warning:importlib",
)
"""Filter lines (pytest's syntax): warnings those packages raise while importing or configuring are not ours."""

# quantization_config blocks the engines must refuse (or, FP8_BLOCK, accept)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8_PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}



def write_tiny_llama(directory: Path) -> Path:
    """A 2-layer Llama with random weights, saved as bf16 safetensors (tests/models.py's architecture)."""
    from tests.models import save_random_model

    return save_random_model("llama", Path(directory), dtype="bfloat16")


def with_quantization(source: Path, directory: Path, quantization_config: dict, weights: bool = False) -> Path:
    """A copy of ``source``'s config.json declaring ``quantization_config``; its weights only if ``weights``.

    Without weights any attempt to read them fails with FileNotFoundError,
    so a refusal that comes first proves nothing was read.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    if weights:
        for file in source.glob("*.safetensors"):
            (directory / file.name).symlink_to(file)
    return directory


def run_engine(engine: str, model: Path, steps: list[dict], timeout: float = 300) -> list[dict]:
    """Run ``steps`` in a fresh engine process (tests/engines/engine_child.py); one result per step."""
    from tests.engines.engine_child import RESULT

    proc = subprocess.run(
        [sys.executable, "-m", "tests.engines.engine_child", "--engine", engine, "--model", str(model), "--steps", json.dumps(steps)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    results = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or len(results) != len(steps):
        raise AssertionError(
            f"{engine} child exited {proc.returncode} after {len(results)} of {len(steps)} steps:\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return results


def server_status(socket_dir) -> dict:
    from weightcache.core.client import Connection

    with Connection(socket_dir, timeout=5.0) as connection:
        return connection.status()


def stop_spawned_server(socket_dir) -> None:
    """Stop the server a daemon-mode engine started in ``socket_dir`` (it outlives the engine on purpose)."""
    from weightcache.core.client import server_is_running

    if not server_is_running(socket_dir):
        return
    pid = server_status(socket_dir)["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server_is_running(socket_dir):
        time.sleep(0.1)


def load_state(path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def assert_same_state(actual_path, expected_path, what: str) -> None:
    """Every parameter and buffer bit-identical, same names (named tensor, dtype, largest difference on failure)."""
    from tests.helpers import assert_tensors_equal

    actual, expected = load_state(actual_path), load_state(expected_path)
    assert sorted(actual) == sorted(expected), f"{what}: tensor names differ: {sorted(set(actual) ^ set(expected))}"
    for name in expected:
        assert_tensors_equal(f"{what}: {name}", actual[name], expected[name])
