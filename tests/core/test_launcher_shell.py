"""The launcher as users drive it (core/spare/environment.py): started from a shell or by the documented systemd user
unit, and asked from a real ``bash`` (a script, ``nice``, ``cd``, ``env VAR=...``, ``setsid``, another terminal). A
launch is forked unless what the engine would run differs: a variable the preloaded code depends on, the interpreter,
the code on disk; the shell's, the terminal's and the service manager's own variables never force an exec, and the
engine runs in the caller's working directory, niceness and environment.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
_PROBE = (
    "import json, os; print(json.dumps({'ppid': os.getppid(), 'cwd': os.getcwd(), 'nice': os.nice(0), "
    "'var': os.environ.get('WC_CALLER_VAR'), 'term': os.environ.get('TERM'), 'leader': os.getsid(0) == os.getpid()}))"
)
_COPIES_ENVIRON = """
import os, platform
ARCH = platform.architecture()  # as py-cpuinfo at import: CPython's helper copies the whole environment to run `file`
PROCESSOR = platform.processor()  # runs `uname -p`, found on PATH
SETTING = os.environ.get("WC_PRELOAD_SETTING")  # a real dependency: read by name
"""
_LAUNCHES = r"""
set -u
launch() { "$WEIGHTCACHE" launch --strict --socket-dir "$SOCK" -- -c "$PROBE"; echo "status $?"; }
echo "case script"; launch
echo "case nice"; nice -n 5 "$WEIGHTCACHE" launch --strict --socket-dir "$SOCK" -- -c "$PROBE"; echo "status $?"
echo "case cd"; cd "$ELSEWHERE" && launch; cd - > /dev/null
echo "case env"; env WC_CALLER_VAR=from-env "$WEIGHTCACHE" launch --strict --socket-dir "$SOCK" -- -c "$PROBE"; echo "status $?"
echo "case terminal"; TERM=dumb COLUMNS=80 LINES=24 SSH_CONNECTION="10.0.0.1 5022 10.0.0.2 22" SSH_TTY=/dev/pts/7 launch
echo "case setsid"; setsid -w "$WEIGHTCACHE" launch --strict --socket-dir "$SOCK" -- -c "$PROBE"; echo "status $?"
echo "case nested"; bash -c 'cd / && "$WEIGHTCACHE" launch --strict --socket-dir "$SOCK" -- -c "$PROBE"; echo "status $?"'
echo "case dependency"; env WC_PRELOAD_SETTING=another "$WEIGHTCACHE" launch --strict --socket-dir "$SOCK" -- -c "$PROBE" 2>&1; echo "status $?"
"""
SHELL_CASES = ("script", "nice", "cd", "env", "terminal", "setsid", "nested")


def _cases(output: str) -> dict[str, list[str]]:
    cases: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("case "):
            current = cases.setdefault(line[5:], [])
        elif current is not None:
            current.append(line)
    return cases


def _forked(lines: list[str], launcher_pid: int) -> dict:
    """The probe's report of a launch that the launcher forked (its parent is the launcher)."""
    assert lines[-1] == "status 0" and len(lines) == 2, lines
    seen = json.loads(lines[0])
    assert seen["ppid"] == launcher_pid, f"not forked from the launcher (pid {launcher_pid}): {seen}"
    return seen


class _Started:
    """A launcher started in the background of a shell (``via_shell``: ``COMMAND &`` in bash) or exec'd as a service
    manager does, found by its ready line."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, ready: Path, log: Path, via_shell: bool):
        self.ready_file, self.log = ready, log
        self.proc = None
        if via_shell:
            shell = f'"$@" > {ready} 2> {log} & echo $!'
            started = subprocess.run(["bash", "-c", shell, "bash", *argv], env=env, cwd=cwd, capture_output=True, text=True)
            self.pid = int(started.stdout)
        else:
            with ready.open("w") as out, log.open("w") as err:
                self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
            self.pid = self.proc.pid
        assert wait_until(self._ready_or_gone, timeout=600), self.output()
        assert ready.read_text().startswith("{"), self.output()
        assert json.loads(ready.read_text())["pid"] == self.pid

    def _ready_or_gone(self) -> bool:
        return self.ready_file.read_text().strip() != "" or _zombie(self.pid)

    def output(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if self.proc is not None:
            self.proc.wait(timeout=60)
        else:
            wait_until(lambda: _zombie(self.pid), timeout=60)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def _shell_env(base: dict, **extra: str) -> dict:
    """A login shell's environment on top of ``base``: a terminal, an SSH login, a venv activated on PATH."""
    return {
        **base,
        "TERM": "xterm-256color",
        "COLORTERM": "truecolor",
        "SSH_CONNECTION": "10.0.0.9 40022 10.0.0.2 22",
        "SSH_CLIENT": "10.0.0.9 40022 22",
        "SSH_TTY": "/dev/pts/3",
        "LS_COLORS": "di=01;34",
        "MAIL": "/var/mail/user",
        "VIRTUAL_ENV": sys.prefix,
        "PATH": f"{BIN}:{base.get('PATH', '/usr/bin:/bin')}",
        **extra,
    }


