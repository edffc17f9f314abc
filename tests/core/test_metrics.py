"""The server's metrics: counted by a real server process, read back by ``status --json`` and scraped over HTTP.

The scrape is a real HTTP client (urllib) against ``weightcache serve --metrics-port``; the server stays
torch-free with the exporter running.
"""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.request
from pathlib import Path

import attrs
import pytest

from tests.core.support import make_fingerprint, publish_host_entry
from tests.core.test_cli import cli
from tests.helpers import ServerProcess, free_port, run_cli, wait_until
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import EntryNotFound
from weightcache.core.server.metrics import ATTACH_BUCKETS_S, Histogram, Metrics
from weightcache.core.socket_dir import SocketDir

pytest.importorskip("prometheus_client", reason="the metrics extra is not installed (pip install -e '.[test]')")


@pytest.fixture
def metered():
    """A server with its metrics endpoint on a free loopback port, and a budget that holds two 16 KiB entries."""
    port = free_port()
    server = ServerProcess.start(None, "--metrics-port", str(port), "--byte-budget", "40KiB")
    try:
        yield server, port
    finally:
        server.close()


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value from the text exposition (comments skipped)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def exercise(socket_dir) -> None:
    """Five publishes (each past the second evicts the least recently used within the budget: three), two hits,
    one miss, two fallback reports, one eviction on request; one entry is left."""
    entry = publish_host_entry(socket_dir)
    for _ in range(2):
        Attachment.open(entry.fingerprint, socket_dir).close()
    with pytest.raises(EntryNotFound):
        Attachment.open(make_fingerprint(architecture="NotHeldForCausalLM"), socket_dir)
    with Connection(socket_dir) as connection:
        connection.report_fallback("not_found")
        connection.report_fallback("made-up")  # counted as other
    for rank in range(3):  # each evicts the least recently used within the 40 KiB budget
        publish_host_entry(socket_dir, make_fingerprint(tp_rank=rank, tp_size=4))
    run_cli("evict", "--socket-dir", str(socket_dir), publish_host_entry(socket_dir).digest[:12])


