"""Fresh Python children for the tests, forked from a zygote that has imported torch and transformers once.

A test that runs ``python -c CODE`` or ``python -m MODULE`` calls ``popen`` or ``run`` here, with subprocess's own
arguments. Where the child would start exactly as the zygote did, it is forked from the zygote (tests/zygote_server.py),
which saves it importing torch, numpy, safetensors and transformers (~1.5-4 CPU-s a child on CI's machine); anywhere
else it is a real exec. The rules:

1. Same interpreter (``sys.executable``), the form ``-c`` or ``-m`` with no interpreter option, no ``shell``,
   ``executable``, ``preexec_fn``, ``close_fds=False``, user, group or process group, and an environment equal to the
   one the zygote started with except for the names in ``ALLOWED`` (read by none of the preloaded libraries at import:
   tests/core/test_zygote.py checks it). Anything else is exec'd.
2. A test whose subject is the interpreter's own start (what a fresh process imports, the console script, an option
   such as ``-W error``) calls ``subprocess`` itself, never this.
3. ``WEIGHTCACHE_TEST_NO_ZYGOTE=1`` execs every child: the suite the old way.

What a forked child shares with its siblings that exec'd ones would not: the preloaded modules (already in
``sys.modules``) and the zygote's string-hash seed (one random seed per zygote, i.e. per worker and run).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

OFF = "WEIGHTCACHE_TEST_NO_ZYGOTE"
PRELOAD = ("numpy", "torch", "safetensors", "transformers", "transformers.modeling_utils")
"""Third-party only, never weightcache; importing runs no torch op (the zygote stays single-threaded but for
OpenBLAS's idle pools, which OpenBLAS stops and restarts around a fork with pthread_atfork)."""
PYTEST_PRELOAD = ("numpy", "torch", "safetensors")
"""For a child that runs pytest (``-m pytest``, ``weightcache conformance``): nothing of a pytest plugin's package
(transformers imports anyio, whose plugin pytest would then warn it cannot assertion-rewrite, an error under
``-W error``; tests/test_zygote.py checks it)."""
ALLOWED = ("WEIGHTCACHE_", "WC_", "PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Environment names (or prefixes, ending in ``_``) a child may have other than its zygote: ours, pytest's per-test
name and torch.distributed's rendezvous (read at ``init_process_group``). None is read while the preloads import, in
Python (tests/test_zygote.py records it) or in C (getenv under gdb)."""
START_TIMEOUT_S = 180.0
SERVER = Path(__file__).with_name("zygote_server.py")

_lock = threading.Lock()
_zygotes: list["_Zygote"] = []
_seen: dict[tuple, int] = {}
_failed: set[tuple] = set()
MAX_ZYGOTES = 4
"""Per process, for environments other than the session's own, which has one more (a zygote holds ~0.5-1 GiB, most
of it shared with its children)."""
_base_env: dict[str, str] | None = None
_child_cpu = 0.0
counts: dict[str, int] = {}
"""How many children this process forked (``forked``) or exec'd, by the reason (``pytest -s`` prints them with
``WEIGHTCACHE_TEST_ZYGOTE_REPORT=1``)."""


def snapshot_environment() -> None:
    """The environment zygotes start with: tests/conftest.py takes it once it has set the suite's variables."""
    global _base_env
    _base_env = dict(os.environ)


def child_cpu_seconds() -> float:
    """CPU seconds of the zygote children this process has waited for (for the suite's CPU accounting)."""
    return _child_cpu


MUST_MATCH = ("WEIGHTCACHE_SHIM_",)
"""Ours but read at start: the engine venvs' shims (tests/engines/shims.py, applied by a .pth file) read these."""


def _allowed(name: str) -> bool:
    if name.startswith(MUST_MATCH):
        return False
    return any(name.startswith(entry) if entry.endswith("_") else name == entry for entry in ALLOWED)


def _differences(env: dict[str, str], base: dict[str, str]) -> list[str]:
    return sorted(k for k in env.keys() | base.keys() if env.get(k) != base.get(k) and not _allowed(k))


