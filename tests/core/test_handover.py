"""Planned restart and upgrade: `weightcache serve --take-over` takes every entry from the running server (issue 24)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.core.support import make_fingerprint, publish_host_entry, resting_fd_count, settle_fd_count
from tests.helpers import ServerProcess, run_cli, wait_until
from weightcache.core.attach import Attachment
from weightcache.core.client import Connection
from weightcache.core.errors import ServerError, ServerUnavailable
from weightcache.core.handover import PAUSE_ENV
from weightcache.core.server_process import serve_command


def _status(socket_dir) -> dict:
    with Connection(socket_dir, timeout=10) as conn:
        return conn.status()


def _digests(socket_dir) -> set[str]:
    return {row["digest"] for row in _status(socket_dir)["entries"]}


def _publish(socket_dir, count: int) -> set[str]:
    return {
        publish_host_entry(socket_dir, make_fingerprint(architecture=f"Handed{n}"), label=f"e{n}").digest for n in range(count)
    }


def _successor(socket_dir, env: dict | None = None) -> subprocess.Popen:
    return _successor_with(socket_dir, env=env)


def _successor_with(socket_dir, *args: str, env: dict | None = None) -> subprocess.Popen:
    log = open(str(socket_dir) + ".successor.log", "ab")
    with log:
        return subprocess.Popen(
            serve_command(socket_dir, "--take-over", *args),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def _predecessor(socket_dir, pause_s: float = 0.0) -> subprocess.Popen:
    """A server that pauses ``pause_s`` after each entry it hands over (so that a test can interrupt it)."""
    return subprocess.Popen(
        serve_command(socket_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, PAUSE_ENV: str(pause_s)},
        start_new_session=True,
    )


def _served_by(socket_dir, pid: int) -> bool:
    try:
        return _status(socket_dir)["pid"] == pid
    except (ServerUnavailable, OSError):
        return False


def _publishes(socket_dir) -> bool:
    try:
        publish_host_entry(socket_dir, make_fingerprint(architecture="After"), label="after")
        return True
    except ServerError as exc:
        assert exc.code == "busy", exc  # refused while it still hands over, never with another error
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_a_successor_takes_every_entry_and_the_socket_and_attached_engines_never_notice(socket_dir):
    first = ServerProcess.start(socket_dir)
    successor = None
    try:
        published = _publish(socket_dir, 12)
        held = publish_host_entry(socket_dir, label="attached")
        attachment = Attachment.open(held.fingerprint, socket_dir)
        before = _status(socket_dir)
        failures: list[BaseException] = []
        stop = threading.Event()

        def keep_asking() -> None:  # a client during the handover: served by one server or the other, never refused
            while not stop.is_set():
                try:
                    _status(socket_dir)
                except BaseException as exc:  # collected for the assertion below
                    failures.append(exc)

        asker = threading.Thread(target=keep_asking)
        asker.start()
        successor = _successor(socket_dir)
        try:
            assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=20), "the successor never served"
            assert first.proc.wait(timeout=10) == 0, "the predecessor did not exit cleanly after the handover"
        finally:
            stop.set()
            asker.join(timeout=20)
        assert failures == [], f"clients failed during the handover: {failures[:3]}"
        after = _status(socket_dir)
        assert {r["digest"] for r in after["entries"]} == published | {held.digest}
        rows = {r["digest"]: r for r in after["entries"]}
        for row in before["entries"]:
            assert rows[row["digest"]]["label"] == row["label"]
            assert rows[row["digest"]]["published_by"] == row["published_by"]
            assert rows[row["digest"]]["bytes"] == row["bytes"]
        # The engine's mapping is intact (checksummed) and the successor already holds its entry: no re-publish needed.
        assert attachment.reattach() is False
        attachment.close()
        # The successor serves attaches from the fds it was handed.
        again = Attachment.open(held.fingerprint, socket_dir)
        again.close()
        assert (socket_dir / "weightcache.sock").exists()
    finally:
        if successor is not None:
            successor.terminate()
            successor.wait(timeout=30)
        first.close()


def test_take_over_without_a_running_server_starts_as_usual(socket_dir):
    successor = _successor(socket_dir)
    try:
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=20)
        assert _digests(socket_dir) == set()
    finally:
        successor.terminate()
        successor.wait(timeout=30)


@contextlib.contextmanager
def _handing_over(socket_dir):
    """A predecessor holding 10 entries that pauses 0.1 s after each it hands over, and a successor taking them over."""
    proc = _predecessor(socket_dir, pause_s=0.1)
    successor = None
    try:
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20)
        published = _publish(socket_dir, 10)
        successor = _successor(socket_dir)
        yield proc, successor, published
    finally:
        if successor is not None:
            _stop(successor)
        _stop(proc)


@pytest.mark.parametrize("after_s", [0.05, 0.5, 1.0])
def test_a_successor_killed_during_the_handover_leaves_every_entry_with_the_predecessor(socket_dir, after_s):
    with _handing_over(socket_dir) as (proc, successor, published):
        time.sleep(after_s)
        os.kill(successor.pid, signal.SIGKILL)
        successor.wait(timeout=10)
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20), "the predecessor stopped serving"
        assert _digests(socket_dir) == published
        assert proc.poll() is None
        publish_host_entry(socket_dir, make_fingerprint(architecture="After"))  # waits out the handover's refusals


@pytest.mark.parametrize("after_s", [0.05, 0.25, 0.55])
def test_a_predecessor_killed_during_the_handover_leaves_the_successor_serving_what_it_received(socket_dir, after_s):
    with _handing_over(socket_dir) as (proc, successor, published):
        started = Path(str(socket_dir) + ".successor.log")
        assert wait_until(lambda: "taking over" in started.read_text(), timeout=20), "the handover never began"
        time.sleep(after_s)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=20), "the successor did not serve"
        kept = _digests(socket_dir)
        assert kept and kept <= published, "the successor must serve what it received, never nothing"


def test_a_predecessor_killed_after_the_last_entry_leaves_the_successor_with_every_entry(socket_dir):
    proc = _predecessor(socket_dir)
    successor = None
    try:
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20)
        published = _publish(socket_dir, 10)
        successor = _successor(socket_dir)
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=20)
        os.kill(proc.pid, signal.SIGKILL)  # whether or not it had exited by itself: the successor holds everything
        proc.wait(timeout=10)
        assert _digests(socket_dir) == published
    finally:
        if successor is not None:
            _stop(successor)
        _stop(proc)


def test_a_successor_that_cannot_hold_every_entry_refuses_and_the_predecessor_keeps_them(socket_dir):
    first = ServerProcess.start(socket_dir)
    try:
        published = _publish(socket_dir, 4)
        before = resting_fd_count(first.pid)
        successor = _successor_with(socket_dir, "--host-budget", "20000")  # room for one 16 KiB entry of four
        assert successor.wait(timeout=30) == 1, "a successor that could not take every entry must exit with an error"
        log = Path(str(socket_dir) + ".successor.log").read_text()
        assert "keeps serving every entry" in log and "Traceback" not in log, log[-2000:]
        assert _served_by(socket_dir, first.pid)
        assert settle_fd_count(first.pid, before) == before, "the failed handover leaked fds in the predecessor"
        assert _digests(socket_dir) == published
        assert wait_until(lambda: _publishes(socket_dir), timeout=10)
    finally:
        first.close()


def test_a_publish_during_a_handover_waits_and_lands_on_the_successor(socket_dir):
    with _handing_over(socket_dir) as (proc, successor, published):
        started = Path(str(socket_dir) + ".successor.log")
        assert wait_until(lambda: "taking over" in started.read_text(), timeout=20), "the handover never began"
        late = publish_host_entry(socket_dir, make_fingerprint(architecture="Late"))  # refused with busy, retried
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=20)
        assert _digests(socket_dir) == published | {late.digest}
        assert proc.wait(timeout=10) == 0


def test_the_documented_upgrade_command_detaches_and_takes_every_entry(socket_dir):
    first = ServerProcess.start(socket_dir)
    try:
        published = _publish(socket_dir, 3)
        done = run_cli("serve", "--socket-dir", str(socket_dir), "--take-over", "--detach")
        assert "serving" in done.stdout, done.stdout + done.stderr
        assert first.proc.wait(timeout=10) == 0
        status = _status(socket_dir)
        assert {row["digest"] for row in status["entries"]} == published
        os.kill(status["pid"], signal.SIGTERM)
        assert wait_until(lambda: not (socket_dir / "weightcache.sock").exists(), timeout=10)
    finally:
        first.close()