def test_the_server_counts_what_an_operator_watches_and_serves_it_over_http(metered):
    server, port = metered
    exercise(server.socket_dir)
    samples = scrape(port)
    expected = {
        "weightcache_hits_total": 2,
        "weightcache_misses_total": 1,
        "weightcache_publishes_total": 5,
        'weightcache_fallbacks_total{reason="not_found"}': 1,
        'weightcache_fallbacks_total{reason="other"}': 1,
        'weightcache_evictions_total{reason="request"}': 1,
        'weightcache_evictions_total{reason="budget"}': 3,
        "weightcache_attach_seconds_count": 2,
        'weightcache_attach_seconds_bucket{le="+Inf"}': 2,
        "weightcache_entries": 1,
        'weightcache_entries_by_device{device="cpu"}': 1,
        "weightcache_total_budget_bytes": 40 << 10,
    }
    for name, value in expected.items():
        assert samples.get(name) == value, f"{name}: {samples.get(name)} (expected {value})"
    assert samples['weightcache_held_bytes{tier="host"}'] == 16384
    assert samples["weightcache_connections_total"] >= 9 and samples["weightcache_connections_open"] >= 0
    assert 0 < samples["weightcache_uptime_seconds"] < 600
    assert 0 < samples["weightcache_attach_seconds_sum"] < 5
    maps = Path(f"/proc/{server.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/_C" not in maps, "the metrics exporter brought torch into the server"


def test_status_json_carries_the_same_counters(metered):
    server, port = metered
    exercise(server.socket_dir)
    status = json.loads(run_cli("status", "--json", "--socket-dir", str(server.socket_dir)).stdout)
    metrics = status["metrics"]
    assert (metrics["hits"], metrics["misses"], metrics["publishes"]) == (2, 1, 5)
    assert metrics["evictions"] == {"budget": 3, "request": 1, "stopping": 0, "superseded": 0}
    assert metrics["fallbacks"]["not_found"] == 1 and metrics["fallbacks"]["other"] == 1
    assert metrics["attach_seconds"]["count"] == 2 and metrics["entries"] == 1
    assert metrics["refusals"]["not_found"] == 0, "a miss is counted as a miss, not a refusal"
    assert scrape(port)["weightcache_hits_total"] == metrics["hits"]


def test_every_gauge_and_label_set_is_there_from_the_start(metered):
    """A fresh server: build_info, the process's fds against its limit, ready, the fd store, the warm list, and every
    label of the counters at 0 (a dashboard or an alert needs the series before the first event)."""
    from weightcache.core import PROTOCOL_VERSION, __version__
    from weightcache.core.server.metrics import EVICTION_REASONS, FALLBACK_KINDS, REFUSAL_CODES
    from weightcache.core.server.rewarm import STATES

    server, port = metered
    samples = scrape(port)
    python = ".".join(map(str, __import__("sys").version_info[:3]))
    assert samples[f'weightcache_build_info{{protocol="{PROTOCOL_VERSION}",python="{python}",version="{__version__}"}}'] == 1
    assert samples["weightcache_ready"] == 1 and samples["weightcache_unverified_entries"] == 0
    assert samples["weightcache_fdstore"] == 0 and samples["weightcache_fdstore_fds"] == 0
    assert 0 < samples["process_open_fds"] < samples["process_max_fds"]
    assert samples['weightcache_held_bytes{tier="host"}'] == 0
    for label, values in [("state", STATES), ("reason", FALLBACK_KINDS), ("reason", EVICTION_REASONS), ("code", REFUSAL_CODES)]:
        names = {"state": "warm_items", "code": "refusals_total"}.get(label)
        for value in values:
            found = [name for name in samples if name.endswith(f'{{{label}="{value}"}}') and (names is None or names in name)]
            assert found and all(samples[name] == 0 for name in found), (label, value)
    status = json.loads(run_cli("status", "--json", "--socket-dir", str(server.socket_dir)).stdout)["metrics"]
    assert status["ready"] is True and status["open_fds"] > 0 and status["max_fds"] >= status["open_fds"]
    assert status["warm_items"] == dict.fromkeys(STATES, 0) and status["build"]["version"] == __version__


def test_refusals_are_counted_by_code(metered):
    server, port = metered
    with Connection(server.socket_dir) as connection, pytest.raises(Exception, match="unknown op"):
        connection.request({"op": "no-such-op"})
    with Connection(server.socket_dir) as connection, pytest.raises(Exception, match="no entry matches"):
        connection.evict("abcdef12")
    with socket.socket(socket.AF_UNIX) as raw:  # a frame that is not weightcache's: refused before any request
        raw.connect(str(SocketDir.parse(server.socket_dir).socket))
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
        raw.settimeout(10)
        assert b"protocol_error" in raw.recv(1 << 16)
    samples = scrape(port)
    assert samples['weightcache_refusals_total{code="bad_request"}'] == 1
    assert samples['weightcache_refusals_total{code="not_found"}'] == 1
    assert samples['weightcache_refusals_total{code="protocol_error"}'] == 1, "a refused frame is a refusal too"


def test_the_log_names_the_pid_of_each_attach_refusal_and_eviction(metered):
    server, _ = metered
    entry = publish_host_entry(server.socket_dir)
    Attachment.open(entry.fingerprint, server.socket_dir).close()
    with Connection(server.socket_dir) as connection, pytest.raises(Exception, match="no entry matches"):
        connection.evict("abcdef12")
    with Connection(server.socket_dir) as connection:
        connection.evict(entry.digest)
    assert wait_until(lambda: "refused evict" in server.log() and "evicted " in server.log())
    assert re.search(rf"INFO .*evicted {entry.digest[:12]} \(request\) during a request of pid {os.getpid()}", server.log())
    assert re.search(rf"INFO .*attached {entry.digest[:12]} for pid {os.getpid()} in [0-9.]+ ms", server.log()), server.log()
    assert re.search(rf"INFO .*refused evict from pid {os.getpid()}: not_found", server.log()), server.log()


def test_without_prometheus_client_the_metrics_port_is_one_line(socket_dir):
    run = cli(
        "serve",
        "--socket-dir",
        str(socket_dir),
        "--metrics-port",
        str(free_port()),
        env={"WC_TEST_HIDE_MODULES": "prometheus_client"},
    )
    assert run.code == 1 and run.stderr[-1] == (
        "weightcache: error: --metrics-port needs prometheus-client; install it with `pip install 'weightcache[metrics]'`"
    ), run


def test_the_histogram_buckets_are_cumulative():
    histogram = Histogram()
    for value in (0.0001, 0.003, 0.003, 100.0):
        histogram.observe(value)
    shown = histogram.to_json()
    assert shown["count"] == 4 and shown["buckets"][0] == [ATTACH_BUCKETS_S[0], 1]
    assert dict(map(tuple, shown["buckets"]))[0.005] == 3 and shown["buckets"][-1][1] == 3  # 100 s only in +Inf
    assert attrs.asdict(Metrics())["hits"] == 0


def test_every_code_the_server_refuses_with_is_counted_from_zero_and_documented():
    """Read from the source: each ``error_reply("code", ...)`` (or ``_refused(fds, "code", ...)``) of the server's modules and each error class's ``code``
    is in REFUSAL_CODES (so its series exists at 0) and has a row in docs/operations.md's table of refusal codes."""
    from weightcache.core.server.metrics import REFUSAL_CODES

    root = Path(__file__).resolve().parents[2]
    sent = set()
    for path in [*(root / "core" / "server").glob("*.py"), root / "core" / "errors.py"]:
        text = path.read_text()
        replies = re.findall(r'(?:error_reply\(|_refused\(\s*fds,)\s*"([a-z_]+)"', text)  # _refused: fds closed, then error_reply
        sent |= set(replies) | set(re.findall(r'^    code = "([a-z_]+)"', text, re.M))
    assert {"version_conflict", "handover_failed", "refused", "busy"} <= sent, sorted(sent)
    assert sent <= set(REFUSAL_CODES), f"not pre-initialised: {sorted(sent - set(REFUSAL_CODES))}"
    docs = (root / "docs" / "operations.md").read_text()
    assert not [code for code in REFUSAL_CODES if f"\n| **`{code}`** |" not in docs], "a refusal code without its row in the docs"
