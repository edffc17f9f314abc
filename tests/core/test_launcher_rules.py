"""The launcher keeps its rules (core/spare/launcher.py, preload.py, launch.py): code unchanged on disk (else it refuses
and is replaced, engines kept), fork-safety, its CUDA readiness and the fds a CUDA-ready child opens, the same uid,
the launch command's imports, and one scan of the adapters until one is installed or removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.core.test_launcher import LauncherProcess, both, launch_command
from tests.core.test_server import test_user  # noqa: F401  the second user, made once


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
