"""Starting a ``weightcache serve`` process: the one place a server is started, by the demo, the kit, tests and daemon mode.

Two kinds:

- ``ServerProcess.start``: a child this process owns and stops (demo, conformance kit, tests).
- ``spawn_detached``: a server that outlives whoever started it (daemon mode). ``serve
  --detach`` forks twice and the server runs as an orphan in a session of its own, so it is
  no descendant of the engine: an engine that kills its whole process tree on shutdown
  (SGLang's ``kill_process_tree``) leaves the server, and the cache, alive.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

from weightcache.core.client.client import server_is_running, wait_for_server
from weightcache.core.errors import ServerUnavailable
from weightcache.core.socket_dir import SocketDir, SocketDirLike

if typing.TYPE_CHECKING:
    from weightcache.core.server.serve_config import ServeSource
    from weightcache.core.server.server import ServerConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


def serve_command(socket_dir: SocketDirLike, *extra_args: str) -> list[str]:
    """The command line of ``weightcache serve`` on ``socket_dir`` with this interpreter."""
    return [
        sys.executable,
        "-m",
        "weightcache.core.cli.cli",
        "serve",
        "--socket-dir",
        str(SocketDir.parse(socket_dir)),
        *extra_args,
    ]


class ServerProcess:
    """A ``weightcache serve`` child process on a private directory, stopped or SIGKILLed by its owner."""

    def __init__(self, socket_dir: Path, proc: subprocess.Popen, log_path: Path, owns_dir: bool = True):
        self.socket_dir = socket_dir
        self.proc = proc
        self.log_path = log_path
        self.owns_dir = owns_dir

    @classmethod
    def start(cls, socket_dir: SocketDirLike = None, *extra_args: str, launcher: typing.Sequence[str] = ()) -> "ServerProcess":
        """Start a server on ``socket_dir`` (default: a fresh 0700 directory it owns) and wait until it answers.

        ``launcher`` is a command the server's command line runs under (``nsenter --net=PATH``: in a network namespace).
        """
        owns_dir = socket_dir is None
        if owns_dir:
            # Short path under the temp dir: Unix socket paths are limited to 107 bytes.
            socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
            socket_dir.chmod(0o700)
            log_path = socket_dir / "server.log"
        else:
            socket_dir = SocketDir.parse(socket_dir).path
            log_path = Path(str(socket_dir) + ".server.log")
            log_path.parent.mkdir(parents=True, exist_ok=True)  # the log lies beside the directory the server makes
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                [*launcher, *serve_command(socket_dir, *extra_args)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )
        server = cls(socket_dir, proc, log_path, owns_dir)
        try:
            wait_for_server(socket_dir, timeout=START_TIMEOUT_S)
        except ServerUnavailable as exc:
            text = server.log()
            server.close()
            raise ServerUnavailable(
                str(socket_dir), f"the server did not start: {exc.reason}; its log:\n{text[-3000:]}"
            ) from None
        return server

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (no cleanup on the server's side), then reap."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

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
                self.kill()
        if self.owns_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def spawn_detached(socket_dir: SocketDirLike = None, log_file: str | os.PathLike | None = None) -> None:
    """Start a server on ``socket_dir`` that outlives this process and its process tree, and wait until it answers.

    A lost race with another starter is fine: whoever binds first serves, and
    this returns once a server answers.
    """
    socket_dir = SocketDir.parse(socket_dir)
    args = serve_command(socket_dir, "--detach") + (["--log-file", str(log_file)] if log_file else [])
    launcher = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if launcher.returncode != 0 and not server_is_running(socket_dir):
        raise ServerUnavailable(str(socket_dir), f"`weightcache serve --detach` failed: {launcher.stderr.strip()[-2000:]}")
    wait_for_server(socket_dir, timeout=START_TIMEOUT_S)
    log.info("weightcache: started a server on %s (%s)", socket_dir, launcher.stdout.strip() or "detached")


def serve_detached(
    config: "ServerConfig",
    log_file: str | os.PathLike | None = None,
    take_over: bool = False,
    source: "ServeSource | None" = None,
) -> int:
    """``weightcache serve --detach``: fork twice, serve in the grandchild, return 0 once it listens (1 if it could not).

    The grandchild runs in a session of its own with stdio on ``log_file``
    (None: /dev/null; the CLI's default is server.log in the socket directory); its readiness, or why it could not start, comes back
    through a pipe and is printed here.
    """
    from weightcache.core.server.server import start_server
    from weightcache.core.wire.paths import ensure_private_dir

    # The log's default place is inside the socket directory: make (and check) the directory before the log opens,
    # as the server would after the fork (a daemon-mode engine names a directory nobody has made yet).
    ensure_private_dir(config.socket_dir.path)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child:  # the launcher: reap the intermediate child, report what the server said
        os.close(write_end)
        os.waitpid(child, 0)
        with os.fdopen(read_end) as pipe:
            message = pipe.read().strip()
        if message.startswith("ok "):
            where = f"; logs: {log_file}" if log_file else ""
            print(f"weightcache server pid {message[3:]} serving {config.socket_dir}{where}")
            return 0
        print(f"weightcache: error: {message or 'the detached server exited before it listened'}", file=sys.stderr)
        return 1
    os.close(read_end)
    os.setsid()
    if os.fork():
        os._exit(0)  # the intermediate: the server becomes an orphan, no descendant of the launcher's parent
    target = os.open(log_file or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(null)
    os.close(target)
    try:
        server = start_server(config, take_over, source)
    except Exception as exc:
        os.write(write_end, f"{exc}".encode())
        os._exit(1)
    os.write(write_end, f"ok {os.getpid()}".encode())
    os.close(write_end)
    try:
        server.serve_forever()
    finally:
        os._exit(0)
