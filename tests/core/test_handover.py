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
from weightcache.core.client.attach import Attachment
from weightcache.core.client.client import Connection
from weightcache.core.errors import ServerError, ServerUnavailable
from weightcache.core.server.handover import ADMIT_PAUSE_ENV, DIE_AT_ENV, PAUSE_ENV
from weightcache.core.server.server_process import serve_command


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


def _predecessor(socket_dir, env: dict | None = None) -> subprocess.Popen:
    """A server with ``env`` added to its environment (the handover's pause and kill hooks)."""
    return subprocess.Popen(
        serve_command(socket_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
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


def _end_all(socket_dir, first: ServerProcess, successor: subprocess.Popen | None) -> None:
    """Stop the successor (if it started), SIGTERM whichever server the socket names now, and close the first."""
    if successor is not None:
        _stop(successor)
    with contextlib.suppress(Exception):
        os.kill(_status(socket_dir)["pid"], signal.SIGTERM)
    first.close()


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
def _handing_over(socket_dir, predecessor_env: dict | None = None, successor_env: dict | None = None, entries: int = 10):
    """A predecessor holding ``entries`` entries and a successor taking them over, each process with its own environment.

    By default the predecessor pauses 0.05 s after each entry it packs and the successor 0.1 s after each it admits,
    so that a test can interrupt either phase.
    """
    proc = _predecessor(socket_dir, {PAUSE_ENV: "0.05", **(predecessor_env or {})})
    successor = None
    try:
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20)
        published = _publish(socket_dir, entries)
        successor = _successor(socket_dir, {ADMIT_PAUSE_ENV: "0.1", **(successor_env or {})})
        yield proc, successor, published
    finally:
        if successor is not None:
            _stop(successor)
        _stop(proc)


@contextlib.contextmanager
def _clients(socket_dir):
    """A client asking for ``status`` in a loop until the block ends; yields the list of what failed."""
    failures: list[BaseException] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            try:
                _status(socket_dir)
            except BaseException as exc:  # collected for the caller's assertion
                failures.append(exc)
                time.sleep(0.01)

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        yield failures
    finally:
        stop.set()
        asker.join(timeout=30)


def _log(socket_dir) -> str:
    path = Path(str(socket_dir) + ".successor.log")
    return path.read_text() if path.exists() else ""


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


@pytest.mark.parametrize("step", ["received", "admitting", "confirming"])
def test_a_successor_that_dies_at_any_step_leaves_every_entry_with_the_predecessor(socket_dir, step):
    with _handing_over(socket_dir, successor_env={DIE_AT_ENV: step}) as (proc, successor, published):
        assert successor.wait(timeout=30) == -signal.SIGKILL, _log(socket_dir)[-2000:]
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20), "the predecessor stopped serving"
        assert _digests(socket_dir) == published
        publish_host_entry(socket_dir, make_fingerprint(architecture="After"))
        assert proc.poll() is None
        assert _status(socket_dir)["metrics"]["refusals"]["handover_failed"] == 1, "the failed handover is counted"


@pytest.mark.parametrize("step", ["sent", "confirmed"])
def test_a_predecessor_killed_once_its_handover_left_leaves_the_successor_with_every_entry(socket_dir, step):
    """SIGKILL right after the one sendmsg that carries every entry, or after the confirmation: nothing is lost and
    clients asking all along are answered (they queue on the listener the successor now holds)."""
    with _handing_over(socket_dir, predecessor_env={DIE_AT_ENV: step}) as (proc, successor, published):
        with _clients(socket_dir) as failures:
            assert proc.wait(timeout=30) == -signal.SIGKILL
            assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), _log(socket_dir)[-2000:]
            assert _digests(socket_dir) == published
            publish_host_entry(socket_dir, make_fingerprint(architecture="After"))
            time.sleep(0.2)  # a few more client requests, answered by the successor
        assert failures == [], f"clients failed: {failures[:3]}"


def test_a_predecessor_killed_while_the_successor_admits_leaves_the_successor_with_every_entry(socket_dir):
    with _handing_over(socket_dir) as (proc, successor, published):
        with _clients(socket_dir) as failures:
            assert wait_until(lambda: "taking over" in _log(socket_dir), timeout=20), "the handover never began"
            time.sleep(0.35)  # the successor has admitted some of the 10 entries (0.1 s each)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), _log(socket_dir)[-2000:]
            assert _digests(socket_dir) == published
        assert failures == [], f"clients failed: {failures[:3]}"


def test_a_predecessor_killed_before_it_handed_over_is_a_crash_and_the_successor_starts_clean(socket_dir):
    """Killed while packing (before the one sendmsg): the successor holds nothing, waits for the lock and starts as
    after a crash; the engine that maps an entry publishes it again, checksummed. Clients meanwhile are answered or
    told the server is unavailable (a client-mode engine then loads from disk), never given anything else."""
    proc = _predecessor(socket_dir, {DIE_AT_ENV: "packing"})
    successor = None
    try:
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20)
        _publish(socket_dir, 3)
        held = publish_host_entry(socket_dir, label="attached")
        attachment = Attachment.open(held.fingerprint, socket_dir)
        with _clients(socket_dir) as failures:
            successor = _successor(socket_dir)
            assert proc.wait(timeout=30) == -signal.SIGKILL
            assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), _log(socket_dir)[-2000:]
        assert all(isinstance(exc, ServerUnavailable) for exc in failures), failures[:3]
        assert "before it handed anything over" in _log(socket_dir)
        assert _digests(socket_dir) == set()
        assert attachment.reattach() is True
        assert _digests(socket_dir) == {held.digest}
        attachment.close()
    finally:
        if successor is not None:
            _stop(successor)
        _stop(proc)


