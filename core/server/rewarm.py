"""Work the server hands to CLI children in the background: the warm list, and a scrub of re-adopted entries.

Keeping a config file's models warm: ``weightcache load`` for each, in order, in the background.
The server never imports torch: it runs one ``weightcache load`` child at a time (which
publishes to it like any loader, within its budgets, and says "already cached" without
reading the disk when the entry is held) and reports each item's state in ``status``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

from weightcache.core import envvars
from weightcache.core.server.serve_config import WarmItem
from weightcache.core.socket_dir import SocketDir

log = logging.getLogger(__name__)

MAX_ROWS = 64
"""Warm items a status reply lists."""
STATES = ("pending", "loading", "done", "failed")
"""The states of a warm item, in the order it goes through them (``done`` or ``failed`` last)."""
_DETAIL_CHARS = 300
SCRUB_PAUSE_ENV = "WEIGHTCACHE_SCRUB_PAUSE_S"
"""Seconds the scrub of re-adopted entries waits before it starts (a test hook: tests that verify entries themselves)."""


class Warmer:
    """Loads the warm list in the background; ``replace`` swaps the list (SIGHUP), ``progress`` reports it."""

    def __init__(self, socket_dir: SocketDir, items: tuple[WarmItem, ...] = ()):
        self.socket_dir = socket_dir
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._items: list[WarmItem] = list(items)
        self._states: dict[WarmItem, tuple[str, str]] = {item: ("pending", "") for item in items}
        self._stopping = False
        self._child: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._run, name="weightcache-warm", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def replace(self, items: tuple[WarmItem, ...]) -> None:
        """A new list: items loaded already keep their state; new ones are loaded, in the new order."""
        with self._changed:
            self._items = list(items)
            self._states = {item: self._states.get(item, ("pending", "")) for item in items}
            self._changed.notify_all()

    def progress(self) -> list[dict]:
        with self._lock:
            return [{**item.describe(), "state": state, "detail": detail} for item, (state, detail) in self._states.items()][
                :MAX_ROWS
            ]

    def counts(self) -> dict[str, int]:
        """Items per state (every state of STATES, 0 when none)."""
        with self._lock:
            counted = dict.fromkeys(STATES, 0)
            for state, _ in self._states.values():
                counted[state] += 1
            return counted

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            child = self._child
            self._changed.notify_all()
        if child is not None and child.poll() is None:
            child.terminate()

    def _next(self) -> WarmItem | None:
        with self._changed:
            while not self._stopping:
                for item in self._items:
                    if self._states[item][0] == "pending":
                        self._states[item] = ("loading", "")
                        return item
                self._changed.wait()
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            state, detail = self._load(item)
            with self._lock:
                if item in self._states:
                    self._states[item] = (state, detail)
            log.log(
                logging.WARNING if state == "failed" else logging.INFO,
                "warm list: %s %s (%s)",
                item.model,
                state,
                detail,
                extra={"model": item.model, "state": state},
            )

    def _load(self, item: WarmItem) -> tuple[str, str]:
        try:
            with self._lock:
                if self._stopping:
                    return "pending", ""
                self._child = child = subprocess.Popen(
                    item.command(self.socket_dir),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            out, err = child.communicate()
        except OSError as exc:
            return "failed", f"could not run weightcache load: {exc}"[:_DETAIL_CHARS]
        finally:
            with self._lock:
                self._child = None
        lines = [line for line in (out + err).splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {child.returncode}"
        return ("done" if child.returncode == 0 else "failed"), last[:_DETAIL_CHARS]


def scrub_in_background(socket_dir: SocketDir) -> threading.Thread:
    """Run ``weightcache verify --drop`` once (entries came back from systemd's fd store: their checksums are checked
    where they live, one that matches is verified from then on, a corrupt one is evicted unless attached); its summary
    is logged."""

    def run() -> None:
        pause = envvars.seconds(SCRUB_PAUSE_ENV)
        if pause > 0:
            log.warning("the scrub of the entries from systemd's fd store waits %g s (%s is set)", pause, SCRUB_PAUSE_ENV)
            threading.Event().wait(pause)
        command = [sys.executable, "-m", "weightcache.core.cli.cli", "verify", "--socket-dir", str(socket_dir), "--drop"]
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, start_new_session=True)
        except OSError as exc:
            log.warning("could not run weightcache verify on the entries from systemd's fd store: %s", exc)
            return
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        log.log(
            logging.INFO if done.returncode == 0 else logging.WARNING,
            "weightcache verify on the entries from systemd's fd store: exit %d; %s",
            done.returncode,
            "; ".join(lines[-5:])[: _DETAIL_CHARS * 2],
        )

    thread = threading.Thread(target=run, name="weightcache-scrub", daemon=True)
    thread.start()
    return thread
