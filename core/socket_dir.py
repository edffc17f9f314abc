"""Where the server's socket lives: the directory's default and the socket's name in it."""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "weightcache.sock"
ENV_SOCKET_DIR = "WEIGHTCACHE_SOCKET_DIR"


def default_socket_dir() -> Path:
    """``$WEIGHTCACHE_SOCKET_DIR``, else ``$XDG_RUNTIME_DIR/weightcache``, else ``/tmp/weightcache-UID``."""
    if os.environ.get(ENV_SOCKET_DIR):
        return Path(os.environ[ENV_SOCKET_DIR])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "weightcache"
    return Path(f"/tmp/weightcache-{os.geteuid()}")


def socket_path(socket_dir: str | os.PathLike | None = None) -> Path:
    """The socket inside ``socket_dir`` (default: ``default_socket_dir()``)."""
    return Path(socket_dir or default_socket_dir()) / SOCKET_NAME
