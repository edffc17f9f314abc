"""An engine started through ``weightcache launcher`` generates the tokens of the same engine exec'd, and its own
``spawn`` children (vLLM's engine core and worker, SGLang's scheduler and detokenizer) are forked from the launcher's
nursery, none exec'd at any depth (vLLM's workers are the engine core's children): ``benchmarks/engine_start.py`` run
once per engine at TP=1, both ways in one run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engines.support import ROOT

pytestmark = pytest.mark.engine_entry
"""Real engine starts: ``make test-engines`` runs this file, ``make test`` leaves it out."""

TIMEOUT_S = 900
"""A launcher's start and two engine starts on a busy 2-core machine."""


@pytest.fixture(params=["vllm", "sglang"])
def engine(request) -> str:
    from tests.engines.test_entry_points import runnable_engine

    return runnable_engine(request.param)


def test_a_launched_engine_generates_the_exec_d_engines_tokens_and_forks_its_children(engine, tmp_path):
    out = tmp_path / "engine_start.json"
    command = [sys.executable, "benchmarks/engine_start.py", "--engines", engine, "--tp", "1"]
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
