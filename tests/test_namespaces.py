"""The container situation simulated with Linux namespaces: a server in its own mount and PID namespace, a loader
and an engine each in another, sharing only the socket directory; the engine attaches bit-identical weights.

Needs ``unshare`` and the right to make namespaces (root, as on the CI machines); skipped otherwise. Each side
hides what the others own with a tmpfs mounted over it: the server sees no checkpoint, the loader and the
engine see no server files but the socket directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.helpers import wait_until
from weightcache.core.client.client import Connection
from weightcache.core.server.server_process import serve_command

UNSHARE = shutil.which("unshare")


def _namespaces_work() -> bool:
    if UNSHARE is None:
        return False
    probe = subprocess.run([UNSHARE, "--mount", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _namespaces_work(), reason="cannot make mount and PID namespaces here (unshare)")


def in_namespace(hide: list[Path], argv: list[str]) -> list[str]:
    """``argv`` in new mount and PID namespaces, with a tmpfs over each of ``hide`` (killed with its ``unshare``)."""
    mounts = " && ".join(f"mount -t tmpfs none {path}" for path in hide)
    script = f'mount --make-rprivate / && {mounts} && exec "$@"'
    return [UNSHARE, "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", script, "sh", *argv]


@pytest.fixture
def layout(model_dir):
    """``root/sock`` (shared by all), ``root/models`` (loader and engine), ``root/server`` (the server's own)."""
    root = Path(tempfile.mkdtemp(prefix="wc-ns-"))
    for name in ("sock", "models", "server"):
        (root / name).mkdir(mode=0o700)
    shutil.copytree(model_dir("llama"), root / "models" / "llama")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


_ENGINE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    assert not any(Path(sys.argv[2]).iterdir()), "the engine sees the server's own directory"
    from weightcache.core.flow.modes import load_model
    from tests.helpers import assert_tensors_equal
    cached = load_model(sys.argv[1], mode="client", socket_dir=sys.argv[3], strict=True)
    disk = load_model(sys.argv[1], mode="off")
    assert cached.source == "cache", cached.source
    expected = dict(disk.model.state_dict())
    for name, tensor in cached.model.state_dict().items():
        assert_tensors_equal(name, tensor, expected[name])
    print("pid", os.getpid(), "tensors", len(expected))
    """
)


def test_an_engine_in_other_namespaces_attaches_bit_identical_weights_through_the_socket_directory(layout):
    sock, models, own = layout / "sock", layout / "models", layout / "server"
    log = open(own.parent / "server.log", "wb")
    server = subprocess.Popen(in_namespace([models], serve_command(sock)), stdout=log, stderr=log, cwd=own)
    try:
        assert wait_until(lambda: (sock / "weightcache.sock").exists(), timeout=30), (own.parent / "server.log").read_text()
        (own / "marker").write_text("only the server's side sees this")  # written from outside, hidden in the others
        load = subprocess.run(
            in_namespace(
                [own],
                [
                    sys.executable,
                    "-m",
                    "weightcache.core.cli.cli",
                    "load",
                    "--model",
                    str(models / "llama"),
                    "--socket-dir",
                    str(sock),
                ],
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert load.returncode == 0 and load.stdout.startswith("published "), load.stderr
        engine = subprocess.run(
            in_namespace([own], [sys.executable, "-c", _ENGINE, str(models / "llama"), str(own), str(sock)]),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert engine.returncode == 0, engine.stderr[-3000:]
        words = engine.stdout.split()
        assert words[:2] == ["pid", "1"] and int(words[3]) > 0, engine.stdout  # pid 1: a PID namespace of its own
        with Connection(sock) as connection:
            status = connection.status()
        assert status["pid"] == 1, "the server runs as pid 1 of its own PID namespace"
        assert status["metrics"]["hits"] == 1 and len(status["entries"]) == 1
    finally:
        server.kill()  # unshare --kill-child takes the server (pid 1 of its namespace) and the namespace with it
        server.wait(timeout=30)
        log.close()
