"""Restarting a server in place: on SIGUSR2 it starts its own successor, ``serve --take-over`` with its own command line.

The successor is started through a launcher that forks it and exits (a double fork), so it is at once the child of
the service manager (pid 1, or a subreaper such as ``systemd --user``), still in the unit's cgroup. Once it has
confirmed the handover, the old server tells systemd ``MAINPID=<successor>`` and exits: the unit stays active with
the successor as its main process (no restart, the fd store kept), and systemd, its parent, sees it exit, so a later
``systemctl stop`` or ``restart`` sends it SIGTERM and waits for it (a main process that is not systemd's child is
"alien": systemd does not wait for it and sends SIGKILL at once on a cgroup-v1 host). A successor started from a
shell instead is outside the unit: systemd restarts the unit when the old server exits, and the restarted server
finds the lock taken. The successor runs ``sys.executable``, so a virtual environment upgraded in place serves the
new code: an upgrade.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable

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


LAUNCHER = """\
import os, sys
report = int(sys.argv[1])
pid = os.fork()
if pid:
    os.write(report, str(pid).encode())
    os._exit(0)
os.close(report)
os.execv(sys.argv[2], sys.argv[2:])
"""
"""Forks the command in ``argv[2:]``, writes its pid to fd ``argv[1]`` and exits: the command's parent is then the
service manager (or init), not the server."""


def spawn_successor(argv: list[str], handed_over: Callable[[], bool] = lambda: False) -> int:
    """Start the successor of the server run with ``argv`` as the service manager's child; its pid. A thread logs it if
    it exits before ``handed_over()`` (the server serves on)."""
    command = successor_command(argv)
    read_end, write_end = os.pipe()
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", LAUNCHER, str(write_end), *command],
            stdin=subprocess.DEVNULL,
            pass_fds=(write_end,),
        )
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        said = reader.read(32)
    code = launcher.wait()
    if code != 0 or not said.isdigit():
        raise OSError(f"the launcher of the successor exited with {code} before starting it")
    pid = int(said)
    log.info("SIGUSR2: started a successor, pid %d: %s", pid, " ".join(command))
    threading.Thread(target=_watch, args=(pid, handed_over), daemon=True, name="successor-watch").start()
    return pid


def _watch(pid: int, handed_over: Callable[[], bool]) -> None:
    """Log the successor ``pid``'s exit unless it took over first (a pidfd: it is not this process's child)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # an old kernel, or a seccomp filter without pidfd_open: its own log says why
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)
    if not handed_over():
        log.warning("the successor (pid %d) exited before taking over; this server serves on (its reason is logged above)", pid)