_KEYWORDS = {"stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors", "bufsize", "cwd", "env",
             "pass_fds", "start_new_session", "umask"}  # fmt: skip


def why_exec(args, kwargs: dict) -> str | None:
    """Why this child must be a real exec whatever its environment (None: a zygote of its environment may fork it)."""
    if os.environ.get(OFF) == "1":
        return f"{OFF}=1"
    if not isinstance(args, (list, tuple)) or not args or os.fspath(args[0]) != sys.executable:
        return "not this interpreter"
    if len(args) < 3 or args[1] not in ("-c", "-m"):
        return f"interpreter option {args[1]!r}"
    if not all(isinstance(a, (str, os.PathLike)) for a in args):
        return "an argument that is not text"
    other = sorted(set(kwargs) - _KEYWORDS)
    if other:
        return f"Popen arguments {other}"
    return None


class _Zygote:
    """One zygote server of this process: an interpreter, its preloads and the environment it started with."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]) -> None:
        self.preload = preload
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER.read_text(), ",".join(preload), str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            pass_fds=[theirs.fileno()],
            env=env,
            cwd="/",
        )
        theirs.close()
        self.control = ours
        ours.settimeout(START_TIMEOUT_S)
        try:
            ready = ours.recv(1 << 20)
        except OSError:
            ready = b""
        ours.settimeout(None)
        self.log.seek(0)
        printed = self.log.read().decode(errors="replace")
        if not ready.startswith(b"ready") or printed:
            self.close()
            raise RuntimeError(f"the test zygote did not start cleanly (it must print nothing): {printed[-3000:]}")
        imported = json.loads(ready[len(b"ready") :])
        self.added = {k: v for k, v in imported.items() if k not in env}
        """What importing the preloads set in the environment (TORCHINDUCTOR_CACHE_DIR, a default torch derives again
        where it is missing): a caller that imported them has it too. A child gets the caller's environment as it is."""

    def serves(self, env: dict[str, str]) -> bool:
        """A child of ``env`` starts as this zygote did: the same environment, before or after the preloads' imports."""
        return not _differences(env, self.env) or not _differences(env, {**self.env, **self.added})

    def spawn(self, request: dict, fds: list[int]) -> socket.socket:
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno(), *fds])
        finally:
            theirs.close()
        return ours

    def close(self) -> None:
        self.control.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _env_key(env: dict[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if not _allowed(k))


def _zygote(env: dict[str, str], preload: tuple[str, ...]) -> _Zygote | None:
    """A zygote that serves ``env``; a new one for the session's own environment at once, for any other at its
    second child (one child alone would pay the imports all the same), at most ``MAX_ZYGOTES`` in all."""
    with _lock:
        for zygote in _zygotes:
            if zygote.preload == preload and zygote.serves(env):
                return zygote
        key = (preload, _env_key(env))
        _seen[key] = _seen.get(key, 0) + 1
        # The session's own environment: as it started, or as this process has it now (a test module may have set a
        # variable in os.environ for the rest of the session).
        usual = _base_env is not None and (not _differences(env, _base_env) or not _differences(env, dict(os.environ)))
        # The cap is for other environments (a fleet's nodes): they must not use up the session's own.
        others = [z for z in _zygotes if _base_env is None or _differences(z.env, _base_env)]
        full = not usual and len(others) >= MAX_ZYGOTES
        if key in _failed or full or not (usual or _seen[key] >= 2):
            return None
        try:
            zygote = _Zygote(preload, env)
        except (OSError, RuntimeError) as exc:
            _failed.add(key)
            print(f"tests/zygote.py: no zygote for {preload}, its children are exec'd: {exc}", file=sys.stderr)
            return None
        _zygotes.append(zygote)
        return zygote


def stop_all() -> None:
    """Stop this process's zygotes and reap them (so that their children's CPU is counted as this process's)."""
    with _lock:
        for zygote in _zygotes:
            zygote.close()
        _zygotes.clear()


class ZygotePopen(subprocess.Popen):
    """A ``subprocess.Popen`` whose child is forked by the zygote: pid, pipes, wait, poll, signals and communicate
    as with exec (the child stays a zombie until this object has read its status)."""

    def __init__(self, zygote: _Zygote, args, netns: str | None = None, **kwargs) -> None:
        self._zygote = zygote
        self._netns = netns
        self._channel: socket.socket | None = None
        self._received = b""
        self._status_lock = threading.Lock()
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                       umask, start_new_session, process_group):  # fmt: skip
        stdio = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        request = {
            "argv": [os.fspath(a) for a in args[1:]],
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
            "cwd": cwd,
            "umask": umask,
            "start_new_session": bool(start_new_session),
            "pass_fds": list(pass_fds),
            "netns": self._netns,
        }
        try:
            self._channel = self._zygote.spawn(request, [*stdio, *pass_fds])
            started = self._message(lambda seen: "pid" in seen and ("started" in seen or "errno" in seen))
        finally:
            if p2cread != -1 and p2cwrite != -1 and p2cread != getattr(self, "_devnull", None):
                os.close(p2cread)
            if c2pwrite != -1 and c2pread != -1 and c2pwrite != getattr(self, "_devnull", None):
                os.close(c2pwrite)
            if errwrite != -1 and errread != -1 and errwrite != getattr(self, "_devnull", None):
                os.close(errwrite)
            if hasattr(self, "_devnull"):
                os.close(self._devnull)
            self._closed_child_pipe_fds = True
        self.pid = started["pid"]
        self._child_created = True
        if "errno" in started:
            self.wait()
            raise OSError(started["errno"], os.strerror(started["errno"]), cwd)

    def _message(self, done, timeout: float | None = START_TIMEOUT_S) -> dict:
        """Read the channel's lines until ``done(seen)``; TimeoutError or BlockingIOError if ``timeout`` passes first."""
        assert self._channel is not None
        seen: dict = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done(seen):
            while b"\n" not in self._received:
                self._channel.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
                chunk = self._channel.recv(65536)
                if not chunk:
                    raise OSError("the test zygote closed a child's channel")
                self._received += chunk
            line, _, self._received = self._received.partition(b"\n")
            seen.update(json.loads(line))
        return seen

    def _status(self, timeout: float | None) -> int | None:
        global _child_cpu
        with self._status_lock:
            if self.returncode is not None:
                return self.returncode
            try:
                status = self._message(lambda seen: "returncode" in seen, timeout=timeout)
            except (TimeoutError, BlockingIOError):
                return None
            self.returncode = status["returncode"]
            _child_cpu += status.get("cpu", 0.0)
            assert self._channel is not None
            self._channel.close()  # the zygote reaps it now
            return self.returncode

    def _internal_poll(self, _deadstate=None, _waitpid=None, _WNOHANG=None, _ECHILD=None):
        return self._status(timeout=0)

    def _wait(self, timeout):
        if self._status(timeout=timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class Forked(subprocess.CompletedProcess):
    """What ``run`` returns for a child forked from a zygote."""


def popen(args, preload: tuple[str, ...] = PRELOAD, netns: str | None = None, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``: forked from a zygote that imported ``preload`` where the rules allow,
    else exec'd; in the network namespace at path ``netns`` when given (the fork enters it, an exec goes through
    ``nsenter``)."""
    reason = why_exec(args, kwargs)
    given = kwargs.get("env")
    zygote = _zygote(dict(os.environ if given is None else given), preload) if reason is None else None
    if zygote is not None:
        counts["forked"] = counts.get("forked", 0) + 1
        return ZygotePopen(zygote, list(args), netns=netns, **kwargs)
    reason = reason or "no zygote"
    counts[reason] = counts.get(reason, 0) + 1
    return subprocess.Popen(["nsenter", f"--net={netns}", *args] if netns else args, **kwargs)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` through ``popen`` (the same steps as the standard library's; ``preload`` goes to popen)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
        code = process.poll()
        if check and code:
            raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
    done = Forked if isinstance(process, ZygotePopen) else subprocess.CompletedProcess
    return done(process.args, code, stdout, stderr)
