"""An engine's start state kept per identity (adapters/engine_state.py): the same identity gets its directory back with
what the last engine left there, another identity (model, rank, engine, machine) a directory of its own, a record of
another key is emptied, and a setting the user chose is left alone. The engines' use of it: tests/engines."""

from __future__ import annotations

import json

import pytest

from tests.core.support import make_fingerprint
from weightcache.adapters import engine_state


@pytest.fixture(autouse=True)
def no_engine_settings(monkeypatch):
    for names in engine_state.SETTINGS.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(engine_state.ENV_SWITCH, raising=False)


def test_the_same_identity_reuses_its_state_and_another_gets_its_own(tmp_path, monkeypatch):
    first = engine_state.keep(make_fingerprint(), "vllm", root=tmp_path)
    assert first is not None and not first.reused
    assert first.settings == {"VLLM_CACHE_ROOT": str(first.path / "vllm_cache_root")}
    compiled = first.path / "vllm_cache_root" / "torch_compile_cache" / "graph.py"
    compiled.parent.mkdir(parents=True)
    compiled.write_text("compiled by the first engine")

    monkeypatch.delenv("VLLM_CACHE_ROOT")
    again = engine_state.keep(make_fingerprint(), "vllm", root=tmp_path)
    assert again is not None and again.reused and again.path == first.path and compiled.read_text()

    others = [
        (make_fingerprint(tp_rank=0), "vllm"),  # another rank
        (make_fingerprint(checkpoint="0" * 64), "vllm"),  # other weights
        (make_fingerprint(), "sglang"),  # another engine
    ]
    for fingerprint, engine in others:
        monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
        other = engine_state.keep(fingerprint, engine, root=tmp_path)
        assert other is not None and not other.reused and other.path != first.path
    assert compiled.read_text() == "compiled by the first engine"


def test_a_directory_recording_another_key_is_emptied_before_use(tmp_path):
    state = engine_state.keep(make_fingerprint(), "sglang", root=tmp_path)
    assert state is not None
    assert set(state.settings) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
    (state.path / "stale").write_text("from another machine")
    record = state.path / engine_state.RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "machine": "another CPU"}))
    again = engine_state.keep(make_fingerprint(), "sglang", root=tmp_path)
    assert again is not None and not again.reused and not (state.path / "stale").exists()
    assert json.loads(record.read_text()) == engine_state.state_key(make_fingerprint(), "sglang")


def test_a_users_own_setting_no_identity_or_the_switch_off_keep_nothing(tmp_path, monkeypatch):
    assert engine_state.keep(None, "vllm", root=tmp_path) is None
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    assert engine_state.keep(make_fingerprint(), "vllm", root=tmp_path) is None
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    state = engine_state.keep(make_fingerprint(), "sglang", root=tmp_path)  # inductor's is still free
    assert state is not None and set(state.settings) == {"TORCHINDUCTOR_CACHE_DIR"}
    monkeypatch.setenv(engine_state.ENV_SWITCH, "0")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert engine_state.keep(make_fingerprint(), "sglang", root=tmp_path) is None
    assert list(tmp_path.iterdir()) == [state.path]
