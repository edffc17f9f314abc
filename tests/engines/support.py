"""Helpers of the engine suite: a tiny checkpoint, engine child processes, the server a daemon-mode engine spawned."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def write_tiny_deepseek_v3(directory: Path) -> Path:
    """A 2-layer DeepSeek-V3 (MLA attention, one dense then one MoE layer) with random bf16 weights.

    The config carries what the released DeepSeek-V3 config.json has beside
    transformers' defaults (YaRN rope scaling, ``moe_layer_freq``, ``topk_method``):
    the engines read them.
    """
    import torch
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=163840,
        architectures=["DeepseekV3ForCausalLM"],
        rope_parameters={
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0,
        },
    )
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval().save_pretrained(directory)
    path = Path(directory) / "config.json"
    path.write_text(
        json.dumps(
            {
                **json.loads(path.read_text()),
                "moe_layer_freq": 1,
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
                "ep_size": 1,
            }
        )
    )
    return Path(directory)


def write_fp8_block_llama(directory: Path) -> Path:
    """A 2-layer Llama stored in block-wise FP8 (e4m3 weights, 128x128 ``weight_scale_inv``; FP8_BLOCK config).

    Every quantized dimension is a multiple of 128, as the engines' block-FP8 layers require.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    from weightcache.core.quantization.fp8_block import Fp8BlockConfig, quantize_model

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    quantize_model(model, Fp8BlockConfig())
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        Path(directory) / "model.safetensors",
        metadata={"format": "pt"},
    )
    path = Path(directory) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": FP8_BLOCK}))
    return Path(directory)


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


def run_engine(engine: str, model: Path, steps: list[dict], timeout: float = 300) -> list[dict]:
    """Run ``steps`` in a fresh engine process (tests/engines/engine_child.py); one result per step."""
    from tests.engines.engine_child import RESULT

    proc = subprocess.run(
        [sys.executable, "-m", "tests.engines.engine_child", "--engine", engine, "--model", str(model), "--steps", json.dumps(steps)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    results = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or len(results) != len(steps):
        raise AssertionError(
            f"{engine} child exited {proc.returncode} after {len(results)} of {len(steps)} steps:\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
        )
    return results


def server_status(socket_dir) -> dict:
    from weightcache.core.client import Connection

    with Connection(socket_dir, timeout=5.0) as connection:
        return connection.status()


def stop_spawned_server(socket_dir) -> None:
    """Stop the server a daemon-mode engine started in ``socket_dir`` (it outlives the engine on purpose)."""
    from weightcache.core.client import server_is_running

    if not server_is_running(socket_dir):
        return
    pid = server_status(socket_dir)["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server_is_running(socket_dir):
        time.sleep(0.1)


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