def test_a_predecessor_killed_after_its_last_entry_leaves_the_successor_with_every_entry(socket_dir):
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


def test_a_predecessor_killed_after_a_refusal_leaves_the_successor_with_what_passed(socket_dir):
    """A successor that cannot hold every entry refuses; if the predecessor dies before it acknowledges, nobody else
    holds the entries: the successor serves those that fit rather than none."""
    proc = _predecessor(socket_dir, {DIE_AT_ENV: "refused"})
    successor = None
    try:
        assert wait_until(lambda: _served_by(socket_dir, proc.pid), timeout=20)
        published = _publish(socket_dir, 4)
        successor = _successor_with(socket_dir, "--host-budget", "40000")  # room for two 16 KiB entries of four
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), _log(socket_dir)[-2000:]
        kept = _digests(socket_dir)
        assert len(kept) == 2 and kept <= published
        assert "died during the handover: serving the 2 entries that passed" in _log(socket_dir)
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
        assert _status(socket_dir)["metrics"]["refusals"]["refused"] == 1, "the successor's refusal is counted"
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


def test_a_handover_of_more_entries_than_one_parcel_holds_keeps_every_one(socket_dir):
    """About a hundred entries fit a parcel (half its send buffer): 250 travel in three, all in one sendmsg."""
    first = ServerProcess.start(socket_dir)
    successor = None
    try:
        published = _publish(socket_dir, 250)
        successor = _successor(socket_dir)
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=60), _log(socket_dir)[-2000:]
        assert first.proc.wait(timeout=10) == 0
        assert _digests(socket_dir) == published
        assert "taking over 250 entries in 3 parcels" in _log(socket_dir)
    finally:
        if successor is not None:
            _stop(successor)
        first.close()


def _probe(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` on the metrics port: (status, body), or (0, why) when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


@pytest.mark.parametrize("how", ["take-over", "SIGUSR2"])
def test_a_restart_with_a_metrics_port_hands_the_port_over_and_it_never_stops_answering(socket_dir, how):
    """The successor gets the predecessor's metrics listener (it could not bind the port the predecessor holds)."""
    pytest.importorskip("prometheus_client", reason="the metrics extra is not installed (pip install -e '.[test]')")
    from tests.helpers import free_port

    port = free_port()
    first = ServerProcess.start(socket_dir, "--metrics-port", str(port))
    successor = None
    try:
        published = _publish(socket_dir, 3)
        assert _probe(port, "/healthz") == (200, f"ok: pid {first.pid} accepts on {socket_dir}/weightcache.sock\n")
        answers: list[tuple[int, str]] = []
        stop = threading.Event()

        def keep_scraping() -> None:
            while not stop.is_set():
                code, text = _probe(port, "/metrics")
                answers.append((code, "" if code == 200 else text))

        scraper = threading.Thread(target=keep_scraping)
        scraper.start()
        try:
            if how == "SIGUSR2":
                os.kill(first.pid, signal.SIGUSR2)
                assert wait_until(lambda: _status(socket_dir)["pid"] != first.pid, timeout=30), first.log()
            else:
                successor = _successor_with(socket_dir, "--metrics-port", str(port))
                assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), first.log()
            assert first.proc.wait(timeout=10) == 0, first.log()
        finally:
            stop.set()
            scraper.join(timeout=20)
        new_pid = _status(socket_dir)["pid"]
        assert _probe(port, "/healthz")[1].startswith(f"ok: pid {new_pid} ")
        assert _probe(port, "/readyz")[0] == 200 and _digests(socket_dir) == published
        assert answers and {code for code, _ in answers} == {200}, f"a scrape failed during the handover: {answers[-3:]}"
        assert "dropped" not in first.log() and "Traceback" not in first.log(), first.log()
    finally:
        _end_all(socket_dir, first, successor)


def test_a_successor_told_another_metrics_port_listens_there_and_frees_the_old_one(socket_dir):
    pytest.importorskip("prometheus_client", reason="the metrics extra is not installed (pip install -e '.[test]')")
    from tests.helpers import free_port

    old, new = free_port(), free_port()
    first = ServerProcess.start(socket_dir, "--metrics-port", str(old))
    successor = _successor_with(socket_dir, "--metrics-port", str(new))
    try:
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), first.log()
        assert first.proc.wait(timeout=10) == 0
        assert _probe(new, "/readyz")[0] == 200
        assert _probe(old, "/readyz")[0] == 0, "the old port must be closed with the old server"
    finally:
        _stop(successor)
        first.close()


def test_a_take_over_after_an_in_place_restart_names_the_live_server_not_the_first(socket_dir):
    """After SIGUSR2 the listener is the first server's, which has exited: the peer's credentials name it still."""
    first = ServerProcess.start(socket_dir)
    successor = None
    try:
        published = _publish(socket_dir, 2)
        os.kill(first.pid, signal.SIGUSR2)
        assert wait_until(lambda: _status(socket_dir)["pid"] != first.pid, timeout=30), first.log()
        assert first.proc.wait(timeout=10) == 0, first.log()
        live = _status(socket_dir)["pid"]
        successor = _successor(socket_dir)
        assert wait_until(lambda: _served_by(socket_dir, successor.pid), timeout=30), _log(socket_dir)
        log = _log(socket_dir)
        assert f"from pid {live} (weightcache" in log, log[-2000:]
        assert f"pid {first.pid}" not in log, log[-2000:]
        assert _digests(socket_dir) == published
    finally:
        _end_all(socket_dir, first, successor)
