"""``weightcache load`` on a node that pulls its entry from another node of the fleet: the plan names the fleet before
the disk, so the command reads nothing of the checkpoint but its headers and configs (it read the whole checkpoint
ahead while it imported, whatever the bytes' source turned out to be). Every read of the command's process is traced
(strace, with the path of each descriptor) and the bytes read from the checkpoint's directory summed. The fleet's
fixtures are tests/core/conftest.py's, its helpers fleet_loads.py's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.core.fleet_loads import load, wait_listed
from tests.core.fleet_support import skip_unless_a_fleet_runs

skip_unless_a_fleet_runs()  # etcd and NIXL, or the module is skipped saying which is missing

STRACE = shutil.which("strace")
_READ = re.compile(r"\b(?:read|pread64|readv|preadv2?)\(\d+<([^>]*)>.* = (\d+)$")


def checkpoint_bytes_read(trace: str, checkpoint) -> int:
    """The bytes that ``read`` and its kin returned from files under ``checkpoint`` in an ``strace -y`` log."""
    inside = str(checkpoint).rstrip("/") + "/"
    return sum(int(m.group(2)) for m in map(_READ.search, trace.splitlines()) if m and m.group(1).startswith(inside))


@pytest.mark.skipif(STRACE is None, reason="strace is not installed: nothing counts the reads per file")
def test_weightcache_load_on_a_node_that_pulls_reads_only_the_headers(fleet, minilm_dir, tmp_path):
    etcd, node = fleet
    a, b = node("a"), node("b")
    first = load(a, minilm_dir)
    wait_listed(etcd, first.fingerprint.content_digest, [a], "node a's agent listing its entry")
    weights = sum(file.stat().st_size for file in minilm_dir.glob("*.safetensors"))
    trace = tmp_path / "reads.strace"
    command = [sys.executable, "-m", "weightcache.core.cli.cli", "load", "--model", str(minilm_dir), "--socket-dir"]
    traced = [STRACE, "-f", "-y", "-e", "trace=read,pread64,readv,preadv,preadv2", "-o", str(trace), *command]
    done = subprocess.run(
        b.net.command([*traced, str(b.socket_dir)]),
        env=b.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "copied from node a over " in done.stdout, done.stdout + done.stderr[-3000:]
    read = checkpoint_bytes_read(trace.read_text(), minilm_dir)
    assert 0 < read <= 1 << 20, f"a load that pulled from node a read {read} bytes of the checkpoint ({weights} in all)"


def test_the_count_sees_a_checkpoint_read_whole(minilm_dir, tmp_path):
    """The check itself: a process that reads the weight files is counted at their size."""
    if STRACE is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "reads.strace"
    code = "import sys, pathlib; [p.read_bytes() for p in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors'))]"
    subprocess.run(
        [STRACE, "-f", "-y", "-e", "trace=read", "-o", str(trace), sys.executable, "-c", code, str(minilm_dir)], check=True
    )
    weights = sum(file.stat().st_size for file in minilm_dir.glob("*.safetensors"))
    assert checkpoint_bytes_read(trace.read_text(), minilm_dir) == weights
