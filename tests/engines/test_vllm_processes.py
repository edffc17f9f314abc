"""``--load-format weightcache`` across vLLM engine processes (off, daemon, client, fallback), every tensor bit-identical
to vLLM's own ``--load-format auto`` (test_vllm.py has the rest of the vLLM adapter's tests).

Runs in the engine venv (``make engine-venv``); the project's own test run reaches it through test_engine_venv.py.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.engines.support import assert_same_state, run_engine, server_status, stop_spawned_server

vllm = pytest.importorskip("vllm")


MODELS = ("tiny_deepseek_v3", "tiny_llama")
"""The MoE model first: vLLM makes its expert-parallel group when a process first sets up its groups, for MoE models only."""


@pytest.fixture(scope="module")
def engine_runs(request, tmp_path_factory):
    """Two vLLM processes loading both models through ``--load-format weightcache`` (SGLang's ``engine_runs`` does the same).

    The first, per model: vLLM's own ``--load-format auto``, then off, a strict client and a client without a
    server, and daemon (the first daemon starts ``weightcache serve`` itself). The second: a strict client per
    model that also tries vLLM's in-place reload.
    """
    out = tmp_path_factory.mktemp("vllm-states")
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
    socket_dir.chmod(0o700)
    missing = str(out / "nobody-serves-here")
    checkpoints = {model: str(request.getfixturevalue(model)) for model in MODELS}
    first, second = [], []
    for model, path in checkpoints.items():
        first += [
            {"model": path, "load_format": "auto", "out": str(out / f"{model}.plain.pt")},
            {"model": path, "extra": {"mode": "off"}, "out": str(out / f"{model}.off.pt")},
            {"model": path, "extra": {"mode": "client", "socket_dir": missing, "strict": True}},
            {"model": path, "extra": {"mode": "client", "socket_dir": missing}, "out": str(out / f"{model}.fallback.pt")},
            {"model": path, "extra": {"mode": "daemon", "socket_dir": str(socket_dir)}, "out": str(out / f"{model}.daemon.pt")},
        ]
        second.append(
            {
                "model": path,
                "extra": {"mode": "client", "socket_dir": str(socket_dir), "strict": True},
                "out": str(out / f"{model}.client.pt"),
                "try_reload": True,
            }
        )
    try:
        loads = run_engine("vllm", checkpoints[MODELS[0]], first)
        clients = run_engine("vllm", checkpoints[MODELS[0]], second)
        status = server_status(socket_dir)
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
    names = ("plain", "off", "strict_missing", "fallback", "daemon")
    runs = {model: dict(zip(names, loads[5 * i : 5 * i + 5], strict=True)) for i, model in enumerate(MODELS)}
    for model, client in zip(MODELS, clients, strict=True):
        runs[model]["client"] = client
    return {"out": out, "runs": runs, "status": status}


@pytest.mark.parametrize("model", MODELS)
def test_daemon_publishes_and_a_client_in_another_process_maps_it_bit_identical_to_vllms_own_load(model, engine_runs):
    """vLLM's own ``--load-format auto`` vs off, fallback and daemon (one process) and a client (another), every
    parameter, buffer and tensor attribute. DeepSeek-V3's MLA used to die with SIGSEGV in daemon and client mode."""
    runs = engine_runs["runs"][model]
    plain, off, strict_missing, fallback, daemon, client = (
        runs[name] for name in ("plain", "off", "strict_missing", "fallback", "daemon", "client")
    )
    assert plain["loader"].endswith("DefaultModelLoader") and off["source"] == fallback["source"] == "disk"
    assert strict_missing["error"] == "ServerUnavailable"
    assert off["external_before"] == fallback["external_before"] == 0
    for result in (daemon, client):
        assert result["source"] == "cache", result
        assert result["meta"] == [] and result["unmapped_parameters"] == [] and result["unmapped_buffers"] == []
        for kind in ("parameters", "buffers", "attributes"):
            assert result[kind] == plain[kind], f"{kind} differ from vLLM's own load"
        assert result["python_attributes"] == plain["python_attributes"]
    assert daemon["external_before"] == 0  # no entry of this model yet: the daemon-mode engine allocates the weights itself
    assert client["external_before"] == client["entry_bytes"] == client["external_after"] > 0
    assert daemon["digest"] == client["digest"] and daemon["fingerprint"] == client["fingerprint"] == off["fingerprint"]
    assert client["reload"].startswith("RuntimeError") and "read-only" in client["reload"]
    (entry,) = [entry for entry in engine_runs["status"]["entries"] if entry["digest"] == client["digest"]]
    assert "vllm" in entry["label"] and entry["bytes"] == client["entry_bytes"]
    assert len(engine_runs["status"]["entries"]) == len(MODELS), "one entry per model, none published twice"
    if model == "tiny_deepseek_v3":
        assert {name.rsplit(".", 1)[1] for name in client["parameters"]} >= {"W_UV", "W_UK_T"}

    out = engine_runs["out"]
    for name in ("off", "fallback", "daemon", "client"):
        assert_same_state(out / f"{model}.{name}.pt", out / f"{model}.plain.pt", f"{name} vs vLLM's own load")
