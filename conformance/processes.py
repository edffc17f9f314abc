"""A real ``weightcache serve`` process on a private socket directory, for the kit's checks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER_START_TIMEOUT_S = 30.0


class KitServer:
    """A ``weightcache serve`` child process on a private directory, stopped or SIGKILLed by its owner.

    The kit's checks and the project's own tests use it alike.
    """

    def __init__(self, socket_dir: Path, proc: subprocess.Popen, log_path: Path, owns_dir: bool = True):
        self.socket_dir = socket_dir
        self.proc = proc
        self.log_path = log_path
        self.owns_dir = owns_dir

    @classmethod
    def start(cls, socket_dir: Path | None = None, *extra_args: str) -> "KitServer":
        """Start a server on ``socket_dir`` (default: a fresh 0700 directory it owns) and wait until it answers."""
        from weightcache.core.client import wait_for_server
        from weightcache.core.errors import ServerUnavailable

        owns_dir = socket_dir is None
        if owns_dir:
            # Short path under the temp dir: Unix socket paths are limited to 107 bytes.
            socket_dir = Path(tempfile.mkdtemp(prefix="wc-kit-"))
            socket_dir.chmod(0o700)
            log_path = socket_dir / "server.log"
        else:
            socket_dir = Path(socket_dir)
            log_path = Path(str(socket_dir) + ".server.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache.core.cli", "serve", "--socket-dir", str(socket_dir), *extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        server = cls(socket_dir, proc, log_path, owns_dir)
        try:
            wait_for_server(socket_dir, timeout=SERVER_START_TIMEOUT_S)
        except ServerUnavailable as exc:
            log_text = server.log()
            server.close()
            raise RuntimeError(f"the weightcache server did not start: {exc}\nserver log:\n{log_text}") from None
        return server

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def sigkill(self) -> None:
        """Kill the server with SIGKILL (no cleanup on its side) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    kill = sigkill

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, wait, and return the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory if it made it."""
        if self.proc.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                self.sigkill()
        if self.owns_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
