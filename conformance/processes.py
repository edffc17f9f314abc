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
    """A server child process the kit owns: started in a fresh 0700 directory, stopped or SIGKILLed by the kit."""

    def __init__(self, socket_dir: Path, proc: subprocess.Popen, log_path: Path):
        self.socket_dir = socket_dir
        self.proc = proc
        self.log_path = log_path

    @classmethod
    def start(cls) -> "KitServer":
        from weightcache.core.client import wait_for_server
        from weightcache.core.errors import ServerUnavailable

        # Short path under the temp dir: Unix socket paths are limited to 107 bytes.
        socket_dir = Path(tempfile.mkdtemp(prefix="wc-kit-"))
        socket_dir.chmod(0o700)
        log_path = socket_dir / "server.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache.core.cli", "serve", "--socket-dir", str(socket_dir)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        server = cls(socket_dir, proc, log_path)
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

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.sigkill()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
