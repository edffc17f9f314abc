"""Seeding a node from a peer node (``weightcache seed``): real processes on gloo, two real servers as two nodes.

The same on two GPUs over NCCL: tests/gpu/test_seeding_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import attrs
import pytest

from tests import zygote
from tests.adapters.test_hf_checkpoints import assert_attaches_like_from_pretrained
from tests.core.support import resting_fd_count
from tests.helpers import free_port
from weightcache.core.client.client import Connection
from weightcache.core.errors import SeedRefused
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.node.seeding import check_environment
from weightcache.core.request import LoadRequest

TIMEOUT_S = 20
NOTICED_TIMEOUT_S = 300
"""The receiver's wait where a test checks it noticed a dead sender at once: long, so that "at once" may be an order of
magnitude (NOTICED_BOUND_S: 10x what two ranks take on a loaded machine) and still far from waiting it out."""
NOTICED_BOUND_S = 150


def rank_env(rank: int, port: int, extra: dict | None = None) -> dict:
    return {
        **os.environ,
        **(extra or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
    }


def seed_command(socket_dir, *args: str, timeout_s: int = TIMEOUT_S) -> list[str]:
    """``weightcache seed`` for one rank, every wait bounded by ``timeout_s``."""
    return [
        sys.executable,
        "-m",
        "weightcache.core.cli.cli",
        "seed",
        "--socket-dir",
        str(socket_dir),
        "--timeout",
        str(timeout_s),
        *args,
    ]


def sender_script(socket_dir, fingerprint, *die_after: int) -> list[str]:
    """tests/core/seed_sender.py: send ``fingerprint``'s entry, dying after ``die_after`` arenas when given."""
    return [
        sys.executable,
        "-m",
        "tests.core.seed_sender",
        str(socket_dir),
        json.dumps(fingerprint.to_json()),
        *map(str, die_after),
    ]


