"""A launcher against what a caller of the same uid may send (core/spare/connections.py, core/wire/launch_request.py):
every field out of its range is refused with one line and the launcher lives; idle or slow connections delay no other
caller; a launch from a removed working directory behaves as ``python`` there.
"""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.test_launcher import _hello, launch_command, started_launcher
from weightcache.core import PROTOCOL_VERSION
from weightcache.core.socket_dir import SocketDir
from weightcache.core.wire.launch_request import LaunchRequest, launcher_socket
from weightcache.core.wire.protocol import HEADER, MAGIC, FrameReader


@pytest.fixture(scope="module")
def light():
    """A launcher that imports only json (the rules checked here do not depend on what it imports)."""
    yield from started_launcher("--preload", "json", "--no-warm")


def _connect(socket_dir: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(launcher_socket(SocketDir.parse(socket_dir)))
    return sock


def _raw_request(field: str, literal: str) -> bytes:
    """A launch request as ``weightcache launch`` sends it, with ``field`` set to the JSON text ``literal`` (which
    ``json.dumps`` would never write: ``1e400``, ``Infinity``, ...)."""
    message = LaunchRequest.of_this_process(["-c", "print('ran')"], {"PATH": os.environ["PATH"]}, [0, 1, 2]).to_message()
    message[field] = "@FIELD@"
    payload = json.dumps(message).replace('"@FIELD@"', literal).encode()
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 3, len(payload)) + payload


HOSTILE = [
    ("umask", "Infinity"), ("umask", "NaN"), ("umask", "1e400"), ("umask", "-1"), ("umask", "1" + "0" * 30),
    ("umask", "true"), ("umask", "18.5"), ("nice", "1e400"), ("nice", "-Infinity"), ("nice", "-100"), ("nice", "1000"),
    ("fds", "[0, 1, 1e400]"), ("fds", "[0, 1, -2]"), ("fds", "[0, 1, 9999999999]"), ("fds", "5"),
    ("ignored", "[Infinity]"), ("ignored", "[0]"), ("ignored", "[100000]"), ("blocked", "[NaN]"), ("blocked", "[-9]"),
    ("limits", '{"RLIMIT_NOFILE": [Infinity, 1024]}'), ("limits", '{"RLIMIT_NOFILE": [1e400, 1e400]}'),
    ("limits", '{"RLIMIT_NOFILE": [4096, 1024]}'), ("limits", '{"RLIMIT_NOFILE": [-5, 1024]}'),
    ("limits", '{"RLIMIT_NOFILE": [1, 99999999999999999999999]}'), ("limits", '{"RLIMIT_BOGUS": [1, 1]}'),
    ("limits", '{"RLIMIT_NOFILE": [1]}'), ("limits", "[]"),
    ("argv", '["-c", 1e400]'), ("argv", '"-c"'), ("env", '{"A": Infinity}'), ("env", '{"A=B": "x"}'),
    ("env", '{"": "x"}'), ("env", '{"A": "x\\u0000y"}'), ("env", "[]"), ("cwd", "1e400"), ("cwd", '"relative/dir"'),
    ("cwd", '"/tmp\\u0000x"'), ("executable", "NaN"), ("prefix", "[1]"),
]  # fmt: skip


def test_every_field_out_of_range_is_refused_with_one_line_and_the_launcher_lives(light):
    refusals = []
    for field, literal in HOSTILE:
        with _connect(light.socket_dir) as sock:
            data = _raw_request(field, literal)
            sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
            reply = FrameReader(sock).read(idle_timeout=60)
        assert reply is not None, f"{field}={literal}: the launcher closed without a reply: {light.output()[-2000:]}"
        message, fds = reply
        assert fds == [] and message["ok"] is False, (field, literal, message)
        error = message["error"]
        assert error["code"] == "bad_request" and "\n" not in error["message"], (field, literal, error)
        assert field in error["message"] and "weightcache launch" in error["message"], (field, literal, error)
        refusals.append(error["message"])
        assert light.proc.poll() is None, f"{field}={literal} ended the launcher: {light.output()[-3000:]}"
    assert _hello(light.socket_dir)["pid"] == light.pid
    done = subprocess.run(launch_command(light.socket_dir, "-c", "print('still serves')"), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "still serves\n", done


def test_idle_and_slow_connections_never_delay_another_callers_launch(light):
    """Three connections that send nothing and one that stops inside its header: a `launch --strict` meanwhile is
    forked (the launcher reads each connection as its bytes come), and each of them is told on one line, after its
    own deadline, that no whole request came."""
    idle = [_connect(light.socket_dir) for _ in range(3)]
    slow = _connect(light.socket_dir)
    slow.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 100)[:5])
    try:
        code = "import os; print(os.getppid())"
        done = subprocess.run(launch_command(light.socket_dir, "-c", code), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout == f"{light.pid}\n", done  # forked, not refused
        for sock in (*idle, slow):
            reply = FrameReader(sock).read(idle_timeout=120)
            assert reply is not None and reply[0]["ok"] is False, reply
            assert "no whole request within" in reply[0]["error"]["message"], reply
            assert sock.recv(1) == b""  # then closed
    finally:
        for sock in (*idle, slow):
            sock.close()
    assert _hello(light.socket_dir)["pid"] == light.pid


_IN_REMOVED = """
import os, sys
print(repr(sys.path[0]), flush=True)
os.getcwd()
"""


@pytest.mark.parametrize(
    "args",
    [["-c", _IN_REMOVED], ["-m", "json.tool", "--help"], ["missing_script.py"], ["-c", "import sys; print(sys.path[:1])"]],
    ids=["-c", "-m", "relative script", "path"],
)
def test_a_launch_from_a_removed_working_directory_behaves_as_python_there(light, tmp_path, args):
    removed = tmp_path / "removed"
    removed.mkdir()
    runs = []
    for command in (launch_command(light.socket_dir, *args), [sys.executable, *args]):
        # a shell that stays in the directory after it is removed (`rm -r` of the directory a terminal is in)
        shell = f'cd {removed} && rmdir {removed} && exec "$@"'
        proc = subprocess.run(["bash", "-c", shell, "bash", *command], capture_output=True, text=True, timeout=300)
        runs.append((proc.returncode, proc.stdout, proc.stderr))
        removed.mkdir()
    assert runs[0] == runs[1], runs
    assert "weightcache" not in runs[0][2], runs[0]  # no traceback of the launch command


def test_a_caller_of_another_venv_of_the_same_interpreter_is_execd(light, tmp_path):
    """Two venvs of one interpreter share its executable (resolved) but not their packages: the launcher of one does
    not fork an engine for the other's caller."""
    venv = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    ours = subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(site, "borrowed.pth").write_text(f"import site; site.addsitedir({ours!r})\n")  # weightcache, from this venv
    other = str(venv / "bin" / "python")
    assert os.path.realpath(other) == os.path.realpath(sys.executable)
    command = [other, *launch_command(light.socket_dir, "-c", "import sys; print(sys.prefix)")[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "start a launcher with the caller's interpreter" in done.stderr, done.stderr
