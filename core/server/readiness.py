"""Telling a service manager the server is ready: systemd's ``Type=notify`` protocol (``sd_notify``).

systemd passes ``$NOTIFY_SOCKET``, a datagram Unix socket (a path, or an abstract name starting with ``@``);
the server sends ``READY=1`` there once its socket listens, so units ordered after it (``After=``) start
engines only when attaching can work. Without ``$NOTIFY_SOCKET`` nothing is sent. No libsystemd needed.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


def notify(state: str) -> bool:
    """Send ``state`` (``READY=1``, ``STOPPING=1``, ``STATUS=...``) to ``$NOTIFY_SOCKET``; False when there is none.

    A service manager that went away is logged, not raised: the server serves either way.
    """
    address = os.environ.get(ENV)
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("ignoring %s=%r: neither a path nor an abstract socket name", ENV, address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("could not tell the service manager %r through %s: %s", state, ENV, exc)
        return False
    return True


def ready(socket_path: os.PathLike | str) -> bool:
    """The server listens on ``socket_path``: ``READY=1`` with its pid and a status line."""
    return notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving on {socket_path}")
