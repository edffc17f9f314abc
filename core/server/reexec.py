"""Restarting a server in place: on SIGUSR2 it starts its own successor, ``serve --take-over`` with its own command line.

The successor is the server's child, so under systemd it runs in the unit's cgroup; once it has
confirmed the handover, the old server tells systemd ``MAINPID=<successor>`` and exits, and the unit
stays active with the successor as its main process (no restart, the fd store kept). A successor
started from a shell instead is outside the unit: systemd restarts the unit when the old server
exits, and the restarted server finds the lock taken. The successor runs
``sys.executable``, so a virtual environment upgraded in place serves the new code: an upgrade.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

_DROPPED_FLAGS = {"--detach": 0, "--log-file": 1}
"""Flags of the server's own command line its successor must not get, and how many values each takes
(a detached server's successor is already detached: it is the server's child and logs where the server logs)."""


def successor_command(argv: list[str]) -> list[str]:
    """``weightcache`` with ``argv`` (a server's ``sys.argv[1:]``) as a successor: ``--take-over``, never ``--detach``."""
    kept: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED_FLAGS:
            skip = _DROPPED_FLAGS[name] if "=" not in arg else 0
            continue
        kept.append(arg)
    if "serve" not in kept:
        raise ValueError(f"not a `weightcache serve` command line: {' '.join(argv)!r:.200}")
    if "--take-over" not in kept:
        kept.append("--take-over")
    return [sys.executable, "-m", "weightcache.core.cli.cli", *kept]


def spawn_successor(argv: list[str]) -> subprocess.Popen:
    """Start the successor of the server run with ``argv``; a thread reaps it and logs a failure (the server serves on)."""
    command = successor_command(argv)
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    log.info("SIGUSR2: started a successor, pid %d: %s", proc.pid, " ".join(command))

    def reap() -> None:
        code = proc.wait()
        if code != 0:
            log.warning(
                "the successor (pid %d) exited with %d; this server serves on (its reason is logged above)", proc.pid, code
            )

    threading.Thread(target=reap, daemon=True, name="successor-reaper").start()
    return proc
