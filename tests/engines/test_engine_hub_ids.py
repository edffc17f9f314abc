"""Hub ids through the engine adapters: ``org/name`` from a local hub cache, offline, in every mode, as a path loads.

vLLM and SGLang resolve the id themselves (huggingface_hub, offline). Their configs keep the name the
engine was given (and vLLM its revision), so an entry published under the id serves engines started with
the id; one started with the snapshot's path misses it (a safe miss, loaded from disk) — docs/engines.md.
Nothing is downloaded: the hub cache is laid out by the test.
"""

from __future__ import annotations

import pytest

from tests.core.test_hub import add_to_hub_cache, hub_env
from tests.engines.support import assert_same_state, run_engine, server_status, stop_spawned_server


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_hub_id_loads_in_every_mode_as_its_snapshot_path_does(engine, tiny_llama, socket_dir, tmp_path):
    pytest.importorskip(engine)
    cache = tmp_path / "hub"
    snapshot = add_to_hub_cache(cache, "org/tiny-llama", tiny_llama)
    env = hub_env(cache)
    daemon = {"mode": "daemon", "socket_dir": str(socket_dir)}
    try:
        off, by_id = run_engine(
            engine,
            "org/tiny-llama",
            [
                {"extra": {"mode": "off"}, "out": str(tmp_path / "off.pt")},
                {"extra": daemon, "out": str(tmp_path / "daemon.pt")},
            ],
            env=env,
        )
        # Another process: a client started with the id, then (a fresh config in the same process) with the path.
        client, by_path = run_engine(
            engine,
            "org/tiny-llama",
            [
                {"extra": {**daemon, "mode": "client", "strict": True}, "out": str(tmp_path / "client.pt")},
                {"model": str(snapshot), "extra": {**daemon, "mode": "client"}, "out": str(tmp_path / "path.pt")},
            ],
            env=env,
        )
        status = server_status(socket_dir)
    finally:
        stop_spawned_server(socket_dir)
    assert off["source"] == "disk" and by_id["source"] == client["source"] == "cache", (off, by_id, client)
    assert by_id["digest"] == client["digest"] and len(status["entries"]) == 1
    assert by_path["source"] == "disk", "the snapshot's path is another entry: a safe miss, loaded from disk"
    for name in ("daemon", "client", "path"):
        assert_same_state(tmp_path / f"{name}.pt", tmp_path / "off.pt", f"{engine} {name} vs its own load by hub id")