def run_ranks(*commands: list[str], wait_s: float = TIMEOUT_S + 40, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run one command per rank (rank = position) on a fresh port, ``env`` added; each must end within ``wait_s``."""
    port = free_port()
    procs = [
        zygote.popen(command, env=rank_env(rank, port, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, command in enumerate(commands)
    ]
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=wait_s)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def entries(socket_dir) -> list[dict]:
    with Connection(socket_dir) as connection:
        return connection.status()["entries"]


def test_seed_command_copies_an_entry_to_another_node_bit_for_bit(nodes, model_dir):
    a, b = nodes
    path = model_dir("llama")
    published = publish(prepare(LoadRequest(model=str(path))), a.socket_dir)
    sender, receiver = run_ranks(seed_command(a.socket_dir, "--model", str(path)), seed_command(b.socket_dir))
    assert sender.returncode == 0, sender.stderr[-3000:]
    assert receiver.returncode == 0, receiver.stderr[-3000:]
    assert sender.stdout.startswith(f"rank 0: sent {published.digest[:12]}"), sender.stdout
    assert receiver.stdout.startswith(f"rank 1: received and published {published.digest[:12]}"), receiver.stdout
    assert "GB/s" in receiver.stdout
    (entry,) = entries(b.socket_dir)
    assert entry["digest"] == published.digest  # a host entry: the same fingerprint on every node
    assert_attaches_like_from_pretrained(path, b.socket_dir, "float32", None)


def test_a_sender_killed_mid_way_leaves_the_receiver_failing_and_nothing_published(nodes, model_dir):
    a, b = nodes
    path = model_dir("llama")
    published = publish(prepare(LoadRequest(model=str(path))), a.socket_dir, chunk_bytes=256 << 10)
    arenas = len(published.manifest.arenas)
    assert arenas >= 4, f"the checkpoint should span several arenas, spans {arenas}"
    fds_before = resting_fd_count(b.pid)
    start = time.monotonic()
    sender, receiver = run_ranks(
        sender_script(a.socket_dir, published.fingerprint, 2),
        seed_command(b.socket_dir, timeout_s=NOTICED_TIMEOUT_S),
        wait_s=NOTICED_TIMEOUT_S + 60,
    )
    elapsed = time.monotonic() - start
    assert sender.returncode == -9, f"the sender should have SIGKILLed itself (exit {sender.returncode}): {sender.stderr[-2000:]}"
    assert receiver.returncode == 1, receiver.stderr[-3000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert message.startswith("weightcache: error: seeding from rank 0 failed:"), receiver.stderr[-3000:]
    assert "nothing was published" in message
    moved = int(message.split(" of ")[0].rsplit("(", 1)[1])
    assert 0 < moved < sum(spec.size for spec in published.manifest.arenas), message
    assert elapsed < NOTICED_BOUND_S, f"the receiver took {elapsed:.1f} s to notice a dead sender"
    assert entries(b.socket_dir) == []
    assert resting_fd_count(b.pid) == fds_before, "server B kept fds of the failed seeding"


def test_a_receiver_of_another_environment_is_refused_before_any_weight_moves(nodes, model_dir):
    a, b = nodes
    prepared = prepare(LoadRequest(model=str(model_dir("llama"))))
    # An entry made under another torch, as a node of another software version holds it.
    elsewhere = attrs.evolve(prepared, fingerprint=attrs.evolve(prepared.fingerprint, torch_version="0.0.1"))
    publish(elsewhere, a.socket_dir)
    sender, receiver = run_ranks(sender_script(a.socket_dir, elsewhere.fingerprint), seed_command(b.socket_dir))
    assert receiver.returncode == 1, receiver.stderr[-3000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert message.startswith("weightcache: error: this node cannot use the entry"), receiver.stderr[-3000:]
    assert "torch_version '0.0.1' there" in message and "nothing was published" in message
    assert sender.returncode == 1, sender.stderr[-3000:]
    assert "rank 1 refused the entry" in sender.stderr and "no weights were sent" in sender.stderr, sender.stderr[-3000:]
    assert entries(b.socket_dir) == []


def test_check_environment_names_each_field_that_differs(model_dir):
    fingerprint = prepare(LoadRequest(model=str(model_dir("llama")))).fingerprint
    assert check_environment(fingerprint, "cpu") == fingerprint  # a host entry keeps its fingerprint
    for field, value in (("torch_version", "0.0.1"), ("cuda_version", "13.0"), ("compute_capability", "9.0")):
        with pytest.raises(SeedRefused, match=f"{field} '{value}' there") as refused:
            check_environment(attrs.evolve(fingerprint, **{field: value}), "cpu")
        assert refused.value.fields == (field,)
        assert "nothing was published" in str(refused.value)


def test_a_sender_without_the_entry_stops_the_receivers_at_once(nodes, model_dir):
    a, b = nodes
    fingerprint = prepare(LoadRequest(model=str(model_dir("llama")))).fingerprint  # never published on A
    start = time.monotonic()
    sender, receiver = run_ranks(sender_script(a.socket_dir, fingerprint), seed_command(b.socket_dir))
    assert sender.returncode == 1
    assert receiver.returncode == 1, receiver.stderr[-3000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert "the sender could not send the entry: no cached entry" in message, message
    assert time.monotonic() - start < TIMEOUT_S
    assert entries(b.socket_dir) == []


def test_a_rendezvous_nobody_else_joins_fails_within_the_timeout(nodes):
    _, b = nodes
    (receiver,) = run_ranks([*seed_command(b.socket_dir), "--src-rank", "1", "--timeout", "2"])  # rank 1 never comes
    assert receiver.returncode == 1, receiver.stderr[-3000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert "the rendezvous of 2 ranks at 127.0.0.1:" in message and "did not complete within 2 s" in message, message


def _refused_before_any_weight_moved(sender, receiver, b) -> str:
    """The receiver's one-line refusal, after checking the sender heard it before sending a weight byte."""
    assert receiver.returncode == 1, receiver.stderr[-3000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert message.startswith("weightcache: error: "), receiver.stderr[-3000:]
    assert sender.returncode == 1, sender.stderr[-3000:]
    assert "rank 1 refused the entry" in sender.stderr and "no weights were sent" in sender.stderr, sender.stderr[-3000:]
    assert entries(b.socket_dir) == []
    return message


def test_a_sender_that_sends_other_bytes_than_its_checksums_say_publishes_nothing(nodes, model_dir):
    a, b = nodes
    published = publish(prepare(LoadRequest(model=str(model_dir("llama")))), a.socket_dir)
    sender, receiver = run_ranks(sender_script(a.socket_dir, published.fingerprint, "bytes"), seed_command(b.socket_dir))
    assert sender.returncode == 0, sender.stderr[-3000:]  # it sent everything: only the receiver can tell
    assert receiver.returncode == 1, receiver.stderr[-3000:]
    message = receiver.stderr.strip().splitlines()[-1]
    assert "arena 0 from rank 0 does not hold the bytes it declared" in message, message
    assert "nothing was published" in message
    assert entries(b.socket_dir) == []


def test_a_sender_declaring_an_arena_far_larger_than_its_tensors_is_refused_before_allocation(nodes, model_dir):
    a, b = nodes
    published = publish(prepare(LoadRequest(model=str(model_dir("llama")))), a.socket_dir)
    sender, receiver = run_ranks(sender_script(a.socket_dir, published.fingerprint, "inflated"), seed_command(b.socket_dir))
    message = _refused_before_any_weight_moved(sender, receiver, b)
    assert f"declares arena 0 of {1 << 40} bytes, but its tensors reach only" in message, message


def test_a_sender_declaring_more_than_this_host_can_hold_is_refused_before_allocation(nodes, model_dir):
    a, b = nodes
    published = publish(prepare(LoadRequest(model=str(model_dir("llama")))), a.socket_dir)
    sender, receiver = run_ranks(sender_script(a.socket_dir, published.fingerprint, "ghost"), seed_command(b.socket_dir))
    message = _refused_before_any_weight_moved(sender, receiver, b)
    assert "the entry needs 1.0 TiB on cpu, which has" in message and "nothing was allocated" in message, message


def test_a_sender_declaring_an_arena_smaller_than_its_tensors_is_refused(nodes, model_dir):
    a, b = nodes
    published = publish(prepare(LoadRequest(model=str(model_dir("llama")))), a.socket_dir)
    sender, receiver = run_ranks(sender_script(a.socket_dir, published.fingerprint, "shrunk"), seed_command(b.socket_dir))
    message = _refused_before_any_weight_moved(sender, receiver, b)
    assert "the sender's manifest is not usable" in message and "ends past arena 0" in message, message


def test_an_entry_beyond_the_receiving_servers_budget_is_refused_before_any_weight_moves(model_dir):
    from weightcache.core.server.server_process import ServerProcess

    a = ServerProcess.start()
    b = ServerProcess.start(None, "--byte-budget", "64K")
    try:
        published = publish(prepare(LoadRequest(model=str(model_dir("llama")))), a.socket_dir)
        assert published.manifest.nbytes > 64 << 10
        sender, receiver = run_ranks(sender_script(a.socket_dir, published.fingerprint), seed_command(b.socket_dir))
        message = _refused_before_any_weight_moved(sender, receiver, b)
        assert "the server can make room for only 64.0 KiB" in message and "--byte-budget" in message, message
    finally:
        for server in (a, b):
            server.close()
