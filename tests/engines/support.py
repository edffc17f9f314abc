"""Helpers of the engine suite: a tiny checkpoint, engine child processes, the server a daemon-mode engine spawned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]

ENGINE_WARNINGS = (
    "ignore::Warning:vllm",
    "ignore::Warning:sglang",
    "ignore::Warning:transformers",
    "ignore::Warning:torch",
    "ignore::Warning:torchvision",
    "ignore::Warning:pydantic",
    "ignore::Warning:triton",
    "ignore::Warning:xgrammar",
    "ignore::Warning:importlib",
    # SGLang's MLA and MoE layers subclass a deprecated base; the warning is attributed to <frozen abc>, and as an
    # error it makes SGLang's model registry skip deepseek_v2 and fall back to its transformers backend.
    "ignore:MultiPlatformOp is deprecated:DeprecationWarning",
)
"""Filter lines (pytest's syntax): warnings those packages raise while importing or configuring are not ours."""

# quantization_config blocks the engines must refuse (or, FP8_BLOCK, accept)
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8_PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def write_tiny_llama(directory: Path) -> Path:
    """A 2-layer Llama with random weights, saved as bf16 safetensors (tests/models.py's architecture)."""
    from tests.models import save_random_model

    return save_random_model("llama", Path(directory), dtype="bfloat16")


def _tiny_configs():
    import transformers

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    return {
        # Every projection a whole number of 128x128 FP8 blocks (head_dim 128), as in real block-FP8 checkpoints.
        "llama_blocks": lambda: transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            architectures=["LlamaForCausalLM"],
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            architectures=["Qwen3MoeForCausalLM"],
        ),
        # DeepSeek-V3: MLA attention (compressed KV, kv_b_proj), a dense first layer, then routed + shared experts.
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            moe_intermediate_size=64,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            architectures=["DeepseekV3ForCausalLM"],
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        ),  # as DeepSeek-V3's own config.json (engines read them)
    }


TINY_MODELS = ("llama_blocks", "qwen3_moe", "deepseek_v3")
"""Tiny random-weight models beyond tests/models.py's (``write_tiny_model``): a Llama shaped for 128x128 FP8
blocks (``write_fp8_block`` makes its FP8 checkpoint), a MoE and an MLA model."""


def write_tiny_model(kind: str, directory: Path, dtype: str = "bfloat16", seed: int = 0, **overrides) -> Path:
    """``kind`` (TINY_MODELS) with seeded random weights, saved by transformers' ``save_pretrained`` (safetensors).

    :param overrides: config fields to change (e.g. MLA's ``kv_lora_rank``).
    """
    import torch
    import transformers

    config = _tiny_configs()[kind]()
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for param in model.parameters():  # some initialisers leave zeros or ones: make every weight distinct
            param.copy_(torch.randn_like(param, dtype=torch.float32).mul_(0.05).to(param.dtype))
    model.save_pretrained(directory, safe_serialization=True)
    return Path(directory)


