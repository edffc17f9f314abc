"""The launcher (core/spare/launcher.py, launch.py, become.py, preload.py): an engine forked from it behaves as one
started by exec, and the launcher keeps its rules (same uid, code unchanged on disk, fork-safety, replaceable,
engines outlive it).

Each comparison runs the same target twice, ``python ARGS`` by exec and ``weightcache launch -- ARGS`` through a
real launcher, with the same fds, environment and working directory, and compares what a program can see.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.core.test_server import test_user  # noqa: F401  the second user, made once
from tests.helpers import EXIT_CASES, wait_until

LAUNCHER_START_S = 600.0

_STATE = r"""
import json, logging, os, random, resource, signal, sys, threading, warnings
import numpy, torch, safetensors, tokenizers, transformers, transformers.modeling_utils  # as an engine (and the launcher)
import transformers.models.auto.tokenization_auto
def _open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
def _handler(sig):
    handler = signal.getsignal(sig)
    return handler if handler in (signal.SIG_DFL, signal.SIG_IGN, None) else getattr(handler, "__name__", "other")
main = sys.modules["__main__"]
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path": sys.path, "name": __name__,
    "file": globals().get("__file__"), "cached": globals().get("__cached__", "unset"),
    "loader": type(main.__loader__).__name__ if not isinstance(main.__loader__, type) else main.__loader__.__name__,
    "main_keys": sorted(k for k in vars(main) if k.startswith("__")),
    "cwd": os.getcwd(), "env": dict(os.environ), "umask": os.umask(0),
    "fds": [fd for fd in range(256) if _open(fd)], "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(), "stdin": sys.stdin.read(), "executable": sys.executable,
    "flags": list(sys.flags), "warnoptions": sys.warnoptions, "filters": [repr(f) for f in warnings.filters],
    "signals": {s.name: str(_handler(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "threads": threading.active_count(),
    "torch_threads": torch.get_num_threads(), "seeds": [torch.initial_seed(), random.random(), numpy.random.random()],
    "root_handlers": len(logging.getLogger().handlers), "root_level": logging.getLogger().level,
    "stdout_line_buffered": sys.stdout.line_buffering, "stderr_line_buffered": sys.stderr.line_buffering,
    "pid": os.getpid(), "ppid_is_caller": os.getppid(),
}))
"""
PER_PROCESS = ("pid", "ppid_is_caller", "seeds", "session_leader", "group_leader")
"""What differs between any two processes, and what a launched engine has of its own: it leads a session (nothing sent
to the launcher's process group reaches it; the caller forwards signals)."""


class LauncherProcess:
    """``weightcache launcher`` in its own process, on a private directory of its own."""

    def __init__(self, socket_dir: Path, *args: str, env: dict | None = None):
        self.socket_dir = socket_dir
        self.log = tempfile.TemporaryFile()
        command = [sys.executable, "-m", "weightcache.core.cli.cli", "launcher", "--socket-dir", str(socket_dir), *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self.proc.stdout.readline()
        self.ready = json.loads(line) if line.startswith("{") else None
        self.pid = self.proc.pid

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def started_launcher(*args: str):
    """A launcher of ``args`` on a directory of its own, ready, for a module's tests (a fixture's body)."""
    directory = Path(tempfile.mkdtemp(prefix="wc-launcher-"))
    started = LauncherProcess(directory / "sock", *args)
    try:
        assert started.ready is not None, started.output()
        yield started
    finally:
        started.stop()
        subprocess.run(["rm", "-rf", str(directory)], check=False)


@pytest.fixture(scope="module")
def launcher():
    """A launcher with the default preloads (torch, transformers, ...), shared by the module's comparisons."""
    yield from started_launcher()


def launch_command(socket_dir: Path, *args: str, strict: bool = True) -> list[str]:
    return [
        sys.executable, "-m", "weightcache.core.cli.cli", "launch", "--socket-dir", str(socket_dir),
        *(["--strict"] if strict else []), "--", *args,
    ]  # fmt: skip


def both(launcher: LauncherProcess, args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    launched = subprocess.run(launch_command(launcher.socket_dir, *args), **kwargs)
    execd = subprocess.run([sys.executable, *args], **kwargs)
    return launched, execd


@pytest.mark.parametrize("form", ["-c", "-m", "script"])
def test_a_launched_engine_sees_what_an_execd_one_sees(launcher, form, tmp_path):
    (tmp_path / "state_probe.py").write_text(_STATE)
    args = {"-c": ["-c", _STATE], "-m": ["-m", "state_probe"], "script": [str(tmp_path / "state_probe.py")]}[form]
    read, write = os.pipe()
    env = {**os.environ, "WEIGHTCACHE_PROBE": "a value", "ANY_NAME": "of the caller"}
    try:
        launched, execd = both(
            launcher,
            [*args, "one", "two words"],
            input="to stdin",
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            pass_fds=[write],
            timeout=300,
        )
    finally:
        os.close(read)
        os.close(write)
    assert launched.returncode == execd.returncode == 0, launched.stderr + execd.stderr
    assert launched.stderr == execd.stderr == ""
    seen, expected = json.loads(launched.stdout), json.loads(execd.stdout)
    assert seen["pid"] != launcher.pid and seen["ppid_is_caller"] == launcher.pid  # a fork of the launcher...
    assert {k: v for k, v in seen.items() if k not in PER_PROCESS} == {k: v for k, v in expected.items() if k not in PER_PROCESS}
    assert seen["argv"][1:] == ["one", "two words"] and seen["stdin"] == "to stdin" and seen["fds"] == [0, 1, 2, write]
    assert seen["env"]["ANY_NAME"] == "of the caller" and seen["session_leader"] and seen["group_leader"]
    again = json.loads(
        subprocess.run(launch_command(launcher.socket_dir, "-c", _STATE), capture_output=True, text=True, timeout=300).stdout
    )
    assert all(a != b for a, b in zip(again["seeds"], seen["seeds"], strict=True)), "siblings share a random seed"


_TERMINAL = (
    "import json, os, sys; print(json.dumps([os.isatty(0), sys.stdin.line_buffering, sys.stdout.line_buffering, "
    "sys.stderr.line_buffering, sys.stdout.write_through]))"
)


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
def test_on_a_terminal_the_streams_are_those_of_an_exec(tmp_path, unbuffered):
    """On a terminal (a pty here) the interpreter line-buffers stdin and stdout, unless told to write through: so
    does a launched engine."""
    import pty

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    started = LauncherProcess(tmp_path / "sock", "--preload", "json", "--no-warm", env=env)
    seen = []
    try:
        assert started.ready is not None, started.output()
        for command in (launch_command(started.socket_dir, "-c", _TERMINAL), [sys.executable, "-c", _TERMINAL]):
            leader, follower = pty.openpty()
            try:
                proc = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, env=env)
                os.close(follower)
                output = b""
                while True:
                    try:
                        chunk = os.read(leader, 4096)
                    except OSError:  # EIO: the pty's other side closed
                        break
                    if not chunk:
                        break
                    output += chunk
                assert proc.wait(timeout=120) == 0, output
            finally:
                os.close(leader)
            seen.append(json.loads(output.decode().strip().splitlines()[-1]))
    finally:
        started.stop()
    expected = [True, False, False, False, True] if unbuffered else [True, True, True, True, False]
    assert seen[0] == seen[1] == expected, seen


@pytest.mark.parametrize(("code", "returncode"), EXIT_CASES)
def test_exit_status_stdout_and_stderr_are_those_of_an_exec(launcher, code, returncode):
    launched, execd = both(launcher, ["-c", code], capture_output=True, text=True, timeout=300)
    assert launched.returncode == execd.returncode == returncode, (launched, execd)
    assert launched.stdout == execd.stdout
    assert launched.stderr == execd.stderr  # the traceback too: the launcher's frames are not in it


_WAITS = """
import signal, sys, time
if sys.argv[1] == "handler":
    signal.signal(signal.SIGTERM, lambda *_: (print("caught SIGTERM", flush=True), sys.exit(5)))
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(("how", "sig", "returncode"), [
    ("handler", signal.SIGTERM, 5), ("default", signal.SIGTERM, -signal.SIGTERM), ("default", signal.SIGINT, -signal.SIGINT),
])  # fmt: skip
def test_signals_to_the_caller_reach_the_engine_as_they_would_an_execd_one(launcher, how, sig, returncode):
    outputs = []
    for command in (launch_command(launcher.socket_dir, "-c", _WAITS, how), [sys.executable, "-c", _WAITS, how]):
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: _dispositions(signal.SIG_DFL)
        )  # a caller run in the background of a script ignores SIGINT (its engine then would too)
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        outputs.append((proc.returncode, out, err.splitlines()[-1:]))
    assert outputs[0] == outputs[1] and outputs[0][0] == returncode, outputs


def _dispositions(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, handler)


def test_signals_the_caller_ignores_stay_ignored_in_the_engine(launcher):
    """`nohup`, a script's background job: SIGINT and SIGQUIT ignored in the caller stay so in the engine, as in an
    exec'd one (`weightcache launch` neither forwards them nor lets the engine see its forwarding handlers)."""
    code = "import json, signal; print(json.dumps({s.name: str(signal.getsignal(s)) for s in signal.Signals if s < 16}))"
    launched, execd = both(
        launcher, ["-c", code], capture_output=True, text=True, timeout=300, preexec_fn=lambda: _dispositions(signal.SIG_IGN)
    )
    assert launched.returncode == execd.returncode == 0, launched.stderr + execd.stderr
    assert launched.stdout == execd.stdout and f'"SIGINT": "{signal.SIG_IGN}"' in execd.stdout, (launched, execd)


def test_a_caller_environment_the_imports_read_differently_is_execd_with_one_line(launcher):
    env = {**os.environ, "HF_HOME": "/nonexistent/another-hub"}  # huggingface_hub reads it at import
    code = "import os, sys; print(os.environ['HF_HOME'], 'torch' in sys.modules)"
    strict = subprocess.run(launch_command(launcher.socket_dir, "-c", code), env=env, capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1 and strict.stdout == ""
    assert strict.stderr.count("\n") == 1 and "differs from the launcher's in HF_HOME" in strict.stderr, strict.stderr
    lenient = subprocess.run(
        launch_command(launcher.socket_dir, "-c", code, strict=False), env=env, capture_output=True, text=True, timeout=300
    )
    assert lenient.returncode == 0 and lenient.stdout == "/nonexistent/another-hub False\n", lenient  # exec'd: fresh
    assert "HF_HOME" in lenient.stderr


def test_an_engine_outlives_its_launcher_killed_and_the_child_forked_ahead_does_not(tmp_path):
    """The launcher keeps a child forked ahead of the next request; the request goes to it (its pid is the engine's),
    and the launcher forks the next. Killed, the launcher takes the waiting child along, never its engines."""
    started = LauncherProcess(tmp_path / "sock", "--preload", "json", "--no-warm")
    try:
        assert started.ready is not None, started.output()
        ahead = _hello(started.socket_dir)["ahead"]
        assert ahead is not None and _running(ahead)
        marker = tmp_path / "done"
        code = f"import os, time; print(os.getpid(), flush=True); time.sleep(2); open({str(marker)!r}, 'w').write('ran')"
        client = subprocess.Popen(
            launch_command(started.socket_dir, "-c", code), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        engine = int(client.stdout.readline())
        assert engine == ahead
        assert wait_until(lambda: _hello(started.socket_dir)["ahead"] not in (None, engine), timeout=30)
        waiting = _hello(started.socket_dir)["ahead"]
        os.kill(started.pid, signal.SIGKILL)
        started.proc.wait(timeout=30)
        assert _running(engine), "the engine died with its launcher"
        assert wait_until(lambda: not _running(waiting), timeout=30), "the child forked ahead outlived its launcher"
        _, err = client.communicate(timeout=120)
        assert marker.read_text() == "ran"  # it ran to its end
        assert client.returncode == 1 and "the launcher went away while engine pid" in err, err
    finally:
        started.stop()


def test_an_engine_whose_caller_is_killed_is_killed_with_it(tmp_path):
    """``launch`` stands for the engine: a caller killed without a chance to forward (SIGKILL, the OOM killer) takes
    its engine along, as the engine's own death would have been."""
    started = LauncherProcess(tmp_path / "sock", "--preload", "json", "--no-warm")
    try:
        assert started.ready is not None, started.output()
        client = subprocess.Popen(
            launch_command(started.socket_dir, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"),
            stdout=subprocess.PIPE,
            text=True,
        )
        engine = int(client.stdout.readline())
        client.kill()
        client.wait(timeout=30)
        client.stdout.close()
        assert wait_until(lambda: not _running(engine), timeout=30), "the engine outlived its caller"
        assert started.proc.poll() is None  # the launcher serves on
    finally:
        started.stop()


def test_a_launcher_whose_code_changed_refuses_and_is_replaced_without_dropping_engines(tmp_path):
    module = tmp_path / "lib" / "wc_preloaded_probe.py"
    module.parent.mkdir()
    module.write_text("VALUE = 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(module.parent), os.environ.get("PYTHONPATH")]))}
    first = LauncherProcess(tmp_path / "sock", "--preload", "json,wc_preloaded_probe", "--no-warm", env=env)
    second = None
    try:
        assert first.ready is not None, first.output()
        waits = "import sys, time; print('up', flush=True); sys.stdin.readline(); sys.exit(4)"
        running = subprocess.Popen(
            launch_command(first.socket_dir, "-c", waits), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert running.stdout.readline() == "up\n"
        module.write_text("VALUE = 2  # upgraded\n")
        refused = subprocess.run(
            launch_command(first.socket_dir, "-c", "pass"), capture_output=True, text=True, env=env, timeout=120
        )
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "imported code changed on disk" in refused.stderr and str(module) in refused.stderr
        assert "weightcache launcher --replace" in refused.stderr
        # Without --replace a second launcher will not take the socket; with it, it does.
        clash = LauncherProcess(tmp_path / "sock", "--preload", "json", "--no-warm", env=env)
        assert clash.ready is None and clash.proc.wait(timeout=120) == 1 and "--replace" in clash.output()
        clash.stop()
        second = LauncherProcess(tmp_path / "sock", "--preload", "json,wc_preloaded_probe", "--no-warm", "--replace", env=env)
        assert second.ready is not None, second.output()
        fresh = subprocess.run(
            launch_command(second.socket_dir, "-c", "import os, wc_preloaded_probe; print(wc_preloaded_probe.VALUE, os.getppid())"),
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert fresh.returncode == 0 and fresh.stdout.split() == ["2", str(second.pid)], fresh
        # The engine of the replaced launcher ran on; its caller still gets its status; then the old launcher exits.
        running.stdin.write("go\n")
        running.stdin.close()
        assert running.wait(timeout=120) == 4
        running.stdout.close()
        assert first.proc.wait(timeout=60) == 0, first.output()
    finally:
        for started in (first, second):
            if started is not None:
                started.stop()


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n",
            "started Python threads",
        ),
        ("import torch\ntorch.set_num_threads(2)\nx = torch.ones(512, 512)\n(x @ x).sum()\n", "hung"),
    ],
    ids=["python-thread", "openmp-pool"],
)
def test_what_is_not_fork_safe_stops_the_launcher_with_one_line(tmp_path, source, expected):
    (tmp_path / "wc_unsafe_preload.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    env["WEIGHTCACHE_LAUNCHER_CANARY_S"] = "10"
    started = LauncherProcess(tmp_path / "sock", "--preload", "wc_unsafe_preload", "--no-warm", env=env)
    try:
        assert started.ready is None and started.proc.wait(timeout=300) == 1
        lines = [line for line in started.output().splitlines() if line.startswith("weightcache: error:")]
        assert len(lines) == 1 and expected in lines[0], started.output()
        assert not (tmp_path / "sock" / "launcher.sock").exists()
    finally:
        started.stop()


def test_the_launcher_never_holds_a_cuda_context_nor_a_thread_pool(launcher):
    """What a launcher keeps while it serves: one Python thread, no torch thread pool, no CUDA (CPU here; the GPU
    test tests/gpu/test_launcher_gpu.py forks engines that create theirs)."""
    tasks = os.listdir(f"/proc/{launcher.pid}/task")
    hello = _hello(launcher.socket_dir)
    assert hello["ok"] and hello["pid"] == launcher.pid and hello["stale"] == []
    # numpy's and scipy's OpenBLAS pools (stopped and restarted around a fork by OpenBLAS itself) are all it runs.
    assert len(tasks) <= 1 + 2 * (os.cpu_count() or 1), tasks
    maps = Path(f"/proc/{launcher.pid}/maps").read_text()
    assert "/dev/nvidia" not in maps


def test_the_default_preloads_include_what_loading_a_compiled_forward_imports(launcher):
    """Inductor's modules are preloaded (a restored compiled forward imports them), and the environment switch they were
    imported under is gone again: an engine's own ``torch.cuda.is_available()`` asks CUDA as an exec'd one's does."""
    from weightcache.core.spare.preload import COMPILER_MODULES, NVML_CHECK

    assert set(COMPILER_MODULES) <= set(launcher.ready["preloaded"]), launcher.ready["preloaded"]
    done = subprocess.run(
        launch_command(launcher.socket_dir, "-c", f"import os, sys; print(os.environ.get({NVML_CHECK!r}), 'torch._inductor.compile_fx' in sys.modules)"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["None", "True"], done


def test_the_nvml_based_cuda_check_is_set_only_meanwhile_and_leaves_a_callers_value(monkeypatch):
    from weightcache.core.spare.preload import NVML_CHECK, nvml_based_cuda_check

    monkeypatch.delenv(NVML_CHECK, raising=False)
    with nvml_based_cuda_check():
        assert os.environ[NVML_CHECK] == "1"
    assert NVML_CHECK not in os.environ
    with nvml_based_cuda_check(on=False):
        assert NVML_CHECK not in os.environ
    monkeypatch.setenv(NVML_CHECK, "0")  # the user's own choice stays, inside and after
    with nvml_based_cuda_check():
        assert os.environ[NVML_CHECK] == "0"
    assert os.environ[NVML_CHECK] == "0"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--preload", "json", "--cuda-ready", "cpu"], "--cuda-ready takes a CUDA device such as cuda:0, not 'cpu'"),
        (["--preload", "json", "--cuda-ready", "cuda:0"], "--cuda-ready needs torch among the preloads"),
        (["--preload", "torch", "--cuda-ready", "cuda:1"], "--cuda-ready cuda:1: torch here sees"),
    ],
    ids=["not-cuda", "no-torch", "no-such-device"],
)
def test_cuda_ready_on_a_device_torch_cannot_see_stops_the_launcher_with_one_line(tmp_path, args, expected):
    """(On this CPU machine no CUDA device is seen; on a 1-GPU machine cuda:1 is not either.)"""
    started = LauncherProcess(tmp_path / "sock", *args, "--no-warm")
    try:
        assert started.ready is None and started.proc.wait(timeout=300) == 1
        lines = [line for line in started.output().splitlines() if line.startswith("weightcache: error:")]
        assert len(lines) == 1 and expected in lines[0], started.output()
    finally:
        started.stop()


def test_the_child_forked_ahead_says_when_it_waits_for_a_request(launcher):
    deadline = time.monotonic() + 60
    while not (hello := _hello(launcher.socket_dir))["ahead_ready"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hello["ahead_ready"] and hello["ahead"] is not None and hello["cuda_ready"] is None, hello


def test_a_child_with_a_cuda_context_takes_only_requests_of_the_launchers_cuda_environment():
    from weightcache.core.spare.launcher import cuda_environment_differences

    mine = {"CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin", "NCCL_DEBUG": "WARN"}
    assert cuda_environment_differences(mine, {**mine, "PATH": "/usr/bin", "HOME": "/h"}) == []
    theirs = {**mine, "CUDA_VISIBLE_DEVICES": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVIDIA_VISIBLE_DEVICES": "all"}
    del theirs["NCCL_DEBUG"]
    assert cuda_environment_differences(mine, theirs) == [
        "CUBLAS_WORKSPACE_CONFIG", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NVIDIA_VISIBLE_DEVICES",
    ]  # fmt: skip


def test_what_a_cuda_ready_child_opens_ahead_is_numbered_above_every_callers_fd_and_nothing_else_stays(tmp_path):
    """The context's fds must survive ``become``, which closes every fd but the caller's numbers: they are opened with
    every lower number taken, so no caller's fd (below the floor; a higher one is forked without a context) lands on one."""
    from weightcache.core.spare.launcher import CUDA_FD_FLOOR, opened_above

    opened = []
    before = set(os.listdir("/proc/self/fd"))
    kept = opened_above(CUDA_FD_FLOOR, lambda: opened.extend(os.open(tmp_path / name, os.O_CREAT | os.O_RDWR) for name in "ab"))
    try:
        assert kept == frozenset(opened) and min(kept) >= CUDA_FD_FLOOR, (kept, opened)
        assert set(os.listdir("/proc/self/fd")) - before == {str(fd) for fd in opened}  # the placeholders are closed
    finally:
        for fd in opened:
            os.close(fd)


def _hello(socket_dir: Path) -> dict:
    from weightcache.core.cli.launch import ask

    reply = ask(socket_dir, {"op": "hello"}, timeout=30)
    assert reply, "the launcher closed without a reply"
    return reply


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between the open and the read
        return False


_LAUNCH_AS_USER = """
import os, sys
from weightcache.core.cli import launch
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))
launched = launch.start(["-c", "import os; print(os.getuid(), flush=True)"], sys.argv[3])
print(launched.wait())
"""


def test_another_uid_is_refused(test_user):  # noqa: F811
    """A launcher of the test user refuses root's request by its peer credentials (root may enter the user's 0700
    directory; only SO_PEERCRED stands between), and serves its own user."""
    uid, gid = test_user
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-launcher-"))  # in /tmp: the test user may reach it
    os.chown(socket_dir, uid, gid)
    socket_dir.chmod(0o700)
    script = f"""
import os, sys
from weightcache.core.spare.launcher import Launcher
launcher = Launcher({str(socket_dir)!r}, preload=[], warm=False)
launcher.prepare()  # as root: the interpreter lives where the test user may not read
os.setgroups([]); os.setgid({gid}); os.setuid({uid})
launcher.listen()
print("ready", flush=True)
child = launcher.serve()
if child is not None:
    child.run()
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        if proc.stdout.readline() != "ready\n":
            pytest.fail(f"the test user's launcher did not start: {proc.communicate(timeout=60)[1]}")
        from weightcache.core.cli import launch
        from weightcache.core.errors import AccessDenied

        with pytest.raises(AccessDenied):  # our client will not trust another user's directory...
            launch.connect(socket_dir)
        import socket as socket_module

        from weightcache.core.socket_dir import SocketDir
        from weightcache.core.wire.launch_request import LaunchRequest, launcher_socket
        from weightcache.core.wire.protocol import FrameReader, send_frame

        sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
        sock.connect(launcher_socket(SocketDir.parse(socket_dir)))  # ...so speak to it directly
        try:
            try:
                request = LaunchRequest.of_this_process(
                    ["-c", "open('/tmp/wc-launched-as-root', 'w')"], dict(os.environ), [0, 1, 2]
                )
                send_frame(sock, request.to_message(), [0, 1, 2])
            except BrokenPipeError:
                pass
            frame = FrameReader(sock).read(idle_timeout=30)
        finally:
            sock.close()
        assert frame is not None and frame[0]["error"]["code"] == "access_denied", frame
        assert f"uid {os.geteuid()} may not use a launcher of uid {uid}" in frame[0]["error"]["message"]
        assert not os.path.exists("/tmp/wc-launched-as-root")
        own = subprocess.run(
            [sys.executable, "-c", _LAUNCH_AS_USER, str(uid), str(gid), str(socket_dir)],
            capture_output=True, text=True, timeout=120, cwd="/",
        )  # fmt: skip
        assert own.returncode == 0 and own.stdout.split() == [str(uid), "0"], own
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        subprocess.run(["rm", "-rf", str(socket_dir)], check=False)


def test_timing_of_a_launch_is_a_fraction_of_an_exec(launcher):
    """The point of it all: a launched engine runs its first line long before an exec'd one has imported torch."""
    code = "import time, torch, transformers; print(time.monotonic(), flush=True)"
    began = time.monotonic()
    launched = subprocess.run(launch_command(launcher.socket_dir, "-c", code), capture_output=True, text=True, timeout=300)
    launched_s = float(launched.stdout) - began
    began = time.monotonic()
    execd = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    execd_s = float(execd.stdout) - began
    assert launched.returncode == execd.returncode == 0
    assert launched_s < execd_s / 2, (launched_s, execd_s)


def test_the_launch_command_imports_no_other_command_before_the_fork(tmp_path):
    """`weightcache launch` runs on the engine's clock: it imports its own client and the wire, not the other commands'
    modules (the server's client, the options, logging's formats), nor looks up an entry point."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *launch_command(tmp_path / "none", "-c", "pass")[1:]],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1 and "no launcher" in proc.stderr, proc.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "weightcache.core.cli.launch" in imported
    others = ("weightcache.core.client", "weightcache.core.server", "weightcache.core.flow", "weightcache.core.spare")
    others += ("weightcache.core.cli.probe", "weightcache.core.cli.cli_options", "weightcache.core.cli.logformat", "torch")
    assert not sorted(m for m in imported if m == "importlib.metadata" or m.startswith(others))


_ADAPTERS = r"""
import importlib.metadata, json
scans = []
def counted(*args, _original=importlib.metadata.entry_points, **kwargs):
    scans.append(kwargs.get("group"))
    return _original(*args, **kwargs)
importlib.metadata.entry_points = counted
from weightcache.core.flow.plugins import installed_plugins
names = sorted(name for name, plugin in installed_plugins().pm.list_name_plugin() if plugin is not None)
print(json.dumps({"adapters": names, "scanned": "weightcache.adapters" in scans}))
"""
EXTRA_ADAPTER = {
    "wc_extra_adapter.py": (
        "from weightcache.core.hookspecs import hookimpl\n"
        "@hookimpl\ndef weightcache_describe(request): ...\n"
        "@hookimpl\ndef weightcache_load(request, builder): ...\n"
        "@hookimpl\ndef weightcache_rebind(request, tensors, manifest): ...\n"
    ),
    "wc_extra_adapter-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: wc-extra-adapter\nVersion: 1.0\n",
    "wc_extra_adapter-1.0.dist-info/entry_points.txt": "[weightcache.adapters]\nextra = wc_extra_adapter\n",
}


def _install(directory: Path) -> None:
    for relative, text in EXTRA_ADAPTER.items():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_text(text)


def test_the_launchers_adapter_scan_serves_its_engines_until_an_adapter_is_installed_or_removed(tmp_path):
    """The launcher scans the adapters' entry points once; an engine takes that scan (no scan of its own) while nothing
    it read changed, and scans itself, as an exec'd engine does, once a distribution was added to or removed from a
    path entry, where its own first path entry (its working directory) holds one, or where its block-list differs."""
    site, project = tmp_path / "site", tmp_path / "project"
    site.mkdir()
    project.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    started = LauncherProcess(tmp_path / "sock", "--no-warm", env=env)

    def seen(cwd: Path = tmp_path, **kwargs) -> tuple[dict, dict]:  # the checkout's root holds an egg-info
        launched, execd = both(started, ["-c", _ADAPTERS], capture_output=True, text=True, timeout=300, cwd=cwd, **kwargs)
        assert launched.returncode == execd.returncode == 0, launched.stderr + execd.stderr
        return json.loads(launched.stdout), json.loads(execd.stdout)

    try:
        assert started.ready is not None, started.output()
        launched, execd = seen(env=env)
        assert launched == {"adapters": execd["adapters"], "scanned": False} and "hf" in execd["adapters"]
        _install(site)
        launched, execd = seen(env=env)
        assert "extra" in launched["adapters"] and launched == execd == {"adapters": execd["adapters"], "scanned": True}
        subprocess.run(["rm", "-rf", str(site / "wc_extra_adapter-1.0.dist-info")], check=True)
        launched, execd = seen(env=env)
        assert "extra" not in launched["adapters"] and launched == execd
        _install(project)
        launched, execd = seen(env=env, cwd=project)
        assert "extra" in launched["adapters"] and launched == execd
        launched, execd = seen(env={**env, "WEIGHTCACHE_BLOCK_ADAPTERS": "hf"})
        assert "hf" not in launched["adapters"] and launched == execd
    finally:
        started.stop()


_SPAWNING = r"""
import json, multiprocessing, multiprocessing.util, os, signal, sys, threading, warnings
import numpy, torch, safetensors, tokenizers, transformers, transformers.modeling_utils  # as an engine (and the launcher)
import transformers.models.auto.tokenization_auto
def _handler(sig):
    handler = signal.getsignal(sig)
    return handler if handler in (signal.SIG_DFL, signal.SIG_IGN, None) else getattr(handler, "__name__", "other")
def state(queue):
    queue.put({
        "argv": sys.argv, "path": sys.path, "name": __name__, "main": sys.modules["__main__"].__name__,
        "cwd": os.getcwd(), "env": dict(os.environ), "umask": os.umask(0), "flags": list(sys.flags),
        "signals": {s.name: str(_handler(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])), "threads": threading.active_count(),
        "filters": [repr(f) for f in warnings.filters], "executable": sys.executable,
        "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
    })
if __name__ == "__main__":
    os.chdir(sys.argv[1])
    os.environ["SET_BY_THE_ENGINE"] = "before its spawn"
    os.environ.update(json.loads(sys.argv[2]))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    os.umask(0o027)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=state, args=(queue,))
    child.start()
    seen = queue.get(timeout=120)
    child.join()
    nursery = getattr(multiprocessing.util.spawnv_passfds, "__self__", None)
    seen.update(
        parent_is_engine=seen["ppid"] == os.getpid(), same_session=seen.pop("sid") == os.getsid(0),
        same_group=seen.pop("pgid") == os.getpgid(0), exitcode=child.exitcode,
        forked=None if nursery is None else len(nursery.forked), refused=None if nursery is None else nursery.refused,
    )
    del seen["ppid"]
    print(json.dumps(seen))
"""


def _spawning(launcher: LauncherProcess, tmp_path: Path, set_in_engine: dict) -> tuple[dict, dict]:
    script = tmp_path / "spawning.py"
    script.write_text(_SPAWNING)
    (tmp_path / "elsewhere").mkdir(exist_ok=True)
    args = [str(script), str(tmp_path / "elsewhere"), json.dumps(set_in_engine)]
    launched, execd = both(launcher, args, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert launched.returncode == execd.returncode == 0, launched.stderr + execd.stderr
    return json.loads(launched.stdout), json.loads(execd.stdout)


def test_an_engines_spawn_children_are_forked_by_its_nursery_and_see_what_execd_children_see(launcher, tmp_path):
    seen, expected = _spawning(launcher, tmp_path, {})
    assert seen.pop("forked") >= 1 and seen.pop("refused") == [], seen  # the child (and the resource tracker)
    assert expected.pop("forked") is None and expected.pop("refused") is None
    assert seen == expected
    assert seen["parent_is_engine"] and seen["same_session"] and seen["same_group"] and seen["exitcode"] == 0
    assert seen["cwd"] == str(tmp_path / "elsewhere") and seen["env"]["SET_BY_THE_ENGINE"] == "before its spawn"
    assert seen["signals"]["SIGUSR1"] == str(signal.SIG_IGN) and int(signal.SIGUSR2) in seen["mask"]


def test_a_child_whose_environment_the_imports_read_differently_is_execd(launcher, tmp_path):
    seen, expected = _spawning(launcher, tmp_path, {"HF_HOME": "/nonexistent/another-hub"})  # read at import
    assert seen.pop("forked") == 0 and all("HF_HOME" in reason for reason in seen["refused"]) and seen.pop("refused")
    expected.pop("forked"), expected.pop("refused")
    assert seen == expected and seen["env"]["HF_HOME"] == "/nonexistent/another-hub"
