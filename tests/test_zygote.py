"""The test zygote (tests/zygote.py): a child forked from it behaves as an exec'd ``python -c``/``-m`` child.

Each check runs the same child both ways, forked and exec'd, and compares what a test can see: exit status and
signal, stdout and stderr, argv, ``sys.path[0]``, ``__main__``, the environment, cwd, umask, session, open fds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import zygote
from tests.helpers import EXIT_CASES, wait_until

needs_zygote = pytest.mark.skipif(os.environ.get(zygote.OFF) == "1", reason=f"{zygote.OFF}=1: every child is exec'd")

_STATE = """
import json, os, sys
import torch  # as the children of the tests do; a fresh one sets what torch's import sets
def _open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path0": sys.path[0], "name": __name__,
    "file": globals().get("__file__"), "cwd": os.getcwd(), "env": dict(os.environ), "umask": os.umask(0),
    "fds": [fd for fd in range(256) if _open(fd)], "session": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(), "executable": sys.executable, "flags": list(sys.flags), "warnoptions": sys.warnoptions,
    "main_keys": sorted(k for k in vars(sys.modules["__main__"]) if k.startswith("__")),
}))
"""


def both(args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """``args`` forked from the zygote and exec'd; the forked one must have been forked."""
    forked = zygote.run(args, **kwargs)
    assert isinstance(forked, zygote.Forked), f"not forked: {zygote.why_exec(args, kwargs)}"
    return forked, subprocess.run(args, **kwargs)


@needs_zygote
@pytest.mark.parametrize(("code", "returncode"), EXIT_CASES)
def test_exit_status_and_output_are_those_of_an_exec(code, returncode):
    forked, execd = both([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert forked.returncode == execd.returncode == returncode, (forked, execd)
    assert forked.stdout == execd.stdout
    # A traceback names the zygote's own top-level frame once more: the rest, the exception and message, is the same.
    assert forked.stderr.splitlines()[-1:] == execd.stderr.splitlines()[-1:]


@needs_zygote
@pytest.mark.parametrize("form", ["-c", "-m"])
def test_argv_path_main_env_cwd_umask_fds_and_stdin_are_those_of_an_exec(form, tmp_path):
    (tmp_path / "state_probe.py").write_text(_STATE)
    args = [sys.executable, "-c", _STATE] if form == "-c" else [sys.executable, "-m", "state_probe"]
    read, write = os.pipe()
    env = {**os.environ, "WEIGHTCACHE_PROBE": "a value of the allow-list"}
    try:
        forked, execd = both(
            [*args, "one", "two words"],
            input="to stdin",
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            pass_fds=[write],
            start_new_session=True,
            umask=0o027,
            timeout=120,
        )
    finally:
        os.close(read)
        os.close(write)
    assert forked.returncode == execd.returncode == 0, forked.stderr + execd.stderr
    seen, expected = json.loads(forked.stdout), json.loads(execd.stdout)
    assert seen == expected
    assert seen["argv"][1:] == ["one", "two words"] and seen["stdin"] == "to stdin" and seen["umask"] == 0o027
    assert seen["fds"] == [0, 1, 2, write] and seen["session"] and seen["env"]["WEIGHTCACHE_PROBE"]


@needs_zygote
def test_pid_signals_wait_and_poll_are_those_of_a_popen():
    proc = zygote.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert isinstance(proc, zygote.ZygotePopen)
    assert proc.stdout.readline() == b"up\n"
    assert proc.poll() is None and proc.pid != os.getpid()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.kill(proc.pid, signal.SIGUSR1)  # the pid is the child's own: a signal sent to it reaches it
    assert proc.wait(timeout=30) == -signal.SIGUSR1
    proc.stdout.close()
    proc = zygote.popen([sys.executable, "-c", "pass"])
    assert wait_until(lambda: _state(proc.pid) == "Z"), "an exited child stays a zombie until its status is read"
    assert proc.wait(timeout=30) == 0
    assert wait_until(lambda: _state(proc.pid) is None), "then it is reaped"
    proc.kill()  # as Popen: signalling a child whose status was read does nothing


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


@needs_zygote
def test_a_timeout_kills_the_child_as_subprocess_run_does():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - started < 30


@needs_zygote
def test_a_missing_cwd_raises_in_the_caller_as_with_exec(tmp_path):
    with pytest.raises(FileNotFoundError):
        zygote.popen([sys.executable, "-c", "pass"], cwd=tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        subprocess.Popen([sys.executable, "-c", "pass"], cwd=tmp_path / "missing")


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        (["-W", "error", "-c", "pass"], {}, "interpreter option '-W'"),
        (["script.py"], {}, "interpreter option 'script.py'"),
        (["-c", "pass"], {"close_fds": False}, "Popen arguments ['close_fds']"),
        (["-c", "pass"], {"preexec_fn": os.getpid}, "Popen arguments ['preexec_fn']"),
    ],
)
def test_what_the_rules_leave_to_exec(args, kwargs, why):
    assert zygote.why_exec([sys.executable, *args], kwargs) == (f"{zygote.OFF}=1" if os.environ.get(zygote.OFF) == "1" else why)
    assert zygote.why_exec(["/usr/bin/python3", "-c", "pass"], {}) in ("not this interpreter", f"{zygote.OFF}=1")


@needs_zygote
def test_another_environment_gets_a_zygote_of_its_own_at_its_second_child_or_an_exec():
    env = {**os.environ, "HF_HOME": "/nonexistent/elsewhere"}  # read by huggingface_hub at import: must match
    code = "import os; print(os.environ['HF_HOME'])"
    first = zygote.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    second = zygote.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert not isinstance(first, zygote.Forked), "one child of an environment is exec'd"
    assert first.stdout == second.stdout == "/nonexistent/elsewhere\n"
    if isinstance(second, zygote.Forked):
        assert any(z.env.get("HF_HOME") == "/nonexistent/elsewhere" for z in zygote._zygotes)


def test_the_switch_execs_every_child():
    code = "import sys; from tests import zygote; print(type(zygote.run([sys.executable, '-c', 'pass'])).__name__)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", "from tests import zygote; zygote.snapshot_environment()\n" + code],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, zygote.OFF: "1"},
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == "CompletedProcess\n", proc.stderr


