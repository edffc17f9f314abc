"""An engine started through ``weightcache launcher`` generates the tokens of the same engine exec'd, and its own
``spawn`` children (vLLM's engine core and worker, SGLang's scheduler and detokenizer) are forked from the launcher's
nursery, none exec'd at any depth (vLLM's workers are the engine core's children): ``benchmarks/engine_start.py`` run
once per engine at TP=1 (vLLM at TP=2 too), both ways in one run. Its exit prints no ``resource_tracker`` line that
the exec'd run does not (vLLM's engine core, killed by its front end before it unlinks its broadcast block when its
workers are slow to exit, leaves one to the tracker: decision 114).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engines.support import ROOT

pytestmark = pytest.mark.engine_entry
"""Real engine starts: ``make test-engines`` runs this file, ``make test`` leaves it out."""

TIMEOUT_S = 1200
"""A launcher's start and two engine starts per TP size on a busy 2-core machine."""


@pytest.fixture(params=["vllm", "sglang"])
def engine(request) -> str:
    from tests.engines.test_entry_points import runnable_engine

    return runnable_engine(request.param)


def test_a_launched_engine_generates_the_exec_d_engines_tokens_and_forks_its_children(engine, tmp_path):
    out = tmp_path / "engine_start.json"
    tps = "1,2" if engine == "vllm" else "1"
    command = [sys.executable, "benchmarks/engine_start.py", "--engines", engine, "--tp", tps]
    command += ["--python", sys.executable, "--json", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"engine_start.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    case = json.loads(out.read_text())["cases"][f"{engine}/tp1"]
    execd, launched = case["exec"]["runs"][0], case["launched"]["runs"][0]
    assert len(execd["tokens"]) == 2 and all(len(tokens) == 8 for tokens in execd["tokens"]), execd["tokens"]
    assert launched["tokens"] == execd["tokens"], f"launched {launched['tokens']}, exec'd {execd['tokens']}"
    assert launched["children_execd"] == [], f"children exec'd, not forked: {launched['children_execd']}"
    assert launched["children_forked"] >= 1, launched
    assert launched["pythons_execd"] == [], f"Pythons exec'd for the launched start: {launched['pythons_execd']}"
    assert execd["pythons_execd"], execd  # the probe sees exec'd Pythons: the engine and its children
    assert execd["children_forked"] == 0 and execd["children_execd"] is None, execd
    for name, case in json.loads(out.read_text())["cases"].items():
        execd, launched = case["exec"]["runs"][0], case["launched"]["runs"][0]
        assert launched["tokens"] == execd["tokens"], f"{name}: launched {launched['tokens']}, exec'd {execd['tokens']}"
        if not execd["resource_tracker_lines"]:  # under enough load vLLM's own shutdown leaves the block exec'd too
            assert launched["resource_tracker_lines"] == [], f"{name}: {launched['resource_tracker_lines']}"