FP8_BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_block(source: Path, directory: Path) -> Path:
    """A copy of the transformers checkpoint ``source`` as a block-FP8 checkpoint (as DeepSeek and Qwen ship them):
    each linear layer's ``weight`` in float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128 block, and
    ``quantization_config`` FP8_BLOCK in config.json."""
    import safetensors.torch

    from weightcache.core.quantization.fp8_block import quantize_weight

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(safetensors.torch.load_file(str(file)))
    quantized = {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and module in FP8_BLOCK_LINEARS:
            weight, scale_inv = quantize_weight(tensor, (128, 128))
            quantized[name], quantized[name + "_scale_inv"] = weight, scale_inv
        else:
            quantized[name] = tensor
    safetensors.torch.save_file(quantized, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for file in source.iterdir():
        if file.suffix == ".json" and file.name != "model.safetensors.index.json":
            (directory / file.name).write_bytes(file.read_bytes())
    with_quantization(source, directory, FP8_BLOCK, weights=False)
    return directory


def with_quantization(source: Path, directory: Path, quantization_config: dict, weights: bool = False) -> Path:
    """A copy of ``source``'s config.json declaring ``quantization_config``; its weights only if ``weights``.

    Without weights any attempt to read them fails with FileNotFoundError,
    so a refusal that comes first proves nothing was read.
    """
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    if weights:
        for file in source.glob("*.safetensors"):
            (directory / file.name).symlink_to(file)
    return directory


def run_engine(engine: str, model: Path, steps: list[dict], timeout: float = 300, env: dict | None = None) -> list[dict]:
    """Run ``steps`` in a fresh engine process (tests/engines/engine_child.py); one result per step.

    :param env: further environment variables of that process (e.g. ``shims.CPU_FP8_ENV``).
    """
    from tests.engines.engine_child import RESULT

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.engines.engine_child",
            "--engine",
            engine,
            "--model",
            str(model),
            "--steps",
            json.dumps(steps),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        # One intra-op thread: how torch splits an elementwise op over threads decides which elements take its
        # vectorised path, and the engines' rotary caches then differ by one bf16 ulp between two loads.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
    )
    results = [json.loads(line[len(RESULT) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or len(results) != len(steps):
        raise AssertionError(
            f"{engine} child exited {proc.returncode} after {len(results)} of {len(steps)} steps:\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return results


def run_entry_points(
    engine: str, runs: list[dict], timeout: float = 900, expect_exit: bool = True, env: dict | None = None
) -> "EntryRun":
    """``runs`` through the engine's public constructor in a fresh process (tests/engines/entry_points.py).

    :param expect_exit: the process must exit 0 with one result per run; else
        its exit status, output and time are returned as they are (SGLang kills
        its own process on a load error).
    :param env: further environment variables of that process (e.g. ``shims.CPU_KERNELS_ENV``).
    """
    start = time.monotonic()
    proc = start_entry_points(engine, runs, env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return entry_run(engine, runs, proc.returncode, stdout, stderr, time.monotonic() - start, expect_exit)


def start_entry_points(engine: str, runs: list[dict], env: dict | None = None) -> subprocess.Popen:
    """``runs`` through the engine's public constructor in a fresh process that runs on while the caller goes on."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engines.entry_points", "--engine", engine, "--runs", json.dumps(runs)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENTRY_POINT_ENV, **(env or {})},
    )


def entry_run(
    engine: str, runs: list[dict], returncode: int, stdout: str, stderr: str, seconds: float, expect_exit: bool = True
) -> "EntryRun":
    """The results of a finished ``start_entry_points`` process (see ``run_entry_points``)."""
    from tests.engines.engine_child import RESULT

    results = [json.loads(line[len(RESULT) :]) for line in stdout.splitlines() if line.startswith(RESULT)]
    if expect_exit and (returncode != 0 or len(results) != len(runs)):
        raise AssertionError(
            f"{engine} exited {returncode} after {len(results)} of {len(runs)} runs:\n"
            f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}"
        )
    return EntryRun(returncode, results, stdout + stderr, seconds)


def two_rank_binding() -> str:
    """This machine's CPUs in two groups (``0|1`` on two cores), one per TP rank: with one NUMA node, both engines
    refuse to place two CPU ranks themselves."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return "|".join(",".join(map(str, group)) for group in (cpus[:half], cpus[half:] or cpus[:half]))


ENTRY_POINT_ENV = {
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",  # as in run_engine: the same op splitting in every load
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache for vLLM's CPU backend (its default takes most of the memory)
    "VLLM_CPU_OMP_THREADS_BIND": two_rank_binding(),
    "SGLANG_CPU_OMP_THREADS_BIND": two_rank_binding(),
}


@attrs.frozen
class EntryRun:
    """One process of ``run_entry_points``: its exit status, one result per finished run, its output, its wall time."""

    returncode: int
    results: list
    output: str
    seconds: float


def private_dir(prefix: str) -> Path:
    """A new 0700 directory for a server's socket (the server refuses any other)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o700)
    return path


def write_word_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A word-level tokenizer (``t0`` ... ``t{vocab_size-1}``) beside a checkpoint, for the engines' HTTP servers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{index}": index for index in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1", "bos_token": "t2"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def server_status(socket_dir) -> dict:
    from weightcache.core.client.client import Connection

    with Connection(socket_dir, timeout=5.0) as connection:
        return connection.status()


def stop_spawned_server(socket_dir) -> None:
    """Stop the server a daemon-mode engine started in ``socket_dir`` (it outlives the engine on purpose)."""
    from weightcache.core.client.client import server_is_running

    if not server_is_running(socket_dir):
        return
    pid = server_status(socket_dir)["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server_is_running(socket_dir):
        time.sleep(0.1)


ROW_PARALLEL = ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight")
"""A Llama's row-parallel projections: each tensor-parallel rank keeps its slice of the checkpoint's input columns."""


def assert_ranks_hold_their_shards(adapter: str, model: Path, tp_size: int = 2) -> None:
    """Each rank of ``tp_size`` loaded alone (``load_model(parallel=...)``, mode off) holds its own slice of the
    checkpoint's row-parallel projections, the slice the engine's rank keeps."""
    import torch
    from safetensors.torch import load_file

    from weightcache import ParallelSpec, load_model

    full = {name: tensor for file in sorted(model.glob("*.safetensors")) for name, tensor in load_file(str(file)).items()}
    for rank in range(tp_size):
        parallel = ParallelSpec(tp_size=tp_size, tp_rank=rank)
        loaded = load_model(str(model), adapter=adapter, dtype="bfloat16", parallel=parallel)
        try:
            state = loaded.model.state_dict()
            for name in ROW_PARALLEL:
                width = full[name].shape[1] // tp_size
                expected = full[name][:, rank * width : (rank + 1) * width]
                assert torch.equal(state[name], expected), f"{adapter} rank {rank} of {tp_size}: {name} is not its shard"
        finally:
            loaded.close()


def assert_an_unproven_rank_is_refused(adapter: str, model: Path, architecture: str) -> None:
    """``load_model`` of rank 1 of TP=2 outside the engine, of a model whose architecture is not among the adapter's
    proven ones (``lone_rank.PROVEN_ARCHITECTURES``), raises before any weight is read: ``model`` keeps its config
    only (no weight files at all), and the error says to load it inside the engine."""
    import pytest

    from weightcache import ParallelSpec, load_model

    for file in model.glob("*.safetensors"):
        file.unlink()
    parallel = ParallelSpec(tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match=r"rank 1 of 2 outside the engine only for architectures") as caught:
        load_model(str(model), adapter=adapter, dtype="bfloat16", parallel=parallel)
    assert architecture in str(caught.value) and "inside the engine (--load-format weightcache)" in str(caught.value)


def load_state(path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def assert_same_state(actual_path, expected_path, what: str) -> None:
    """Every parameter and buffer bit-identical, same names (named tensor, dtype, largest difference on failure)."""
    from tests.helpers import assert_tensors_equal

    actual, expected = load_state(actual_path), load_state(expected_path)
    assert sorted(actual) == sorted(expected), f"{what}: tensor names differ: {sorted(set(actual) ^ set(expected))}"
    for name in expected:
        assert_tensors_equal(f"{what}: {name}", actual[name], expected[name])
