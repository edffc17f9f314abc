"""Where the server's socket lives: ``SocketDir``, parsed once where a directory enters (CLI, API, options).

The default is ``$WEIGHTCACHE_SOCKET_DIR``, else ``$XDG_RUNTIME_DIR/weightcache``, else
``/tmp/weightcache-UID``; the socket is ``weightcache.sock`` in it. Code past the edge takes a
``SocketDir`` and never resolves the default or joins the socket's name again.
"""

from __future__ import annotations

import os
import shlex
import typing
from pathlib import Path

import attrs

SOCKET_NAME = "weightcache.sock"
LOCK_NAME = "server.lock"
ENV_SOCKET_DIR = "WEIGHTCACHE_SOCKET_DIR"


@attrs.frozen
class SocketDir:
    """The server's private directory: ``path``; the socket and the lock inside it."""

    path: Path = attrs.field(converter=Path)

    @classmethod
    def parse(cls, value: SocketDirLike = None) -> SocketDir:
        """``value`` as a SocketDir: one already parsed, a path (str or PathLike), or None or ``""`` for the default."""
        if isinstance(value, SocketDir):
            return value
        if value is None or value == "":
            return cls.default()
        return cls(Path(os.fspath(value)))

    @classmethod
    def default(cls) -> SocketDir:
        """``$WEIGHTCACHE_SOCKET_DIR``, else ``$XDG_RUNTIME_DIR/weightcache``, else ``/tmp/weightcache-UID``."""
        if os.environ.get(ENV_SOCKET_DIR):
            return cls(Path(os.environ[ENV_SOCKET_DIR]))
        if os.environ.get("XDG_RUNTIME_DIR"):
            return cls(Path(os.environ["XDG_RUNTIME_DIR"]) / "weightcache")
        return cls(Path(f"/tmp/weightcache-{os.geteuid()}"))

    @classmethod
    def of_socket(cls, socket: str | os.PathLike) -> SocketDir:
        """The directory of ``socket`` (a socket path, or a directory given as it is)."""
        path = Path(socket)
        return cls(path.parent if path.name == SOCKET_NAME else path)

    @property
    def socket(self) -> Path:
        return self.path / SOCKET_NAME

    @property
    def lock(self) -> Path:
        return self.path / LOCK_NAME

    def serve_command(self) -> str:
        """``weightcache serve``, with ``--socket-dir`` unless this is the default directory."""
        if self == SocketDir.default():
            return "weightcache serve"
        return f"weightcache serve --socket-dir {shlex.quote(str(self.path))}"

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def to_socket_dir(value: SocketDirLike) -> SocketDir:
    """``SocketDir.parse`` as an attrs converter (mypy's attrs plugin reads converters that are plain functions)."""
    return SocketDir.parse(value)


SocketDirLike: typing.TypeAlias = "SocketDir | str | os.PathLike[str] | None"
"""What a public function accepts for a socket directory; it calls ``SocketDir.parse`` once, where it enters."""
