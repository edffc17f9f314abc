"""Where the server's socket lives, and the checks that keep other users out of it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from weightcache.core.errors import AccessDenied

SOCKET_NAME = "weightcache.sock"
LOCK_NAME = "server.lock"
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


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` with mode 0700 if missing, then check it is private to this user.

    Refuses a symlink, a directory owned by another user, or one that the group
    or others can write or enter: any of these would let another user swap
    the socket for their own.
    """
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise AccessDenied(f"socket directory {path} is a symlink; use a real directory owned by you with mode 0700")
    if not stat.S_ISDIR(info.st_mode):
        raise AccessDenied(f"socket directory {path} is not a directory; remove it or choose another --socket-dir")
    if info.st_uid != os.geteuid():
        raise AccessDenied(
            f"socket directory {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}); "
            "choose a directory of your own with --socket-dir"
        )
    if info.st_mode & 0o077:
        raise AccessDenied(
            f"socket directory {path} has mode {stat.S_IMODE(info.st_mode):04o}; "
            f"others could replace the socket. Run `chmod 700 {path}` or choose another --socket-dir"
        )
    return path
