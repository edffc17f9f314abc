"""Server restarts, hot standby and memory accounting."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.core.support import publish_host_entry
from tests.core.test_standby import StandbyProcess
from tests.helpers import Engine, ServerProcess, wait_until
from weightcache.core.arena.checksum import SCHEME
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import ChecksumMismatch, ServerError
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.identity.digests import RACY_WINDOW_NS
from weightcache.core.request import LoadRequest


def _entries(socket_dir) -> list[dict]:
    with Connection(socket_dir) as conn:
        return conn.status()["entries"]


def test_a_restarted_server_gets_its_entries_back_from_live_engines_without_disk_reads(socket_dir, model_dir, tmp_path):
    path = Path(shutil.copytree(model_dir("llama"), tmp_path / "llama"))
    time.sleep(RACY_WINDOW_NS / 1e9)  # files this fresh are hashed but not remembered (core/identity/digests.py)
    first = ServerProcess.start(socket_dir)
    engine = late = None
    try:
        publish(prepare(LoadRequest(model=str(path))), socket_dir)  # hashes the files and remembers their digests
        engine = Engine(path, socket_dir)
        reference = engine.ask("hash")
        first.kill()  # SIGKILL: the server's fds are gone; the engine's mapping and fds are not
        second = ServerProcess.start(socket_dir)
        try:
            assert wait_until(lambda: len(_entries(socket_dir)) == 1, timeout=15), "the engine did not re-publish"
            late = Engine(path, socket_dir, count_opens=True)
            assert late.ready["source"] == "cache"
            assert late.ask("hash") == reference
            opened = late.ask("opens")
            assert opened == {"opens": [], "kernel_opens": []}, (
                f"the late engine opened checkpoint files ({opened}); its identity must come from the digest store (a stat per file)"
            )
            assert engine.ask("hash") == reference
        finally:
            if late:
                late.close()
            second.stop()
    finally:
        if engine:
            engine.close()
        first.kill()


def test_hot_standby_takes_over_at_once(server, model_dir):
    """`weightcache standby --watch-pid` beside a live primary: SIGKILL the primary, the standby's first token follows at
    once: within 10 s, an order of magnitude (a few hundred ms on a loaded CI machine; benchmarks/restart.py and
    benchmarks/standby.py measure it), not after a timeout or a load."""
    from weightcache.core.flow.modes import load_model
    from weightcache.core.spare.standby import first_token, fixed_prompt

    model = model_dir("llama")
    publish(prepare(LoadRequest(model=str(model))), server.socket_dir)
    primary = Engine(model, server.socket_dir)
    standby = StandbyProcess(model, server.socket_dir, "--watch-pid", str(primary.proc.pid))
    try:
        ready = standby.line()
        assert ready["event"] == "ready" and ready["parameters_outside_arenas"] == 0
        killed_at = time.monotonic()
        primary.proc.kill()
        took = standby.line()
        assert (took["reason"], took["detail"]) == ("primary_exited", f"pid {primary.proc.pid}")
        assert took["first_token_at"] - killed_at < 10.0, (
            f"first token {1000 * (took['first_token_at'] - killed_at):.0f} ms after the kill"
        )
        assert standby.proc.wait(timeout=60) == 0
    finally:
        standby.close()
        primary.proc.kill()
        primary.proc.communicate(timeout=60)
    disk = load_model(str(model))  # the reference: a plain disk load, the standby's fixed prompt
    prompt = fixed_prompt(LoadRequest(model=str(model)), disk.model)
    assert took["token"] == first_token(disk.model, prompt), "the standby's first token differs from a disk-loaded model's"


def test_least_recently_used_unattached_entries_make_room_within_the_byte_budget(socket_dir, model_dir):
    kinds = ("llama", "qwen2", "gemma")
    sizes = {k: sum(p.stat().st_size for p in model_dir(k).glob("*.safetensors")) for k in kinds}
    budget = int(max(sizes.values()) * 2.5)
    server = ServerProcess.start(socket_dir, "--byte-budget", str(budget))
    try:
        llama = publish(prepare(LoadRequest(model=str(model_dir("llama")))), socket_dir)
        holder = Engine(model_dir("llama"), socket_dir)  # attached: never evicted
        qwen = publish(prepare(LoadRequest(model=str(model_dir("qwen2")))), socket_dir)
        publish(prepare(LoadRequest(model=str(model_dir("gemma")))), socket_dir)
        digests = {e["digest"] for e in _entries(socket_dir)}
        assert llama.digest in digests and qwen.digest not in digests, "the idle qwen2 entry should have made room"
        with Connection(socket_dir) as conn:
            status = conn.status()
        assert status["held_bytes"] <= budget
        with pytest.raises(ServerError, match="over_budget"):
            big = model_dir("mixtral")
            if sum(p.stat().st_size for p in big.glob("*.safetensors")) + sizes["llama"] <= budget:
                pytest.skip("the MoE test model fits the budget; nothing to refuse")
            publish(prepare(LoadRequest(model=str(big))), socket_dir)
        assert {e["digest"] for e in _entries(socket_dir)} == digests, "a publish that cannot fit evicts nothing"
        holder.close()
    finally:
        server.stop()


def test_a_mapping_whose_bytes_do_not_match_their_checksum_is_not_published_again(socket_dir):
    """Re-adoption checks what it re-publishes: bytes that differ from the published checksum stay out of the new server."""
    first = ServerProcess.start(socket_dir)
    try:
        liar = publish_host_entry(socket_dir, checksum=f"{SCHEME}:{'c3' * 16}")  # its bytes are not what it declares
        attachment = Attachment.open(liar.fingerprint, socket_dir)
    finally:
        first.kill()
    second = ServerProcess.start(socket_dir)
    try:
        with pytest.raises(ChecksumMismatch, match="arena 0 from this engine's mapping does not hold the bytes it declared"):
            attachment.reattach()
        assert _entries(socket_dir) == []
    finally:
        attachment.close()
        second.stop()
