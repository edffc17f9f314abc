"""``weightcache verify``: a scrub of the server's entries, run as a user runs it (a real server, the CLI in its own process).

Host (CPU) entries here; a GPU entry is checked on its GPU in tests/gpu/test_node_fill.py.
"""

from __future__ import annotations

from tests.core.support import make_fingerprint, publish_host_entry
from tests.helpers import run_cli
from weightcache.core.arena.checksum import SCHEME
from weightcache.core.cli.verify import CORRUPT, OK
from weightcache.core.client.client import Connection
from weightcache.core.flow.loader import prepare, publish
from weightcache.core.request import LoadRequest

LIE = f"{SCHEME}:{'5a' * 16}"


def _digests(socket_dir) -> list[str]:
    with Connection(socket_dir) as connection:
        return [row["digest"] for row in connection.status()["entries"]]


def test_verify_reports_a_good_and_a_corrupt_entry_and_exits_non_zero(server, model_dir):
    good = publish(prepare(LoadRequest(model=str(model_dir("llama")))), server.socket_dir)
    bad = publish_host_entry(server.socket_dir, checksum=LIE, label="corrupt-one")
    scrub = run_cli("verify", "--socket-dir", str(server.socket_dir), check=False)
    assert scrub.returncode == CORRUPT, scrub.stderr[-3000:]
    lines = scrub.stdout.splitlines()
    assert any(line.startswith(good.digest[:12]) and line.endswith(": ok") for line in lines), scrub.stdout
    assert any(line.startswith(bad.digest[:12]) and line.endswith("CORRUPT arena 0") for line in lines), scrub.stdout
    assert lines[-1] == "2 entries checked, 1 corrupt"
    assert sorted(_digests(server.socket_dir)) == sorted([good.digest, bad.digest])  # without --drop nothing is evicted
    only_good = run_cli("verify", good.digest[:8], "--socket-dir", str(server.socket_dir))
    assert only_good.returncode == OK and only_good.stdout.splitlines()[-1] == "1 entry checked, 0 corrupt"


def test_verify_drop_evicts_a_corrupt_entry_but_not_one_an_engine_has_attached_unless_forced(server, model_dir):
    good = publish(prepare(LoadRequest(model=str(model_dir("llama")))), server.socket_dir)
    loose = publish_host_entry(server.socket_dir, checksum=LIE, label="loose")
    held = publish_host_entry(server.socket_dir, make_fingerprint(dtype="float16"), checksum=LIE, label="held")
    with Connection(server.socket_dir) as engine:
        engine.attach(held.fingerprint)
        scrub = run_cli("verify", "--drop", "--socket-dir", str(server.socket_dir), check=False)
        assert scrub.returncode == CORRUPT
        assert f"{loose.digest[:12]}  loose" in scrub.stdout and "CORRUPT arena 0 (dropped)" in scrub.stdout, scrub.stdout
        assert "attached by pids" in scrub.stdout and "restart those engines from disk" in scrub.stdout, scrub.stdout
        assert sorted(_digests(server.socket_dir)) == sorted([good.digest, held.digest])
        forced = run_cli("verify", held.digest[:10], "--drop", "--force", "--socket-dir", str(server.socket_dir), check=False)
        assert forced.returncode == CORRUPT and "(dropped)" in forced.stdout, forced.stdout
    assert _digests(server.socket_dir) == [good.digest]
    assert run_cli("verify", "--socket-dir", str(server.socket_dir)).returncode == OK


def test_verify_of_an_unknown_id_says_so(server):
    publish_host_entry(server.socket_dir)
    scrub = run_cli("verify", "ffffffff", "--socket-dir", str(server.socket_dir), check=False)
    assert scrub.returncode == 1
    assert "no entry's digest starts with 'ffffffff'" in scrub.stderr
