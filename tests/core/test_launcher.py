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


def script_both_ways(
    tmp_path: Path, source: str, preload: str, timeout: float
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """``source`` as a script, launched through a launcher of its own that preloads ``preload``, and exec'd."""
    import shutil

    script = tmp_path / "script.py"
    script.write_text(source)
    directory = Path(tempfile.mkdtemp(prefix="wc-launcher-"))
    started = LauncherProcess(directory / "sock", "--preload", preload, "--no-warm")
    try:
        assert started.ready is not None, started.output()
        return both(started, [str(script)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    finally:
        started.stop()
        shutil.rmtree(directory, ignore_errors=True)


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


def test_the_child_forked_ahead_says_when_it_waits_for_a_request(launcher):
    deadline = time.monotonic() + 60
    while not (hello := _hello(launcher.socket_dir))["ahead_ready"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hello["ahead_ready"] and hello["ahead"] is not None and hello["cuda_ready"] is None, hello


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


def test_a_launch_spends_a_fraction_of_an_execs_cpu_before_its_first_line(launcher):
    """The point of it all: a launched engine runs its first line without importing torch itself, which an exec'd one
    spends seconds of CPU on. CPU time, not wall time (no wall-clock bound a loaded machine can miss): the launched
    process is forked with torch imported, so the CPU it used before its first line is a fraction of the exec'd one's
    (benchmarks/engine_start.py times the two)."""
    code = "import time, torch, transformers; print(time.monotonic(), time.process_time(), flush=True)"
    began = time.monotonic()
    launched = subprocess.run(launch_command(launcher.socket_dir, "-c", code), capture_output=True, text=True, timeout=300)
    at, launched_cpu = map(float, launched.stdout.split())
    launched_s = at - began
    began = time.monotonic()
    execd = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    at, execd_cpu = map(float, execd.stdout.split())
    execd_s = at - began
    assert launched.returncode == execd.returncode == 0
    figures = f"CPU {launched_cpu:.2f} s launched, {execd_cpu:.2f} s exec'd; wall {launched_s:.2f} s and {execd_s:.2f} s"
    assert launched_cpu < execd_cpu / 5, figures


_SPAWNING = r"""
import json, multiprocessing, multiprocessing.util, os, signal, sys, threading, warnings
import numpy, torch, safetensors, tokenizers, transformers, transformers.modeling_utils  # as an engine (and the launcher)
import transformers.models.auto.tokenization_auto
def _handler(sig):
    handler = signal.getsignal(sig)
    return handler if handler in (signal.SIG_DFL, signal.SIG_IGN, None) else getattr(handler, "__name__", "other")
def _affinity():
    import torch  # loads libgomp, which binds this thread where GOMP_CPU_AFFINITY says
    return sorted(os.sched_getaffinity(0))
def state(queue):
    queue.put({
        "argv": sys.argv, "path": sys.path, "name": __name__, "main": sys.modules["__main__"].__name__,
        "cwd": os.getcwd(), "env": dict(os.environ), "umask": os.umask(0), "flags": list(sys.flags),
        "signals": {s.name: str(_handler(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])), "threads": threading.active_count(),
        "filters": [repr(f) for f in warnings.filters], "executable": sys.executable,
        "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "affinity": _affinity(),
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


def test_a_child_of_one_gomp_cpu_is_forked_and_bound_to_it_as_an_execd_one_is(launcher, tmp_path):
    """vLLM's CPU workers: each spawned with ``GOMP_CPU_AFFINITY`` of its rank's CPU (one CPU each here)."""
    cpu = max(os.sched_getaffinity(0))
    seen, expected = _spawning(launcher, tmp_path, {"GOMP_CPU_AFFINITY": str(cpu)})
    assert seen.pop("forked") >= 1 and seen.pop("refused") == [], seen
    expected.pop("forked"), expected.pop("refused")
    assert seen == expected and seen["affinity"] == [cpu]


def test_a_child_whose_environment_the_imports_read_differently_is_execd(launcher, tmp_path):
    seen, expected = _spawning(launcher, tmp_path, {"HF_HOME": "/nonexistent/another-hub"})  # read at import
    assert seen.pop("forked") == 0 and all("HF_HOME" in reason for reason in seen["refused"]) and seen.pop("refused")
    expected.pop("forked"), expected.pop("refused")
    assert seen == expected and seen["env"]["HF_HOME"] == "/nonexistent/another-hub"