_RECORDER = """
import os, sys, traceback
reads, scans = set(), set()
get, iterate = os._Environ.__getitem__, os._Environ.__iter__
def recorded_get(self, key):
    if sys._getframe(1).f_code.co_name != "__iter__":  # items() and values() of a scan (recorded there) read every key
        reads.add(key)
    return get(self, key)
def recorded_iter(self):
    frames = [f.filename for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("/os.py", "_collections_abc>"))]
    scans.add(frames[-1])
    return iterate(self)
os._Environ.__getitem__, os._Environ.__iter__ = recorded_get, recorded_iter
for name in sys.argv[1].split(","):
    __import__(name)
import json
print(json.dumps({"reads": sorted(reads), "scans": sorted(scans)}))
"""
PREFIX_SCANS = ("tqdm/utils.py",)
"""Where the preloads iterate the environment, each for a prefix of its own (tqdm: ``TQDM_``)."""


def test_the_preloads_read_no_name_the_rules_let_differ_at_import():
    proc = subprocess.run(
        [sys.executable, "-c", _RECORDER, ",".join(zygote.PRELOAD)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert not [name for name in seen["reads"] if zygote._allowed(name)], "the allow-list holds a name read at import"
    assert seen["reads"], "the recorder saw nothing: it did not record"
    assert all(scan.endswith(PREFIX_SCANS) for scan in seen["scans"]), seen["scans"]


def test_the_pytest_preload_imports_no_pytest_plugins_package():
    import importlib.metadata

    packages = set()
    for dist in importlib.metadata.distributions():
        for entry in dist.entry_points:
            if entry.group == "pytest11":
                packages.add(entry.value.partition(":")[0].partition(".")[0])
    code = f"import sys; {'; '.join(f'import {m}' for m in zygote.PYTEST_PRELOAD)}; print(sorted(sys.modules))"
    imported = {
        m.partition(".")[0]
        for m in json.loads(subprocess.check_output([sys.executable, "-c", code], text=True).replace("'", '"'))
    }
    assert packages and not imported & packages, imported & packages
