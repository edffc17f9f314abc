"""The node as one cache, the server's half: where a content lives (``locate``), budgets per tier, status per tier.

The copies themselves run in a CUDA process (tests/gpu/test_node_fill.py); here a real
server process answers real clients, and the registry's eviction choices are checked
with real entries (host memfds standing in for GPU arenas, which the CUDA-free server
never maps: it counts their declared sizes per tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.core.support import make_fingerprint, publish_host_entry
from tests.core.test_exhaustion import configured_server
from tests.helpers import run_cli
from weightcache.core.client.client import Connection
from weightcache.core.errors import ServerError
from weightcache.core.fingerprint import HOST_TIER
from weightcache.core.server.registry import Budgets, Entry, OverBudget, Registry

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def test_locate_names_every_other_copy_of_the_content_peer_gpus_first_then_the_host_tier(server):
    wanted = make_fingerprint(gpu_uuid=GPU_B)
    host_copy = publish_host_entry(server.socket_dir, wanted.on_device(HOST_TIER))
    peer_copy = publish_host_entry(server.socket_dir, wanted.on_device(GPU_A))
    publish_host_entry(server.socket_dir, make_fingerprint(gpu_uuid=GPU_A, dtype="float16"))  # other content
    with Connection(server.socket_dir) as connection:
        sources = connection.locate(wanted)
        mine = publish_host_entry(server.socket_dir, wanted)
        again = connection.locate(wanted)
    assert [row["fingerprint"]["gpu_uuid"] for row in sources] == [GPU_A, HOST_TIER]
    assert [row["fingerprint"] for row in sources] == [peer_copy.fingerprint.to_json(), host_copy.fingerprint.to_json()]
    assert all(row["tier"] == HOST_TIER and row["bytes"] > 0 for row in sources)  # host memfds here: their tier is the host
    assert mine.digest not in {row["fingerprint"]["gpu_uuid"] for row in again} and len(again) == 2


def test_locate_with_a_malformed_fingerprint_is_refused_and_the_server_stays_up(server):
    with Connection(server.socket_dir) as connection:
        with pytest.raises(ServerError, match="malformed locate request") as caught:
            connection.request({"op": "locate", "fingerprint": {"gpu_uuid": 1}})
        assert caught.value.code == "bad_request"
        assert connection.hello()["ok"]


def test_status_says_where_each_entry_lives_and_which_rows_share_a_content(server):
    wanted = make_fingerprint(gpu_uuid=GPU_A)
    publish_host_entry(server.socket_dir, wanted.on_device(HOST_TIER), label="model-x")
    publish_host_entry(server.socket_dir, make_fingerprint(dtype="float16"), label="model-y")
    with Connection(server.socket_dir) as connection:
        status = connection.status()
    rows = {row["label"]: row for row in status["entries"]}
    assert rows["model-x"]["device"] == HOST_TIER and rows["model-x"]["tier"] == HOST_TIER
    assert rows["model-x"]["content"] == wanted.content_digest[:12]
    assert rows["model-y"]["content"] != rows["model-x"]["content"]
    assert status["budgets"] == {"total": None, "host": None, "per_gpu": None}
    assert status["tiers"] == {HOST_TIER: {"held": status["held_bytes"], "budget": None}}
    table = run_cli("status", "--socket-dir", str(server.socket_dir)).stdout
    assert "host tier" in table and "cpu (host)" in table


def test_a_host_tier_over_its_budget_refuses_a_new_model_naming_the_budget_and_evicts_nothing(tmp_path):
    socket_dir = tmp_path / "s"
    with configured_server(socket_dir, host_budget=3 << 20) as server:
        attached = publish_host_entry(socket_dir, make_fingerprint(gpu_uuid=HOST_TIER), nbytes=2 << 20, label="attached")
        with Connection(socket_dir) as holder:
            holder.attach(attached.fingerprint)
            with pytest.raises(ServerError, match="host tier budget") as caught:
                publish_host_entry(socket_dir, make_fingerprint(gpu_uuid=HOST_TIER, dtype="float16"), nbytes=2 << 20)
            assert caught.value.code == "over_budget" and "nothing was evicted" in str(caught.value)
            with Connection(socket_dir) as connection:
                status = connection.status()
        assert [row["label"] for row in status["entries"]] == ["attached"]
        assert status["tiers"][HOST_TIER] == {"held": 2 << 20, "budget": 3 << 20}
        assert server.proc.poll() is None
        table = run_cli("status", "--socket-dir", str(socket_dir)).stdout
        assert "host memory: 2.0 MiB held of 3.0 MiB" in table


def test_the_server_command_takes_per_tier_budgets(tmp_path):
    socket_dir = tmp_path / "s"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            "serve",
            "--socket-dir",
            str(socket_dir),
            "--host-budget",
            "1GiB",
            "--gpu-budget",
            "80GiB",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        from weightcache.core.client.client import wait_for_server

        wait_for_server(socket_dir, timeout=30)
        status = json.loads(run_cli("status", "--json", "--socket-dir", str(socket_dir)).stdout)
        assert status["budgets"] == {"total": None, "host": 1 << 30, "per_gpu": 80 << 30}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _entry(digest_seed: str, tier: str, nbytes: int) -> Entry:
    fingerprint = make_fingerprint(gpu_uuid=tier, architecture=digest_seed)
    return Entry(
        fingerprint=fingerprint,
        manifest={},
        fds=[],
        nbytes=nbytes,
        label=digest_seed,
        published_by=os.getpid(),
        tier_bytes={tier: nbytes},
    )


def test_a_full_gpu_evicts_only_that_gpus_idle_entries_and_never_the_host_copies():
    registry = Registry(Budgets(per_gpu=100, host=1000))
    for entry in (_entry("a-on-gpu-a", GPU_A, 80), _entry("a-on-host", HOST_TIER, 80), _entry("b-on-gpu-b", GPU_B, 80)):
        assert registry.publish(entry)
    assert registry.publish(_entry("c-on-gpu-a", GPU_A, 60))  # evicts a-on-gpu-a, LRU on that GPU alone
    labels = sorted(row["label"] for row in registry.status()[0])
    assert labels == ["a-on-host", "b-on-gpu-b", "c-on-gpu-a"]
    assert registry.tiers()[GPU_A] == {"held": 60, "budget": 100}


def test_model_swapping_three_models_one_gpu_budget_all_on_the_host_tier():
    """Three models on the host tier; the GPU holds one at a time: each switch evicts the idle GPU entry, keeps its host copy."""
    registry = Registry(Budgets(per_gpu=100, host=300))
    for name in ("x", "y", "z"):
        assert registry.publish(_entry(f"{name}-host", HOST_TIER, 90))
    for name in ("x", "y", "z", "x"):
        assert registry.publish(_entry(f"{name}-gpu", GPU_A, 90))
        rows = [row["label"] for row in registry.status()[0]]
        assert [label for label in rows if label.endswith("-gpu")] == [f"{name}-gpu"]
        assert sorted(label for label in rows if label.endswith("-host")) == ["x-host", "y-host", "z-host"]


def test_an_attached_gpu_entry_is_never_evicted_for_another_and_the_refusal_names_the_gpu_budget():
    registry = Registry(Budgets(per_gpu=100))
    busy = _entry("busy", GPU_A, 80)
    registry.publish(busy)
    registry.checkout(busy.digest, connection=1, pid=os.getpid())
    with pytest.raises(OverBudget, match=f"GPU {GPU_A}.* budget of 100 bytes"):
        registry.publish(_entry("newcomer", GPU_A, 50))
    assert [row["label"] for row in registry.status()[0]] == ["busy"]


def test_load_into_the_host_tier_needs_a_gpu(tmp_path, model_dir):
    done = run_cli(
        "load", "--model", str(model_dir("llama")), "--tier", "host", "--socket-dir", str(tmp_path), timeout=120, check=False
    )
    assert done.returncode != 0
    assert "--tier host needs a CUDA --device, not cpu" in done.stderr, done.stderr