def test_launches_from_a_shell_are_forked_whatever_the_shell_and_terminal_set(tmp_path):
    """A preload that copies the whole environment at import (as py-cpuinfo does through CPython's ``platform``) and
    reads one name: a launcher started with ``&`` from an interactive shell serves a script's launches with ``nice``,
    ``cd``, ``env VAR=...``, other terminal variables, ``setsid`` and a nested shell; a value of the name it read
    differs and is exec'd with one line."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "wc_copies_environ.py").write_text(_COPIES_ENVIRON)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sock = tmp_path / "sock"
    pythonpath = os.pathsep.join(filter(None, [str(lib), os.environ.get("PYTHONPATH")]))
    env = _shell_env({**os.environ, "PYTHONPATH": pythonpath}, SHLVL="1")
    argv = [str(BIN / "weightcache"), "launcher", "--socket-dir", str(sock), "--preload", "json,wc_copies_environ", "--no-warm"]
    started = _Started(argv, env, ROOT, tmp_path / "ready", tmp_path / "launcher.log", via_shell=True)
    try:
        script = tmp_path / "launches.sh"
        script.write_text(_LAUNCHES)
        script_env = {**env, "WEIGHTCACHE": str(BIN / "weightcache"), "SOCK": str(sock), "PROBE": _PROBE}
        script_env["ELSEWHERE"] = str(elsewhere)
        done = subprocess.run(["bash", str(script)], env=script_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        cases = _cases(done.stdout)
        assert set(cases) == {*SHELL_CASES, "dependency"}, done
        seen = {name: _forked(cases[name], started.pid) for name in SHELL_CASES}
        assert seen["script"]["cwd"] == str(tmp_path) and seen["script"]["nice"] == 0 and not seen["script"]["var"]
        assert seen["script"]["term"] == "xterm-256color" and seen["script"]["leader"]
        assert seen["nice"]["nice"] == 5 and seen["cd"]["cwd"] == str(elsewhere) and seen["nested"]["cwd"] == "/"
        assert seen["env"]["var"] == "from-env" and seen["terminal"]["term"] == "dumb"
        refused = cases["dependency"]
        assert refused[-1] == "status 1" and len(refused) == 2, refused
        assert "differs from the launcher's in WC_PRELOAD_SETTING," in refused[0], refused
    finally:
        started.stop()


def _unit() -> dict[str, str]:
    """The systemd user unit docs/operations.md ships for the launcher: its [Service] settings."""
    text = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"```ini\n# ~/.config/systemd/user/weightcache-launcher.service\n(.*?)```", text, re.S)
    assert block, "docs/operations.md no longer shows the launcher's unit"
    service = block.group(1).split("[Service]\n", 1)[1].split("\n[", 1)[0]
    return dict(line.split("=", 1) for line in service.splitlines() if "=" in line)


def _as_systemd_runs(line: str, runtime: Path) -> list[str]:
    """``line`` (an ExecStart) as the user manager runs it: ``%t`` is the runtime directory; the venv is this one."""
    return [word.replace("%t", str(runtime)).replace("/opt/venv", sys.prefix) for word in line.split()]


def _user_manager_env(runtime: Path) -> dict:
    """What systemd's user manager gives a service: the login's basics, its default PATH, its own per-unit variables,
    and what the user set for all their processes (environment.d, ``systemctl --user import-environment``), here the
    test run's own settings; none of a shell's or a terminal's."""
    shell_only = {"PATH", "PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLUMNS", "LINES", "VIRTUAL_ENV"}
    user_wide = {k: v for k, v in os.environ.items() if k not in shell_only and not k.startswith("SSH_")}
    return {
        **user_wide,
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "XDG_RUNTIME_DIR": str(runtime),
        "INVOCATION_ID": secrets.token_hex(16),
        "JOURNAL_STREAM": "8:41234",
        "MANAGERPID": "1201",
        "SYSTEMD_EXEC_PID": "0",
    }


@pytest.mark.skipif(not (BIN / "weightcache").exists(), reason="the weightcache script is not installed in this venv")
@pytest.mark.parametrize("preloads", ["as shipped", "copying the environment"])
def test_the_documented_systemd_unit_serves_launches_from_a_login_shell(tmp_path, preloads):
    """systemd cannot run here: the unit's ExecStart is run as shipped, in the environment the user manager gives a
    service (as shipped: the default preloads; then with a preload that copies the whole environment at import, as
    vLLM's py-cpuinfo does); a login shell (terminal, SSH, an activated venv, its own PATH) launches through it with
    ``cd`` and ``nice`` and is forked."""
    unit = _unit()
    runtime = Path(tempfile.mkdtemp(prefix="wc-runtime-"))
    runtime.chmod(0o700)
    try:
        argv = _as_systemd_runs(unit["ExecStart"], runtime)
        assert "--socket-dir" in argv and unit.get("KillMode") == "process", unit
        env = _user_manager_env(runtime)
        if preloads != "as shipped":
            (tmp_path / "lib").mkdir()
            (tmp_path / "lib" / "wc_copies_environ.py").write_text(_COPIES_ENVIRON)
            argv += ["--preload", "json,wc_copies_environ", "--no-warm"]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "lib"), env.get("PYTHONPATH")]))
        started = _Started(argv, env, Path(env["HOME"]), tmp_path / "ready", tmp_path / "unit.log", via_shell=False)
        try:
            shell = _shell_env({k: v for k, v in os.environ.items() if k not in ("PWD", "OLDPWD", "_")})
            shell["XDG_RUNTIME_DIR"] = str(runtime)
            if "PYTHONPATH" in env:
                shell["PYTHONPATH"] = env["PYTHONPATH"]  # user-wide, as the unit's
            line = (
                f'cd {tmp_path} && nice -n 2 weightcache launch --strict --socket-dir "$XDG_RUNTIME_DIR/weightcache" -- -c "$0"'
            )
            done = subprocess.run(["bash", "-c", line, _PROBE], env=shell, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (done, started.output())
            seen = json.loads(done.stdout)
            assert seen["ppid"] == started.pid and seen["cwd"] == str(tmp_path) and seen["nice"] == 2, seen
            assert seen["term"] == "xterm-256color", seen
        finally:
            started.stop()
    finally:
        subprocess.run(["rm", "-rf", str(runtime)], check=False)
