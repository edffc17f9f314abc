"""Log levels, the JSON log format, and ``serve --detach`` logging to a file it names."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.fleet_support import nixl_problem
from tests.core.support import publish_host_entry
from tests.helpers import run_cli, wait_until
from weightcache.core.client.attach import Attachment


def _detach(socket_dir, *options: str, after: tuple[str, ...] = ()) -> tuple[int, str]:
    """A detached server with ``options`` before ``serve`` and ``after`` it: its pid and its log file."""
    proc = run_cli(*options, "serve", "--detach", "--socket-dir", str(socket_dir), *after)
    match = re.fullmatch(r"weightcache server pid (\d+) serving (\S+); logs: (\S+)\n", proc.stdout)
    assert match and match.group(2) == str(socket_dir), proc.stdout
    return int(match.group(1)), match.group(3)


def test_a_detached_server_logs_json_lines_to_the_file_it_names(socket_dir):
    pid, log_path = _detach(socket_dir, "--log-format", "json")
    try:
        assert log_path == str(socket_dir / "server.log")
        entry = publish_host_entry(socket_dir)
        Attachment.open(entry.fingerprint, socket_dir).close()
        log = Path(log_path)
        assert wait_until(lambda: "attached" in log.read_text())
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert {"time", "level", "logger", "pid", "message"} <= set(records[0]), records[0]
        attached = [r for r in records if r["message"].startswith(f"attached {entry.digest[:12]} for pid {os.getpid()}")]
        assert attached and attached[0]["level"] == "info" and attached[0]["pid"] == pid, records
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not (socket_dir / "weightcache.sock").exists())


def test_a_detached_server_makes_a_socket_directory_nobody_made_yet(tmp_path):
    socket_dir = tmp_path / "not" / "made" / "yet"
    pid, log_path = _detach(socket_dir)
    try:
        assert log_path == str(socket_dir / "server.log") and (socket_dir.stat().st_mode & 0o777) == 0o700
        entry = publish_host_entry(socket_dir)
        Attachment.open(entry.fingerprint, socket_dir).close()
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not (socket_dir / "weightcache.sock").exists())


def test_log_level_warning_keeps_info_out(socket_dir, tmp_path):
    log_file = tmp_path / "server.log"
    proc = run_cli("--log-level", "warning", "serve", "--detach", "--socket-dir", str(socket_dir), "--log-file", str(log_file))
    pid = int(proc.stdout.split()[3])
    try:
        assert proc.stdout.rstrip().endswith(f"logs: {log_file}")
        publish_host_entry(socket_dir)
        run_cli("status", "--socket-dir", str(socket_dir))
        assert "INFO" not in log_file.read_text()
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not (socket_dir / "weightcache.sock").exists())


def test_log_options_go_before_the_command_or_after_serve():
    from weightcache.core.cli.cli import build_parser

    parser = build_parser()
    # None: not given (the config file may set them; text at info for serve otherwise)
    assert (parser.parse_args(["serve"]).log_level, parser.parse_args(["serve"]).log_format) == (None, None)
    after = parser.parse_args(["serve", "--log-level", "debug", "--log-format", "json"])
    before = parser.parse_args(["--log-level", "debug", "--log-format", "json", "serve"])
    assert (after.log_level, after.log_format) == (before.log_level, before.log_format) == ("debug", "json")


def test_json_lines_carry_the_entry_model_bytes_and_peer_pid_as_fields(socket_dir):
    pid, log_path = _detach(socket_dir, "--log-format", "json")
    try:
        entry = publish_host_entry(socket_dir, label="fielded")
        Attachment.open(entry.fingerprint, socket_dir).close()
        log = Path(log_path)
        assert wait_until(lambda: "attached" in log.read_text())
        records = [json.loads(line) for line in log.read_text().splitlines()]
        published = next(r for r in records if r["message"].startswith("published "))
        assert published["entry"] == entry.digest and published["model"] == "fielded", published
        assert published["bytes"] > 0 and published["peer_pid"] == os.getpid(), published
        attached = next(r for r in records if r["message"].startswith("attached "))
        assert attached["entry"] == entry.digest and attached["peer_pid"] == os.getpid() and attached["op"] == "attach"
        assert "code" not in attached, "a field without a value is left out"
        evicter = run_cli("evict", "--socket-dir", str(socket_dir), entry.digest)  # another process: another pid
        assert wait_until(lambda: "dropped " in log.read_text())
        records = [json.loads(line) for line in log.read_text().splitlines()]
        dropped = next(r for r in records if r["message"].startswith("dropped "))
        assert dropped["publisher_pid"] == os.getpid() and "peer_pid" not in dropped, "peer_pid is a requester, always"
        evicted = next(r for r in records if r["message"].startswith("evicted "))
        assert evicted["peer_pid"] not in (os.getpid(), None) and evicter.returncode == 0, evicted
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not (socket_dir / "weightcache.sock").exists())


def test_an_entry_taken_over_in_place_is_logged_with_its_publisher_and_no_requester(socket_dir):
    """After SIGUSR2 the successor's "published" line for an entry it took over names who published it
    (``publisher_pid``) and no ``peer_pid``: nobody requested it of the successor."""
    from weightcache.core.client.client import Connection

    pid, log_path = _detach(socket_dir, "--log-format", "json")
    serving = [pid]
    try:
        entry = publish_host_entry(socket_dir, label="kept")
        os.kill(pid, signal.SIGUSR2)

        def successor() -> bool:
            with Connection(socket_dir) as connection:
                serving.append(connection.status()["pid"])
            return serving[-1] != pid

        assert wait_until(successor, timeout=30), Path(log_path).read_text()[-3000:]
        records = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.startswith("{")]
        taken = [r for r in records if r["pid"] == serving[-1] and r["message"].startswith("published ")]
        assert [r["entry"] for r in taken] == [entry.digest], records[-10:]
        assert taken[0]["publisher_pid"] == os.getpid() and "peer_pid" not in taken[0], taken[0]
    finally:
        os.kill(serving[-1], signal.SIGTERM)
        wait_until(lambda: not (socket_dir / "weightcache.sock").exists())


def test_the_config_file_sets_the_log_format_and_level_and_flags_win(socket_dir, tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('[server]\nlog_format = "json"\nlog_level = "warning"\n')
    pid, log_path = _detach(socket_dir, after=("--config", str(config)))
    try:
        publish_host_entry(socket_dir)
        run_cli("status", "--socket-dir", str(socket_dir))
        lines = Path(log_path).read_text().splitlines()
        assert all(json.loads(line)["level"] != "info" for line in lines), lines
        proc = run_cli("serve", "--config", str(config), "--log-format", "text", "--check-config")
        assert "log_format = text" in proc.stdout and "log_level = warning" in proc.stdout, proc.stdout
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not (socket_dir / "weightcache.sock").exists())


_NIXL_AGENT = """
import sys
from weightcache.core.cli.logformat import configure
configure(sys.argv[1], brief=True)
from weightcache.core.node.fleet.nixl import NixlTransport
NixlTransport("quiet-probe").close()
"""


def test_nixls_own_info_lines_stay_out_unless_debug():
    """What `weightcache load` in a fleet printed: NIXL's INFO lines, from a logger NIXL configures on import."""
    if (problem := nixl_problem()) is not None:
        pytest.skip(f"NIXL cannot run here: {problem}")
    env = {key: value for key, value in os.environ.items() if key != "NIXL_LOG_LEVEL"}
    said = {}
    for level in ("warning", "debug"):
        proc = subprocess.run([sys.executable, "-c", _NIXL_AGENT, level], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said[level] = proc.stdout + proc.stderr
    assert "NIXL INFO" not in said["warning"], said["warning"]
    assert "NIXL INFO" in said["debug"], "with -v they are shown (else this test proves nothing)"


_THIRD_PARTY = """
import logging, sys
from weightcache.core.cli.logformat import configure
configure(sys.argv[1])
logging.getLogger("some.library").info("a library's INFO")
logging.getLogger("some.library").warning("a library's WARNING")
logging.getLogger("weightcache.core.server.server").info("weightcache's INFO")
"""


def test_a_python_librarys_info_lines_stay_out_of_a_serving_command_unless_debug():
    """A server logs its own INFO lines; another library's INFO (a Python logger under the root) shows only with -v,
    its warnings always."""
    said = {}
    for level in ("info", "debug"):
        proc = subprocess.run([sys.executable, "-c", _THIRD_PARTY, level], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said[level] = proc.stderr
    assert "weightcache's INFO" in said["info"] and "a library's WARNING" in said["info"], said["info"]
    assert "a library's INFO" not in said["info"], said["info"]
    assert "a library's INFO" in said["debug"], said["debug"]
