"""``weightcache probe``: is the server up and answering? An exit status a service manager or Kubernetes reads.

Exit status (the contract, also in docs/operations.md):

====  ===========  ===========================================================================
 0    ready        the server answered ``hello`` and ``status`` within ``--timeout``
 3    no server    nothing serves the directory: no socket (or a dead server's), and no server holds its lock
 4    not ready    a server holds the directory's lock but does not listen yet (starting), or it is busy
 5    unhealthy    a socket is there but the server gave no valid answer in time, or it is not to be trusted
====  ===========  ===========================================================================

(1 and 2 stay what they are for every command: a mistake in the options, a usage error.) One line goes to
stdout, or with ``--json`` one JSON object, either way saying which and why.
"""

from __future__ import annotations

import argparse
import enum
import errno
import fcntl
import json
import os
import time

import attrs

from weightcache.core.client.client import Connection
from weightcache.core.errors import AccessDenied, ProtocolError, ServerError, ServerUnavailable
from weightcache.core.socket_dir import SocketDir, SocketDirLike


class Health(enum.IntEnum):
    """What a probe found; the value is the exit status."""

    READY = 0
    NO_SERVER = 3
    NOT_READY = 4
    UNHEALTHY = 5


@attrs.frozen
class Verdict:
    health: Health
    reason: str
    status: dict | None = attrs.field(default=None, repr=False)

    def line(self) -> str:
        return f"{self.health.name.lower().replace('_', ' ')}: {self.reason}"

    def to_json(self) -> dict:
        return {"health": self.health.name.lower(), "exit_status": int(self.health), "reason": self.reason}


def _lock_held(socket_dir: SocketDir) -> bool:
    """Whether a server holds the directory's lock (it takes it before it binds its socket)."""
    try:
        fd = os.open(socket_dir.lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # closing drops a shared lock this probe took
    return False


def probe(socket_dir: SocketDirLike = None, timeout: float = 5.0) -> Verdict:
    """Ask the server on ``socket_dir`` for ``hello`` and ``status`` within ``timeout`` seconds; never raises for its state."""
    directory = SocketDir.parse(socket_dir)
    if not directory.socket.exists():
        if _lock_held(directory):
            return Verdict(Health.NOT_READY, f"a server holds {directory.lock} but does not listen yet (starting)")
        return Verdict(Health.NO_SERVER, str(ServerUnavailable(str(directory.socket), "no socket")))
    started = time.monotonic()
    try:
        with Connection(directory, timeout=timeout) as connection:
            hello = connection.hello()
            status = connection.status()
    except ServerError as exc:
        health = Health.NOT_READY if exc.code == "busy" else Health.UNHEALTHY
        return Verdict(health, f"the server refused: {exc}")
    except ServerUnavailable as exc:
        if not _lock_held(directory):
            return Verdict(Health.NO_SERVER, str(exc))
        return Verdict(Health.UNHEALTHY, f"the server at {directory} gave no answer: {exc.reason}")
    except (AccessDenied, ProtocolError) as exc:
        return Verdict(Health.UNHEALTHY, str(exc))
    seconds = time.monotonic() - started
    metrics = status.get("metrics", {})
    entries = len(status.get("entries", [])) + int(status.get("omitted", 0))
    uptime = f", up {metrics['uptime_s']:.0f} s" if "uptime_s" in metrics else ""
    return Verdict(
        Health.READY,
        f"server pid {hello.get('pid')} (weightcache {hello.get('version')}) answered in {seconds * 1000:.0f} ms: "
        f"{entries} {'entry' if entries == 1 else 'entries'}{uptime}",
        status,
    )


def add_parser(parser: argparse.ArgumentParser) -> None:
    """The probe's own options (the CLI adds ``--socket-dir``)."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="longest wait for the server's answer (default: 5); a server slower than this is unhealthy",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON: health, exit_status, reason")


def run(args: argparse.Namespace) -> int:
    verdict = probe(args.socket_dir, args.timeout)
    print(json.dumps(verdict.to_json()) if args.json else verdict.line())
    return int(verdict.health)
